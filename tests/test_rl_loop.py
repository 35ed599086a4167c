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
        # tt.first: exactly BATCH groups, each of GROUP ok rollouts with unequal rewards
        assert len(step.groups) == rl_loop.BATCH
        for group in step.groups:
            assert len(group) == rl_loop.GROUP
            assert all(e.ok for e in group)
            assert len({e.reward for e in group}) > 1
            assert len({e.group for e in group}) == 1
            mean = sum(e.reward for e in group) / len(group)
            assert all(e.advantage == pytest.approx(e.reward - mean) for e in group)
        # Staleness: no rollout is trained on more than MAX_LAG versions after its policy
        assert max(step.lags) <= rl_loop.MAX_LAG
        assert step.version == step.step  # the trainer advanced once per batch
    # nothing of a batch's cancelled groups still ran when tt.first returned
    assert loop.live_after_batch == [0] * 8
    # the bounded channel: at most QUEUED batches waited; the feed never ran further ahead
    assert loop.queued_peak <= rl_loop.QUEUED
    assert loop.ahead_peak <= rl_loop.MAX_LAG + 1
    if train_time >= 5.0:  # a slow trainer back-pressures the feed: it paused, lags hit 2
        assert loop.pauses > 0
        assert max(max(step.lags) for step in loop.steps) == rl_loop.MAX_LAG
    if train_time <= 0.001:  # a fast trainer never holds the feed back
        assert loop.pauses == 0
