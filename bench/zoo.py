"""The adaptive window against a sweep of fixed windows, on servers written outside the
project: the zoo (`../shared/servers/zoo.py`, issue 32).

    python -m bench.zoo [--quick] [--families engine plateau ...] [--seeds 1 2 3 4 5]
                        [--seconds 20] [--repeat 1] [--busy 0] [--zoo PATH]

For each family and seed, the zoo serves that family in its own process (`zoo.py FAMILY
--seed N`: every parameter drawn at random, printed with the figures). Each contender is
what a user runs: `tt.run_eval` of single-call rollouts over `tt.OpenAIClient`
(``max_retries=1000``: a 429 is retried, after its Retry-After when there is one), dashboard
off, traces written, for `--seconds` of wall time (a minute-long rate limit gets 2.5 of its
periods). The contenders of one draw run one after the other, the order rotated on each
`--repeat`, each against a fresh zoo process of the draw's parameters: a sweep of fixed windows chosen around what the draw's parameters say the best
one is (the bench knows them; the adaptive window does not), and the adaptive window
`-c 1-8-256` with each objective the family is judged on (`knee`; `throughput` and
`p99=SECONDS` on the engines; `knee` with `--engine-metrics` on `engine`).
The full run takes about `seconds x contenders x seeds x families`: 20 s x ~8 x 5 x 6 is
80 minutes (and more with minute-long limits); `--families`/`--seeds` pick a part.

Measured per contender: calls/s over the whole run (what the run made of its wall time,
convergence included) and over its second half (where it settled), each call counted by
its share of its time inside the span (no call starts after the run's time; those in
flight then finish: counting completions, calls that end in waves were off by a wave), the client's p50 and
p99 latency of successful calls, the share of calls the zoo answered 429 (its own
`/stats`), failed rows, and where the window settled. Goals (issue 32), each a ratio of
contenders measured side by side, on the second half's rate:

* engine, plateau: `knee` >= 0.95x the best fixed window's rate, at a p99 <= 1.3x that of
  the smallest fixed window within 5 % of that rate; `p99=X` keeps p99 under X at >= 0.9x
  the best fixed rate that meets X; `--engine-metrics` (engine) as `knee`; `throughput`
  >= 0.95x the best fixed (0.98x on a real vLLM: `bench.real_engine`).
* ratelimit, tpm: `knee` >= 0.9x the best fixed window, < 5 % of calls answered 429, no
  failed row.
* concurrency, flaky: `knee` >= 0.9x the best fixed window, no failed row.

A contender runs for `--seconds`, a rate limit's for 2.5 of its periods and 300 calls at its
rate at least (at most 120 s: the first unpaced calls are not the pacing), a bucket's for 40
times the seconds its burst holds (at most 120 s: the burst is then at most 5 % of the
judged half's calls, not a fixed window's lead over the limit), and an
engine's or a plateau's for 50 calls' latency at its knee at least (at most 120 s: a draw
of 1 s calls, run for 15 s, sees slow start and one probe past the capacity fill its
second half, whatever the controller).

`--busy N` runs N busy loops (processes spinning on the CPU) beside the client for the whole
run: the busy-CPU point. Every draw is reported, not the best. `--quick` (CI): four
families (engine, ratelimit, concurrency, plateau), seed 1 with calls of tens of
milliseconds, 16 s a contender, per-second periods; exits 1 when a goal is missed.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import trio

import trio_tasksets as tt
from trio_tasksets._core.adaptive import Outcome

from .common import goal_line, markdown_table

ZOO = Path(__file__).resolve().parent.parent.parent / "shared" / "servers" / "zoo.py"
FAMILIES = ("engine", "plateau", "ratelimit", "tpm", "concurrency", "flaky")
ADAPTIVE = (1, 8, 256)
PROMPT = "Count from one to twenty, in words."
QUICK = {  # --quick: the draw's other parameters, with calls of tens of milliseconds
    "engine": ["--base", "0.03", "--tpot", "0"],
    "plateau": ["--base", "0.03"],
    "ratelimit": ["--latency", "0.02"],
    "tpm": ["--latency", "0.02"],
    "concurrency": ["--latency", "0.02"],
    "flaky": ["--latency", "0.02", "--slow", "0.5"],
}


class Calls(tt.Taskset[tt.Task, tt.TasksetConfig]):
    """`n` single-call tasks, streamed; none pulled at `until` (trio's clock) or later."""

    def __init__(self, n: int, until: float = math.inf) -> None:
        super().__init__()
        self.n = n
        self.until = until

    def load(self) -> Iterable[tt.Task]:  # (streamed: `stream` below)
        return []

    async def stream(self) -> AsyncIterator[tt.Task]:
        for i in range(self.n):
            if trio.current_time() >= self.until:
                return
            yield tt.Task(PROMPT, answer="", key=str(i))


class Latencies(tt.CallObserver):
    """Every attempt's end time, outcome and latency, as the model client reports them."""

    def __init__(self) -> None:
        self.ok: list[tuple[float, float]] = []  # (end, latency)
        self.failed = 0

    def on_call(self, outcome: Outcome, retry_after: float | None, latency: float | None) -> None:
        if outcome is Outcome.SUCCESS and latency is not None:
            self.ok.append((trio.current_time(), latency))
        elif outcome is not Outcome.SUCCESS:
            self.failed += 1


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# --- the zoo --------------------------------------------------------------------------------


@contextmanager
def zoo(
    path: Path, family: str, seed: int, extra: list[str]
) -> Iterator[tuple[str, dict[str, Any]]]:
    """One zoo server (its own process): (base URL, its parameters)."""
    proc = subprocess.Popen(
        [sys.executable, str(path), family, "--seed", str(seed), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stderr is not None
        url = proc.stdout.readline().strip()
        info = json.loads(proc.stderr.readline())
        if not url.startswith("http"):
            raise RuntimeError(f"zoo {family} did not start: {url!r}")
        yield url, info["params"]
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _http(url: str, method: str = "GET") -> Any:
    request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(request, timeout=10) as reply:
        body = reply.read()
    return json.loads(body) if body else None


def _spin(stop: Any) -> None:
    while not stop.is_set():
        sum(range(1000))


@contextmanager
def busy_loops(n: int) -> Iterator[None]:
    """`n` processes spinning on the CPU beside the client (the busy-CPU point)."""
    stop = multiprocessing.Event()
    procs = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True) for _ in range(n)]
    for proc in procs:
        proc.start()
    try:
        yield
    finally:
        stop.set()
        for proc in procs:
            proc.join(5)


# --- what to run ----------------------------------------------------------------------------


def _sizes(values: Iterable[float]) -> list[int]:
    return sorted({min(256, max(1, round(v))) for v in values})


def tokens_per_call(params: dict[str, Any]) -> int:
    return len(PROMPT) // 4 + int(params["gen_tokens"])


def engine_latency(params: dict[str, Any], family: str) -> float:
    """The latency of a call at the knee (a full batch, nothing queued)."""
    if family == "engine":
        work = params["base"] + params["tpot"] * params["gen_tokens"]
        return float(work * (1 + params["alpha"]))
    return float(params["base"] * 2 ** params["gamma"])


def limit_rate(family: str, params: dict[str, Any]) -> float:
    """The calls a second a `ratelimit` or `tpm` draw lets through."""
    if family == "ratelimit":
        return float(params.get("rate") or params["limit"] / params["period"])
    return float(params["tpm"] / params["period"] / tokens_per_call(params))


def burst_seconds(family: str, params: dict[str, Any]) -> float:
    """The seconds of calls a `ratelimit` or `tpm` bucket's burst holds, at its rate."""
    if family == "ratelimit":
        return float(params["burst"] / params["rate"])
    return float(params["period"])  # (a tpm bucket holds its period's tokens)


def contenders(family: str, params: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(the fixed windows, the adaptive contenders) of one draw."""
    adaptive = ["knee"]
    if family == "engine":
        c = params["capacity"]
        fixed = _sizes([c / 2, 3 * c / 4, c, 3 * c / 2, 2 * c])
        bound = 1.25 * engine_latency(params, family)
        adaptive += [f"p99={bound:.3g}", "throughput", "knee --engine-metrics"]
    elif family == "plateau":
        c, gamma = params["soft_capacity"], params["gamma"]
        peak = c / (gamma - 1) if gamma > 1.05 else 256
        fixed = _sizes([c / 2, c, 2 * c, peak / 2, peak, 2 * peak, 256])
        bound = 1.25 * engine_latency(params, family)
        adaptive += [f"p99={bound:.3g}", "throughput"]
    elif family in ("ratelimit", "tpm"):
        need = limit_rate(family, params) * params["latency"]
        fixed = _sizes([need / 2, need, 2 * need, 4 * need, 16 * need])
    elif family == "concurrency":
        c = params["capacity"]
        fixed = _sizes([c / 2, c, 2 * c])
    else:  # flaky: no limit, so the most calls in flight is the best fixed window
        fixed = _sizes([8, 32, 128, 256])
    return [str(size) for size in fixed], adaptive


async def one_run(
    url: str, spec: str, seconds: float, *, model: str = "zoo", max_tokens: int | None = None
) -> dict[str, Any]:
    """One contender once: single-call rollouts through `tt.run_eval` for `seconds`, against
    a zoo server (its `/stats` counts the 429s) or, with `model` other than "zoo", any engine
    (`bench.real_engine`: the 429s are the client's count)."""
    zoo = model == "zoo"
    metrics = url.removesuffix("/v1") + "/metrics" if "--engine-metrics" in spec else None
    window: tt.Window
    if spec.isdigit():
        window = tt.Window(int(spec))
    else:
        window = tt.AdaptiveWindow(*ADAPTIVE, objective=spec.split()[0])
    observer = Latencies()
    if zoo:
        _http(url.removesuffix("/v1") + "/stats/reset", "POST")
    with tempfile.TemporaryDirectory() as out:
        async with tt.OpenAIClient(url, timeout=300.0, max_retries=1000) as client:
            config = tt.EvalConfig(max_concurrent=window, output_dir=out, run_name="bench",
                                   num_examples=10**9,
                                   dashboard=False, engine_metrics=metrics)  # fmt: skip
            sampling = tt.Sampling(temperature=1.0, max_tokens=max_tokens)
            ctx = tt.ModelContext(client, model, sampling)
            start = trio.current_time()
            stop = start + seconds
            cpu = time.process_time()
            # no call starts after `stop`; the calls in flight then finish (a queue longer
            # than the run itself is cut), so each is counted by its share of its time
            # inside the span measured: counting completions, a draw whose 256 calls end in
            # waves of 1.5 s was off by a wave, 6 % of a 22 s half
            with tt.observe_calls(observer), trio.move_on_after(2 * seconds):
                await tt.run_eval(tt.Env(Calls(10**9, until=stop)), ctx, config)
            cpu = time.process_time() - cpu
    stats = _http(url.removesuffix("/v1") + "/stats") if zoo else None
    if stats is None:  # no server count: every attempt not answered 200 counts as failed
        stats = {"ok": len(observer.ok), "refused": 0, "errors": 0}
    half = start + seconds / 2

    def share(a: float, b: float) -> float:
        """The calls' work inside [a, b], in calls: each its share of its time there."""
        return sum(
            max(0.0, min(end, b) - max(end - lat, a)) / lat for end, lat in observer.ok if lat > 0
        )

    late = [lat for end, lat in observer.ok if end >= half]
    lats = [lat for _, lat in observer.ok]
    sizes = [size for _, size, _ in window.history]
    answered = stats["ok"] + stats["refused"] + stats["errors"]
    return {
        "rate": share(start, stop) / seconds,
        "rate2": share(half, stop) / (stop - half),
        "p50": quantile(lats, 0.5), "p99": quantile(lats, 0.99), "p99_2": quantile(late, 0.99),
        "refused": stats["refused"] / answered if answered else 0.0,
        "failed": observer.failed - stats["refused"] - stats["errors"],
        "window": sizes[-1], "max": max(sizes), "steps": len(sizes) - 1,
        "history": window.history, "cpu_per_call": cpu / max(1, len(observer.ok)),
        "summary": window.report() if isinstance(window, tt.AdaptiveWindow) else None,
        "pacer": repr(getattr(window, "pacer", None)),
    }  # fmt: skip


def draw(
    server: Any, specs: list[str], seconds: float, repeat: int
) -> dict[str, list[dict[str, Any]]]:
    """Each contender `repeat` times, the order rotated on each repeat, each against a zoo
    server of its own (`server()`: the draw's parameters, a fresh process: a rate limit
    spent by the contender before must not shape the next one's start)."""
    found: dict[str, list[dict[str, Any]]] = {spec: [] for spec in specs}
    for r in range(repeat):
        order = specs[r % len(specs) :] + specs[: r % len(specs)]
        for spec in order:
            with server() as (url, _):
                found[spec].append(trio.run(one_run, url, spec, seconds))
    return found


def merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    merged = {k: statistics.median(run[k] for run in runs)
              for k in ("rate", "rate2", "p50", "p99", "p99_2", "refused", "cpu_per_call")}  # fmt: skip
    merged["failed"] = sum(max(0, run["failed"]) for run in runs)
    merged["window"] = "/".join(str(run["window"]) for run in runs)
    merged["history"] = runs[-1]["history"]
    return merged


def judge(
    family: str,
    params: dict[str, Any],
    figures: dict[str, dict[str, Any]],
    fixed: list[str],
    *,
    throughput: float = 0.95,
) -> list[tuple[bool, str, str]]:
    """Each goal of the draw: (held, goal, what was measured). `throughput`: the share of
    the best fixed rate that objective must make (0.98 on a real vLLM)."""
    best = max(fixed, key=lambda s: figures[s]["rate2"])
    top = figures[best]["rate2"]
    goals: list[tuple[bool, str, str]] = []
    for spec, mine in figures.items():
        if spec in fixed:
            continue
        ratio = mine["rate2"] / top if top else math.nan
        name = f"-c 1-8-256 {spec}"
        if family in ("engine", "plateau") and spec.startswith("knee"):
            smallest = min((s for s in fixed if figures[s]["rate2"] >= 0.95 * top), key=int)
            p99 = mine["p99_2"] / figures[smallest]["p99_2"]
            goals.append(
                (ratio >= 0.95, f"{name} >= 0.95x best fixed (-c {best})", f"{ratio:.2f}x")
            )
            goals.append((p99 <= 1.3, f"{name} p99 <= 1.3x -c {smallest}'s", f"{p99:.2f}x"))
        elif spec.startswith("p99="):
            bound = float(spec.removeprefix("p99="))
            meets = [s for s in fixed if figures[s]["p99_2"] <= bound]
            ref = max((figures[s]["rate2"] for s in meets), default=0.0)
            goals.append((mine["p99_2"] <= bound, f"{name}: p99 under {bound:g} s",
                          f"{mine['p99_2']:.3f} s"))  # fmt: skip
            if ref:
                r = mine["rate2"] / ref
                goals.append((r >= 0.9, f"{name} >= 0.9x best fixed meeting it", f"{r:.2f}x"))
        elif spec == "throughput":
            goals.append((ratio >= throughput, f"{name} >= {throughput:g}x best fixed (-c {best})",
                          f"{ratio:.2f}x"))  # fmt: skip
        else:
            goals.append((ratio >= 0.9, f"{name} >= 0.9x best fixed (-c {best})", f"{ratio:.2f}x"))
        if family in ("ratelimit", "tpm"):
            goals.append((mine["refused"] < 0.05, f"{name} < 5 % answered 429",
                          f"{100 * mine['refused']:.1f} %"))  # fmt: skip
        goals.append((mine["failed"] == 0, f"{name} no failed call", str(mine["failed"])))
    return goals


def report(family: str, seed: int, params: dict[str, Any], found: dict[str, list[dict[str, Any]]],
           fixed: list[str]) -> bool:  # fmt: skip
    figures = {spec: merge(runs) for spec, runs in found.items()}
    shown = {k: v for k, v in params.items() if k not in ("model",)}
    print(f"\n### {family} --seed {seed}: {json.dumps(shown)}")
    rows = [[("-c " + s) if s in fixed else f"-c 1-8-256 {s}", f"{f['rate']:.1f}",
             f"{f['rate2']:.1f}", f"{f['p50']:.3f}", f"{f['p99_2']:.3f}",
             f"{100 * f['refused']:.1f}", str(f["failed"]), f["window"],
             f"{1000 * f['cpu_per_call']:.2f}"] for s, f in figures.items()]  # fmt: skip
    print(markdown_table(["contender", "calls/s", "2nd half", "p50 s", "p99 s (2nd half)",
                          "429 %", "failed", "window at end", "client CPU ms/call"], rows))  # fmt: skip
    passed = True
    for held, goal, detail in judge(family, params, figures, fixed):
        passed = passed and held
        print(goal_line(held, goal, detail))
    for spec, f in figures.items():
        if spec not in fixed:
            steps = [f"{size} ({why}, {at:.1f} s)" for at, size, why in f["history"][:16]]
            print(f"  {spec} window: {', '.join(steps)}{' ...' if len(f['history']) > 16 else ''}")
    return passed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI: 4 families, 1 seed, 16 s")
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3, 4, 5])
    parser.add_argument("--seconds", type=float, default=20.0, help="per contender and repeat")
    parser.add_argument("--repeat", type=int, default=1, help="alternated repeats")
    parser.add_argument("--busy", type=int, default=0, help="busy loops beside the client")
    parser.add_argument("--zoo", type=Path, default=ZOO, help="zoo.py")
    parser.add_argument("--per-second", action="store_true",
                        help="rate limits per second (--period 1; tpm: the minute's budget / 60)")  # fmt: skip
    args = parser.parse_args(argv)
    families, seeds, seconds = args.families, args.seeds, args.seconds
    if args.quick:
        families = [f for f in ("engine", "ratelimit", "concurrency", "plateau") if f in families]
        # 16 s a contender: over 8 s, the judged half held the knee's search (each probe
        # measures up to a quarter cooldown, 3.75 s: the plateau's knee took its last
        # step at 6.5 s, p99 1.47x in one run of three) and a rate limit's last bind (a
        # Retry-After in whole seconds holds the calls a second, and the refill waits in
        # the bucket for the paced calls after it: a 4 s half ended with up to a second of
        # it unspent, 0.89x)
        seeds, seconds, args.per_second = seeds[:1], 16.0, True
    if not args.zoo.exists():
        print(f"bench.zoo: no zoo at {args.zoo} (give --zoo PATH)", file=sys.stderr)
        return 2
    print(f"bench.zoo: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, "
          f"{seconds:g} s a contender, {args.repeat} repeat(s), {args.busy} busy loop(s)")  # fmt: skip
    started = time.perf_counter()
    passed = True
    with busy_loops(args.busy):
        for family in families:
            for seed in seeds:
                extra = ["--period", "1"] if args.per_second and family == "ratelimit" else []
                if family == "tpm":
                    extra = ["--period", "60"]
                if args.quick:  # calls of tens of ms: a few seconds see many rounds
                    extra += QUICK[family]
                with zoo(args.zoo, family, seed, extra) as (_, params):
                    pass  # the draw's parameters
                if family == "tpm" and args.per_second:
                    # the same rate a second: the minute's budget over 60 (not the whole
                    # budget each second, 60 times the rate, where the client is the limit)
                    extra = ["--period", "1", "--tpm", str(max(1, round(params["tpm"] / 60)))]
                    extra += QUICK[family] if args.quick else []
                    with zoo(args.zoo, family, seed, extra) as (_, params):
                        pass
                fixed, adaptive = contenders(family, params)
                period = params.get("period", 1) if family in ("ratelimit", "tpm") else 0
                span = max(seconds, 2.5 * period)
                if family in ("ratelimit", "tpm") and not args.quick:
                    # at least 300 calls at the limit's rate: a limit of a few calls a second
                    # run for 15 s is judged on its first unpaced calls, not on the pacing
                    span = max(span, min(120.0, 300 / limit_rate(family, params)))
                    if params.get("kind") == "bucket":
                        # a bucket's burst at most 5 % of the judged half's calls: a fixed
                        # window a little slower than the limit spent ratelimit 1's burst of
                        # 151 calls (1.6 s at 92.7/s) over all of a 15 s run, and made 0.11x
                        # more than the limit lets through in its second half
                        span = max(span, min(120.0, 40 * burst_seconds(family, params)))
                if family in ("engine", "plateau") and not args.quick:
                    # at least 50 calls' latency at the knee: a draw of 1 s calls run for
                    # 15 s sees slow start and one probe past the capacity fill its second
                    # half, whatever the controller (a real eval runs for minutes)
                    span = max(span, min(120.0, 50 * engine_latency(params, family)))
                server = functools.partial(zoo, args.zoo, family, seed, extra)
                found = draw(server, fixed + adaptive, span, args.repeat)
                passed = report(family, seed, params, found, fixed) and passed
    print(f"\n{time.perf_counter() - started:.0f} s wall in all, load average "
          f"{os.getloadavg()[0]:.1f}; goals {'met' if passed else 'missed'}")  # fmt: skip
    return 0 if passed or not args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
