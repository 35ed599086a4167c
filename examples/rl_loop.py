"""A trio-native async RL feeding loop: a feed of prompts, groups, over-sampling, staleness.

The shape of an async GRPO trainer's rollout side, with a fake trainer and a fake policy:

* a feed of prompts (an endless stream, read on demand through a zero-buffer channel);
* each prompt is a group of `GROUP` rollouts (one nursery, one cancel scope, their places
  taken from one `tt.Window`), scored together: GRPO's advantage, reward minus group mean;
* a batch is `tt.first(BATCH, ...)` over the groups whose rewards are not all equal (a group
  where every rollout got the same reward carries no learning signal): once BATCH are in,
  every other group is cancelled *and awaited* before the batch is handed on, so no
  straggler runs into the next step;
* `tt.Staleness(max_lag=2)`: the trainer advances the policy after each batch; a rollout
  never trains more than 2 versions after the policy that produced it (the feed pauses while
  the trainer is behind, and rollouts that fall further behind are cancelled);
* batches reach the trainer through a bounded memory channel: a slow trainer back-pressures
  the whole feed, and memory stays bounded (at most `QUEUED` batches wait).

    python examples/rl_loop.py              # 6 steps, printed as they are trained
    python examples/rl_loop.py --steps 20 --train-time 0.5

`tests/test_rl_loop.py` runs it on trio's MockClock and checks each of these points.
"""

from __future__ import annotations

import argparse
import random
import statistics
from typing import Any

import attrs
import trio

import trio_tasksets as tt

GROUP = 8  # rollouts per prompt
BATCH = 4  # groups per training batch
MAX_LAG = 2  # policy versions a rollout may lag the trainer when it is trained on
QUEUED = 2  # batches that may wait for the trainer
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


class Grpo(tt.Env[tt.Task]):
    """Scores a group as GRPO does: each rollout's advantage is its reward minus the mean."""

    async def score_group(self, task: tt.Task, episodes: list[tt.Episode]) -> None:
        mean = statistics.fmean(e.reward for e in episodes)
        for episode in episodes:
            episode.advantage = episode.reward - mean


def varied(group: list[tt.Episode] | None) -> bool:
    """A group worth training on: it ran (not cancelled as stale), every rollout is ok, and
    their rewards differ."""
    return group is not None and all(e.ok for e in group) and len({e.reward for e in group}) > 1


async def prompts(send: trio.MemorySendChannel[tt.Task]) -> None:
    """The feed: an endless stream of prompts; a zero-buffer channel hands each on demand."""
    async with send:
        for number in range(1_000_000):
            await send.send(tt.Task(prompt=f"prompt #{number}: what is 6 * 7?", answer="42"))


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
    queued_peak: int = 0  # batches waiting for the trainer, at most
    ahead_peak: int = 0  # batches handed minus policy version, at most
    live_after_batch: list[int] = attrs.Factory(list)  # model calls running when first returned
    pauses: int = 0  # pulls the feed held back while the trainer was behind


async def rl_loop(
    *, steps: int = 6, train_time: float = 0.2, model_delay: float = 0.01, seed: int = 0
) -> Loop:
    """Run `steps` training steps of the loop described above; return what it did."""
    staleness = tt.Staleness(max_lag=MAX_LAG)
    policy = FakePolicy(staleness, delay=model_delay, seed=seed)
    env = Grpo(tt.testing.FeedTaskset())  # the tasks come from the feed, not this taskset
    ctx = tt.ModelContext(policy, "policy")
    window = tt.Window(WINDOW)
    loop = Loop()
    send_batch, receive_batch = trio.open_memory_channel[list[list[tt.Episode]]](QUEUED)
    send_prompt, receive_prompt = trio.open_memory_channel[tt.Task](0)

    async def rollout(slot: tt.RunSlot[tt.Task]) -> tt.Episode:
        return await env.run_slot(slot, ctx)

    async def run_one(group: tt.Group) -> list[tt.Episode]:
        return await tt.run_group(env, group, rollout)

    run = staleness.run(run_one)  # a group more than MAX_LAG behind is cancelled: None

    async def produce() -> None:
        async with send_batch:
            for _ in range(steps):
                # a clone: tt.first closes its source, the prompt feed goes on
                feed = staleness.feed(receive_prompt.clone())
                groups = tt.group_feed(feed, GROUP, window)
                batch = await tt.first(BATCH, groups, run, window=window, accept=varied)
                loop.live_after_batch.append(policy.live)
                staleness.handed()
                loop.ahead_peak = max(loop.ahead_peak, staleness.handed_count - staleness.version)
                await send_batch.send([group for group in batch if group is not None])
                queued = send_batch.statistics().current_buffer_used
                loop.queued_peak = max(loop.queued_peak, queued)

    async def train() -> None:
        async for batch in receive_batch:
            version = staleness.version
            lags = [version - (e.policy_version or 0) for group in batch for e in group]
            await trio.sleep(train_time)  # the fake trainer's optimizer step
            loop.steps.append(Step(len(loop.steps), version, batch, lags))
            staleness.advance()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(prompts, send_prompt)
        async with trio.open_nursery() as pipeline:
            pipeline.start_soon(train)  # ends once produce closes the batch channel
            await produce()
        nursery.cancel_scope.cancel()  # every batch is trained: stop the prompt feed
    loop.pauses = staleness.pauses
    return loop


async def _demo(steps: int, train_time: float) -> None:
    loop = await rl_loop(steps=steps, train_time=train_time)
    for step in loop.steps:
        rewards = [e.reward for group in step.groups for e in group]
        print(
            f"step {step.step}: policy v{step.version}, {len(step.groups)} groups of {GROUP}, "
            f"reward mean {statistics.fmean(rewards):.2f}, lag max {max(step.lags)}"
        )
    print(f"feed paused {loop.pauses} times; at most {loop.queued_peak} batches queued")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--train-time", type=float, default=0.2, metavar="S")
    args = parser.parse_args()
    trio.run(_demo, args.steps, args.train_time)


if __name__ == "__main__":
    main()
