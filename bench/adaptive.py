"""The adaptive window against fixed ones, on an endpoint with a hidden capacity (issue 13).

    python -m bench.adaptive [--quick] [--n 3000] [--capacity 40] [--repeat 1]

The model server is its own process (an asyncio protocol, pinned to CPU 0 when ``taskset``
exists): it answers ``POST .../chat/completions`` after 50 ms, at most ``--capacity`` (40)
calls at once; a call above that is answered at once with HTTP 429 and ``Retry-After: 1``.
It counts what it answered (``/stats``; ``/reset`` zeroes it before each contender).

Each contender is its own process (pinned to CPU 1): ``tt.run_eval`` of ``--n`` (3,000)
single-call rollouts over ``tt.OpenAIClient`` (``max_retries=100``: a 429 is retried after
its Retry-After), dashboard off, traces written, with ``-c``:

* fixed 40: the oracle (the capacity, known in advance);
* fixed 512: too high (the server answers most calls 429);
* fixed 8: too low (the endpoint idles);
* adaptive 1-8-512: `tt.AdaptiveWindow` (slow start; the first 429 cuts x0.8, every 429
  caps the window at the calls the endpoint took; growth paused 15 s after the last 429;
  a rollout waiting out a Retry-After lends its place);
* adaptive connections: ``-c 512`` with ``--max-connections 1-8-512`` (the same controller
  on the endpoint's calls, `EndpointLimits`; a call waiting out a Retry-After holds no
  connection), not one of the issue's four: how the other place to adapt compares.

Reported: rollouts/s (the eval's own, whole run), the share of calls answered 429, the
most calls the server had at once, the window at the end, and the time to converge: from
the start until the window last entered [0.75 C, 1.3 C] and stayed there to the end (from
`summary.json`'s `window_history`, or its `connection_history`). Each
contender runs ``--repeat`` times, the order rotating; the best rate is kept (interference
only slows). Goals (reported, never enforced): adaptive >= 0.85x the oracle's rollouts/s,
>= 2x fixed 8's, < 2 % of calls answered 429, and faster than fixed 512.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterable
from typing import Any, ClassVar

import trio

from .common import env_info, goal_line, markdown_table, next_request

LATENCY = 0.05
RETRY_AFTER = "1"
ORACLE, HIGH, LOW, ADAPTIVE = "fixed -c 40", "fixed -c 512", "fixed -c 8", "adaptive -c 1-8-512"
CONNECTIONS = "-c 512 --max-connections 1-8-512"
WINDOWS = {ORACLE: "40", HIGH: "512", LOW: "8", ADAPTIVE: "1-8-512", CONNECTIONS: "512:1-8-512"}
ADAPTIVES = (ADAPTIVE, CONNECTIONS)

# --- the model server (its own process) ---------------------------------------------------
# Not the tests' ChatServer with a `Capacity` policy (tests/fixtures/chat_server.py), on
# purpose: the figures are rollouts per wall second against a process pinned to a core, so the
# server must stay far cheaper than the eval it serves; this protocol writes prebuilt bytes
# (the same choice as bench/http's server).

REPLY = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "model": "fake",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "7"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
    }
).encode()
LIMITED = b'{"error": {"message": "rate limited", "type": "rate_limit_exceeded"}}'


def _http(status: str, body: bytes, extra: str = "") -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{extra}\r\n"
    )
    return head.encode() + body


class _Capacity(asyncio.Protocol):
    """HTTP/1.1 keep-alive with Content-Length bodies. A completion waits LATENCY while it
    holds one of `capacity` places; with none free it is answered 429 at once."""

    capacity = 40
    active = 0
    stats: ClassVar[dict[str, int]] = {"ok": 0, "limited": 0, "peak": 0}
    ok = _http("200 OK", REPLY)
    limited = _http("429 Too Many Requests", LIMITED, f"retry-after: {RETRY_AFTER}\r\n")

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.buffer = b""
        self.loop = asyncio.get_running_loop()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (request := next_request(self.buffer)) is not None:
            path, self.buffer = request
            self._answer(path)

    def _answer(self, path: bytes) -> None:
        cls = _Capacity
        if path == b"/stats":
            self.transport.write(_http("200 OK", json.dumps(cls.stats).encode()))
        elif path == b"/reset":
            cls.stats = {"ok": 0, "limited": 0, "peak": 0}
            self.transport.write(_http("200 OK", b"{}"))
        elif cls.active >= cls.capacity:
            cls.stats["limited"] += 1
            self.transport.write(cls.limited)
        else:
            cls.active += 1
            cls.stats["peak"] = max(cls.stats["peak"], cls.active)
            self.loop.call_later(LATENCY, self._done)

    def _done(self) -> None:
        _Capacity.active -= 1
        _Capacity.stats["ok"] += 1
        if not self.transport.is_closing():
            self.transport.write(self.ok)


async def _serve(capacity: int) -> None:
    _Capacity.capacity = capacity
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Capacity, "127.0.0.1", 0, backlog=4096)
    print(server.sockets[0].getsockname()[1], flush=True)
    await loop.run_in_executor(None, sys.stdin.read)  # until the parent closes our stdin


def _get(port: int, path: str) -> dict[str, int]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
        found: dict[str, int] = json.loads(reply.read())
        return found


# --- a contender (its own process) ----------------------------------------------------------


def _contender(port: int, spec: str, n: int) -> dict[str, Any]:
    import trio_tasksets as tt
    from trio_tasksets._core.adaptive import parse_window
    from trio_tasksets._core.limits import EndpointLimits

    window, _, connections = spec.partition(":")
    limits = EndpointLimits(connections=parse_window(connections)) if connections else None

    class Calls(tt.Taskset[tt.Task, tt.TasksetConfig]):
        def load(self) -> Iterable[tt.Task]:
            return [tt.Task("say 7", answer="7", key=str(i)) for i in range(n)]

    async def main() -> dict[str, Any]:
        base = f"http://127.0.0.1:{port}/v1"
        with tempfile.TemporaryDirectory() as out:
            async with tt.OpenAIClient(base, max_retries=100, limits=limits) as client:
                ctx = tt.ModelContext(client, "fake")
                config = tt.EvalConfig(max_concurrent=parse_window(window), output_dir=out,
                                       run_name="bench", dashboard=False)  # fmt: skip
                result = await tt.run_eval(tt.Env(Calls()), ctx, config)
        summary = result.summary
        assert summary["ok"] == n, f"{n - summary['ok']} rollouts failed"
        history = summary["window_history"]
        if connections:
            (history,) = summary["connection_history"].values()
        return {"seconds": summary["duration_s"], "history": history}

    return trio.run(main)


# --- the driver -----------------------------------------------------------------------------


def _pinned(cpu: int) -> list[str]:
    return ["taskset", "-c", str(cpu)] if shutil.which("taskset") and os.cpu_count() else []


def _measure(name: str, port: int, n: int) -> dict[str, Any]:
    _get(port, "/reset")
    command = [*_pinned(1), sys.executable, "-m", "bench.adaptive", "--contender",
               WINDOWS[name], "--port", str(port), "--n", str(n)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"failed": last}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result.update(_get(port, "/stats"))
    return result


def converged(history: list[list[Any]], capacity: int, end: float) -> float | None:
    """Seconds until the window last entered [0.75 C, 1.3 C] and stayed there to `end`;
    None if it ended outside."""
    low, high = 0.75 * capacity, 1.3 * capacity
    since: float | None = None
    for at, size, _reason in history:
        inside = low <= size <= high
        if inside and since is None:
            since = float(at)
        elif not inside:
            since = None
    return None if since is None or since > end else since


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: n=1000, 1 repeat")
    parser.add_argument("--n", type=int, default=3000, help="rollouts per contender")
    parser.add_argument("--capacity", type=int, default=40, help="the server's hidden capacity")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each contender")
    parser.add_argument("--only", nargs="+", choices=list(WINDOWS), help="these contenders only")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--contender", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(_serve(args.capacity))
        return 0
    if args.contender:
        print(json.dumps(_contender(args.port, args.contender, args.n)), flush=True)
        return 0
    n = 1000 if args.quick else args.n
    names = args.only or list(WINDOWS)
    server = subprocess.Popen(
        [*_pinned(0), sys.executable, "-m", "bench.adaptive", "--serve",
         "--capacity", str(args.capacity)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        print(" ".join(f"{k}={v}" for k, v in env_info()))
        print(f"server pinned to CPU 0, contenders to CPU 1: {bool(_pinned(0))}")
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        started = time.perf_counter()
        for repeat in range(args.repeat):
            turn = repeat % len(names)
            for name in names[turn:] + names[:turn]:
                runs[name].append(_measure(name, port, n))
        took = time.perf_counter() - started
    finally:
        if server.stdin is not None:
            server.stdin.close()
        server.wait(timeout=10)
    _report(runs, n, args.capacity, took)
    return 0


def _report(runs: dict[str, list[dict[str, Any]]], n: int, capacity: int, took: float) -> None:
    ideal = capacity / LATENCY
    print(
        f"\n{n:,} single-call rollouts; server capacity {capacity} calls at once, "
        f"{LATENCY * 1000:.0f} ms each (at most {ideal:,.0f} rollouts/s), 429 with "
        f"Retry-After: {RETRY_AFTER} above it; best of {len(next(iter(runs.values())))} "
        f"({took:.0f} s in all)"
    )
    best: dict[str, dict[str, Any]] = {}
    rows = []
    for name, results in runs.items():
        good = [r for r in results if "failed" not in r]
        if not good:
            rows.append([name, results[0]["failed"][:60], "", "", "", "", ""])
            continue
        top = min(good, key=lambda r: r["seconds"])
        best[name] = top
        calls = top["ok"] + top["limited"]
        history = top["history"]
        when = converged(history, capacity, top["seconds"]) if name in ADAPTIVES else None
        sizes = [size for _, size, _ in history]
        rows.append([
            name, f"{n / top['seconds']:,.0f}", f"{top['seconds']:.2f}",
            f"{top['limited'] / calls:.1%}", str(top["peak"]), f"{sizes[-1]} (max {max(sizes)})",
            "-" if name not in ADAPTIVES else "never" if when is None else f"{when:.2f} s",
        ])  # fmt: skip
    print(markdown_table(
        ["-c", "rollouts/s", "seconds", "429s", "peak at server", "window at end",
         "converged"], rows,
    ))  # fmt: skip
    for name in ADAPTIVES:
        if name in best:
            steps = ", ".join(f"{size} ({reason}, {at:.2f} s)" for at, size, reason in
                              best[name]["history"][1:])  # fmt: skip
            print(f"  {name}: {steps}")
    mine = best.get(ADAPTIVE)
    if mine is None or any(name not in best for name in (ORACLE, LOW, HIGH)):
        return

    def rate(name: str) -> float:
        return n / best[name]["seconds"] if name in best else float("nan")

    share = mine["limited"] / (mine["ok"] + mine["limited"])
    ratio = {name: rate(ADAPTIVE) / rate(name) for name in (ORACLE, LOW, HIGH)}
    print(goal_line(ratio[ORACLE] >= 0.85, "adaptive >= 0.85x the oracle", f"{ratio[ORACLE]:.2f}x"))
    print(goal_line(ratio[LOW] >= 2, "adaptive >= 2x fixed -c 8", f"{ratio[LOW]:.2f}x"))
    print(goal_line(share < 0.02, "adaptive: < 2 % of calls answered 429", f"{share:.2%}"))
    print(goal_line(ratio[HIGH] > 1, "adaptive faster than fixed -c 512", f"{ratio[HIGH]:.2f}x"))


if __name__ == "__main__":
    sys.exit(main())
