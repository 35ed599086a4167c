"""Hostile and odd peers of the served path and the HTTP transport (issue 26): real env server
processes on 127.0.0.1, the fake OpenAI server, and raw socket servers that misbehave on
purpose. Every wait is bounded (`trio.fail_after`, or a subprocess timeout).
"""

from __future__ import annotations

import socket
import struct
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

import trio_tasksets as tt
from trio_tasksets._core.exceptions import ConfigError
from trio_tasksets._serve import EnvServerError
from trio_tasksets._transport import HTTPClient, ProtocolError

FIXTURES = Path(__file__).resolve().parent / "fixtures"
if str(FIXTURES) not in sys.path:
    sys.path.insert(0, str(FIXTURES))

from chat_server import ChatServer  # noqa: E402
from env_server import EnvServer  # noqa: E402
from helpers import RawServer  # noqa: E402


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for pid {pid}")


def slot(prompt: str = "say hi") -> tt.RunSlot[tt.Task]:
    return tt.RunSlot(tt.Task(prompt, answer="hi"))


# --- a raw HTTP server that answers every request with the same bytes ---------------------------


class RawHTTP(RawServer):
    """Reads each request (head and Content-Length body) and writes `reply(n)` for the n-th
    request; counts `connections` and `requests`."""

    def __init__(self, reply: Callable[[int], bytes]) -> None:
        self.reply = reply
        self.requests = 0
        super().__init__()
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def serve(self, conn: socket.socket) -> None:
        buffer = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(buffer) < length:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buffer += data
                buffer = buffer[length:]
                with self._lock:
                    self.requests += 1
                    n = self.requests
                try:
                    conn.sendall(self.reply(n))
                except OSError:
                    return


def gzip_of_zeros(mib: int) -> bytes:
    """A valid gzip member of `mib` MiB of zero bytes (about 1 KiB on the wire per MiB),
    built from one compressed MiB repeated (a full flush makes each copy stand alone)."""
    zeros = bytes(1 << 20)
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    segment = deflate.compress(zeros) + deflate.flush(zlib.Z_FULL_FLUSH)
    end = deflate.flush()
    crc = 0
    for _ in range(mib):
        crc = zlib.crc32(zeros, crc)
    header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
    return header + segment * mib + end + struct.pack("<II", crc, (mib << 20) & 0xFFFFFFFF)


# --- D1: the env server's model calls go through the project's transport ------------------------


async def test_an_env_servers_model_calls_go_through_the_projects_transport(
    env_server: Callable[..., EnvServer],
) -> None:
    """Issue 20: the server's model calls went through an `httpx.AsyncClient`. Now they go
    through `trio_tasksets._transport` (its User-Agent), on its keep-alive pool: 24 runs, 4
    at a time, reach the model endpoint over at most 4 connections."""
    with ChatServer() as chat:
        server = env_server("echo", f"--allow-base-url={chat.url}")
        ctx = tt.ModelContext(tt.OpenAIClient(chat.url, max_retries=0), "m")
        with trio.fail_after(60):
            async with tt.EnvClient(server.url) as client:
                await client.run(slot("What is 1 + 1?"), ctx)  # warm: one connection
                assert chat.connections == 1

                async def run(_: int) -> None:
                    episode = await client.run(slot("What is 2 + 2?"), ctx)
                    assert episode.ok, episode.errors
                    assert episode.completion == "4"

                await tt.run_stream(_count(24), run, window=4)
        assert len(chat.requests) == 25
        assert set(chat.user_agents) == {"trio-tasksets"}
        assert 1 <= chat.connections <= 4


async def _count(n: int) -> Any:
    for i in range(n):
        yield i


