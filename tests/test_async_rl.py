"""`examples/async_rl.py` on trio's MockClock against the simulated engine: in each mode the
trainer updates while groups run, no generated token is thrown away, every rollout trained
on is at most `MAX_LAG` updates old from its oldest token, and the rows say which policy
made their tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import trio
from trio.testing import MockClock

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

import async_rl  # noqa: E402


@pytest.mark.parametrize("mode", ["wait", "keep", "abort"])
async def test_the_trainer_updates_while_groups_run(autojump_clock: MockClock, mode: str) -> None:
    with trio.fail_after(600):
        run = await async_rl.async_rl(mode, steps=5)  # type: ignore[arg-type]
    assert run.steps == 5
    assert run.policy["version"] == "5"
    assert run.policy["updates"] == 5
    assert run.policy["discarded_tokens"] == 0
    assert run.policy["restarted"] == 0
    assert len(run.rows) == 5 * async_rl.BATCH * async_rl.GROUP
    for row in run.rows:
        oldest, newest = row["policy_versions"]
        assert int(newest) - int(oldest) <= async_rl.MAX_LAG + 1
        assert row["versions"]
        assert row["group_versions"]
        assert row["policy_version"] == int(oldest)  # its lag counts from its oldest token
    if mode == "wait":
        assert all(row["policy_versions"][0] == row["policy_versions"][1] for row in run.rows)
    else:  # rollouts lived through an update: their tokens carry two versions
        assert any(row["policy_versions"][0] != row["policy_versions"][1] for row in run.rows)
    if mode == "abort":
        assert run.policy["cut"] > 0
    else:
        assert run.policy["cut"] == 0
