"""One eval at a time writes a run dir (issue 26): two concurrent ``--resume`` of one run dir
both ran every owed slot; now the second exits 2 naming the holder. Real eval processes; every
wait is bounded.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import forkserver
import pytest
import trio
from helpers import until

import trio_tasksets as tt
from trio_tasksets._core.builtin import EchoTaskset
from trio_tasksets._eval.lock import RunDirLock

ROOT = Path(__file__).resolve().parent.parent
FEEDS = str(ROOT / "tests" / "fixtures" / "feeds.py")
ARGS = (f"{FEEDS}:Numbers", "-n", "200", "-c", "2", "--run-name", "k", "--no-dashboard")


def command(tmp_path: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "trio_tasksets", "eval", *args, "-o", str(tmp_path / "out")]


def start(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    return forkserver.popen(
        command(tmp_path, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=tmp_path,
    )  # fmt: skip


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return forkserver.run(
        command(tmp_path, *args), capture_output=True, text=True, timeout=60, cwd=tmp_path
    )


def lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def interrupt(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stderr
    return stderr


def test_a_second_resume_of_a_run_dir_in_use_exits_2_naming_the_holder(tmp_path: Path) -> None:
    run_dir = tmp_path / "out" / "k"
    traces = run_dir / "traces.jsonl"
    first = start(tmp_path, *ARGS, "--echo-delay", "0.5")  # a run that leaves slots owed
    until(lambda: lines(traces) >= 2, "the first rows", 30, 0.05)
    interrupt(first)
    owed_from = lines(traces)
    assert owed_from < 200

    resuming = start(tmp_path, *ARGS, "--echo-delay", "0.5", "--resume")
    until(lambda: f"pid {resuming.pid} " in (run_dir / ".lock").read_text(), "the lock", 30, 0.05)
    second = run(tmp_path, *ARGS, "--resume")
    assert second.returncode == 2, second.stderr
    error = second.stderr.strip().splitlines()[-1]
    assert error.startswith(f"trio-tasksets eval: error: {run_dir} is in use by another eval")
    assert f"pid {resuming.pid} on " in error
    interrupt(resuming)

    rows = [json.loads(line) for line in traces.read_text().splitlines()]
    assert len({row["task"]["key"] for row in rows}) == len(rows)  # no slot ran twice

    done = run(tmp_path, *ARGS, "--resume")  # the holder is gone: the lock went with it
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in traces.read_text().splitlines()]
    assert len(rows) == 200
    assert len({row["task"]["key"] for row in rows}) == 200


async def test_run_eval_refuses_a_run_dir_locked_by_another_holder(tmp_path: Path) -> None:
    """The library's side of it: `run_eval` with `resume` on a run dir another holder has
    locked raises `EvalConfigError` before reading it; the lock is released when the holder
    lets go, and a run releases its own when it returns."""
    env = tt.Env(EchoTaskset())
    ctx = tt.ModelContext(tt.EchoClient(), "echo")
    config = tt.EvalConfig(output_dir=str(tmp_path), run_name="r", dashboard=False)
    with trio.fail_after(30):
        await tt.run_eval(env, ctx, config)
        resume = tt.EvalConfig(output_dir=str(tmp_path), run_name="r", dashboard=False,
                               resume=True)  # fmt: skip
        with RunDirLock() as holder:
            holder.take(tmp_path / "r")
            with pytest.raises(tt.EvalConfigError, match="is in use by another eval"):
                await tt.run_eval(env, ctx, resume)
        await tt.run_eval(env, ctx, resume)
        await tt.run_eval(env, ctx, resume)  # released on return: again
