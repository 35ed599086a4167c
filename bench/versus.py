"""This checkout against another one of the project: CPU per episode of the same workloads
(issue 24's "no slower than today").

    git worktree add /tmp/base c141cc9        # the other checkout (no venv of its own needed)
    python -m bench.versus --base /tmp/base [--repeat 9] [--n 20000] [--calls 3000] [--quick]

Each run is its own process, ``python bench/_versus_child.py`` with the checkout first on
``PYTHONPATH`` (so this venv's dependencies, that checkout's `trio_tasksets`; the child checks
which it imported). The two checkouts alternate, the order swapping every repeat, so that
both see the same load. The figure is CPU seconds (``time.process_time`` around the timed
`run_eval`, after a warm-up run in the same process), per episode: far less sensitive to
other processes than wall time, though not immune (caches, frequency). Reported per
workload: the median and the best of each checkout, and the median of the per-repeat
ratios (this / base of the two adjacent runs; the load they share cancels best there).
Without ``--base`` the checkout runs against itself: the ratios then show the noise.

Workloads: ``echo`` (`run_eval`, echo model, no latency, ``-c 256``, dashboard off, N
episodes); ``http 0 ms`` and ``http 50 ms`` (`run_eval` + `OpenAIClient`, ``-c 64``, against
bench.http's fake server with that latency; ``--calls`` calls); ``echo cli``: the echo eval
in a process set up as each checkout's `trio-tasksets eval` sets its own (this one freezes
its start-up heap, `trio_tasksets._cli.heap`; the round's base did nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from .common import env_info, markdown_table

HERE = Path(__file__).resolve().parent
THIS = HERE.parent
CHILD = HERE / "_versus_child.py"


def run_child(tree: Path, args: list[str]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [sys.executable, "-P", str(CHILD), *args]  # -P: not bench/ on sys.path
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900,
                          check=False)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"{tree}: {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    module = Path(result["module"]).resolve()
    if tree.resolve() not in module.parents:
        raise SystemExit(f"{tree}: the child imported {module}, not this checkout's")
    return result


def compare(
    base: Path, workloads: dict[str, list[str]], repeat: int
) -> dict[str, dict[str, list[float]]]:
    """CPU µs per episode, per workload, for "base" and "this", `repeat` runs each."""
    figures: dict[str, dict[str, list[float]]] = {}
    for name, args in workloads.items():
        runs: dict[str, list[float]] = {"base": [], "this": []}
        for r in range(repeat):
            order = [("base", base), ("this", THIS)]
            for side, tree in order if r % 2 == 0 else order[::-1]:
                result = run_child(tree, args)
                runs[side].append(result["cpu"] / result["n"] * 1e6)
            print(f"  {name} #{r + 1}: base {runs['base'][-1]:.1f}  this {runs['this'][-1]:.1f}"
                  f" µs CPU/episode", file=sys.stderr, flush=True)  # fmt: skip
        figures[name] = runs
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, help="the other checkout (default: this one)")
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--n", type=int, default=20_000, help="echo episodes per run")
    parser.add_argument("--calls", type=int, default=3000, help="HTTP calls per run")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 3 repeats, small N")
    parser.add_argument(
        "--only", nargs="+", choices=["echo", "echo cli", "http 0 ms", "http 50 ms"]
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.repeat, args.n, args.calls = 2, 2000, 500
    base = args.base or THIS
    if not (base / "trio_tasksets" / "__init__.py").exists():
        parser.error(f"--base {base}: not a checkout of the project (no trio_tasksets/)")
    for key, value in env_info():
        print(f"{key}: {value}")
    print(f"base: {base} ({_rev(base)}); this: {THIS} ({_rev(THIS)}); load: "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")  # fmt: skip
    server = subprocess.Popen([sys.executable, "-m", "bench.http", "--serve"], cwd=THIS,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        workloads = {
            "echo": ["echo", str(args.n), "", "256"],
            "echo cli": ["echo", str(args.n), "", "256", "cli"],
            "http 0 ms": ["http", str(args.calls), f"http://127.0.0.1:{port}/l0/v1", "64"],
            "http 50 ms": ["http", str(args.calls), f"http://127.0.0.1:{port}/l50/v1", "64"],
        }
        if args.only:
            workloads = {k: v for k, v in workloads.items() if k in args.only}
        figures = compare(base, workloads, args.repeat)
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(timeout=10)
    rows = []
    for name, runs in figures.items():
        b, t = runs["base"], runs["this"]
        paired = statistics.median(x / y for x, y in zip(t, b, strict=True))
        rows.append([name, f"{statistics.median(b):.1f}", f"{min(b):.1f}",
                     f"{statistics.median(t):.1f}", f"{min(t):.1f}",
                     f"{statistics.median(t) / statistics.median(b):.3f}",
                     f"{min(t) / min(b):.3f}", f"{paired:.3f}"])  # fmt: skip
    print(f"\nCPU µs per episode, {args.repeat} runs of each, alternating; load after: "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")  # fmt: skip
    print(markdown_table(["workload", "base median", "base best", "this median", "this best",
                          "ratio of medians", "ratio of bests", "median paired ratio"],
                         rows))  # fmt: skip
    return 0


def _rev(tree: Path) -> str:
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=False)  # fmt: skip
    return done.stdout.strip() or "?"


if __name__ == "__main__":
    raise SystemExit(main())
