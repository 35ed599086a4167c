"""User tracebacks (SPEC 12): an error raised by the user's own code (reward, rollout, tool,
taskset) keeps its traceback, the user's frames, on the row; the first error's is printed;
`--debug` prints every one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import forkserver
import pytest
import trio

import trio_tasksets as tt
from trio_tasksets._env.env import user_traceback
from trio_tasksets._models import ModelContext

CTX = ModelContext(tt.EchoClient(), "echo")


class One(tt.Taskset[tt.Task, tt.TasksetConfig]):
    def load(self) -> list[tt.Task]:
        return [tt.Task("hi", answer="hi")]


def my_reward(task: Any, completion: str) -> float:
    scores = {"score": 1.0}
    return scores["scor"]  # the typo of the issue


async def test_a_reward_error_keeps_the_users_frames() -> None:
    env = tt.Env(One(), reward=my_reward)
    episode = await env.run_slot(tt.RunSlot(tt.Task("hi")), CTX)
    (error,) = episode.errors
    assert (error.type, error.message) == ("KeyError", "'scor'")
    assert error.traceback is not None
    assert 'return scores["scor"]' in error.traceback
    assert "in my_reward" in error.traceback
    assert error.traceback.rstrip().endswith("KeyError: 'scor'")
    assert "trio_tasksets" not in error.traceback  # only the user's frames
    row = episode.to_row()
    assert row["errors"][0]["traceback"] == error.traceback
    assert tt.Episode.from_row(row).errors[0].traceback == error.traceback


async def test_a_rollout_error_keeps_its_frames_and_the_packages_own_errors_none() -> None:
    class Broken(tt.Env[tt.Task]):
        async def rollout(self, task: tt.Task, ctx: ModelContext) -> tuple[list[Any], str]:
            await trio.lowlevel.checkpoint()
            return [], helper(task)

    def helper(task: tt.Task) -> str:
        raise ValueError(f"cannot parse {task.prompt}")

    episode = await Broken(One()).run_slot(tt.RunSlot(tt.Task("hi")), CTX)
    tb = episode.errors[0].traceback
    assert tb is not None
    assert "in rollout" in tb
    assert "in helper" in tb
    timed = tt.Env(One(), rollout_timeout=0.001)
    timed.rollout = _forever  # type: ignore[method-assign]
    episode = await timed.run_slot(tt.RunSlot(tt.Task("hi")), CTX)
    assert episode.errors[0].type == "RolloutTimeoutError"
    assert episode.errors[0].traceback is None  # raised by the package: no user frames
    assert "traceback" not in episode.to_row()["errors"][0]


async def _forever(task: Any, ctx: ModelContext) -> tuple[list[Any], str]:
    await trio.sleep_forever()
    raise AssertionError  # pragma: no cover


def test_user_traceback_is_none_for_the_packages_own_errors() -> None:
    with pytest.raises(KeyError) as theirs:
        my_reward(None, "")
    assert "in my_reward" in (user_traceback(theirs.value) or "")
    with pytest.raises(tt.EvalConfigError) as ours:
        tt.EvalConfig(max_concurrent=0)
    assert user_traceback(ours.value) is None


TASKSET = """\
import trio_tasksets as tt


def score_of(completion):
    scores = {"score": 1.0}
    return scores["scor"]


class Typo(tt.Taskset):
    def load(self):
        return [tt.Task(f"q{i}") for i in range(3)]

    def reward(self, task, completion):
        return score_of(completion)
"""


def _eval(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "typo.py"
    path.write_text(TASKSET)
    argv = [sys.executable, "-m", "trio_tasksets", "eval", f"{path}:Typo", "-o",
            str(tmp_path / "out"), "--run-name", "run", "--no-dashboard", *args]  # fmt: skip
    return forkserver.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)


def test_the_cli_prints_the_first_errors_traceback_and_debug_prints_all(tmp_path: Path) -> None:
    done = _eval(tmp_path)
    assert done.returncode == 1
    assert "first error (KeyError), in your code:" in done.stderr
    assert f'File "{tmp_path / "typo.py"}", line 6, in score_of' in done.stderr
    assert done.stderr.count('return scores["scor"]') == 1  # the first only
    summary = json.loads((tmp_path / "out" / "run" / "summary.json").read_text())
    assert "in score_of" in summary["first_error"]["traceback"]

    again = _eval(tmp_path, "--resume", "--debug")
    assert again.returncode == 1
    assert again.stderr.count('return scores["scor"]') == 3  # every failed row's
    assert again.stderr.count(", rollout 0, attempt 1: KeyError") == 3
