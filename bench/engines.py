"""Engines that queue, a request-rate limit, many endpoints: adaptive against fixed (issue 23).

    python -m bench.engines [--quick] [--n 3000] [--warm 0] [--only engine rate pool kill]

Every server is the tests' fake OpenAI server (`tests/fixtures/chat_server.py`) with a
policy: `engine.py`'s `ContinuousBatching` or a `RateLimit`, on 127.0.0.1 sockets, in the same
trio run as the eval, on `MockClock(autojump_threshold=0)`: the figures are in the simulation's own
seconds, so they do not depend on the machine's load (real sockets and the real client all
the same; the wall time is printed apart). Each contender is `tt.run_eval` of `--n`
single-call rollouts over `tt.OpenAIClient`, dashboard off, traces written.

* engine: a continuous-batching engine, capacity 48, KV budget 64 (a call holds 1 unit
  plus 1 more as it decodes, so a full batch of 48 outgrows the budget and gets
  preempted), 16 +- 8 tokens a call, step 10 ms + 0.2 ms per running call + 2 ms per
  admitted prefill. Fixed -c 8 ... 1024 against adaptive `-c 1-8-1024`, and the same with
  `--engine-metrics`. Goals: throughput >= 0.95x the best fixed window, p99 <= 1.3x that
  window's (the best fixed: the highest throughput; among those within 2 % of it, the
  lowest p99), preempted calls <= 2 %; with --engine-metrics the same within 0.98x.
* rate: at most 200 calls/s (429 + Retry-After + x-ratelimit-* above it, whatever the
  concurrency), 50 ms a call. Fixed -c 8 ... 64 against adaptive `-c 1-8-64`. Goals:
  adaptive >= 0.9x the best fixed, 429s < 5 % of calls.
* pool: four engines of capacities 8, 16, 32, 64 (KV unbounded), one eval with
  `--base-url` x4, `-c 1024` (each endpoint's own adaptive window bounds it), against the
  sum of each engine's own throughput at a fixed window of its capacity. Goals: >= 0.9x the
  sum; no endpoint idle (nothing running) while another has calls waiting (sampled every
  10 ms).
* kill: the same four, one (32) killed a third of the way through: every slot answered,
  the dead endpoint's calls retried elsewhere.

`--warm W` runs W more rollouts first and judges the `--n` after them: every figure (calls/s,
p50/p99, preempted, 429s, idle samples) counts from the W-th answer on, for every contender
alike, so a short run measures each window's steady state instead of its start-up (which a
full run of 3,000 amortizes). `--quick` is a warm run of the same goals: 1,000 judged
rollouts after 500, and of the engine sweep only the fixed windows around the best one
(32, 48, 64: the full sweep's best is 48; 8 and 16 are far slower, 128 and 1024 as fast with a
worse p99).
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import trio
import trio.testing

import trio_tasksets as tt
from trio_tasksets._core.adaptive import AdaptiveWindow, parse_window

from .common import goal_line, markdown_table

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
if str(FIXTURES) not in sys.path:
    sys.path.insert(0, str(FIXTURES))

from chat_server import ChatServer, RateLimit  # noqa: E402
from engine import ContinuousBatching  # noqa: E402

FIXED_ENGINE = ["8", "16", "32", "48", "64", "128", "1024"]
QUICK_ENGINE = ["32", "48", "64"]  # --quick: the full sweep's best fixed window, either side
FIXED_RATE = ["8", "16", "32", "64"]
POOL = (8, 16, 32, 64)


class Calls(tt.Taskset[tt.Task, tt.TasksetConfig]):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def load(self) -> Iterable[tt.Task]:
        return [tt.Task("say 7", answer="7", key=str(i)) for i in range(self.n)]


async def _eval(
    url: str | list[str],
    spec: str,
    n: int,
    *,
    metrics: str | None = None,
    warm: int = 0,
    tail: int = 0,
    answered: Callable[[], int] | None = None,
    on_mark: Callable[[str], None] | None = None,
    **client: Any,
) -> dict[str, Any]:
    """`n` judged rollouts, after `warm` more and before `tail` more: the rate counts from
    the `warm`-th call `answered` to the `warm + n`-th (polled every 10 ms of the simulation;
    without `tail`, to the end), and `on_mark("warm")` / `on_mark("end")` run there (the
    caller's snapshots of its server's counts)."""
    window = parse_window(spec)
    built = AdaptiveWindow(*window) if isinstance(window, tuple) else window
    marks: dict[str, float] = {}

    def mark(label: str) -> None:
        marks[label] = trio.current_time()
        if on_mark is not None:
            on_mark(label)

    async def watch() -> None:
        assert answered is not None
        for label, count in (("warm", warm), ("end", warm + n)):
            if label == "end" and not tail:
                return  # the eval's end is the mark
            while answered() < count:  # noqa: ASYNC110  (a poll of the simulation)
                await trio.sleep(0.01)
            mark(label)

    with tempfile.TemporaryDirectory() as out:
        async with tt.OpenAIClient(url, **client) as model, trio.open_nursery() as nursery:
            config = tt.EvalConfig(max_concurrent=built, output_dir=out, run_name="bench",
                                   dashboard=False, engine_metrics=metrics)  # fmt: skip
            if warm or tail:
                nursery.start_soon(watch)
            else:
                mark("warm")
            wall = time.perf_counter()
            env = tt.Env(Calls(warm + n + tail))
            result = await tt.run_eval(env, tt.ModelContext(model, "sim"), config)
            if "end" not in marks:
                mark("end")
            seconds = marks["end"] - marks["warm"]
            nursery.cancel_scope.cancel()
    summary = result.summary
    sizes = [size for _, size, _ in summary["window_history"]]
    return {
        "rate": n / seconds, "ok": summary["ok"], "wall": time.perf_counter() - wall,
        "window": sizes[-1], "max": max(sizes), "endpoints": summary.get("endpoints"),
    }  # fmt: skip


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


async def engine_sweep(
    n: int, *, warm: int = 0, tail: int = 0, fixed: list[str] = FIXED_ENGINE
) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for spec in [*fixed, "1-8-1024", "1-8-1024 --engine-metrics"]:
        engine = ContinuousBatching(capacity=48, kv_budget=64)
        async with ChatServer(policy=engine) as server:
            metrics = server.url.removesuffix("/v1") + "/metrics" if "metrics" in spec else None
            at: dict[str, tuple[int, int, int]] = {"warm": (0, 0, 0)}

            def snapshot(
                label: str, engine: ContinuousBatching = engine, at: dict[str, Any] = at
            ) -> None:
                at[label] = (engine.calls, engine.preemptions, len(engine.latencies))

            result = await _eval(
                server.url, spec.split()[0], n, metrics=metrics, warm=warm, tail=tail,
                answered=functools.partial(len, engine.latencies), on_mark=snapshot,
            )  # fmt: skip
            (calls0, preempted0, answered0), (calls1, preempted1, answered1) = (
                at["warm"], at["end"]
            )  # fmt: skip
            judged = engine.latencies[answered0:answered1]
            result.update(
                p50=_quantile(judged, 0.5), p99=_quantile(judged, 0.99),
                preempted=(preempted1 - preempted0) / max(1, calls1 - calls0),
            )  # fmt: skip
            found[spec] = result
    return found


async def rate_sweep(n: int, *, warm: int = 0, tail: int = 0) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for spec in [*FIXED_RATE, "1-8-64"]:
        async with ChatServer(0.05, policy=RateLimit(200)) as server:
            at: dict[str, tuple[int, int]] = {"warm": (0, 0)}

            def snapshot(label: str, server: ChatServer = server, at: dict[str, Any] = at) -> None:
                at[label] = (server.ok, server.limited)

            def answered(server: ChatServer = server) -> int:
                return server.ok

            result = await _eval(
                server.url, spec, n, max_retries=100, warm=warm, tail=tail, answered=answered,
                on_mark=snapshot,
            )  # fmt: skip
            ok = at["end"][0] - at["warm"][0]
            limited = at["end"][1] - at["warm"][1]
            result["limited"] = limited / max(1, ok + limited)
            found[spec] = result
    return found


async def _watch_idle(engines: list[ContinuousBatching], found: dict[str, int]) -> None:
    """Every 10 ms: is an engine idle (nothing running) while another queues?"""
    while True:
        await trio.sleep(0.01)
        queued = any(e.waiting > 0 for e in engines)
        idle = any(e.running == 0 and e.waiting == 0 for e in engines)
        busy = any(e.running > 0 for e in engines)
        if busy:
            found["samples"] += 1
            found["idle_while_queued"] += queued and idle


async def pool_run(n: int, *, kill: bool, warm: int = 0, tail: int = 0) -> dict[str, Any]:
    alone = []
    if not kill:
        for capacity in POOL:
            engine = ContinuousBatching(capacity=capacity, kv_budget=10_000, seed=capacity)
            async with ChatServer(policy=engine) as server:
                answered = functools.partial(len, engine.latencies)
                run = await _eval(server.url, str(capacity), n // 4, warm=warm // 4,
                                  tail=tail // 4, answered=answered)  # fmt: skip
                alone.append(run["rate"])
    engines = [ContinuousBatching(capacity=c, kv_budget=10_000, seed=c) for c in POOL]
    servers = [ChatServer(policy=engine) for engine in engines]
    idle = {"samples": 0, "idle_while_queued": 0}
    at: dict[str, list[int]] = {"warm": [0] * len(POOL)}
    judged = {"idle": idle}

    def snapshot(label: str) -> None:  # the idle samples and the calls count between marks
        at[label] = [e.calls for e in engines]
        if label == "warm":
            idle.update(samples=0, idle_while_queued=0)
        else:
            judged["idle"] = dict(idle)

    async with AsyncExitStack() as stack:
        for server in servers:
            await stack.enter_async_context(server)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_idle, engines, idle)
            if kill:

                async def killer() -> None:
                    while sum(len(e.latencies) for e in engines) < n // 3:  # noqa: ASYNC110
                        await trio.sleep(0.01)  # a poll of the simulation
                    servers[2].kill()

                nursery.start_soon(killer)
            result = await _eval(
                [s.url for s in servers], "1024", n, backoff=0.05, warm=warm, tail=tail,
                answered=lambda: sum(len(e.latencies) for e in engines), on_mark=snapshot,
            )  # fmt: skip
            nursery.cancel_scope.cancel()
    calls = [end - begin for begin, end in zip(at["warm"], at["end"], strict=True)]
    result.update(
        alone=alone, idle=judged["idle"], calls=calls,
        answered=[len(e.latencies) for e in engines],
    )  # fmt: skip
    return result


def _best_fixed(results: dict[str, dict[str, Any]], fixed: list[str]) -> str:
    top = max(results[s]["rate"] for s in fixed)
    close = [s for s in fixed if results[s]["rate"] >= 0.98 * top]
    return min(close, key=lambda s: results[s].get("p99", 0.0))


def _report_engine(results: dict[str, dict[str, Any]], fixed: list[str] = FIXED_ENGINE) -> None:
    print("\nSimulated engine, capacity 48, KV budget 64 (simulated seconds)")
    rows = [[spec, f"{r['rate']:.1f}", f"{r['p50']:.3f}", f"{r['p99']:.3f}",
             f"{r['preempted']:.1%}", f"{r['window']} (max {r['max']})", f"{r['wall']:.1f}"]
            for spec, r in results.items()]  # fmt: skip
    print(markdown_table(["-c", "calls/s", "p50 s", "p99 s", "preempted", "window at end",
                          "wall s"], rows))  # fmt: skip
    best = _best_fixed(results, fixed)
    for spec, floor in (("1-8-1024", 0.95), ("1-8-1024 --engine-metrics", 0.95 * 0.98)):
        mine, ref = results[spec], results[best]
        ratio, p99 = mine["rate"] / ref["rate"], mine["p99"] / ref["p99"]
        print(goal_line(ratio >= floor, f"{spec}: >= {floor:.3g}x the best fixed (-c {best})",
                        f"{ratio:.2f}x"))  # fmt: skip
        limit = 1.3 if "metrics" not in spec else 1.3 / 0.98
        print(goal_line(p99 <= limit, f"{spec}: p99 <= {limit:.3g}x -c {best}'s", f"{p99:.2f}x"))
        print(goal_line(mine["preempted"] <= 0.02, f"{spec}: preempted <= 2 % of calls",
                        f"{mine['preempted']:.1%}"))  # fmt: skip


def _report_rate(results: dict[str, dict[str, Any]]) -> None:
    print("\nRequest-rate limit 200 calls/s, 50 ms a call (simulated seconds)")
    rows = [[spec, f"{r['rate']:.1f}", f"{r['limited']:.1%}", f"{r['window']} (max {r['max']})",
             f"{r['wall']:.1f}"] for spec, r in results.items()]  # fmt: skip
    print(markdown_table(["-c", "calls/s", "429s", "window at end", "wall s"], rows))
    best = max(FIXED_RATE, key=lambda s: results[s]["rate"])
    mine = results["1-8-64"]
    ratio = mine["rate"] / results[best]["rate"]
    print(goal_line(ratio >= 0.9, f"1-8-64: >= 0.9x the best fixed (-c {best})", f"{ratio:.2f}x"))
    print(
        goal_line(mine["limited"] < 0.05, "1-8-64: 429s < 5 % of calls", f"{mine['limited']:.1%}")
    )


def _report_pool(result: dict[str, Any], killed: dict[str, Any] | None, n: int) -> None:
    total = sum(result["alone"])
    print(f"\nFour engines, capacities {', '.join(map(str, POOL))} (simulated seconds)")
    rows = [
        [f"alone, -c {c}", f"{rate:.1f}"] for c, rate in zip(POOL, result["alone"], strict=True)
    ]
    rows.append(["sum of the four alone", f"{total:.1f}"])
    rows.append(["one eval over all four", f"{result['rate']:.1f}"])
    print(markdown_table(["", "calls/s"], rows))
    calls = ", ".join(f"{c}: {k}" for c, k in zip(POOL, result["calls"], strict=True))
    print(f"  calls per endpoint (capacity: calls): {calls}")
    idle = result["idle"]
    share = idle["idle_while_queued"] / max(1, idle["samples"])
    print(goal_line(result["rate"] >= 0.9 * total, ">= 0.9x the sum of the four alone",
                    f"{result['rate'] / total:.2f}x"))  # fmt: skip
    print(goal_line(share <= 0.02, "no endpoint idle while another queues (<= 2 % of samples)",
                    f"{share:.1%} of {idle['samples']}"))  # fmt: skip
    if killed is None:
        return
    dead = killed["endpoints"][list(killed["endpoints"])[2]]
    print(f"  killed the capacity-32 engine after {n // 3} answers: ok {killed['ok']}/{n}, "
          f"its figures {dead}")  # fmt: skip
    print(goal_line(killed["ok"] == n, "one killed mid-run: every slot answered",
                    f"{killed['ok']}/{n}"))  # fmt: skip
    print(goal_line(dead["ejections"] >= 1, "the dead endpoint ejected, its calls retried elsewhere",
                    f"{dead['ejections']} ejection(s), {dead['errors']} failed calls"))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true",
        help="the same goals on a short steady-state run: --n 1000 --warm 500 --tail 250, "
        "fixed -c 32, 48, 64",
    )  # fmt: skip
    parser.add_argument("--n", type=int, default=3000, help="judged rollouts per contender")
    parser.add_argument(
        "--warm", type=int, default=0,
        help="rollouts run first and not judged (each contender's start-up) (default 0)",
    )  # fmt: skip
    parser.add_argument(
        "--tail", type=int, default=0,
        help="rollouts run after the judged ones (the drain at the end) (default 0)",
    )  # fmt: skip
    parser.add_argument("--only", nargs="+", choices=["engine", "rate", "pool", "kill"])
    args = parser.parse_args(argv)
    n, warm = (1000, 500) if args.quick else (args.n, args.warm)
    tail = 250 if args.quick else args.tail
    fixed = QUICK_ENGINE if args.quick else FIXED_ENGINE
    only = set(args.only or ["engine", "rate", "pool", "kill"])

    async def run() -> None:
        started = time.perf_counter()
        if warm or tail:
            print(f"each contender runs {warm:,} + {n:,} + {tail:,} rollouts; the {n:,} in the "
                  f"middle are judged")  # fmt: skip
        if "engine" in only:
            _report_engine(await engine_sweep(n, warm=warm, tail=tail, fixed=fixed), fixed)
        if "rate" in only:
            _report_rate(await rate_sweep(n, warm=warm, tail=tail))
        if "pool" in only or "kill" in only:
            pool = await pool_run(n, kill=False, warm=warm, tail=tail)
            killed = await pool_run(n, kill=True) if "kill" in only else None
            _report_pool(pool, killed, n)
        print(f"\n{n:,} rollouts per contender; {time.perf_counter() - started:.0f} s wall in all")

    trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
