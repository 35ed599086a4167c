"""Model clients against a fast fake OpenAI-compatible server: CPU per call and calls/s.

    python -m bench.http [--quick] [--repeat R] [--only NAME ...] [--scenario MS:WINDOW[:N] ...]
    python -m bench.http --served [--quick]   # the served path's clients, see `served`

The fake server is its own process (an asyncio protocol that answers every
``POST .../chat/completions`` with a fixed completion after the scenario's latency; pinned
to CPU 0 when ``taskset`` exists). Each contender is its own process too (pinned to CPU 1),
run one after the other, so they never share a core with the server or each other:

* ``tt.run_eval + OpenAIClient``: the project's eval path (window = ``-c``, dashboard off,
  traces written), over the project's HTTP transport (`trio_tasksets._transport`);
* ``trio + tt HTTPClient``: the transport alone, in the loop the raw contenders share;
* ``trio + httpx``: ``httpx.AsyncClient(limits=Limits(W, W))`` under trio;
* ``trio + httpx2``: the same with httpx2 (the httpx fork openai 3.x depends on), if installed;
* ``asyncio + openai``: ``openai.AsyncOpenAI`` (its httpx client, Limits(W, W), no retries);
* ``asyncio + aiohttp``: ``aiohttp.ClientSession`` with ``TCPConnector(limit=W)``.

The raw contenders run W workers that each send a request, parse the JSON reply and go
again. Every contender first warms up (connections opened, code paths hot), then is timed:
the calls done, the wall time and the process CPU time (``time.process_time``, all threads)
up to the N-th call or the time cap (4 s; quick: 1 s), whichever is first. Each scenario runs
every contender ``--repeat`` times (3; quick: 1), the order rotating, and reports the best
CPU per call and the best rate (interference from other processes only adds). ``calls/s
per core``: 1e6 / CPU µs per call, the rate the client could reach with a core to itself.
``client CPU``: the share of its core the client used (under 100 %: it waited for the
server, the latency or its turn on a shared core, not for its own CPU). ``conns``: TCP connections the server accepted from the
contender, warm-up included (churn: more than W). ``--quick`` (about a minute) leaves out httpx2 and
openai, the slowest to run; ``--only`` runs any. Goals (issue 15), reported, never
enforced: CPU/call <= 1.5x aiohttp's and calls/s >= 0.9x aiohttp's at 64 in flight;
calls/s >= 0.8x aiohttp's at 1,024.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterable
from importlib import metadata
from typing import Any

import trio

from .common import goal_line, markdown_table, next_request

PROJECT = "tt.run_eval + OpenAIClient"
TRANSPORT = "trio + tt HTTPClient"
AIOHTTP = "asyncio + aiohttp"
CONTENDERS = [PROJECT, TRANSPORT, "trio + httpx", "trio + httpx2", "asyncio + openai", AIOHTTP]
DRAIN = 5.0  # seconds a warm-up waits for its calls in flight before cancelling them
QUICK_SKIPS = ("trio + httpx2", "asyncio + openai")  # the slowest to start; --only runs them
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say 7"}]
PAYLOAD = json.dumps({"model": "fake", "messages": MESSAGES}).encode()

# --- the fake server -----------------------------------------------------------------------
# Not the tests' ChatServer (tests/fixtures/chat_server.py), on purpose: this measures HTTP
# clients in wall time, so the server must cost far less per request than any contender and
# the same for all of them. An asyncio protocol pinned to a core of its own, writing one
# prebuilt reply, is that; ChatServer's h11 parsing and JSON per request would be measured too.

REPLY = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "fake",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "7"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
    }
).encode()


def _http(body: bytes) -> bytes:
    head = f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


class _Server(asyncio.Protocol):
    """HTTP/1.1 keep-alive, Content-Length bodies; ``/l<ms>/...`` answers after <ms>;
    ``/stats`` tells the connections accepted so far and open now."""

    opened = 0
    open = 0
    reply = _http(REPLY)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.buffer = b""
        self.loop = asyncio.get_running_loop()
        _Server.opened += 1
        _Server.open += 1

    def connection_lost(self, exc: Exception | None) -> None:
        _Server.open -= 1

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (request := next_request(self.buffer)) is not None:
            path, self.buffer = request
            if path == b"/stats":
                stats = {"opened": _Server.opened, "open": _Server.open}
                self.transport.write(_http(json.dumps(stats).encode()))
            elif path.startswith(b"/l") and path.split(b"/")[1][1:] != b"0":
                delay = int(path.split(b"/")[1][1:]) / 1000
                self.loop.call_later(delay, self._answer)
            else:
                self.transport.write(self.reply)

    def _answer(self) -> None:
        if not self.transport.is_closing():
            self.transport.write(self.reply)


async def _serve() -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Server, "127.0.0.1", 0, backlog=4096)
    port = server.sockets[0].getsockname()[1]
    print(port, flush=True)
    await loop.run_in_executor(None, sys.stdin.read)  # until the parent closes our stdin


def _server_stats(url: str) -> dict[str, int]:
    with urllib.request.urlopen(url.split("/l")[0] + "/stats", timeout=10) as reply:
        stats: dict[str, int] = json.loads(reply.read())
        return stats


# --- the contenders (each in its own process) ----------------------------------------------


class _Tally:
    """Workers claim calls until ``n`` or the time cap; the figures are taken at whichever
    comes first."""

    def __init__(self, n: int, seconds: float, drain: bool = False) -> None:
        self.n, self.seconds = n, seconds
        self.drain = drain  # at the time cap, let the calls in flight end (up to DRAIN s)
        self.claimed = self.done = 0
        self.wall = self.cpu = 0.0
        self.start_wall = time.perf_counter()
        self.start_cpu = time.process_time()
        self.stopped = False
        self.on_stop: Callable[[], None] = lambda: None

    def claim(self) -> bool:
        if self.stopped or self.claimed >= self.n:
            return False
        self.claimed += 1
        return True

    def finish_one(self) -> None:
        self.done += 1
        if self.done == self.n:
            self.stop()

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.wall = time.perf_counter() - self.start_wall
            self.cpu = time.process_time() - self.start_cpu
            self.on_stop()


def _check(reply: Any) -> None:
    assert reply["choices"][0]["message"]["content"] == "7", reply


async def _trio_loop(call: Callable[[], Awaitable[None]], window: int, tally: _Tally) -> None:
    async def worker() -> None:
        while tally.claim():
            await call()
            tally.finish_one()

    async with trio.open_nursery() as nursery:
        for _ in range(window):
            nursery.start_soon(worker)
        done = trio.Event()
        tally.on_stop = done.set
        with trio.move_on_after(tally.seconds):
            await done.wait()
        tally.stop()
        nursery.cancel_scope.deadline = trio.current_time() + (DRAIN if tally.drain else 0)


async def _asyncio_loop(call: Callable[[], Awaitable[None]], window: int, tally: _Tally) -> None:
    async def worker() -> None:
        while tally.claim():
            await call()
            tally.finish_one()

    done = asyncio.Event()
    tally.on_stop = done.set
    tasks = [asyncio.create_task(worker()) for _ in range(window)]
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(done.wait(), tally.seconds)
    tally.stop()
    if tally.drain:
        await asyncio.wait(tasks, timeout=DRAIN)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


Runner = Callable[[str, int, int, float, float], _Tally]


def _run_transport(url: str, window: int, n: int, seconds: float, warm: float) -> _Tally:
    from trio_tasksets._transport import HTTPClient

    headers = {"content-type": "application/json"}

    async def main() -> _Tally:
        async with HTTPClient() as http:

            async def call() -> None:
                response = await http.request("POST", url, headers=headers, body=PAYLOAD)
                _check(response.json())

            await _trio_loop(call, window, _Tally(max(window, n // 10), warm, drain=True))
            tally = _Tally(n, seconds)
            await _trio_loop(call, window, tally)
            return tally

    return trio.run(main)


def _run_httpx(module_name: str) -> Runner:
    def run(url: str, window: int, n: int, seconds: float, warm: float) -> _Tally:
        module: Any = __import__(module_name)

        async def main() -> _Tally:
            limits = module.Limits(max_connections=window, max_keepalive_connections=window)
            async with module.AsyncClient(limits=limits, timeout=None) as http:

                async def call() -> None:
                    response = await http.post(url, content=PAYLOAD, headers=HEADERS)
                    _check(response.json())

                await _trio_loop(call, window, _Tally(max(window, n // 10), warm, drain=True))
                tally = _Tally(n, seconds)
                await _trio_loop(call, window, tally)
                return tally

        return trio.run(main)

    return run


HEADERS = {"content-type": "application/json"}


def _run_openai(url: str, window: int, n: int, seconds: float, warm: float) -> _Tally:
    import httpx
    import openai

    base = url.rsplit("/chat/completions", 1)[0]

    async def main() -> _Tally:
        limits = httpx.Limits(max_connections=window, max_keepalive_connections=window)
        http = openai.DefaultAsyncHttpxClient(limits=limits, timeout=None)
        async with openai.AsyncOpenAI(
            base_url=base, api_key="sk-bench", max_retries=0, http_client=http
        ) as client:

            async def call() -> None:
                reply = await client.chat.completions.create(
                    model="fake",
                    messages=MESSAGES,  # type: ignore[arg-type]
                )
                assert reply.choices[0].message.content == "7"

            await _asyncio_loop(call, window, _Tally(max(window, n // 10), warm, drain=True))
            tally = _Tally(n, seconds)
            await _asyncio_loop(call, window, tally)
            return tally

    return asyncio.run(main())


def _run_aiohttp(url: str, window: int, n: int, seconds: float, warm: float) -> _Tally:
    import aiohttp

    async def main() -> _Tally:
        connector = aiohttp.TCPConnector(limit=window)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def call() -> None:
                async with session.post(url, data=PAYLOAD, headers=HEADERS) as response:
                    _check(json.loads(await response.read()))

            await _asyncio_loop(call, window, _Tally(max(window, n // 10), warm, drain=True))
            tally = _Tally(n, seconds)
            await _asyncio_loop(call, window, tally)
            return tally

    return asyncio.run(main())


def _run_project(url: str, window: int, n: int, seconds: float, warm: float) -> _Tally:
    import trio_tasksets as tt

    base = url.rsplit("/chat/completions", 1)[0]

    class Calls(tt.Taskset[tt.Task, tt.TasksetConfig]):
        size = n

        def load(self) -> Iterable[tt.Task]:
            return [tt.Task("say 7", answer="7", key=str(i)) for i in range(self.size)]

    async def eval_once(ctx: tt.ModelContext, count: int, out: str, name: str) -> None:
        Calls.size = count
        config = tt.EvalConfig(num_examples=count, max_concurrent=window, output_dir=out,
                               run_name=name, dashboard=False)  # fmt: skip
        result = await tt.run_eval(tt.Env(Calls()), ctx, config)
        assert all(e.ok and e.reward == 1.0 for e in result.episodes), "a call failed"

    async def main() -> _Tally:
        with tempfile.TemporaryDirectory() as out:
            async with tt.OpenAIClient(base, max_retries=0) as client:
                ctx = tt.ModelContext(client, "fake")
                await eval_once(ctx, max(window, min(n // 10, int(warm * 2000))), out, "warm")
                tally = _Tally(n, seconds)
                await eval_once(ctx, n, out, "timed")
                tally.done = n
                tally.stop()
                return tally

    return trio.run(main)


RUNNERS: dict[str, Runner] = {
    PROJECT: _run_project,
    TRANSPORT: _run_transport,
    "trio + httpx": _run_httpx("httpx"),
    "trio + httpx2": _run_httpx("httpx2"),
    "asyncio + openai": _run_openai,
    AIOHTTP: _run_aiohttp,
}


def _contender(args: argparse.Namespace) -> int:
    before = _server_stats(args.url)
    tally = RUNNERS[args.contender](args.url, args.window, args.n, args.seconds, args.warm)
    after = _server_stats(args.url)
    result = {"calls": tally.done, "wall": tally.wall, "cpu": tally.cpu,
              "conns": after["opened"] - before["opened"] - 1}  # fmt: skip
    print(json.dumps(result), flush=True)
    return 0


# --- the driver ----------------------------------------------------------------------------


def _pinned(cpu: int) -> list[str]:
    return ["taskset", "-c", str(cpu)] if shutil.which("taskset") and os.cpu_count() else []


def _available(name: str) -> bool:
    module = {"trio + httpx2": "httpx2", "asyncio + openai": "openai", AIOHTTP: "aiohttp"}
    try:
        __import__(module.get(name, "trio"))
    except ImportError:
        return False
    return True


def _measure(
    name: str, url: str, window: int, n: int, seconds: float, warm: float
) -> dict[str, Any]:
    command = [*_pinned(1), sys.executable, "-m", "bench.http", "--contender", name,
               "--url", url, "--window", str(window), "--n", str(n),
               "--seconds", str(seconds), "--warm", str(warm)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"  {name} failed: {last}", file=sys.stderr)
        return {"failed": last}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if not result["calls"]:
        return {"failed": f"0 calls done in {seconds:g} s"}
    return result


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "-"


def _proc_cpu(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def served_model_calls(window: int = 64, n: int = 2000, repeat: int = 3) -> None:
    """CPU per model call: an `OpenAIClient` in this process against the env server's own
    (a run of an OpenAI model on a server child, 1 worker, its CPU per run less its CPU per
    echo run), both against the fake chat server, ``window`` in flight."""
    import trio_tasksets as tt
    from trio_tasksets import EnvClient, spawn_server

    from .serve import CountConfig, Counted

    fake = subprocess.Popen(
        [sys.executable, "-m", "bench.http", "--serve"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert fake.stdout is not None
    base_url = f"http://127.0.0.1:{int(fake.stdout.readline())}/v1"

    async def main() -> dict[str, float]:
        env = tt.Env(Counted(CountConfig(count=0)))
        model = tt.OpenAIClient(base_url, max_retries=0)
        echo_ctx = tt.ModelContext(tt.EchoClient(), "echo")
        model_ctx = tt.ModelContext(model, "fake")
        best = {"in-process": math.inf, "served": math.inf}
        async with (
            spawn_server(env, allow_base_urls=[base_url]) as server,
            EnvClient(server.url, token=server.token) as client,
            model,
        ):

            async def chat() -> None:
                await model.chat(MESSAGES, model="fake", sampling=tt.Sampling())

            async def per_run(ctx: tt.ModelContext) -> float:
                async def run() -> None:
                    episode = await client.run(tt.RunSlot(tt.Task("say 7", answer="7")), ctx)
                    assert episode.ok, episode.errors

                await _trio_loop(run, window, _Tally(n // 5, 30.0))  # warm up
                before = _proc_cpu(server.pid)
                tally = _Tally(n, 60.0)
                await _trio_loop(run, window, tally)
                return (_proc_cpu(server.pid) - before) / tally.done

            for _ in range(repeat):
                await _trio_loop(chat, window, _Tally(n // 5, 30.0))
                tally = _Tally(n, 60.0)
                await _trio_loop(chat, window, tally)
                best["in-process"] = min(best["in-process"], tally.cpu / tally.done * 1e6)
                extra = await per_run(model_ctx) - await per_run(echo_ctx)
                best["served"] = min(best["served"], extra * 1e6)
        return best

    try:
        best = trio.run(main)
    finally:
        assert fake.stdin is not None
        fake.stdin.close()
        fake.wait(timeout=10)
    rows = [["in-process `OpenAIClient.chat` (client CPU)", f"{best['in-process']:,.0f}"],
            ["env server's model call (server CPU per run, less an echo run's)",
             f"{best['served']:,.0f}"]]  # fmt: skip
    print(f"\nmodel calls, {window} in flight, 1 server worker (best of {repeat})")
    print(markdown_table(["model call", "CPU µs/call"], rows))


def served(window: int = 64, n: int = 3000, repeat: int = 3) -> None:
    """The served path's own HTTP client (`EnvClient`, ``transport="http"``: the project's
    transport since issue 26, httpcore before) against `HTTPClient`, and the default WebSocket
    transport: client CPU per call at ``window`` against one env server child (1 worker)."""
    import trio_tasksets as tt
    from trio_tasksets import EnvClient, spawn_server
    from trio_tasksets._transport import HTTPClient

    from .serve import CountConfig, Counted

    async def main() -> None:
        async with spawn_server(tt.Env(Counted(CountConfig(count=0)))) as server:
            url, token = server.url, server.token
            ctx = tt.ModelContext(tt.EchoClient(), "echo")
            async with (
                EnvClient(url, token=token, transport="http", max_connections=window) as http,
                EnvClient(url, token=token) as ws,
                HTTPClient() as transport,
            ):

                async def health_env() -> None:
                    await http.health()

                async def health_transport() -> None:
                    auth = {"authorization": f"Bearer {token}"}
                    assert (
                        await transport.request("GET", url + "/health", headers=auth)
                    ).status == 200

                async def run_http() -> None:
                    await http.run(tt.RunSlot(tt.Task("say 7", answer="7")), ctx)

                async def run_ws() -> None:
                    await ws.run(tt.RunSlot(tt.Task("say 7", answer="7")), ctx)

                calls = {"GET /health, EnvClient http": health_env,
                         "GET /health, HTTPClient": health_transport,
                         "run, EnvClient http": run_http,
                         "run, EnvClient websocket": run_ws}  # fmt: skip
                best: dict[str, tuple[float, float]] = {}
                for _ in range(repeat):
                    for name, call in calls.items():
                        tally = _Tally(n, 30.0)
                        await _trio_loop(call, window, tally)
                        cpu, rate = tally.cpu / tally.done * 1e6, tally.done / tally.wall
                        old = best.get(name, (math.inf, 0.0))
                        best[name] = (min(old[0], cpu), max(old[1], rate))
        rows = [[name, f"{cpu:,.0f}", f"{rate:,.0f}"] for name, (cpu, rate) in best.items()]
        print(f"\nserved path, {window} in flight, 1 server worker (best of {repeat})")
        print(markdown_table(["call", "client CPU µs/call", "calls/s"], rows))

    trio.run(main)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run, about a minute")
    parser.add_argument("--only", nargs="+", choices=CONTENDERS, help="these contenders only")
    parser.add_argument("--scenario", nargs="+", help="LATENCY_MS:WINDOW[:N], e.g. 50:64:5000")
    parser.add_argument("--repeat", type=int, help="runs of each contender (default 3, quick 1)")
    parser.add_argument("--served", action="store_true", help="the served path's clients only")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--contender", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--window", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--warm", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(_serve())
        return 0
    if args.contender:
        return _contender(args)
    if args.served:
        repeat = args.repeat or (1 if args.quick else 3)
        served(n=500 if args.quick else 3000, repeat=repeat)
        served_model_calls(n=300 if args.quick else 2000, repeat=repeat)
        return 0

    quick = args.quick
    scenarios = [(0, 64, 2000 if quick else 10_000), (50, 64, 1500 if quick else 5000),
                 (50, 1024, 5000 if quick else 20_000)]  # fmt: skip
    if args.scenario:
        scenarios = []
        for spec in args.scenario:
            latency, window, *rest = (int(x) for x in spec.split(":"))
            scenarios.append((latency, window, rest[0] if rest else 5000))
    seconds, warm = (1.0, 0.3) if quick else (4.0, 1.0)
    default = [n for n in CONTENDERS if n not in QUICK_SKIPS] if quick else CONTENDERS
    names = [n for n in (args.only or default) if _available(n)]
    server = subprocess.Popen(
        [*_pinned(0), sys.executable, "-m", "bench.http", "--serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        versions = " ".join(
            f"{d}={_version(d)}" for d in ("trio", "h11", "httpx", "httpx2", "openai", "aiohttp")
        )
        print(f"python={sys.version.split()[0]} cpus={os.cpu_count()} {versions}")
        print(f"server pinned to CPU 0, contenders to CPU 1: {bool(_pinned(0))}")
        for latency, window, n in scenarios:
            url = f"http://127.0.0.1:{port}/l{latency}/v1/chat/completions"
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
            for repeat in range(args.repeat or (1 if quick else 3)):
                turn = repeat % len(names)
                for name in names[turn:] + names[:turn]:  # the order rotates each repeat
                    runs[name].append(_measure(name, url, window, n, seconds, warm))
            _report(latency, window, n, {name: _best(r) for name, r in runs.items()})
    finally:
        if server.stdin is not None:
            server.stdin.close()
        server.wait(timeout=10)
    return 0


def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The best CPU per call and the best rate of the runs (interference only adds); the
    first failure if every run failed."""
    failed = [r for r in runs if "failed" in r]
    runs = [r for r in runs if "failed" not in r]
    if not runs:
        return failed[0]
    cpu = min(r["cpu"] / r["calls"] for r in runs)
    rate = max(r["calls"] / r["wall"] for r in runs)
    return {"calls": runs[0]["calls"], "cpu": cpu * runs[0]["calls"],
            "wall": runs[0]["calls"] / rate, "conns": max(r["conns"] for r in runs)}  # fmt: skip


