"""The asyncio bridge's cost, both directions (issue 5).

    python -m bench.aio [--n 50000] [--env-n 10000] [--window 64] [--repeat 5] [--quick]

Same process, same sizes, contenders interleaved across repeats (the order rotates every
repeat); each measurement is the wall time of the *whole* `trio.run(...)` / `asyncio.run(...)`
call (loop start-up, trio-asyncio's `open_loop`, shutdown: all included), after a
`gc.collect()`. Medians are the figures; bests are printed too.

Guest mode (asyncio programs calling the trio runner), `n` items, window `window`:

* ``trio.run``: `tt.run_stream(counter(n), trio_run)` under `trio.run` (the reference);
* ``guest, trio code``: the *same* workload (trio source, trio run) through
  `tt.aio.run_stream(..., trio_source=True, trio_run=True)` from `asyncio.run`: the cost of
  trio guest mode itself (the goal: <= 1.3x `trio.run`);
* ``guest, asyncio code``: an asyncio source and an asyncio `run` (`asyncio.sleep(0)`), as an
  asyncio program would pass them: each pull and each run is one asyncio task (reported).

The env bridge (trio programs driving an asyncio env), `env_n` episodes through the service
pattern (`env.serving()`, `env.taskset.channel()`, `tt.run_stream(..., env.run_slot)`, the
echo model), window `window`:

* ``native trio env``: a trio feed and a trio `rollout` (`trio.lowlevel.checkpoint()`, then
  `ctx.chat`) in a `tt.Env` subclass (the reference);
* ``bridged asyncio env``: the same written with asyncio (an `AsyncioTaskset` feed, an asyncio
  `rollout` with `asyncio.sleep(0)` and `await ctx.chat`) through `tt.aio.bridge_env`;
* ``bridged, asyncio rollout only`` / ``tt.Env, asyncio feed only``: one half bridged, to
  split the cost between the feed and the rollout (reported).

Then the guest-mode contenders once more: importing trio-asyncio (the env part does) patches
asyncio globally, and this shows what that costs guest mode.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import AbstractAsyncContextManager
from typing import Any

import trio

import trio_tasksets as tt

from .common import Timings, env_info, goal_line, markdown_table

GOAL_GUEST = 1.3  # guest mode <= 1.3x trio.run (issue 5)

Message = dict[str, Any]


# --- guest mode -----------------------------------------------------------------------------


async def counter(n: int) -> AsyncIterator[int]:
    """0..n-1 with no awaits of its own: valid trio and asyncio code."""
    for i in range(n):
        yield i


async def trio_run(x: int) -> int:
    await trio.lowlevel.checkpoint()
    return 2 * x


async def aio_run(x: int) -> int:
    await asyncio.sleep(0)
    return 2 * x


def g_trio(n: int, window: int) -> list[int]:
    async def main() -> list[int]:
        return await tt.run_stream(counter(n), trio_run, window=window)

    return trio.run(main)


def g_guest_trio(n: int, window: int) -> list[int]:
    async def main() -> list[int]:
        return await tt.aio.run_stream(
            counter(n), trio_run, window=window, trio_source=True, trio_run=True
        )

    return asyncio.run(main())


def g_guest_asyncio(n: int, window: int) -> list[int]:
    async def main() -> list[int]:
        return await tt.aio.run_stream(counter(n), aio_run, window=window)

    return asyncio.run(main())


GUEST: dict[str, Callable[[int, int], list[int]]] = {
    "trio.run": g_trio,
    "guest, trio code": g_guest_trio,
    "guest, asyncio code": g_guest_asyncio,
}


# --- the env bridge -------------------------------------------------------------------------


def _task(i: int) -> tt.Task:
    return tt.Task(f"say {i}", answer=str(i), key=str(i))


class TrioFeed(tt.Taskset[tt.Task, tt.TasksetConfig]):
    """A trio feed of `size` tasks."""

    size = 0

    async def stream(self) -> AsyncIterator[tt.Task]:
        for i in range(self.size):
            await trio.lowlevel.checkpoint()
            yield _task(i)


class AioFeed(tt.aio.AsyncioTaskset[tt.Task, tt.TasksetConfig]):
    """The same feed, asyncio code."""

    size = 0

    async def stream(self) -> AsyncIterator[tt.Task]:
        for i in range(self.size):
            await asyncio.sleep(0)
            yield _task(i)


class TrioEnv(tt.Env[tt.Task]):
    """The native trio env: a checkpoint, then the model."""

    async def rollout(self, task: tt.Task, ctx: tt.ModelContext) -> tuple[list[Message], str]:
        await trio.lowlevel.checkpoint()
        messages: list[Message] = [{"role": "user", "content": task.prompt}]
        reply = await ctx.chat(messages)
        return [*messages, {"role": "assistant", "content": reply.content}], reply.content


class AioEnv:
    """The same env written with asyncio (an asyncio env for `tt.aio.bridge_env`)."""

    def __init__(self, taskset: tt.Taskset[tt.Task, Any]) -> None:
        self.taskset = taskset

    async def rollout(
        self, task: tt.Task, ctx: tt.aio.AsyncioModelContext
    ) -> tuple[list[Message], str]:
        await asyncio.sleep(0)
        messages: list[Message] = [{"role": "user", "content": task.prompt}]
        reply = await ctx.chat(messages)
        return [*messages, {"role": "assistant", "content": reply.content}], reply.content


def _sized(cls: type[TrioFeed] | type[AioFeed], n: int) -> tt.Taskset[tt.Task, Any]:
    taskset = cls()
    taskset.size = n
    return taskset


def _serve(env: tt.Env[tt.Task], window: int) -> int:
    """The service pattern over `env`, all its feed: the number of ok episodes."""
    ctx = tt.ModelContext(tt.EchoClient(), "echo")

    async def run(task: tt.Task) -> tt.Episode:
        return await env.run_slot(tt.RunSlot(task), ctx)

    async def main() -> int:
        serving: AbstractAsyncContextManager[Any] = env.serving()
        async with serving, env.taskset.channel() as tasks:
            episodes = await tt.run_stream(tasks, run, window=window)
        return sum(1 for e in episodes if e.ok)

    return trio.run(main)


def e_native(n: int, window: int) -> int:
    return _serve(TrioEnv(_sized(TrioFeed, n)), window)


def e_bridged(n: int, window: int) -> int:
    return _serve(tt.aio.bridge_env(AioEnv(_sized(AioFeed, n))), window)


def e_bridged_rollout(n: int, window: int) -> int:
    return _serve(tt.aio.bridge_env(AioEnv(_sized(TrioFeed, n))), window)


def e_aio_feed(n: int, window: int) -> int:
    return _serve(TrioEnv(_sized(AioFeed, n)), window)


ENV: dict[str, Callable[[int, int], int]] = {
    "native trio env": e_native,
    "bridged asyncio env": e_bridged,
    "bridged, asyncio rollout only": e_bridged_rollout,
    "tt.Env, asyncio feed only": e_aio_feed,
}


# --- measuring ------------------------------------------------------------------------------


def _check(name: str, result: object, n: int) -> None:
    expected: object = [2 * i for i in range(n)] if isinstance(result, list) else n
    if result != expected:
        raise AssertionError(f"{name}: wrong result")


def measure(
    contenders: dict[str, Callable[[int, int], Any]],
    n: int,
    window: int,
    repeat: int,
    warmup: int,
) -> dict[str, Timings]:
    timings = {name: Timings(name, n) for name in contenders}
    for name, fn in contenders.items():  # warm-up, checked, untimed
        _check(name, fn(warmup, window), warmup)
    names = list(contenders)
    for r in range(repeat):
        rotated = names[r % len(names) :] + names[: r % len(names)]
        for name in rotated:
            gc.collect()
            wall, cpu = time.perf_counter(), time.process_time()
            result = contenders[name](n, window)
            timings[name].seconds.append(time.perf_counter() - wall)
            timings[name].cpu_seconds.append(time.process_time() - cpu)
            _check(name, result, n)
    return timings


def table(timings: dict[str, Timings], reference: str, unit: str) -> str:
    ref = timings[reference]
    rows = [
        [
            t.name,
            f"{t.median_us:.2f}",
            f"{t.best_us:.2f}",
            f"{t.median / ref.median:.2f}x",
            f"{t.best / ref.best:.2f}x",
        ]
        for t in timings.values()
    ]
    headers = [
        "contender",
        f"µs/{unit} median",
        "(best)",
        f"vs {reference} (median)",
        "(best)",
    ]
    return markdown_table(headers, rows)


def contention(timings: Iterable[Timings]) -> float:
    return max(t.contention for t in timings)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.aio", description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, help="items per guest-mode run (default 50000; quick 5000)")
    p.add_argument("--env-n", type=int, help="episodes per env run (default 10000; quick 1000)")
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--repeat", type=int, help="interleaved repeats (default 5; quick 3)")
    p.add_argument("--quick", action="store_true", help="small sizes for a smoke run (~5 s)")
    args = p.parse_args(argv)
    args.n = args.n or (5_000 if args.quick else 50_000)
    args.env_n = args.env_n or (1_000 if args.quick else 10_000)
    args.repeat = args.repeat or (3 if args.quick else 5)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    began = time.perf_counter()
    print("# asyncio bridge benchmark (issue 5)\n")
    print(markdown_table(["", ""], [list(row) for row in env_info()]))
    print(f"\nwindow {args.window}, {args.repeat} interleaved repeats, medians (best)\n")

    guest = measure(GUEST, args.n, args.window, args.repeat, warmup=500)
    print(f"## Guest mode: tt.aio.run_stream from asyncio.run, N={args.n:,}\n")
    print(table(guest, "trio.run", "item"))
    ratio = guest["guest, trio code"].median / guest["trio.run"].median
    aio_ratio = guest["guest, asyncio code"].median / guest["trio.run"].median
    print()
    print(goal_line(ratio <= GOAL_GUEST, f"guest mode <= {GOAL_GUEST}x trio.run", f"{ratio:.3f}x"))
    print(
        f"  (reported, no goal) guest mode with asyncio source and run: {aio_ratio:.3f}x trio.run"
    )

    env = measure(ENV, args.env_n, args.window, args.repeat, warmup=200)
    print(f"\n## Env bridge: tt.aio.bridge_env under trio.run, {args.env_n:,} episodes\n")
    print(table(env, "native trio env", "episode"))
    bridged = env["bridged asyncio env"].median / env["native trio env"].median
    extra = env["bridged asyncio env"].median_us - env["native trio env"].median_us
    print(f"\n  bridged asyncio env / native trio env: {bridged:.2f}x (+{extra:.1f} µs/episode)")
    # trio-asyncio is imported now (bridge_env imports it): it patches asyncio globally
    # (trio_tasksets.aio._loop._keep_asyncio_loops undoes the loop factory part). Guest mode again:
    after = measure(GUEST, args.n, args.window, args.repeat, warmup=500)
    print(f"\n## Guest mode again, now that trio-asyncio is imported, N={args.n:,}\n")
    print(table(after, "trio.run", "item"))
    worst = contention([*guest.values(), *env.values(), *after.values()])
    print(
        f"\nworst wall/CPU ratio of a run: {worst:.2f}; total {time.perf_counter() - began:.0f} s"
    )


if __name__ == "__main__":
    main()
