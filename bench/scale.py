"""`rescore` and `report` of a very large run: peak memory and time at 10^6 rows (issue 36,
F10; goals: rescore under 500 MB at 10^6 rows, a page under `MAX_SIZE` (27 MB) at any size).

    python -m bench.scale [--rows 1000000] [--tree PATH] [--quick]

The run dir is synthetic and shaped as an echo eval writes it (`Episode.to_row`: one
rollout per task, every task distinct, a prompt of ~40 characters echoed as the completion,
two messages, timing, usage; 8 % failed): 633 bytes a row, so 10^6 rows are 633 MB of
traces. Each of `trio-tasksets rescore RUN --reward ...` and `trio-tasksets report RUN` runs
in its own process under `/usr/bin/time -v` (its peak RSS and CPU time); its wall time is
measured around it. `--tree PATH` runs the commands
from another checkout (e.g. the tree before a change), for a before/after table.
`--quick` is a smoke run of 20,000 rows.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from .common import env_info, goal_line, markdown_table

REWARD = "def half(task, completion):\n    return 0.5\n"


def rows(n: int, seed: int = 0) -> Iterator[bytes]:
    rng = random.Random(seed)
    t = 1_800_000_000.0
    for i in range(n):
        prompt = f"{i} + {rng.randrange(1000)} = ?"
        failed = rng.random() < 0.08
        t += 0.001
        duration = rng.lognormvariate(-6.0, 0.5)
        data: dict[str, Any] = {
            "prompt": prompt,
            "answer": str(i),
            "info": {},
            "system_prompt": None,
        }
        row = {
            "id": f"{rng.getrandbits(128):032x}",
            "task": {"key": f"{rng.getrandbits(64):016x}", "data": data},
            "rollout": 0, "ok": not failed, "reward": 0.0 if failed else 1.0,
            "completion": None if failed else prompt,
            "messages": [] if failed else [{"role": "user", "content": prompt},
                                           {"role": "assistant", "content": prompt}],
            "errors": [{"type": "ModelTimeoutError", "message": "the model did not answer in "
                        "60 s", "attempt": 1}] if failed else [],
            "attempts": 1,
            "timing": {"started": t, "finished": t + duration, "duration": duration,
                       "waited_connection": 0.0, "waited_rate": 0.0, "working": duration},
            "usage": {"prompt_tokens": 12, "completion_tokens": 12}, "finish_reason": "stop",
            "turns": 1, "tool_calls": 0, "stop_reason": None, "metrics": {},
        }  # fmt: skip
        yield orjson.dumps(row, option=orjson.OPT_APPEND_NEWLINE)


def make_run(root: Path, n: int) -> Path:
    run_dir = root / "big"
    run_dir.mkdir()
    with (run_dir / "traces.jsonl").open("wb") as out:
        batch: list[bytes] = []
        for line in rows(n):
            batch.append(line)
            if len(batch) >= 10_000:
                out.write(b"".join(batch))
                batch.clear()
        out.write(b"".join(batch))
    config = {"identity": {"model": "echo", "taskset": "bench:Big"}, "command": ["bench"]}
    (run_dir / "config.json").write_bytes(orjson.dumps(config))
    summary = {"planned": n, "finished": n, "duration_s": 1000.0, "rollouts_per_s": n / 1000}
    (run_dir / "summary.json").write_bytes(orjson.dumps(summary))
    (root / "rewards.py").write_text(REWARD)
    return run_dir


def measure(command: list[str], tree: Path, cwd: Path) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds and peak RSS (MB) of `trio-tasksets COMMAND` run from
    `tree`, under `/usr/bin/time -v` (a child's own getrusage would count this process's
    memory too: Linux keeps the high-water mark across the exec)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    began = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-m", "trio_tasksets",
                           *command], cwd=cwd, env=env, capture_output=True, text=True,
                          check=False)  # fmt: skip
    wall = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}): {done.stderr[-2000:]}")
    found = dict(line.strip().rsplit(": ", 1) for line in done.stderr.splitlines() if ": " in line)
    cpu = float(found["User time (seconds)"]) + float(found["System time (seconds)"])
    return wall, cpu, int(found["Maximum resident set size (kbytes)"]) / 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 20,000 rows")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows = 20_000
    print("# bench.scale: rescore and report of a large run")
    for key, value in env_info():
        print(f"  {key}: {value}")
    print(f"  tree: {args.tree.resolve()}")
    table, goals = [], []
    with tempfile.TemporaryDirectory(prefix="tt-bench-scale-") as tmp:
        root = Path(tmp)
        run_dir = make_run(root, args.rows)
        traces_mb = (run_dir / "traces.jsonl").stat().st_size / 1e6
        wall, cpu, peak = measure(["report", "big"], args.tree, root)
        page_mb = (run_dir / "report.html").stat().st_size / 1e6
        table.append(["report", f"{args.rows:,}", f"{traces_mb:.0f} MB", f"{wall:.1f} s",
                      f"{cpu:.1f} s", f"{peak:.0f} MB", f"page {page_mb:.1f} MB"])  # fmt: skip
        goals.append(goal_line(page_mb < 27.5, "report: page under 27 MB", f"{page_mb:.1f} MB"))
        wall, cpu, peak = measure(["rescore", "big", "--reward", "rewards.py:half", "--run-name",
                              "again"], args.tree, root)  # fmt: skip
        table.append(["rescore", f"{args.rows:,}", f"{traces_mb:.0f} MB", f"{wall:.1f} s",
                      f"{cpu:.1f} s", f"{peak:.0f} MB", ""])  # fmt: skip
        goals.append(goal_line(peak < 500, "rescore: under 500 MB", f"{peak:.0f} MB"))
    print()
    headers = ["command", "rows", "traces.jsonl", "wall", "CPU", "peak RSS", ""]
    print(markdown_table(headers, table))
    print()
    print("\n".join(goals))
    return 0


if __name__ == "__main__":
    sys.exit(main())
