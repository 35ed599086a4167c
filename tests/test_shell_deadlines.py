"""Deadlines travel into the shell tool (SPEC 12, issue 24): a command started with 2 s left
in its rollout (an enclosing cancel scope, a `working_limit`, the env's `tool_timeout`) is
killed, its whole process group included, by that deadline plus a small margin, and the
model reads the effective timeout it had.

The real-clock tests run a real /bin/sh whose child ignores SIGTERM, with a `grace` (3 s)
longer than the margin they allow (1 s): a kill that waited out the grace after the
deadline, as the shell did before, fails them; a machine slow enough to take 1 s to reap a
killed process would too, but the command itself would have run 60 s."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
import trio
from helpers import marked

import trio_tasksets as tt
from trio_tasksets.testing import ScriptedClient, reply
from trio_tasksets.tools._shell import effective_timeout

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="process groups are POSIX")

MARGIN = 1.0  # seconds a killed group may take to be gone after the deadline (stated in docs)


def stubborn(token: str) -> str:
    """A shell and its child that both ignore SIGTERM, marked by `token` (a sleep's length):
    the commands run in a PID namespace, so the test finds them by their command line."""
    return f"trap '' TERM; sh -c \"trap '' TERM; sleep {token}\" & wait"


class One(tt.Taskset[tt.Task, tt.TasksetConfig]):
    def load(self) -> list[tt.Task]:
        return [TASK]


TASK = tt.Task("What is 2 + 3?", answer="5")


async def _gone_at(token: str) -> float:
    """When every process marked by `token` was seen gone (trio time); fails after 10 s."""
    with trio.fail_after(10):
        while marked(token):  # noqa: ASYNC110 (no event to wait on)
            await trio.sleep(0.005)
    return trio.current_time()


def test_the_effective_timeout_leaves_the_kill_inside_the_deadline() -> None:
    # no deadline, or one far enough: the shell's own timeout
    assert effective_timeout(30.0, math.inf, 1.0) == 30.0
    assert effective_timeout(30.0, 100.0, 1.0) == 30.0
    assert effective_timeout(30.0, 31.0, 1.0) == 30.0
    # 2 s left, grace 1: SIGTERM at 1.5 s (a quarter of what is left), SIGKILL at 2 s
    assert effective_timeout(30.0, 2.0, 1.0) == 1.5
    # 10 s left: SIGTERM a whole grace before the deadline
    assert effective_timeout(30.0, 10.0, 1.0) == 9.0
    assert effective_timeout(30.0, 10.0, 0.0) == 10.0
    # the deadline has passed: nothing runs
    assert effective_timeout(30.0, 0.0, 1.0) == 0.0
    assert effective_timeout(30.0, -5.0, 1.0) == 0.0


async def test_the_kill_lands_on_the_deadline_not_a_grace_after_it(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """On virtual time: a stubborn command with 2 s left and a 3 s `grace` is over at 2 s
    (SIGTERM at 1.5 s, SIGKILL at 2 s), where a kill at the deadline would have waited out
    the grace (5 s)."""
    shell = tt.tools.shell(cwd=tmp_path, timeout=30, grace=3.0)
    began = trio.current_time()
    with trio.move_on_after(2.0):
        await shell(command=stubborn("60.7201"))
    assert trio.current_time() - began <= 2.0


async def test_the_model_reads_the_time_its_call_had_left(tmp_path: Path) -> None:
    """Under the env's `tool_timeout` of 4 s a 30 s shell gets SIGTERM at 3 s (4 s less a
    grace of 1 s), and its answer says so."""
    shell = tt.tools.shell(cwd=tmp_path, timeout=30, grace=1.0)
    env = tt.ToolEnv(One(), [shell], tool_timeout=4.0)
    client = ScriptedClient([reply(tool_calls=[("shell", {"command": "sleep 60"})]), reply("5")])
    began = trio.current_time()
    episode = await env.run_slot(tt.RunSlot(TASK), tt.ModelContext(client, "m"))
    assert trio.current_time() - began <= 4.0 + MARGIN
    assert episode.ok
    assert episode.reward == 1.0
    answer = next(m for m in episode.messages if m["role"] == "tool")["content"]
    # the time left is read when the command starts: on a loaded machine the model's first
    # reply and the tool's start take a few real milliseconds of the 3 s ("2.99s")
    found = re.fullmatch(
        r"\[timed out after ([0-9.]+)s, the time this call had left \(the shell's own timeout"
        r" is 30s\): the command was killed\]",
        answer,
    )
    assert found is not None, answer
    assert 2.5 <= float(found[1]) <= 3.0, answer


async def test_a_command_with_2s_left_is_killed_with_its_group_by_the_deadline(
    tmp_path: Path,
) -> None:
    shell = tt.tools.shell(cwd=tmp_path, timeout=30, grace=3.0)
    began = trio.current_time()
    with trio.move_on_after(2.0) as scope:
        text = await shell(command=stubborn("60.7202"))
    returned = trio.current_time()
    gone = await _gone_at("60.7202")
    assert returned - began <= 2.0 + MARGIN, returned - began
    assert gone - began <= 2.0 + MARGIN, gone - began
    if not scope.cancelled_caught:  # the shell answered just before the deadline
        assert text.endswith("the command was killed]")


async def test_a_working_limit_of_2s_kills_the_command_and_scores_the_rollout(
    tmp_path: Path,
) -> None:
    shell = tt.tools.shell(cwd=tmp_path, timeout=30, grace=3.0)
    env = tt.ToolEnv(One(), [shell], working_limit=2.0)
    command = stubborn("60.7203")
    client = ScriptedClient([reply(tool_calls=[("shell", {"command": command})]), reply("5")])
    began = trio.current_time()
    episode = await env.run_slot(tt.RunSlot(TASK), tt.ModelContext(client, "m"))
    returned = trio.current_time()
    gone = await _gone_at("60.7203")
    assert returned - began <= 2.0 + MARGIN, returned - began
    assert gone - began <= 2.0 + MARGIN, gone - began
    # cut at its working limit (the group was killed at it), then scored
    assert episode.ok
    assert episode.stop_reason == "working_limit"
    assert episode.to_row()["stop_reason"] == "working_limit"
    assert len(client.calls) == 1
