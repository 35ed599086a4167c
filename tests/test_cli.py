"""The `trio-tasksets eval` command end to end, in a subprocess, as a user runs it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import forkserver
import pytest
from helpers import until

ROOT = Path(__file__).resolve().parent.parent
FEEDS = str(ROOT / "tests" / "fixtures" / "feeds.py")


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "trio_tasksets", "eval", *args]


def run(tmp_path: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TT_PULL_LOG": str(tmp_path / "pulls.log")}
    return forkserver.run(
        command(*args, "-o", str(tmp_path / "out"), "--no-dashboard"),
        capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path,
    )  # fmt: skip


def rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "traces.jsonl").read_text().splitlines()]


def pulls(tmp_path: Path) -> int:
    log = tmp_path / "pulls.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_a_never_draining_stream_with_n3_ends_with_exactly_3(tmp_path: Path) -> None:
    done = run(tmp_path, f"{FEEDS}:NeverDrains", "-n", "3", "--run-name", "s")
    assert done.returncode == 0, done.stderr
    written = rows(tmp_path / "out" / "s")
    assert len(written) == 3
    assert all(r["ok"] and r["reward"] == 1.0 for r in written)
    assert pulls(tmp_path) == 3
    assert done.stdout.startswith("3/3 ok, reward mean 1.000")
    summary = json.loads((tmp_path / "out" / "s" / "summary.json").read_text())
    assert summary["ok"] == 3


def test_builtin_echo_stream(tmp_path: Path) -> None:
    done = run(tmp_path, "echo-stream", "-n", "2", "-r", "2", "--run-name", "e")
    assert done.returncode == 0, done.stderr
    assert len(rows(tmp_path / "out" / "e")) == 4


def test_no_n_on_a_stream_is_a_usage_error_before_any_pull(tmp_path: Path) -> None:
    done = run(tmp_path, f"{FEEDS}:NeverDrains", "--run-name", "s")
    assert done.returncode == 2
    assert "-n/--num-examples" in done.stderr
    assert "usage:" in done.stderr
    assert pulls(tmp_path) == 0
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag", ["--shuffle", "--resume"])
def test_shuffle_and_resume_on_a_stream_are_usage_errors(tmp_path: Path, flag: str) -> None:
    done = run(tmp_path, "echo-stream", "-n", "3", flag)
    assert done.returncode == 2
    assert f"cannot {flag.lstrip('-')}" in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("args", "needle"),
    [(["nope"], "TASKSET 'nope'"), (["echo", "-c", "0"], "-c/--max-concurrent"),
     (["echo", "-m", "gpt-x"], "--base-url"), (["echo", "--retries", "-1"], "--retries"),
     (["echo", "--api-key-var", "TT_SURELY_UNSET", "-m", "x", "--base-url", "http://127.0.0.1:9/v1"],
      "TT_SURELY_UNSET"),
     (["echo", "-n", "two"], "-n/--num-examples")],
)  # fmt: skip
def test_bad_flags_name_the_flag_and_exit_2(tmp_path: Path, args: list[str], needle: str) -> None:
    done = run(tmp_path, *args)
    assert done.returncode == 2
    assert needle in done.stderr
    assert not (tmp_path / "out").exists()


def test_static_n5_r2_gives_10_rows(tmp_path: Path) -> None:
    done = run(tmp_path, f"{FEEDS}:Numbers", "-n", "5", "-r", "2", "--run-name", "s")
    assert done.returncode == 0, done.stderr
    written = rows(tmp_path / "out" / "s")
    assert len(written) == 10
    assert sorted((r["task"]["data"]["prompt"], r["rollout"]) for r in written) == sorted(
        (f"say {i}", r) for i in range(5) for r in range(2)
    )


def start(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    return forkserver.popen(
        command(*args, "-o", str(tmp_path / "out"), "--no-dashboard"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )  # fmt: skip


def line_count(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_sigkill_midway_then_resume_ends_with_exactly_the_owed_rows(tmp_path: Path) -> None:
    args = (f"{FEEDS}:Numbers", "-n", "60", "-r", "2", "-c", "4", "--run-name", "k")
    traces = tmp_path / "out" / "k" / "traces.jsonl"
    proc = start(tmp_path, *args, "--echo-delay", "0.05")
    until(lambda: line_count(traces) >= 20, "20 rows", timeout=30)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    before = line_count(traces)
    assert 20 <= before < 120

    done = run(tmp_path, *args, "--resume")
    assert done.returncode == 0, done.stderr
    written = rows(tmp_path / "out" / "k")
    assert len(written) == 120
    slots = {(r["task"]["key"], r["rollout"]) for r in written}
    assert len(slots) == 120  # every slot once, no duplicates
    summary = json.loads((tmp_path / "out" / "k" / "summary.json").read_text())
    assert summary["kept_from_resume"] >= 20

    again = run(tmp_path, *args, "--resume")  # nothing owed: exit 0, nothing changes
    assert again.returncode == 0, again.stderr
    assert rows(tmp_path / "out" / "k") == written


def test_sigint_exits_130_with_every_finished_episode_on_disk(tmp_path: Path) -> None:
    traces = tmp_path / "out" / "i" / "traces.jsonl"
    proc = start(tmp_path, "echo-stream", "-n", "1000", "-c", "8", "--run-name", "i",
                 "--echo-delay", "0.2")  # fmt: skip
    until(lambda: line_count(traces) >= 3, "3 rows", timeout=30)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stderr
    text = traces.read_text()
    assert text.endswith("\n")  # only whole lines: nothing torn on a clean interrupt
    written = [json.loads(line) for line in text.splitlines()]
    assert len(written) >= 3
    summary = json.loads((tmp_path / "out" / "i" / "summary.json").read_text())
    assert summary["interrupted"] is True
    assert summary["finished"] == len(written)


@pytest.mark.parametrize("sub", ["worker", "enqueue", "serve"])
def test_every_subcommand_is_wired_into_the_command(sub: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "trio_tasksets", sub, "--help"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"trio-tasksets {sub}" in done.stdout
