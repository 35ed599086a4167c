"""A trio-native async RL feeding loop: a feed of prompts, groups, batches, staleness.

The shape of an async GRPO trainer's rollout side, with a fake trainer and a fake policy:

* a feed of prompts (an endless async generator, pulled on demand);
* each prompt is a group of `GROUP` rollouts (`tt.group_feed`, `tt.run_group`: one nursery,
  one cancel scope, their places taken from one `tt.Window`), given GRPO's advantage (reward
  minus the group mean) by default: the env has no `score_group` of its own;
* `tt.batches(BATCH, ...)` hands the trainer batches of BATCH groups whose rewards are not
  all equal (a group where every rollout got the same reward carries no learning signal),
  while the next groups run during the trainer's step (at most `WINDOW` live rollouts);
* `tt.Staleness(max_lag=2)`: the trainer advances the policy after each batch; a rollout
  never trains more than 2 versions after the policy that produced it (the feed pauses while
  the trainer is behind; a group that falls further behind is cancelled, or dropped before
  a batch);
* leaving the `async with` block cancels the groups still running, waits for them and
  closes the prompt feed: nothing runs once the loop returns.

    python examples/rl_loop.py              # 6 steps, printed as they are trained
    python examples/rl_loop.py --steps 20 --train-time 0.5

`tests/test_rl_loop.py` runs it on trio's MockClock and checks each of these points.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
from collections.abc import AsyncIterator
from typing import Any

import attrs
import trio

import trio_tasksets as tt

GROUP = 8  # rollouts per prompt
BATCH = 4  # groups per training batch
MAX_LAG = 2  # policy versions a rollout may lag the trainer when it is trained on
WINDOW = 16  # live rollouts at once


class FakePolicy:
    """A model whose chance of answering right depends on the prompt's difficulty (easy,
    hard, or in between) and grows with the policy version: easy and hard prompts give groups
    with no reward spread, the others mostly do. Deterministic for a seed."""

    def __init__(self, staleness: tt.Staleness, *, delay: float, seed: int = 0) -> None:
        self.staleness = staleness
        self.delay = delay
        self.random = random.Random(seed)
        self.live = 0  # model calls in flight now
        self.calls = 0

    async def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        model: str,
        sampling: tt.Sampling,
        tools: list[dict[str, Any]] | None = None,
    ) -> tt.Completion:
        self.live += 1
        self.calls += 1
        try:
            await trio.sleep(self.delay * (0.5 + self.random.random()))
        finally:
            self.live -= 1
        prompt = str(messages[-1]["content"])
        level = int(prompt.split("#")[1].split(":")[0]) % 4  # 0 easy, 3 hard, 1-2 between
        chance = {0: 1.0, 1: 0.4, 2: 0.6, 3: 0.0}[level]
        if 0 < chance < 1:
            chance = min(0.95, chance + 0.02 * self.staleness.version)  # it learns
        right = self.random.random() < chance
        return tt.Completion("42" if right else "41", usage={"completion_tokens": 1})

    async def aclose(self) -> None:
        pass


def varied(group: list[tt.Episode]) -> bool:
    """A group worth training on: every rollout is ok and their rewards differ."""
    return all(e.ok for e in group) and len({e.reward for e in group}) > 1


async def prompts() -> AsyncIterator[tt.Task]:
    """The feed: an endless stream of prompts, pulled on demand."""
    for number in itertools.count():
        yield tt.Task(prompt=f"prompt #{number}: what is 6 * 7?", answer="42")


@attrs.define
class Step:
    """One trained batch: its step, the policy version it trained, each group's reward
    spread, and how far behind the trainer each rollout's policy was (its lag)."""

    step: int
    version: int
    groups: list[list[tt.Episode]]
    lags: list[int]


@attrs.define
class Loop:
    """What the loop did, for its caller (and its test)."""

    steps: list[Step] = attrs.Factory(list)
    ahead_peak: int = 0  # batches handed minus policy version, at most
    overlapped: int = 0  # model calls that ran while the trainer trained
    live_after: int = 0  # model calls still running once the loop returned
    pauses: int = 0  # pulls the feed held back while the trainer was behind
    dropped: int = 0  # groups that went stale: cancelled, or dropped before a batch


async def rl_loop(
    *,
    steps: int = 6,
    train_time: float = 0.2,
    model_delay: float = 0.01,
    seed: int = 0,
    max_lag: int = MAX_LAG,
) -> Loop:
    """Run `steps` training steps of the loop described above; return what it did."""
    staleness = tt.Staleness(max_lag)
    policy = FakePolicy(staleness, delay=model_delay, seed=seed)
    env = tt.Env(tt.testing.FeedTaskset())  # no score_group: GRPO's advantage by default
    ctx = tt.ModelContext(policy, "policy")
    window = tt.Window(WINDOW)  # live rollouts, shared by the groups and the runs
    loop = Loop()

    async def rollout(slot: tt.RunSlot[tt.Task]) -> tt.Episode:
        return await env.run_slot(slot, ctx)

    async def run_one(group: tt.Group) -> list[tt.Episode]:
        return await tt.run_group(env, group, rollout)

    groups = tt.group_feed(prompts(), GROUP, window)
    async with tt.batches(
        BATCH, groups, run_one, window=window, staleness=staleness, accept=varied
    ) as batches:
        async for batch in batches:
            version = staleness.version
            lags = [version - (e.policy_version or 0) for group in batch for e in group]
            calls = policy.calls
            await trio.sleep(train_time)  # the fake trainer's optimizer step
            loop.overlapped += policy.calls - calls
            loop.steps.append(Step(len(loop.steps), version, batch, lags))
            loop.ahead_peak = max(loop.ahead_peak, staleness.handed_count - version)
            staleness.advance()
            if len(loop.steps) == steps:
                break
    loop.live_after = policy.live
    loop.pauses = staleness.pauses
    loop.dropped = staleness.cancelled + staleness.dropped
    return loop


async def _demo(steps: int, train_time: float) -> None:
    loop = await rl_loop(steps=steps, train_time=train_time)
    for step in loop.steps:
        rewards = [e.reward for group in step.groups for e in group]
        print(
            f"step {step.step}: policy v{step.version}, {len(step.groups)} groups of {GROUP}, "
            f"reward mean {statistics.fmean(rewards):.2f}, lag max {max(step.lags)}"
        )
    print(f"feed paused {loop.pauses} times; {loop.dropped} groups went stale")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--train-time", type=float, default=0.2, metavar="S")
    args = parser.parse_args()
    trio.run(_demo, args.steps, args.train_time)


if __name__ == "__main__":
    main()