async def test_a_gzip_bomb_from_an_allowed_endpoint_fails_the_run_and_not_the_server(
    env_server: Callable[..., EnvServer],
) -> None:
    """D1: 512 MiB of zeros as gzip (about half a MiB on the wire) took the server from 39
    to 1,596 MiB. On the transport the decoded body stops at its 64 MiB limit: the run fails
    naming the limit, the server's peak memory stays far under the bomb, and it serves on."""
    bomb = gzip_of_zeros(512)
    assert len(bomb) < 1 << 20
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-encoding: gzip\r\n"
        b"content-length: %d\r\n\r\n" % len(bomb)
    )
    with RawHTTP(lambda _: head + bomb) as endpoint:
        server = env_server("echo", f"--allow-base-url={endpoint.url}")
        ctx = tt.ModelContext(tt.OpenAIClient(endpoint.url, max_retries=0), "m")
        with trio.fail_after(60):
            async with tt.EnvClient(server.url) as client:
                episode = await client.run(slot(), ctx)
                assert not episode.ok
                assert [e.type for e in episode.errors] == ["ModelResponseError"]
                assert "over the limit" in episode.errors[0].message, episode.errors
                assert endpoint.requests == 1  # a too-large answer is not retried
                assert peak_rss_mb(server.pid) < 300
                echo = await client.run(slot(), tt.ModelContext(tt.EchoClient(), "echo"))
                assert echo.ok


# --- D4: bytes after a complete response; D7: the head limit ---------------------------------

COMPLETION = (
    b'{"choices": [{"message": {"role": "assistant", "content": "4"}, "finish_reason": "stop"}]}'
)


