"""An eval that plans no slot (issue 35, item 3; SPEC 4b): an empty taskset or data file,
``-n 0``, a stream that ends before its first task. It says which, writes no run dir, and
the command line exits 1 (a resume with nothing owed is not one: it exits 0).

The library raises `tt.EmptyEvalError`; the command line runs in this process
(`trio_tasksets._cli.main`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import cli
from trio.testing import MockClock

import trio_tasksets as tt
from trio_tasksets.testing import FeedTaskset


class Nothing(tt.Taskset[tt.Task, tt.TasksetConfig]):
    def load(self) -> Iterable[tt.Task]:
        return []


class Three(tt.Taskset[tt.Task, tt.TasksetConfig]):
    def load(self) -> Iterable[tt.Task]:
        return [tt.Task(f"say {i}", answer=f"say {i}") for i in range(3)]


def echo() -> tt.ModelContext:
    return tt.ModelContext(tt.EchoClient(), "echo")


def config(tmp_path: Path, **kw: Any) -> tt.EvalConfig:
    return tt.EvalConfig(output_dir=str(tmp_path / "out"), dashboard=False, **kw)


def left_behind(tmp_path: Path) -> list[str]:
    out = tmp_path / "out"
    return sorted(str(p.relative_to(out)) for p in out.rglob("*")) if out.exists() else []


# --- the library ----------------------------------------------------------------------------


async def test_num_examples_0_raises_before_any_work_naming_the_parameter(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    with pytest.raises(tt.EmptyEvalError) as raised:
        await tt.run_eval(tt.Env(Three()), echo(), config(tmp_path, num_examples=0))
    assert raised.value.parameter == "num_examples"
    assert "num_examples 0" in str(raised.value)
    assert isinstance(raised.value, tt.TrioTasksetsError)
    assert not isinstance(raised.value, tt.ConfigError)  # not a usage error: exit 1, not 2
    assert left_behind(tmp_path) == []


async def test_an_empty_static_taskset_raises_after_load_and_writes_nothing(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    with pytest.raises(tt.EmptyEvalError, match="taskset Nothing holds no task"):
        await tt.run_eval(tt.Env(Nothing()), echo(), config(tmp_path))
    assert left_behind(tmp_path) == []
    # A named run dir is not made either:
    with pytest.raises(tt.EmptyEvalError):
        await tt.run_eval(tt.Env(Nothing()), echo(), config(tmp_path, run_name="r", group=True))
    assert left_behind(tmp_path) == []


async def test_a_stream_that_ends_before_its_first_task_leaves_no_run_dir(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    feed = FeedTaskset()
    async with trio.open_nursery() as nursery:

        async def close_later() -> None:
            await trio.sleep(5)
            feed.end()

        nursery.start_soon(close_later)
        with trio.fail_after(60), pytest.raises(tt.EmptyEvalError, match="ended before"):
            await tt.run_eval(tt.Env(feed), echo(), config(tmp_path, num_examples=4))
    assert left_behind(tmp_path) == []


async def test_a_resume_with_nothing_owed_is_not_empty(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    first = await tt.run_eval(tt.Env(Three()), echo(), config(tmp_path, run_name="r"))
    again = await tt.run_eval(tt.Env(Three()), echo(), config(tmp_path, run_name="r", resume=True))
    assert again.run_dir == first.run_dir
    assert again.summary["planned"] == 3
    assert again.summary["kept_from_resume"] == 3


# --- the command line -----------------------------------------------------------------------


def test_cli_n_0_exits_1_says_why_and_writes_no_run_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli("eval", "echo", "-n", "0", "-o", str(tmp_path / "out"), "--no-dashboard")
    err = capsys.readouterr()
    assert code == 1
    assert "-n/--num-examples 0" in err.err
    assert "fix:" in err.err
    assert "0/0 ok" not in err.out
    assert left_behind(tmp_path) == []


# duplicates: one empty input a test, alike by design; each names what it left behind
def test_cli_an_empty_data_file_exits_1_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    Path("empty.jsonl").write_text("")
    code = cli("eval", "empty.jsonl", "-o", "out", "--no-dashboard")
    err = capsys.readouterr()
    assert code == 1
    assert "empty.jsonl" in err.err
    assert "no task" in err.err
    assert "0/0 ok" not in err.out
    assert left_behind(tmp_path) == []


def test_cli_an_empty_stream_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    stream = tmp_path / "stream.py"
    stream.write_text(
        "import trio_tasksets as tt\n"
        "class Quiet(tt.Taskset[tt.Task, tt.TasksetConfig]):\n"
        "    async def stream(self):\n"
        "        return\n"
        "        yield\n"
    )
    code = cli("eval", f"{stream}:Quiet", "-n", "2", "-o", "out", "--no-dashboard")
    err = capsys.readouterr()
    assert code == 1, err.err
    assert "ended before its first task" in err.err
    assert left_behind(tmp_path) == []


def test_cli_a_resume_with_nothing_owed_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "out")
    assert cli("eval", "echo", "-n", "2", "-o", out, "--run-name", "r", "--no-dashboard") == 0
    assert cli("eval", "echo", "-n", "2", "-o", out, "--run-name", "r", "--resume",
               "--no-dashboard") == 0  # fmt: skip
    summary = json.loads((tmp_path / "out" / "r" / "summary.json").read_text())
    assert summary["kept_from_resume"] == 2
