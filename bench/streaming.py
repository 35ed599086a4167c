"""Streamed replies against whole ones: the client's CPU per call at 256 tokens a reply.

    python -m bench.streaming [--quick] [--repeat R] [--tokens N] [--calls N] [--interval K]

A fake OpenAI-compatible server in its own process (pinned to CPU 0 when ``taskset``
exists; an asyncio protocol writing prebuilt bytes, so that it costs the same for every
contender) answers ``POST /v1/chat/completions`` with one reply of N tokens (256): whole
(one JSON body, Content-Length) or, for ``"stream": true``, as vLLM streams it: one
``chat.completion.chunk`` event a token (id, object, created, model in each, about 200
bytes an event), each event its own HTTP chunk (``Transfer-Encoding: chunked``, as uvicorn
sends them), the finish reason, the usage chunk, ``[DONE]``. With ``return_tokens`` the
replies carry vLLM's ``token_ids`` and ``logprobs`` (whole: in the choice; streamed: in each
chunk), and the prompt's ids. ``--interval K`` sends K tokens an event, as vLLM does with
``--stream-interval K`` (a paced event then comes every K tokens' time).

Two scenarios, each with and without token ids:

* ``burst``: the server writes the reply at once (8 calls in flight): what reading and
  parsing a stream costs over a whole body, the client's own work;
* ``paced``: the server writes one token every 2 ms (a 0.5 s reply; 32 calls in flight),
  and sends a whole reply after the same 0.5 s: a stream then wakes the client once a token
  or so (trio's wake-up, the read, the event), a whole reply once.

The client is `tt.OpenAIClient.chat` (the project's transport, `Sampling(stream=...)`), in
this process (pinned to CPU 1); ``openai.AsyncOpenAI`` (httpx, asyncio) does the same
without token ids, for reference (not with ``--quick``). Each contender does a warm-up,
then N calls; figures are the
process CPU time per call (``time.process_time``), best of ``--repeat`` (3; quick: 1) runs,
the contenders alternating. Every streamed reply is checked equal to the whole one. The
goal (issue 33), reported, never enforced: a streamed call costs at most 1.3x a whole one's
client CPU at 256 tokens a reply.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any, ClassVar

import trio

from .common import env_info, goal_line, markdown_table, next_request

MODEL = "bench-model"
PAYLOAD_MESSAGES = [{"role": "user", "content": "count"}]


# --- the fake server (its own process) ---------------------------------------------------------


def _reply_parts(tokens: int, with_ids: bool, interval: int = 1) -> tuple[bytes, list[bytes]]:
    """(the whole reply's body, the streamed reply's events), of the same reply: `interval`
    tokens an event (vLLM's ``--stream-interval``)."""
    words = [f" w{i}" for i in range(tokens)]
    ids = list(range(1000, 1000 + tokens))
    logprobs = [{"token": w, "logprob": -0.25, "bytes": list(w.encode()), "top_logprobs": []}
                for w in words]  # fmt: skip
    usage = {"prompt_tokens": 12, "completion_tokens": tokens, "total_tokens": 12 + tokens}
    envelope = {"id": "chatcmpl-8f2d0c1e9a7b4c6d", "created": 1767225600, "model": MODEL}
    choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": "".join(words)},
                              "logprobs": None, "finish_reason": "stop", "stop_reason": None}  # fmt: skip
    whole: dict[str, Any] = {**envelope, "object": "chat.completion", "choices": [choice],
                             "usage": usage}  # fmt: skip
    if with_ids:
        whole["prompt_token_ids"] = list(range(12))
        choice["token_ids"] = ids
        choice["logprobs"] = {"content": logprobs}

    def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        chunk = {**envelope, "object": "chat.completion.chunk", "choices": choices, **extra}
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"

    def step(
        delta: dict[str, Any], k: int | None = None, finish: str | None = None
    ) -> dict[str, Any]:
        one: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                               "finish_reason": finish}  # fmt: skip
        if with_ids and k is not None:
            one["logprobs"] = {"content": logprobs[k : k + interval]}
            one["token_ids"] = ids[k : k + interval]
        return one

    first = {"prompt_token_ids": list(range(12))} if with_ids else {}
    events = [event([step({"role": "assistant", "content": ""})], **first)]
    events += [event([step({"content": "".join(words[k : k + interval])}, k)])
               for k in range(0, tokens, interval)]  # fmt: skip
    events.append(event([step({}, finish="stop")]))
    events.append(event([], usage=usage))
    events.append(b"data: [DONE]\n\n")
    return json.dumps(whole, separators=(",", ":")).encode(), events


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class _Server(asyncio.Protocol):
    tokens = 256
    pace = 0.0
    replies: ClassVar[dict[bool, tuple[bytes, list[bytes]]]] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.buffer = b""
        self.loop = asyncio.get_running_loop()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            request = next_request(self.buffer)
            if request is None:
                return
            body = self.buffer[end + 4 : len(self.buffer) - len(request[1])]
            self.buffer = request[1]
            self._answer(body)

    def _answer(self, body: bytes) -> None:
        stream = b'"stream":true' in body
        whole, events = self.replies[b'"return_token_ids":true' in body]
        if not stream:
            reply = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(whole), whole))  # fmt: skip
            if self.pace:
                self.loop.call_later(self.pace * len(events), self._write, reply)
            else:
                self.transport.write(reply)
            return
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        if not self.pace:
            self.transport.write(head + b"".join(map(_chunk, events)) + b"0\r\n\r\n")
            return
        self.transport.write(head)
        for k, event in enumerate(events):
            last = k == len(events) - 1
            self.loop.call_later(self.pace * (k + 1), self._write,
                                 _chunk(event) + (b"0\r\n\r\n" if last else b""))  # fmt: skip

    def _write(self, data: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(data)


async def _serve(tokens: int, pace: float, interval: int) -> None:
    _Server.tokens, _Server.pace = tokens, pace * interval  # an event every `interval` tokens
    _Server.replies = {ids: _reply_parts(tokens, ids, interval) for ids in (False, True)}
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Server, "127.0.0.1", 0, backlog=1024)
    print(server.sockets[0].getsockname()[1], flush=True)
    await loop.run_in_executor(None, sys.stdin.read)  # until the parent closes our stdin