def framed(body: bytes, *, chunked: bool) -> bytes:
    """A 200 response with `body`: Content-Length (the fast path) or chunked (h11's path)."""
    if chunked:
        return (
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked"
            b"\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        )
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


@pytest.mark.parametrize("chunked", [False, True], ids=["fast path", "h11"])
@pytest.mark.parametrize("after", [b"\x00junk\r\n\r\n", b"HTTP/1.1 200", b"0\r\n\r\n"])
async def test_bytes_after_a_complete_response_close_the_connection_and_are_never_reposted(
    chunked: bool, after: bytes
) -> None:
    """D4: junk h11 could not parse after a complete response made it a ProtocolError, and
    `OpenAIClient` POSTed it again (a second charge); a partial head left over was pooled as
    reusable. Now the complete response is returned, once, and its connection closed: the
    next call opens another and reads its own answer."""
    with RawHTTP(lambda _: framed(COMPLETION, chunked=chunked) + after) as endpoint:
        async with tt.OpenAIClient(endpoint.url, max_retries=3, backoff=0) as client:
            with trio.fail_after(20):
                for calls in (1, 2):
                    completion = await client.chat([], model="m", sampling=tt.Sampling())
                    assert completion.content == "4"
                    assert (endpoint.requests, endpoint.connections) == (calls, calls)


def head_of(size: int, *, chunked: bool) -> bytes:
    """A response head of exactly `size` bytes, its blank line included (padded with an
    ``x-pad`` header)."""
    start = b"HTTP/1.1 200 OK\r\n" + (
        b"transfer-encoding: chunked\r\n" if chunked else b"content-length: 2\r\n"
    )
    pad = size - len(start) - len(b"x-pad: \r\n\r\n")
    return start + b"x-pad: " + b"a" * pad + b"\r\n\r\n"


@pytest.mark.parametrize("chunked", [False, True], ids=["fast path", "h11"])
async def test_a_response_head_may_be_64_kib_and_not_a_byte_more(chunked: bool) -> None:
    """D7: the fast path checked the head's size before each 64 KiB read, so heads up to
    about 128 KiB passed. Now a head of exactly 64 KiB (its blank line included) is read on
    either path, and one byte more is a ProtocolError naming the limit."""
    body = b"2\r\nok\r\n0\r\n\r\n" if chunked else b"ok"
    for size, ok in ((65536, True), (65537, False), (100_000, False)):
        reply = head_of(size, chunked=chunked) + body
        assert reply.index(b"\r\n\r\n") + 4 == size
        with RawHTTP(lambda _, reply=reply: reply) as server:  # type: ignore[misc]
            async with HTTPClient() as http:
                with trio.fail_after(20):
                    if ok:
                        response = await http.request("GET", server.url)
                        assert (response.status, response.body) == (200, b"ok")
                    else:
                        with pytest.raises(ProtocolError, match="over 65536 bytes"):
                            await http.request("GET", server.url)


# --- D5: a run cannot make the server hammer its endpoint --------------------------------------


def test_the_policy_caps_retries_and_raises_a_small_backoff() -> None:
    from trio_tasksets._serve.policy import ModelPolicy
    from trio_tasksets._serve.wire import Forbidden, OpenAISpec

    policy = ModelPolicy.from_flags(
        ["http://127.0.0.1:9/v1"], None, {}, max_retries=4, min_backoff=0.25
    )
    spec = OpenAISpec("http://127.0.0.1:9/v1", max_retries=4, backoff=0.0, max_backoff=0.0)
    policy.check(spec)
    client = policy.build(spec)
    assert isinstance(client, tt.OpenAIClient)
    assert (client.max_retries, client.backoff, client.max_backoff) == (4, 0.25, 0.25)
    with pytest.raises(Forbidden, match="max_retries 5"):
        policy.check(attrs.evolve(spec, max_retries=5))
    for name, kwargs in [("max_retries", {"max_retries": -1}),
                         ("min_backoff", {"min_backoff": -0.5})]:  # fmt: skip
        with pytest.raises(ConfigError, match=name) as caught:
            ModelPolicy.from_flags([], None, {}, **kwargs)  # type: ignore[arg-type]
        assert caught.value.parameter == name


async def test_a_run_asking_for_more_retries_than_the_cap_is_refused_before_any_request(
    env_server: Callable[..., EnvServer],
) -> None:
    """D5: ``ctx.client.max_retries`` had no bound and ``backoff`` could be 0: one run made
    the server send 1,025 requests in 3 s to its allowed endpoint, with its key. Now a run
    over the server's ``--max-model-retries`` is refused with 403 naming the flag, before
    any request; one within it makes at most its retries + 1 requests."""
    failing = b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 4\r\n\r\nnope"
    with RawHTTP(lambda _: failing) as endpoint:
        server = env_server(
            "echo", f"--allow-base-url={endpoint.url}", "--max-model-retries", "2",
            "--min-model-backoff", "0.01",
        )  # fmt: skip
        greedy = tt.ModelContext(tt.OpenAIClient(endpoint.url, max_retries=1024, backoff=0), "m")
        modest = tt.ModelContext(tt.OpenAIClient(endpoint.url, max_retries=2, backoff=0), "m")
        with trio.fail_after(60):
            async with tt.EnvClient(server.url) as client:
                with pytest.raises(EnvServerError, match="--max-model-retries 1024") as info:
                    await client.run(slot(), greedy)
                assert info.value.status == 403
                assert endpoint.requests == 0
                episode = await client.run(slot(), modest)
        assert not episode.ok
        assert endpoint.requests == 3


async def test_every_worker_of_a_pool_keeps_the_retry_cap(
    env_server: Callable[..., EnvServer],
) -> None:
    """D5 with ``--workers 2``: each pool worker enforces the ``--max-model-retries`` and
    ``--min-model-backoff`` the server was started with, not the defaults (10)."""
    failing = b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 4\r\n\r\nnope"
    with RawHTTP(lambda _: failing) as endpoint:
        server = env_server(
            "echo", f"--allow-base-url={endpoint.url}", "--max-model-retries", "2", "--workers", "2"
        )
        over = tt.ModelContext(tt.OpenAIClient(endpoint.url, max_retries=5, backoff=0), "m")
        with trio.fail_after(60):
            for _ in range(6):  # new connections: the kernel spreads them over both workers
                async with tt.EnvClient(server.url, transport="http") as client:
                    with pytest.raises(EnvServerError, match="--max-model-retries 5") as info:
                        await client.run(slot(), over)
                    assert info.value.status == 403
        assert endpoint.requests == 0


async def test_a_closed_env_client_says_so_over_http_too() -> None:
    client = tt.EnvClient("http://127.0.0.1:9", transport="http")
    await client.aclose()
    with pytest.raises(EnvServerError, match="the client was closed"):
        await client.health()
