"""The Redis client under trio: what a call costs with the project's own connection against the
well-kept libraries it could have used (docs/benchmarks.md, "The Redis client").

    python -m bench.redis_client [--n 5000] [--repeat 3] [--quick]

Starts its own `redis-server` (loopback, free port, no persistence). Each contender runs, in
this process and one after the other within each repeat, N times:

* `ping`: one PING round trip;
* `slot`: what a worker does per task: `XREADGROUP COUNT 1` of an entry waiting in the
  stream, then `MULTI XADD XACK EXEC` of a 300-byte result (two round trips).

Contenders:

* `trio_tasksets.redis._resp` (what ships): trio sockets, hiredis parsing, no thread;
* `redis-py + trio.to_thread`: redis-py's sync client, each call in a trio worker thread (what
  shipped before);
* `coredis (anyio on trio)`: coredis's async client on trio, if installed (`.[dev]`);
* `redis-py sync, no event loop`: the floor, for reference (no trio at all).

Reported: CPU µs per call (this process, every thread) and wall µs, best of the repeats, and
each against the shipped connection.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import redis
import trio

from trio_tasksets.redis._resp import Address, Connection

from .common import env_info, markdown_table, redis_server

STREAM, GROUP, RESULTS = "bench:client", "bench:g", "bench:client:results"
ROW = "x" * 300
Loop = Callable[[str, int], Awaitable[None]]


@attrs.define
class Best:
    wall: float = float("inf")
    cpu: float = float("inf")

    def add(self, wall: float, cpu: float) -> None:
        self.wall, self.cpu = min(self.wall, wall), min(self.cpu, cpu)


def _fill(r: redis.Redis, n: int) -> None:
    r.delete(STREAM, RESULTS)
    r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    with r.pipeline(transaction=False) as pipe:
        for i in range(n):
            pipe.xadd(STREAM, {"task": f'{{"key": "{i}", "data": {{"prompt": "say {i}"}}}}'})
        pipe.execute()


async def resp_loop(url: str, n: int, what: str) -> None:
    c = await Connection.open(Address.parse(url))
    try:
        if what == "ping":
            for _ in range(n):
                await c.execute("PING")
            return
        for _ in range(n):
            reply = await c.execute(
                "XREADGROUP", "GROUP", GROUP, "w", "COUNT", 1, "STREAMS", STREAM, ">"
            )
            entry = reply[0][1][0][0]
            await c.pipeline(
                [
                    ("XADD", RESULTS, "*", "entry", entry, "row", ROW),
                    ("XACK", STREAM, GROUP, entry),
                ],
                transaction=True,
            )
    finally:
        c.close()


async def thread_loop(url: str, n: int, what: str) -> None:
    c = redis.Redis.from_url(url, decode_responses=True, protocol=2)
    try:
        if what == "ping":
            for _ in range(n):
                await trio.to_thread.run_sync(c.ping)
            return

        def read() -> Any:
            return c.xreadgroup(GROUP, "w", {STREAM: ">"}, count=1)

        for _ in range(n):
            entry = (await trio.to_thread.run_sync(read))[0][1][0][0]

            def publish(entry: str = entry) -> Any:
                with c.pipeline(transaction=True) as pipe:
                    pipe.xadd(RESULTS, {"entry": entry, "row": ROW})
                    pipe.xack(STREAM, GROUP, entry)
                    return pipe.execute()

            await trio.to_thread.run_sync(publish)
    finally:
        c.close()


async def coredis_loop(url: str, n: int, what: str) -> None:
    import coredis

    c = coredis.Redis.from_url(url, decode_responses=True)
    async with c:
        if what == "ping":
            for _ in range(n):
                await c.ping()
            return
        for _ in range(n):
            reply = await c.xreadgroup(GROUP, "w", streams={STREAM: ">"}, count=1)
            assert reply is not None
            entry = reply[STREAM][0].identifier
            async with c.pipeline(transaction=True) as pipe:
                pipe.xadd(RESULTS, {"entry": entry, "row": ROW})
                pipe.xack(STREAM, GROUP, [entry])


def sync_loop(url: str, n: int, what: str) -> None:
    c = redis.Redis.from_url(url, decode_responses=True, protocol=2)
    try:
        for _ in range(n):
            if what == "ping":
                c.ping()
                continue
            reply: Any = c.xreadgroup(GROUP, "w", {STREAM: ">"}, count=1)
            entry = str(reply[0][1][0][0])
            with c.pipeline(transaction=True) as pipe:
                pipe.xadd(RESULTS, {"entry": entry, "row": ROW})
                pipe.xack(STREAM, GROUP, entry)
                pipe.execute()
    finally:
        c.close()


def _has_coredis() -> bool:
    try:
        import coredis  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--n", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smoke run: n=500, 1 repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.n, args.repeat = 500, 1
    contenders: dict[str, Callable[[str, int, str], Any]] = {
        "trio_tasksets.redis._resp": lambda u, n, w: trio.run(resp_loop, u, n, w),
        "redis-py + trio.to_thread": lambda u, n, w: trio.run(thread_loop, u, n, w),
    }
    if _has_coredis():
        contenders["coredis (anyio on trio)"] = lambda u, n, w: trio.run(coredis_loop, u, n, w)
    contenders["redis-py sync, no event loop"] = sync_loop
    best = {(name, what): Best() for name in contenders for what in ("ping", "slot")}
    print(" ".join(f"{k}={v}" for k, v in env_info()), f"redis-py={redis.__version__}")
    with redis_server("bench.redis_client") as (url, r):
        print(f"redis-server {r.info('server')['redis_version']}, n={args.n}, "
              f"best of {args.repeat}")  # fmt: skip
        for _ in range(args.repeat):
            for name, run in contenders.items():
                for what in ("ping", "slot"):
                    if what == "slot":
                        _fill(r, args.n)
                    cpu, wall = time.process_time(), time.perf_counter()
                    run(url, args.n, what)
                    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                    best[name, what].add(wall / args.n * 1e6, cpu / args.n * 1e6)
                print(f"  {name}: done", flush=True)
    ours = "trio_tasksets.redis._resp"
    rows = [
        [name]
        + [
            f"{best[name, what].cpu:.0f} ({best[name, what].cpu / best[ours, what].cpu:.2f}x)"
            for what in ("ping", "slot")
        ]
        + [f"{best[name, what].wall:.0f}" for what in ("ping", "slot")]
        for name in contenders
    ]
    headers = ["client", "PING CPU µs", "slot CPU µs", "PING wall µs", "slot wall µs"]
    print(markdown_table(headers, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