def _pinned(cpu: int) -> list[str]:
    return (
        ["taskset", "-c", str(cpu)] if shutil.which("taskset") and (os.cpu_count() or 1) > 1 else []
    )


# --- the client ---------------------------------------------------------------------------------


async def _measure(url: str, *, stream: bool, ids: bool, window: int, calls: int) -> float:
    """CPU µs per call of `calls` calls, `window` at a time (after a warm-up)."""
    import trio_tasksets as tt

    sampling = tt.Sampling(stream=stream, return_tokens=ids)
    async with tt.OpenAIClient(url, timeout=60) as client:

        async def run(count: int) -> None:
            left = [count]

            async def worker() -> None:
                while left[0] > 0:
                    left[0] -= 1
                    reply = await client.chat(PAYLOAD_MESSAGES, model=MODEL, sampling=sampling)
                    assert reply.finish_reason == "stop"

            async with trio.open_nursery() as nursery:
                for _ in range(window):
                    nursery.start_soon(worker)

        await run(max(window * 2, calls // 5))
        began = time.process_time()
        await run(calls)
        return (time.process_time() - began) / calls * 1e6


def _measure_openai(url: str, *, stream: bool, window: int, calls: int) -> float:
    """The same, through ``openai.AsyncOpenAI`` (its httpx client, no retries), for
    reference: CPU µs per call."""
    import asyncio

    import httpx
    import openai

    async def main() -> float:
        limits = httpx.Limits(max_connections=window, max_keepalive_connections=window)
        http = openai.DefaultAsyncHttpxClient(limits=limits, timeout=60)
        async with openai.AsyncOpenAI(base_url=url, api_key="sk-bench", max_retries=0,
                                      http_client=http) as client:  # fmt: skip
            create: Any = client.chat.completions.create  # the messages as plain dicts

            async def one() -> None:
                if not stream:
                    reply = await create(model=MODEL, messages=PAYLOAD_MESSAGES)
                    assert reply.choices[0].finish_reason == "stop"
                    return
                events = await create(model=MODEL, messages=PAYLOAD_MESSAGES, stream=True,
                                      stream_options={"include_usage": True})  # fmt: skip
                text = [c.choices[0].delta.content or "" async for c in events if c.choices]
                assert text

            async def run(count: int) -> None:
                left = [count]

                async def worker() -> None:
                    while left[0] > 0:
                        left[0] -= 1
                        await one()

                await asyncio.gather(*(worker() for _ in range(window)))

            await run(max(window * 2, calls // 5))
            began = time.process_time()
            await run(calls)
            return (time.process_time() - began) / calls * 1e6

    return asyncio.run(main())


async def _same_reply(url: str, ids: bool) -> None:
    import attrs

    import trio_tasksets as tt

    async with tt.OpenAIClient(url) as client:
        whole = await client.chat(PAYLOAD_MESSAGES, model=MODEL,
                                  sampling=tt.Sampling(return_tokens=ids))  # fmt: skip
        streamed = await client.chat(PAYLOAD_MESSAGES, model=MODEL,
                                     sampling=tt.Sampling(return_tokens=ids, stream=True))  # fmt: skip
    assert attrs.evolve(streamed, ttft=None, tpot=None) == whole, (whole, streamed)


def _scenario(name: str, pace: float, window: int, args: argparse.Namespace) -> list[list[str]]:
    server = subprocess.Popen(
        [*_pinned(0), sys.executable, "-m", "bench.streaming", "--serve", str(args.tokens),
         str(pace), str(args.interval)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert server.stdout is not None
    assert server.stdin is not None
    try:
        url = f"http://127.0.0.1:{server.stdout.readline().strip()}/v1"
        rows = []
        for ids in (False, True):
            trio.run(_same_reply, url, ids)
            best: dict[bool, float] = {}
            for _ in range(args.repeat):
                for stream in (False, True):
                    measure = functools.partial(
                        _measure, url, stream=stream, ids=ids, window=window, calls=args.calls
                    )
                    us = trio.run(measure)
                    best[stream] = min(best.get(stream, us), us)
            ratio = best[True] / best[False]
            rows.append([name, "OpenAIClient", "yes" if ids else "no", f"{best[False]:,.0f}",
                         f"{best[True]:,.0f}", f"{ratio:.2f}x"])  # fmt: skip
        if args.openai:
            best = {}
            for _ in range(args.repeat):
                for stream in (False, True):
                    us = _measure_openai(url, stream=stream, window=window, calls=args.calls)
                    best[stream] = min(best.get(stream, us), us)
            rows.append([name, "openai.AsyncOpenAI", "no", f"{best[False]:,.0f}",
                         f"{best[True]:,.0f}", f"{best[True] / best[False]:.2f}x"])  # fmt: skip
        return rows
    finally:
        server.stdin.close()
        server.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one run of fewer calls")
    parser.add_argument("--repeat", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--calls", type=int, default=None)
    parser.add_argument(
        "--no-openai",
        dest="openai",
        action="store_false",
        help="leave out openai.AsyncOpenAI (the reference; left out by --quick)",
    )
    parser.add_argument(
        "--interval",
        type=int,
        default=1,
        help="tokens a streamed event, as vLLM's --stream-interval sends them (1)",
    )
    parser.add_argument("--serve", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(_serve(int(args.serve[0]), float(args.serve[1]), int(args.serve[2])))
        return
    args.repeat = args.repeat or (1 if args.quick else 3)
    args.openai = args.openai and not args.quick
    args.calls = args.calls or (100 if args.quick else 400)
    if shutil.which("taskset") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {1})
    print(f"# bench.streaming: client CPU per call, {args.tokens} tokens a reply, "
          f"{args.interval} a streamed event, {args.calls} calls, best of {args.repeat}")  # fmt: skip
    for key, value in env_info()[:3]:
        print(f"#   {key}: {value}")
    rows = _scenario("burst, 8 in flight", 0.0, 8, args)
    rows += _scenario("paced 2 ms/token, 32 in flight", 0.002, 32, args)
    print(markdown_table(["scenario", "client", "token ids", "whole µs/call",
                          "streamed µs/call", "streamed/whole"], rows, left=(0, 1, 2)))  # fmt: skip
    burst = max(float(row[5].rstrip("x")) for row in rows[:2])
    print(goal_line(burst <= 1.3, "streamed <= 1.3x a whole call's client CPU at "
                    f"{args.tokens} tokens (burst, OpenAIClient)", f"{burst:.2f}x"))  # fmt: skip


if __name__ == "__main__":
    main()
