"""The served path against in-process: throughput of an eval, and the per-slot round trip.

Run from the project root: ``python -m bench.serve`` (``--quick`` for a smoke run).

* **echo eval**: ``tt.run_eval`` over N echo tasks (``-r 1``, ``-c 64``, dashboard off, traces
  written as usual) in-process, then ``serve=True`` with 1 and 2 workers. Two rates: *wall*
  is N over the whole ``run_eval`` call (a served eval includes starting its server child,
  about half a second), *steady* is N over the span from the first episode's start to the last
  one's finish (the episodes' own timestamps), i.e. without start-up. Median of the repeats.
* **cpu-heavy eval**: the same, but the reward burns about 2 ms of CPU per episode: the work
  the served path exists to move off the runner's thread.
* **round trip**: one server child (1 worker), one `tt.EnvClient` (its default WebSocket
  transport, then ``transport="http"``); the wall time of each ``client.run`` of an echo
  slot, at window 1 (pure latency) and at window 64 (under load, queueing included). p50
  and p99.
* **CPU per slot**: the same pair over the WebSocket at window 64; the CPU time (user +
  system) the client process and the server process spend per echo slot, median of the
  repeats. Unlike the rates, it hardly moves when other processes share the cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Iterable
from importlib import metadata

import attrs
import trio

import trio_tasksets as tt
from trio_tasksets._env.env import answer_match
from trio_tasksets._serve import spawn_server

from .common import env_info, goal_line, markdown_table

GOAL_RATIO = 0.5  # served (1 worker) / in-process, echo eval: stated in issue 4, reported only
WINDOW = 64


@attrs.define
class CountConfig(tt.TasksetConfig):
    count: int = 5000
    burn_ms: float = 0.0


class Counted(tt.Taskset[tt.Task, CountConfig]):
    """`count` echo tasks; the reward busy-loops `burn_ms` of CPU first (0: none)."""

    def load(self) -> Iterable[tt.Task]:
        return [tt.Task(f"say {i}", answer=str(i), key=f"n:{i}") for i in range(self.config.count)]

    def reward(self, task: tt.Task, completion: str) -> float:
        deadline = time.perf_counter() + self.config.burn_ms / 1000
        while time.perf_counter() < deadline:
            pass
        return answer_match(task, completion)


@attrs.frozen
class EvalRun:
    wall: float  # seconds of the whole run_eval call
    steady: float  # first episode start to last episode finish
    n: int


async def one_eval(config: CountConfig, *, serve: bool, workers: int) -> EvalRun:
    env = tt.Env(Counted(config))
    ctx = tt.ModelContext(tt.EchoClient(), "echo")
    with tempfile.TemporaryDirectory() as out:
        eval_config = tt.EvalConfig(
            max_concurrent=WINDOW, output_dir=out, run_name="bench", dashboard=False,
            serve=serve, workers=workers,
        )  # fmt: skip
        began = time.monotonic()
        result = await tt.run_eval(env, ctx, eval_config)
        wall = time.monotonic() - began
    episodes = result.episodes
    assert len(episodes) == config.count
    assert all(e.ok for e in episodes)
    steady = max(e.timing["finished"] for e in episodes) - min(
        e.timing["started"] for e in episodes
    )
    return EvalRun(wall, steady, len(episodes))


CONTENDERS = [
    ("in-process", False, 1),
    ("served, 1 worker", True, 1),
    ("served, 2 workers", True, 2),
]


def eval_rates(config: CountConfig, repeats: int) -> dict[str, tuple[float, float]]:
    """Median wall and steady rollouts/s of each contender (interleaved across repeats)."""
    runs: dict[str, list[EvalRun]] = {name: [] for name, _, _ in CONTENDERS}
    for repeat in range(repeats):
        order = CONTENDERS[repeat % 3 :] + CONTENDERS[: repeat % 3]
        for name, serve, workers in order:
            runs[name].append(trio.run(_eval, config, serve, workers))
    return {
        name: (statistics.median(r.n / r.wall for r in done),
               statistics.median(r.n / r.steady for r in done))
        for name, done in runs.items()
    }  # fmt: skip


async def _eval(config: CountConfig, serve: bool, workers: int) -> EvalRun:
    return await one_eval(config, serve=serve, workers=workers)


async def round_trips(n: int, window: int, transport: str = "websocket") -> list[float]:
    """Seconds of each `client.run` of n echo slots at `window` over `transport`."""
    env = tt.Env(Counted(CountConfig(count=0)))
    ctx = tt.ModelContext(tt.EchoClient(), "echo")
    times: list[float] = []

    async def slots() -> AsyncIterator[tt.RunSlot[tt.Task]]:
        for i in range(n):
            yield tt.RunSlot(tt.Task(f"say {i}", answer=str(i), key=f"n:{i}"))

    async with (
        spawn_server(env) as server,
        tt.EnvClient(
            server.url, token=server.token, max_connections=window, transport=transport
        ) as client,
    ):

        async def run(slot: tt.RunSlot[tt.Task]) -> None:
            began = time.perf_counter()
            await client.run(slot, ctx)
            times.append(time.perf_counter() - began)

        await tt.run_stream(slots(), run, window=window)
    return times


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def cpu_per_slot(n: int, repeats: int) -> tuple[float, float]:
    """Median microseconds of CPU per echo slot: (client process, server process)."""
    env = tt.Env(Counted(CountConfig(count=0)))
    ctx = tt.ModelContext(tt.EchoClient(), "echo")
    client_us: list[float] = []
    server_us: list[float] = []

    async def slots(count: int) -> AsyncIterator[tt.RunSlot[tt.Task]]:
        for i in range(count):
            yield tt.RunSlot(tt.Task(f"say {i}", answer=str(i), key=f"n:{i}"))

    async with spawn_server(env) as server, tt.EnvClient(server.url, token=server.token) as client:

        async def run(slot: tt.RunSlot[tt.Task]) -> None:
            await client.run(slot, ctx)

        await tt.run_stream(slots(n // 5), run, window=WINDOW)  # warm up
        for _ in range(repeats):
            client_before, server_before = time.process_time(), _cpu_seconds(server.pid)
            await tt.run_stream(slots(n), run, window=WINDOW)
            client_us.append((time.process_time() - client_before) / n * 1e6)
            server_us.append((_cpu_seconds(server.pid) - server_before) / n * 1e6)
    return statistics.median(client_us), statistics.median(server_us)


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def rate_table(rates: dict[str, tuple[float, float]]) -> str:
    base_wall, base_steady = rates["in-process"]
    rows = [
        [name, f"{wall:,.0f}", f"{wall / base_wall:.3f}", f"{steady:,.0f}",
         f"{steady / base_steady:.3f}"]
        for name, (wall, steady) in rates.items()
    ]  # fmt: skip
    headers = [
        "contender",
        "wall rollouts/s",
        "vs in-process",
        "steady rollouts/s",
        "vs in-process",
    ]
    return markdown_table(headers, rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (small N, 1 repeat)")
    parser.add_argument(
        "--repeat", type=int, default=7,
        help="interleaved repeats (default 7: a 5,000-rollout in-process run lasts ~0.1 s, so "
        "its rate is noisy and the median needs several)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    n, cpu_n, repeats = (500, 100, 1) if args.quick else (5000, 1000, args.repeat)
    lines: list[str] = ["## Served path (issue 4)", ""]
    info = [(k, v) for k, v in env_info() if k in ("python", "platform", "cpus", "trio")]
    info += [(dist, _version(dist)) for dist in ("hypercorn", "wsproto", "h11")]
    lines += ["### Machine", "", "| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in info)]
    lines += ["", "### Results"]
    lines += ["", f"#### Echo eval: {n:,} rollouts, `-c {WINDOW}` (median of {repeats})", ""]
    echo = eval_rates(CountConfig(count=n), repeats)
    lines.append(rate_table(echo))
    ratio = echo["served, 1 worker"][1] / echo["in-process"][1]
    lines += ["", goal_line(ratio >= GOAL_RATIO, f"served (1 worker) >= {GOAL_RATIO}x in-process",
                            f"{ratio:.3f}x (steady)")]  # fmt: skip
    lines += ["", f"#### CPU-heavy eval: {cpu_n:,} rollouts, reward burns 2 ms, `-c {WINDOW}`", ""]
    lines.append(rate_table(eval_rates(CountConfig(count=cpu_n, burn_ms=2.0), repeats)))
    lines += ["", "#### Per-slot round trip on loopback (`client.run`, echo, 1 worker)", ""]
    rows: list[list[str]] = []
    for transport in ("websocket", "http"):
        for window, count in ((1, n // 5), (WINDOW, n)):
            times = trio.run(round_trips, count, window, transport)
            rows.append([transport, str(window), f"{count:,}",
                         f"{percentile(times, 0.5) * 1e3:.2f}",
                         f"{percentile(times, 0.99) * 1e3:.2f}"])  # fmt: skip
    lines.append(markdown_table(["transport", "window", "slots", "p50 ms", "p99 ms"], rows))
    lines += ["", f"#### CPU per served slot (echo, WebSocket, window {WINDOW}, 1 worker)", ""]
    client_us, server_us = trio.run(cpu_per_slot, n * 2, repeats)
    lines.append(markdown_table(
        ["process", "CPU µs per slot"], [["client", f"{client_us:.1f}"],
                                         ["server", f"{server_us:.1f}"]],
    ))  # fmt: skip
    print("\n".join(lines))


if __name__ == "__main__":
    main()
