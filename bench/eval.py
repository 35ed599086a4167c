"""Eval overhead: `run_eval` against bare `run_stream` over the same `run_slot` (issue 3).

    python -m bench.eval [--n 20000] [--window 256] [--repeat 5] [--quick]

Same process, same slots, same echo model (no latency), contenders interleaved across
repeats; the figure per contender is the median wall time of a whole `trio.run`. Contenders:

* bare: `tt.run_stream` over the planned slots, each `env.run_slot(slot, ctx)`;
* run_eval, dashboard off: the same plus traces (one write per row, group fsync), summary;
* run_eval, dashboard on: the same plus the live rich view, rendered to a terminal console
  whose output goes to /dev/null.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import AbstractAsyncContextManager
from typing import Any

import trio
from rich.console import Console

import trio_tasksets as tt
from trio_tasksets._monitor import dashboard

from .common import env_info, markdown_table


class Many(tt.Taskset[tt.Task, tt.TasksetConfig]):
    size = 20_000

    def load(self) -> Iterable[tt.Task]:
        return [tt.Task(f"say {i}", answer=str(i), key=str(i)) for i in range(self.size)]


def _ctx() -> tt.ModelContext:
    return tt.ModelContext(tt.EchoClient(), "echo")


async def bare(n: int, window: int) -> int:
    env: tt.Env[tt.Task] = tt.Env(Many())
    ctx = _ctx()
    slots = [tt.RunSlot(task) for task in env.taskset.head(n)]

    async def source() -> AsyncIterator[tt.RunSlot[tt.Task]]:
        for slot in slots:
            yield slot

    async def run(slot: tt.RunSlot[tt.Task]) -> tt.Episode:
        return await env.run_slot(slot, ctx)

    return len(await tt.run_stream(source(), run, window=window))


async def with_eval(n: int, window: int, live: bool) -> int:
    with tempfile.TemporaryDirectory() as out:
        config = tt.EvalConfig(num_examples=n, max_concurrent=window, output_dir=out,
                               run_name="bench", dashboard=live)  # fmt: skip
        result = await tt.run_eval(tt.Env(Many()), _ctx(), config)
        return len(result.episodes)


def _terminal_dashboard() -> Callable[..., AbstractAsyncContextManager[None]]:
    """`dashboard.show` drawing to a real (forced) terminal console that discards its output."""
    sink = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    console = Console(file=sink, force_terminal=True, width=100)
    return functools.partial(dashboard.show, console=console)


CONTENDERS: dict[str, Callable[[int, int], Any]] = {
    "bare run_stream + run_slot": bare,
    "run_eval, dashboard off": lambda n, w: with_eval(n, w, False),
    "run_eval, dashboard on": lambda n, w: with_eval(n, w, True),
}


def measure(name: str, n: int, window: int) -> float:
    fn = CONTENDERS[name]
    start = time.perf_counter()
    done = trio.run(fn, n, window)
    elapsed = time.perf_counter() - start
    assert done == n, (name, done)
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a smoke run: n=2000, repeat 2")
    args = parser.parse_args(argv)
    if args.quick:
        args.n, args.repeat = 2000, 2
    Many.size = args.n
    setattr(dashboard, "show", _terminal_dashboard())  # noqa: B010  (eval.py calls dashboard.show)

    times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for name in CONTENDERS:  # warm-up
        measure(name, min(args.n, 1000), args.window)
    for _ in range(args.repeat):
        for name in CONTENDERS:
            times[name].append(measure(name, args.n, args.window))

    base = statistics.median(times["bare run_stream + run_slot"])
    rows = []
    for name, seconds in times.items():
        med = statistics.median(seconds)
        rows.append(
            [name, f"{args.n / med:,.0f}", f"{med / args.n * 1e6:.1f}", f"{med / base:.2f}x"]
        )
    print(" ".join(f"{k}={v}" for k, v in env_info()))
    print(f"echo eval, n={args.n} rollouts, window (-c) {args.window}, median of {args.repeat}")
    print(markdown_table(["contender", "rollouts/s", "us/rollout", "vs bare"], rows))
    for name in ("run_eval, dashboard off", "run_eval, dashboard on"):
        ratio = statistics.median(times[name]) / base
        print(f"goal {name} <= 1.5x bare: {ratio:.2f}x {'PASS' if ratio <= 1.5 else 'MISS'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
