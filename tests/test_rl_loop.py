"""`examples/rl_loop.py` on trio's MockClock: each promise its docstring makes, checked."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import trio
from trio.testing import MockClock

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

import rl_loop  # noqa: E402


@pytest.mark.parametrize("train_time", [0.001, 0.2, 5.0])  # fast, even, far slower trainer
async def test_the_rl_loop_keeps_its_promises(autojump_clock: MockClock, train_time: float) -> None:
    with trio.fail_after(10_000):
        loop = await rl_loop.rl_loop(steps=8, train_time=train_time, model_delay=0.05)
    assert [step.step for step in loop.steps] == list(range(8))
    for step in loop.steps:
        # tt.batches: exactly BATCH groups, each of GROUP ok rollouts with unequal rewards
        assert len(step.groups) == rl_loop.BATCH
        for group in step.groups:
            assert len(group) == rl_loop.GROUP
            assert all(e.ok for e in group)
            assert len({e.reward for e in group}) > 1
            assert len({e.group for e in group}) == 1
            # GRPO's advantage by default (the env has no score_group of its own)
            mean = sum(e.reward for e in group) / len(group)
            assert all(e.advantage == pytest.approx(e.reward - mean) for e in group)
        # Staleness: no rollout is trained on more than MAX_LAG versions after its policy
        assert max(step.lags) <= rl_loop.MAX_LAG
        assert step.version == step.step  # the trainer advanced once per batch
    # leaving tt.batches' block cancelled and awaited every group still running
    assert loop.live_after == 0
    assert loop.ahead_peak <= rl_loop.MAX_LAG + 1
    if train_time >= 0.2:  # the next groups ran while the trainer trained
        assert loop.overlapped > 0
        assert max(max(step.lags) for step in loop.steps) >= 1
    if train_time <= 0.001:  # a fast trainer never holds the feed back
        assert loop.pauses == 0


async def test_on_policy_the_feed_waits_for_the_trainer(autojump_clock: MockClock) -> None:
    with trio.fail_after(10_000):
        loop = await rl_loop.rl_loop(steps=4, train_time=5.0, model_delay=0.05, max_lag=0)
    assert [max(step.lags) for step in loop.steps] == [0, 0, 0, 0]
    assert loop.pauses > 0  # nothing was pulled while the trainer trained
    assert loop.live_after == 0