def _report(latency: int, window: int, n: int, results: dict[str, dict[str, Any]]) -> None:
    ideal = f", ideal {window / (latency / 1000):,.0f} calls/s" if latency else ""
    print(f"\n{latency} ms latency, {window} in flight (N <= {n:,}{ideal}; best of the runs)")
    figures = {name: (r["cpu"] / r["calls"] * 1e6, r["calls"] / r["wall"], r)
               for name, r in results.items() if "failed" not in r}  # fmt: skip
    base = figures.get(AIOHTTP)
    rows = []
    for name in results:
        if name not in figures:
            rows.append([name, results[name]["failed"][:60], "", "", "", "", "", ""])
            continue
        cpu_us, rate, r = figures[name]
        busy = f"{cpu_us * rate / 1e4:.0f} %"  # of one core: under 100, it waited for more work
        versus = f"{cpu_us / base[0]:.2f}x / {rate / base[1]:.2f}x" if base else ""
        rows.append([name, f"{cpu_us:,.0f}", f"{1e6 / cpu_us:,.0f}", f"{rate:,.0f}", busy,
                     f"{r['calls']:,}", str(r["conns"]), versus])  # fmt: skip
    print(markdown_table(["client", "CPU µs/call", "calls/s per core", "calls/s", "client CPU",
                          "calls", "conns", "vs aiohttp (CPU / rate)"], rows))  # fmt: skip
    mine = figures.get(PROJECT)
    if base and mine:
        cpu_ratio, rate_ratio = mine[0] / base[0], mine[1] / base[1]
        if window <= 64:
            print(goal_line(cpu_ratio <= 1.5, "CPU/call <= 1.5x aiohttp", f"{cpu_ratio:.2f}x"))
            print(goal_line(rate_ratio >= 0.9, "calls/s >= 0.9x aiohttp", f"{rate_ratio:.2f}x"))
        else:
            print(goal_line(rate_ratio >= 0.8, "calls/s >= 0.8x aiohttp", f"{rate_ratio:.2f}x"))


if __name__ == "__main__":
    sys.exit(main())
