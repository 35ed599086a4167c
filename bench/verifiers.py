"""verifiers' own eval vs the same verifiers env under the trio runner (issue 10).

    python -m bench.verifiers [--n 200] [--window 8] [--delay 0.02] [--repeat 5] [--quick]
    python -m bench.verifiers --profile NAME [--n 200]   # cProfile one contender's eval

One model server (`tests/fixtures/chat_server.py`, `delay` seconds per reply) in a process of
its own; the verifiers taskset `tests/fixtures/vf_arith.py` (20 sums) with its in-process
harness (one chat turn over httpx through verifiers' interception), `n / 20` rollouts per
task, window `window`. Each run is a fresh process (`python -m bench.verifiers --run NAME`)
that imports everything and runs one untimed warm-up eval (20 rollouts: lazy imports, caches),
then times the eval call alone (wall and CPU):

* ``verifiers run_eval``: `verifiers.v1.cli.eval.runner.run_eval` (what `vf-eval` runs) under
  `asyncio.run`, `max_concurrent=window` (the reference);
* ``tt.run_eval(verifiers_env)``: `tt.aio.verifiers_env("vf_arith")` under `tt.run_eval` and
  `trio.run`, `max_concurrent=window`: verifiers' asyncio code on a stdlib asyncio loop in a
  thread of its own (`VerifiersEnv.asyncio_loop = "thread"`), the goal's contender;
* ``the same, on trio-asyncio's loop``: the same env with `asyncio_loop = "trio-asyncio"` (how
  the bridge ran it first; reported, to show where trio-asyncio's cost goes);
* ``tt.aio.run_eval from asyncio.run``: the trio runner in guest mode on an asyncio host,
  verifiers on the host loop (reported).

They alternate (the order rotates every repeat). The ratio is the median over repeats of each
run's rollouts/s over verifiers' run of the same repeat (adjacent in time, so the machine's
other load cancels out as far as it can). Goal: the trio runner reaches >= 0.95x verifiers'
own rollouts/s. CPU ms per rollout (the eval is CPU-bound: 20 ms replies, window 8) moves
less with the machine's load than the wall figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .common import env_info, goal_line, markdown_table

GOAL = 0.95  # the trio runner >= 0.95x verifiers' own rollouts/s
ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
ENV: dict[str, Any] = {"agent": {"runtime": {"type": "subprocess"}}}
TASKS = 20  # vf_arith's size
CONTENDERS = {
    "vf": "verifiers run_eval",
    "tt": "tt.run_eval(verifiers_env)",
    "trio-asyncio": "the same, on trio-asyncio's loop",
    "guest": "tt.aio.run_eval from asyncio.run",
}


# --- one run, in its own process --------------------------------------------------------------


def run_vf(
    url: str, n: int, window: int, out: str, profiler: cProfile.Profile | None
) -> tuple[float, float, int]:
    from verifiers.v1.cli.eval.runner import run_eval
    from verifiers.v1.configs.cli.eval import EvalConfig

    def config(rollouts: int, name: str) -> Any:
        return EvalConfig.model_validate(
            {
                "env": {"taskset": {"id": "vf_arith"}, **ENV},
                "model": "bench",
                "client": {"type": "eval", "base_url": url, "api_key_var": "TT_BENCH_NO_KEY"},
                "num_rollouts": rollouts // TASKS,
                "max_concurrent": window,
                "push": False,
                "rich": None,
                "output_dir": out,
                "run": {"name": name},
            }
        )

    asyncio.run(run_eval(config(TASKS, "warmup")))  # lazy imports and caches, untimed
    timed = config(n, "timed")
    with _timed(profiler) as timing:
        episodes = asyncio.run(run_eval(timed))
    wall, cpu = timing
    return wall, cpu, sum(e.ok for e in episodes)


def run_tt(
    url: str, n: int, window: int, out: str, profiler: cProfile.Profile | None
) -> tuple[float, float, int]:
    return _run_tt(url, n, window, out, profiler, trio_asyncio=False)


def run_trio_asyncio(
    url: str, n: int, window: int, out: str, profiler: cProfile.Profile | None
) -> tuple[float, float, int]:
    return _run_tt(url, n, window, out, profiler, trio_asyncio=True)


def _run_tt(
    url: str,
    n: int,
    window: int,
    out: str,
    profiler: cProfile.Profile | None,
    *,
    trio_asyncio: bool,
) -> tuple[float, float, int]:
    import trio

    import trio_tasksets as tt

    env = tt.aio.verifiers_env("vf_arith", **ENV)
    if trio_asyncio:  # the same env on trio-asyncio's loop instead of a native one

        class OnTrioAsyncio(type(env)):  # type: ignore[misc]
            asyncio_loop = "trio-asyncio"

        env = OnTrioAsyncio(env.taskset)
    ctx = tt.ModelContext(tt.OpenAIClient(url), "bench")

    def config(rollouts: int, name: str) -> tt.EvalConfig:
        return tt.EvalConfig(
            rollouts_per_example=rollouts // TASKS,
            max_concurrent=window,
            output_dir=out,
            run_name=name,
            dashboard=False,
        )

    trio.run(tt.run_eval, env, ctx, config(TASKS, "warmup"))  # as for verifiers, untimed
    timed = config(n, "timed")
    with _timed(profiler) as timing:
        result = trio.run(tt.run_eval, env, ctx, timed)
    wall, cpu = timing
    return wall, cpu, int(result.summary["ok"])


@contextlib.contextmanager
def _timed(profiler: cProfile.Profile | None) -> Iterator[list[float]]:
    """[wall, cpu] seconds of the block (filled in when it ends), profiled if asked."""
    timing: list[float] = []
    wall, cpu = time.perf_counter(), time.process_time()
    if profiler is not None:
        profiler.enable()
    try:
        yield timing
    finally:
        if profiler is not None:
            profiler.disable()
        timing += [time.perf_counter() - wall, time.process_time() - cpu]


def run_guest(
    url: str, n: int, window: int, out: str, profiler: cProfile.Profile | None
) -> tuple[float, float, int]:
    import trio_tasksets as tt

    env = tt.aio.verifiers_env("vf_arith", **ENV)
    ctx = tt.ModelContext(tt.OpenAIClient(url), "bench")

    def config(rollouts: int, name: str) -> tt.EvalConfig:
        return tt.EvalConfig(
            rollouts_per_example=rollouts // TASKS,
            max_concurrent=window,
            output_dir=out,
            run_name=name,
            dashboard=False,
        )

    asyncio.run(tt.aio.run_eval(env, ctx, config(TASKS, "warmup")))
    timed = config(n, "timed")
    with _timed(profiler) as timing:
        result = asyncio.run(tt.aio.run_eval(env, ctx, timed))
    wall, cpu = timing
    return wall, cpu, int(result.summary["ok"])


RUNS = {"vf": run_vf, "tt": run_tt, "trio-asyncio": run_trio_asyncio, "guest": run_guest}


def run_one(name: str, url: str, n: int, window: int, profile: bool) -> None:
    sys.path.insert(0, str(FIXTURES))
    profiler = cProfile.Profile() if profile else None
    with tempfile.TemporaryDirectory() as out:
        wall, cpu, ok = RUNS[name](url, n, window, out, profiler)
    if profiler is None:
        print(json.dumps({"wall": wall, "cpu": cpu, "ok": ok}))
        return
    print(f"{CONTENDERS[name]}: {n / wall:.1f} rollouts/s, {cpu / n * 1e3:.2f} ms CPU/rollout")
    print("(under cProfile, which slows every call down; the timed eval only)\n")
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(50)


# --- the driver -----------------------------------------------------------------------------


def start_server(delay: float) -> tuple[subprocess.Popen[str], str]:
    server = subprocess.Popen(
        [sys.executable, str(FIXTURES / "chat_server.py"), "--delay", str(delay)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None
    url = server.stdout.readline().strip()
    if not url.startswith("http://127.0.0.1:"):
        server.kill()
        raise RuntimeError(f"the chat server did not start (said {url!r})")
    return server, url


def spawn(name: str, url: str, n: int, window: int, profile: bool = False) -> str:
    argv = [sys.executable, "-m", "bench.verifiers", "--run", name, "--url", url, "--n", str(n),
            "--window", str(window)] + (["--profile", name] if profile else [])  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(FIXTURES)])}
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{CONTENDERS[name]} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.verifiers", description=__doc__.split("\n")[0]
    )
    p.add_argument("--n", type=int, help="rollouts per run, a multiple of 20 (default 200)")
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--delay", type=float, default=0.02, help="seconds per model reply")
    p.add_argument("--repeat", type=int, help="interleaved repeats (default 5; quick 2)")
    p.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    p.add_argument("--profile", choices=sorted(RUNS), help="cProfile one contender's eval")
    p.add_argument(
        "--only",
        default=",".join(RUNS),
        help=f"comma-separated contenders to run (default all: {','.join(RUNS)}; vf is needed)",
    )
    p.add_argument("--run", choices=sorted(RUNS), help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.n = args.n or (40 if args.quick else 200)
    args.repeat = args.repeat or (2 if args.quick else 5)
    if args.n % TASKS:
        p.error(f"--n must be a multiple of {TASKS} (the taskset's size)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.run is not None:
        run_one(args.run, args.url, args.n, args.window, profile=args.profile is not None)
        return
    server, url = start_server(args.delay)
    try:
        if args.profile is not None:
            print(spawn(args.profile, url, args.n, args.window, profile=True))
            return
        measure(args, url)
    finally:
        server.kill()
        server.wait()


def measure(args: argparse.Namespace, url: str) -> None:
    print("# verifiers' own eval vs verifiers_env under the trio runner (issue 10)\n")
    versions = [("verifiers", _version("verifiers")), ("trio-asyncio", _version("trio-asyncio"))]
    print(markdown_table(["", ""], [list(row) for row in [*env_info(), *versions]]))
    print(
        f"\n{args.n} rollouts per run ({args.n // TASKS} per task), window {args.window}, "
        f"model reply {args.delay * 1e3:.0f} ms, {args.repeat} interleaved repeats, "
        f"one process per run\n"
    )
    names = [name for name in RUNS if name in args.only.split(",")]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for r in range(args.repeat):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            result = json.loads(spawn(name, url, args.n, args.window).splitlines()[-1])
            if result["ok"] != args.n:
                raise RuntimeError(f"{CONTENDERS[name]}: {result['ok']}/{args.n} ok")
            runs[name].append(result)
    rates = {name: [args.n / x["wall"] for x in runs[name]] for name in names}
    # Paired: each run against verifiers' run of the same repeat (adjacent in time), so that a
    # change of the machine's other load between repeats cancels out.
    paired = {name: statistics.median(a / b for a, b in zip(rates[name], rates["vf"], strict=True))
              for name in names}  # fmt: skip
    rows = []
    for name in names:
        cpu = statistics.median(x["cpu"] / args.n * 1e3 for x in runs[name])
        rows.append([CONTENDERS[name], f"{statistics.median(rates[name]):.1f}",
                     f"{max(rates[name]):.1f}", f"{cpu:.2f}", f"{paired[name]:.3f}x",
                     " ".join(f"{x:.0f}" for x in rates[name])])  # fmt: skip
    headers = ["contender", "rollouts/s median", "(best)", "CPU ms/rollout",
               "vs verifiers (paired median)", "each run, rollouts/s"]  # fmt: skip
    print(markdown_table(headers, rows, left=(0, 5)))
    ratio = paired["tt"]
    print()
    print(
        goal_line(ratio >= GOAL, f"trio runner >= {GOAL}x verifiers' rollouts/s", f"{ratio:.3f}x")
    )


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    main()
