"""Groups and over-sampling (issue 22): `tt.first` and `eval --group` against their plain forms.

    python -m bench.groups [--groups 4000] [--repeat 5] [--quick]

Same process, contenders interleaved across repeats; each figure is the best and the median
wall time of a whole `trio.run` (event loop start-up included), after a `gc.collect()`. The
goals are judged on the medians' ratio; on a loaded machine interference only adds time.

1. Over-sampling: a feed of groups (each run checkpoints 8 x 3 times: its rollouts' work,
   the same for every contender, so that the window bounds the same runs everywhere), of
   which 1 in 4 is accepted; the time to the n-th accepted group, window 64:

   * ``tt.first(n, ...)``;
   * ``as_completed + break``: `tt.as_completed` with a loop that counts accepted results
     and leaves the block at the n-th (what a user writes by hand with this library);
   * ``trio by hand``: a nursery, a `CapacityLimiter`, a memory channel for the results and
     a cancel of the nursery at the n-th (the plain trio form);
   * ``asyncio, cancel only`` (reference): `asyncio.as_completed` over tasks gated by a
     semaphore, each other task `cancel()`ed at the n-th but not awaited: the bug of
     slime #2176 / #2218, shown by its count of runs still alive at return.

   Goal: ``tt.first`` <= 1.1x ``trio by hand``; runs still alive 0 ms after it returns: 0.

2. Eval throughput: `run_eval` with ``-r 8 --group`` against ``-r 8`` without groups, the
   same echo model, the same ``-c``, dashboard off, traces written. Three measurements:

   * the schedule, in virtual time (trio's MockClock) with model latencies of 10 to 30 ms
     (the same seeded list for both): whether groups keep the window full, exactly and
     whatever the machine's load;
   * wall clock with a 20 ms model latency (the CPU the group machinery adds, when each
     rollout waits on a model);
   * wall clock with no latency (the per-rollout cost of the machinery itself).

   Goal: ``--group`` >= 0.95x the rollouts/s of ``-r 8`` (each measurement is reported
   against it; the wall-clock ones on medians and on bests). The wall-clock runs also show
   the process CPU time per rollout (user + system): on a loaded machine it counts less of
   the time spent waiting for a core than the wall clock does.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import random
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import trio
import trio.testing

import trio_tasksets as tt

from .common import env_info, goal_line, markdown_table

GROUP = 8
WINDOW = 64
ACCEPT_ONE_IN = 4


class Live:
    """Runs started and not yet unwound (their `finally` not yet run)."""

    def __init__(self) -> None:
        self.now = 0


def _group_trio(live: Live) -> Callable[[int], Awaitable[int]]:
    async def group(number: int) -> int:
        live.now += 1
        try:
            for _ in range(GROUP * 3):
                await trio.lowlevel.checkpoint()
            return number
        finally:
            live.now -= 1

    return group


async def _numbers(total: int) -> AsyncIterator[int]:
    for number in range(total):
        yield number


def _accepted(number: int) -> bool:
    return number % ACCEPT_ONE_IN == 0


async def first_tt(n: int, live: Live) -> tuple[int, int]:
    got = await tt.first(
        n, _numbers(n * ACCEPT_ONE_IN * 4), _group_trio(live), window=WINDOW, accept=_accepted
    )
    return len(got), live.now


async def first_as_completed(n: int, live: Live) -> tuple[int, int]:
    kept: list[int] = []
    async with tt.as_completed(
        _numbers(n * ACCEPT_ONE_IN * 4), _group_trio(live), window=WINDOW
    ) as results:
        async for _index, number in results:
            if _accepted(number):
                kept.append(number)
                if len(kept) == n:
                    break
    return len(kept), live.now


async def first_by_hand(n: int, live: Live) -> tuple[int, int]:
    run = _group_trio(live)
    limiter = trio.CapacityLimiter(WINDOW)
    send, receive = trio.open_memory_channel[int](WINDOW)
    kept: list[int] = []

    async def one(number: int) -> None:
        try:
            await send.send(await run(number))
        finally:
            limiter.release_on_behalf_of(number)

    async def feed(nursery: trio.Nursery) -> None:
        async for number in _numbers(n * ACCEPT_ONE_IN * 4):
            await limiter.acquire_on_behalf_of(number)
            nursery.start_soon(one, number)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(feed, nursery)
        async for number in receive:
            if _accepted(number):
                kept.append(number)
                if len(kept) == n:
                    nursery.cancel_scope.cancel()
                    break
    return len(kept), live.now


async def _first_asyncio(n: int, live: Live) -> tuple[int, int]:
    semaphore = asyncio.Semaphore(WINDOW)

    async def group(number: int) -> int:
        async with semaphore:
            live.now += 1
            try:
                for _ in range(GROUP * 3):
                    await asyncio.sleep(0)
                return number
            finally:
                live.now -= 1

    tasks = [asyncio.ensure_future(group(i)) for i in range(n * ACCEPT_ONE_IN * 4)]
    kept: list[int] = []
    for next_done in asyncio.as_completed(tasks):
        number = await next_done
        if _accepted(number):
            kept.append(number)
            if len(kept) == n:
                break
    for task in tasks:
        task.cancel()  # cancelled, not awaited: they unwind after this returns
    alive = sum(1 for task in tasks if not task.done())
    return len(kept), alive


FIRST: dict[str, Callable[[int, Live], Awaitable[tuple[int, int]]]] = {
    "tt.first": first_tt,
    "as_completed + break": first_as_completed,
    "trio by hand": first_by_hand,
}


def _time_first(name: str, n: int) -> tuple[float, int]:
    live = Live()
    gc.collect()
    start = time.perf_counter()
    if name == "asyncio, cancel only":
        got, alive = asyncio.run(_first_asyncio(n, live))
    else:
        got, alive = trio.run(FIRST[name], n, live)
    elapsed = time.perf_counter() - start
    assert got == n, (name, got)
    return elapsed, alive


class Prompts(tt.Taskset[tt.Task, tt.TasksetConfig]):
    size = 1000

    def load(self) -> Iterable[tt.Task]:
        return [tt.Task(f"say {i}", answer=str(i), key=str(i)) for i in range(self.size)]


class Grpo(tt.Env[tt.Task]):
    async def score_group(self, task: tt.Task, episodes: list[tt.Episode]) -> None:
        mean = statistics.fmean(e.reward for e in episodes)
        for episode in episodes:
            episode.advantage = episode.reward - mean


class Jittered(tt.EchoClient):
    """The echo model with the k-th call's latency from a fixed, seeded list (10 to 30 ms):
    the same latencies, in call order, for every contender."""

    def __init__(self) -> None:
        super().__init__()
        rng = random.Random(22)
        self.latencies = [rng.uniform(0.01, 0.03) for _ in range(4096)]
        self.calls = 0

    async def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        model: str,
        sampling: tt.Sampling,
        tools: list[dict[str, Any]] | None = None,
    ) -> tt.Completion:
        self.calls += 1
        await trio.sleep(self.latencies[self.calls % len(self.latencies)])
        return await super().chat(messages, model=model, sampling=sampling)


async def _virtual(tasks: int, group: bool) -> float:
    """Virtual seconds (trio's MockClock) of an eval over the jittered model: how long the
    schedule takes, whatever the CPU."""
    with tempfile.TemporaryDirectory() as out:
        config = tt.EvalConfig(
            num_examples=tasks, rollouts_per_example=GROUP, max_concurrent=WINDOW,
            output_dir=out, run_name="bench", dashboard=False, group=group,
        )  # fmt: skip
        began = trio.current_time()
        result = await tt.run_eval(Grpo(Prompts()), tt.ModelContext(Jittered(), "echo"), config)
        assert len(result.episodes) == tasks * GROUP
        return trio.current_time() - began


async def _eval(tasks: int, group: bool, delay: float) -> int:
    with tempfile.TemporaryDirectory() as out:
        config = tt.EvalConfig(
            num_examples=tasks, rollouts_per_example=GROUP, max_concurrent=WINDOW,
            output_dir=out, run_name="bench", dashboard=False, group=group,
        )  # fmt: skip
        ctx = tt.ModelContext(tt.EchoClient(delay=delay), "echo")
        result = await tt.run_eval(Grpo(Prompts()), ctx, config)
        return len(result.episodes)


EVAL: dict[str, bool] = {"-r 8": False, "-r 8 --group": True}


def _time_eval(name: str, tasks: int, delay: float) -> tuple[float, float]:
    """The wall time and the process CPU time (user + system) of one eval."""
    gc.collect()
    start, cpu = time.perf_counter(), time.process_time()
    done = trio.run(_eval, tasks, EVAL[name], delay)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert done == tasks * GROUP, (name, done)
    return elapsed, cpu


def _eval_of(tasks: int, delay: float, name: str) -> tuple[float, float]:
    return _time_eval(name, tasks, delay)


def _interleaved(names: list[str], repeat: int, one: Callable[[str], Any]) -> dict[str, list[Any]]:
    found: dict[str, list[Any]] = {name: [] for name in names}
    for turn in range(repeat):
        order = names[turn % len(names) :] + names[: turn % len(names)]
        for name in order:
            found[name].append(one(name))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=4000, help="accepted groups to wait for")
    parser.add_argument("--tasks", type=int, default=1000, help="eval tasks (x 8 rollouts)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a smoke run: small n, repeat 2")
    args = parser.parse_args(argv)
    if args.quick:
        args.groups, args.tasks, args.repeat = 300, 150, 2
    Prompts.size = args.tasks
    print(" ".join(f"{k}={v}" for k, v in env_info()))

    names = [*FIRST, "asyncio, cancel only"]
    for name in names:  # warm-up
        _time_first(name, 50)
    firsts = _interleaved(names, args.repeat, lambda name: _time_first(name, args.groups))
    base = statistics.median(s for s, _ in firsts["trio by hand"])
    print(
        f"\nfirst(n): n={args.groups} accepted groups (1 in {ACCEPT_ONE_IN} accepted, "
        f"{GROUP} rollouts each), window {WINDOW}, {args.repeat} repeats"
    )
    rows = []
    for name, runs in firsts.items():
        seconds = [s for s, _ in runs]
        med = statistics.median(seconds)
        rows.append([name, f"{min(seconds) * 1e3:.1f}", f"{med * 1e3:.1f}",
                     f"{med / base:.2f}x", str(max(alive for _, alive in runs))])  # fmt: skip
    print(markdown_table(
        ["contender", "best ms", "median ms", "vs trio by hand", "alive after return"], rows
    ))  # fmt: skip
    ratio = statistics.median(s for s, _ in firsts["tt.first"]) / base
    alive = max(a for _, a in firsts["tt.first"])
    print(goal_line(ratio <= 1.1, "tt.first <= 1.1x trio by hand", f"{ratio:.2f}x"))
    print(goal_line(alive == 0, "runs alive 0 ms after tt.first returns == 0", str(alive)))

    evals = list(EVAL)
    rollouts = args.tasks * GROUP
    print(
        f"\neval, virtual time (MockClock): {args.tasks} tasks x {GROUP} rollouts, -c {WINDOW}, "
        f"model latency 10 to 30 ms (ideal {rollouts * 0.02 / WINDOW:.3f} s)"
    )
    rows = []
    virtual: dict[str, float] = {}
    for name in evals:
        clock = trio.testing.MockClock(autojump_threshold=0)
        virtual[name] = trio.run(_virtual, args.tasks, EVAL[name], clock=clock)
        rows.append([name, f"{virtual[name]:.3f}", f"{rollouts / virtual[name]:,.0f}"])
    print(markdown_table(["contender", "virtual s", "rollouts/s"], rows))
    speed = virtual["-r 8"] / virtual["-r 8 --group"]
    print(goal_line(speed >= 0.95, "--group >= 0.95x the rollouts/s of -r 8 (schedule)",
                    f"{speed:.2f}x"))  # fmt: skip
    for name in evals:  # warm-up
        _time_eval(name, min(args.tasks, 50), 0.0)
    for delay in (0.02, 0.0):
        timed = _interleaved(evals, args.repeat, functools.partial(_eval_of, args.tasks, delay))
        ideal = f"ideal {WINDOW / delay:,.0f} rollouts/s" if delay else "no latency"
        print(
            f"\neval: {args.tasks} tasks x {GROUP} rollouts, -c {WINDOW}, echo with "
            f"{delay * 1e3:g} ms latency ({ideal}), {args.repeat} repeats"
        )
        rows = []
        walls = {name: [wall for wall, _ in runs] for name, runs in timed.items()}
        for name, runs in timed.items():
            med = statistics.median(walls[name])
            cpus = [cpu * 1e6 / rollouts for _, cpu in runs]
            rows.append([name, f"{rollouts / min(walls[name]):,.0f}", f"{rollouts / med:,.0f}",
                         f"{min(cpus):.1f}", f"{statistics.median(cpus):.1f}"])  # fmt: skip
        print(markdown_table(["contender", "best rollouts/s", "median rollouts/s",
                              "best CPU µs/rollout", "median CPU µs/rollout"], rows))  # fmt: skip
        speed = statistics.median(walls["-r 8"]) / statistics.median(walls["-r 8 --group"])
        best = min(walls["-r 8"]) / min(walls["-r 8 --group"])
        detail = f"{speed:.2f}x (medians), {best:.2f}x (bests)"
        print(goal_line(speed >= 0.95, "--group >= 0.95x the rollouts/s of -r 8 (wall)", detail))
    return 0


if __name__ == "__main__":
    sys.exit(main())
