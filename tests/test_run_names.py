"""Default run names never collide (issue 35, item 6): evals started in the same second each
get their own run dir (`NAME`, then `NAME-2`, `NAME-3`: each claimed with one atomic
`mkdir`), in one process and across processes; an explicit `--run-name` that holds a run is
refused as before.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from subprocess import PIPE
from typing import Any

import forkserver
import pytest
import trio
from helpers import cli
from trio.testing import MockClock

import trio_tasksets as tt

STAMP = "20260101-120000"


@pytest.fixture
def one_second(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every default run name is made in the same second."""

    def frozen(fmt: str, *args: Any) -> str:
        return STAMP

    monkeypatch.setattr(time, "strftime", frozen)  # what default_run_name reads


def rows(run_dir: Path) -> int:
    return len((run_dir / "traces.jsonl").read_text().splitlines())


async def test_evals_started_at_once_in_one_process_get_their_own_run_dirs(
    autojump_clock: MockClock, tmp_path: Path, one_second: None
) -> None:
    results: list[tt.EvalResult] = []

    async def one() -> None:
        config = tt.EvalConfig(num_examples=3, output_dir=str(tmp_path), dashboard=False)
        ctx = tt.ModelContext(tt.EchoClient(delay=1.0), "echo")
        results.append(await tt.run_eval(tt.Env(tt.EchoTaskset()), ctx, config))

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(one)
    names = sorted(result.run_dir.name for result in results)
    base = f"EchoTaskset-echo-{STAMP}"
    assert names == [base, f"{base}-2", f"{base}-3"]
    assert [rows(result.run_dir) for result in results] == [3, 3, 3]


def test_cli_default_names_in_one_second_do_not_collide(
    tmp_path: Path, one_second: None, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "out")
    for _ in range(3):
        assert cli("eval", "echo", "-n", "2", "-o", out, "--no-dashboard") == 0
    base = f"EchoTaskset-echo-{STAMP}"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [base, f"{base}-2", f"{base}-3"]
    # The resume command printed for a run names its own dir:
    assert cli("eval", "echo", "-n", "2", "-o", out, "--run-name", f"{base}-2", "--resume",
               "--no-dashboard") == 0  # fmt: skip
    assert "already holds a run" not in capsys.readouterr().err


def test_cli_an_explicit_run_name_that_holds_a_run_is_refused_as_before(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "out")
    assert cli("eval", "echo", "-n", "2", "-o", out, "--run-name", "r", "--no-dashboard") == 0
    assert cli("eval", "echo", "-n", "2", "-o", out, "--run-name", "r", "--no-dashboard") == 2
    assert "already holds a run" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["r"]


def test_cli_a_claimed_name_is_given_back_when_the_run_keeps_nothing(
    tmp_path: Path, one_second: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    Path("empty.jsonl").write_text("")
    assert cli("eval", "empty.jsonl", "-o", "out", "--no-dashboard") == 1
    assert not (tmp_path / "out").exists()


def test_three_evals_started_together_each_write_their_own_run(tmp_path: Path) -> None:
    """Real processes, started at once (the issue's three `eval echo -n 3`)."""
    command = [sys.executable, "-m", "trio_tasksets", "eval", "echo", "-n", "3", "-o", "out",
               "--no-dashboard"]  # fmt: skip
    procs = [
        forkserver.popen(command, cwd=tmp_path, stdout=PIPE, stderr=PIPE, text=True)
        for _ in range(3)
    ]
    results = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0, 0], results
    dirs = sorted((tmp_path / "out").iterdir())
    assert len(dirs) == 3
    for run_dir in dirs:
        assert rows(run_dir) == 3
        assert json.loads((run_dir / "summary.json").read_text())["ok"] == 3
