"""Deadlines that travel (SPEC 12): `--timeout` bounds a whole model request, and no model
request outlives the caller's `trio.current_effective_deadline()`.

The servers are real sockets on 127.0.0.1 that the tests start; time is trio's autojump
clock, so a 34-second trickle costs milliseconds.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

import trio_tasksets as tt
from trio_tasksets._models import ModelTimeoutError, OpenAIClient, Sampling
from trio_tasksets._transport import HTTPClient, Response

MARGIN = 0.05  # seconds a request may run past the deadline it was given (virtual time)

BODY = (
    b'{"choices": [{"message": {"role": "assistant", "content": "hello"}, '
    b'"finish_reason": "stop"}], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}'
)


async def _trickle(stream: trio.SocketStream, *, every: float) -> None:
    """Read a request, then answer it one byte every `every` seconds (about 34 s for BODY
    at 0.2 s a byte): each wait for the next byte is short, the whole response is long."""
    try:
        data = b""
        while b"\r\n\r\n" not in data:
            data += await stream.receive_some(65536)
        head, _, rest = data.partition(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        while len(rest) < length:
            rest += await stream.receive_some(65536)
        reply = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(BODY), BODY)
        for byte in reply:
            await stream.send_all(bytes([byte]))
            await trio.sleep(every)
    except trio.BrokenResourceError:
        pass


async def _trickling_server(nursery: trio.Nursery, every: float = 0.2) -> str:
    handler = functools.partial(_trickle, every=every)
    listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


async def test_timeout_bounds_the_whole_request_of_a_trickling_server(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """Issue 26 D2: a byte every 0.2 s held a `--timeout 2` call for 34.5 s."""
    url = await _trickling_server(nursery)
    async with OpenAIClient(url, timeout=2.0, max_retries=0) as client:
        start = trio.current_time()
        with pytest.raises(ModelTimeoutError, match="timed out after 2s"):
            await client.chat([{"role": "user", "content": "hi"}], model="m", sampling=Sampling())
        assert trio.current_time() - start == pytest.approx(2.0, abs=MARGIN)


# duplicates: the same trickle as the test above, another bound (each attempt's): one rule a test
async def test_each_attempt_has_the_whole_timeout(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    url = await _trickling_server(nursery)
    async with OpenAIClient(url, timeout=2.0, max_retries=2, backoff=0.0) as client:
        start = trio.current_time()
        with pytest.raises(ModelTimeoutError, match="3 attempts"):
            await client.chat([{"role": "user", "content": "hi"}], model="m", sampling=Sampling())
        assert trio.current_time() - start == pytest.approx(6.0, abs=MARGIN)


async def test_a_fast_enough_trickle_completes(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    url = await _trickling_server(nursery, every=0.001)  # ~0.2 s in all
    async with OpenAIClient(url, timeout=2.0, max_retries=0) as client:
        reply = await client.chat(
            [{"role": "user", "content": "hi"}], model="m", sampling=Sampling()
        )
    assert reply.content == "hello"


async def test_a_model_request_never_outlives_the_callers_deadline(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """A rollout with 2 s left: its request (timeout 120 s, retries left) ends with the
    caller's cancellation at the deadline, not after its own timeout nor in a retry."""
    url = await _trickling_server(nursery)
    async with OpenAIClient(url, timeout=120.0, max_retries=5) as client:
        start = trio.current_time()
        with trio.move_on_after(2.0) as scope:
            await client.chat([{"role": "user", "content": "hi"}], model="m", sampling=Sampling())
        assert scope.cancelled_caught  # the caller's deadline, not a ModelTimeoutError
        assert trio.current_time() - start == pytest.approx(2.0, abs=MARGIN)


async def test_the_request_timeout_is_cut_to_the_time_left(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """What the transport is asked for: never more than the time left (so an own
    http_client, or the error's phase, sees the deadline too)."""
    url = await _trickling_server(nursery)
    seen: list[float | None] = []

    class Spy(HTTPClient):
        async def request(self, *args: Any, **kwargs: Any) -> Response:
            seen.append(kwargs["timeouts"].total)
            return await super().request(*args, **kwargs)

    async with Spy() as http, OpenAIClient(url, timeout=120.0, http_client=http) as client:
        with trio.move_on_after(2.0):
            await client.chat([{"role": "user", "content": "hi"}], model="m", sampling=Sampling())
        with trio.move_on_after(500.0):  # a later deadline: the client's own 120 s (~38 s)
            await client.chat([{"role": "user", "content": "hi"}], model="m", sampling=Sampling())
    assert seen[0] == pytest.approx(2.0)
    assert seen[1] == 120.0


async def test_a_time_limit_is_the_rollouts_effective_deadline(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """--time-limit is a deadline every rollout sees, so its model requests, served runs
    and --via entries carry it; the eval still drains with stopped: "time_limit"."""
    seen: list[float] = []

    class Sees(tt.Env[tt.Task]):
        async def rollout(self, task: tt.Task, ctx: tt.ModelContext) -> tuple[list[Any], str]:
            seen.append(trio.current_effective_deadline() - trio.current_time())
            await trio.sleep(4.0)
            return [], str(task.prompt)

    class Two(tt.Taskset[tt.Task, tt.TasksetConfig]):
        def load(self) -> list[tt.Task]:
            return [tt.Task("a"), tt.Task("b"), tt.Task("c")]

    config = tt.EvalConfig(output_dir=str(tmp_path), run_name="run", dashboard=False,
                           max_concurrent=1, time_limit=10.0)  # fmt: skip
    result = await tt.run_eval(Sees(Two()), tt.ModelContext(tt.EchoClient(), "echo"), config)
    assert seen == pytest.approx([10.0, 6.0, 2.0])
    assert result.summary["stopped"] == "time_limit"
    assert result.summary["finished"] == 2
