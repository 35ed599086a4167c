"""An async RL trainer whose rollouts live through its policy updates (`tt.Policy`).

The rollout side of a fully asynchronous trainer, with a fake optimizer step:

* groups of `GROUP` rollouts run on an engine (`tt.group_feed`, `tt.run_group`), their model
  calls made through a `tt.ModelContext(..., policy=policy)`: governed by the policy;
* `tt.batches(BATCH, ...)` hands the trainer batches of groups while the next ones run;
* every `EVERY` steps the trainer pushes new weights: `await policy.update(version,
  mode=MODE, load=push)`. From that moment new model calls park; then, by mode, the calls in
  flight finish first (`wait`), stay frozen in the engine (`keep`), or are cut and, after
  the update, continue from their prompt plus the tokens they had (`abort`: nothing
  generated is thrown away); `push()` runs, the engine takes the version and resumes;
* `tt.Staleness(MAX_LAG, policy=policy)`: a rollout whose oldest token is more than
  `MAX_LAG` updates old is cancelled; the feed waits while the trainer is behind;
* each row says which policy made which of its tokens (`versions`, `policy_versions`), and
  each group the versions it spans (`group_versions`).

    python examples/async_rl.py                      # each mode, on a simulated engine
    python examples/async_rl.py --mode abort --steps 8
    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL ...      # then, against it:
    python examples/async_rl.py --vllm http://127.0.0.1:8000/v1 --model MODEL

Against vLLM the engine is told of each update through `tt.VLLMControl` (``/pause``,
``/update_weight_version``, ``/resume``); `push` stands for your weight transfer.
`tests/test_async_rl.py` runs it on trio's MockClock.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import AsyncIterator
from typing import Any, Literal

import attrs
import trio

import trio_tasksets as tt
from trio_tasksets.testing import SimulatedEngine

GROUP = 4  # rollouts per prompt
BATCH = 4  # groups per training batch
EVERY = 1  # steps between policy updates
MAX_LAG = 1  # updates a rollout's oldest token may lag
WINDOW = 32  # live rollouts at once
Mode = Literal["wait", "keep", "abort"]


async def prompts() -> AsyncIterator[tt.Task]:
    for number in itertools.count():
        yield tt.Task(prompt=f"prompt {number}: tell me a story", answer="t")


@attrs.define
class Run:
    """What one run of the loop did."""

    mode: str
    steps: int = 0
    rows: list[dict[str, Any]] = attrs.Factory(list)
    seconds: float = 0.0
    tokens: int = 0  # output tokens of the rollouts trained on
    policy: dict[str, Any] = attrs.Factory(dict)  # `Policy.stats()`
    stale: int = 0  # rollouts cancelled as stale

    def versions_seen(self) -> set[tuple[str, ...]]:
        return {tuple(row["policy_versions"]) for row in self.rows}


async def async_rl(
    mode: Mode,
    *,
    steps: int = 6,
    train_time: float = 2.0,
    client: tt.ModelClient | None = None,
    engines: list[tt.EngineControl] | None = None,
    model: str = "sim",
) -> Run:
    """`steps` training steps, an update every `EVERY` of them in `mode`; against the
    simulated engine unless a `client` (and its `engines`) is given."""
    if client is None:
        sim = SimulatedEngine(decode_time=0.02, mean_tokens=128, sigma=0.8, max_running=32)
        client, engines = sim, [sim]
    policy = tt.Policy(0, engines=engines or [])
    staleness = tt.Staleness(MAX_LAG, policy=policy)
    env = tt.Env(tt.testing.FeedTaskset())
    ctx = tt.ModelContext(
        client, model, tt.Sampling(max_tokens=256, return_tokens=True), policy=policy
    )
    window = tt.Window(WINDOW)
    run = Run(mode)
    began = trio.current_time()

    async def rollout(slot: tt.RunSlot[tt.Task]) -> tt.Episode:
        return await env.run_slot(slot, ctx)

    async def run_one(group: tt.Group) -> list[tt.Episode]:
        return await tt.run_group(env, group, rollout)

    async def push() -> None:
        await trio.sleep(0.5)  # the trainer's weight transfer to the engine

    groups = tt.group_feed(prompts(), GROUP, window)
    async with tt.batches(BATCH, groups, run_one, window=window, staleness=staleness) as feed:
        async for batch in feed:
            for group in batch:
                for episode in group:
                    run.rows.append(episode.to_row())
                    run.tokens += episode.usage.get("completion_tokens", 0)
            await trio.sleep(train_time)  # the optimizer step
            run.steps += 1
            if run.steps % EVERY == 0:
                await policy.update(run.steps // EVERY, mode=mode, load=push)
            if run.steps == steps:
                break
    run.seconds = trio.current_time() - began
    run.policy = policy.stats()
    run.stale = staleness.cancelled
    return run


async def _demo(args: argparse.Namespace) -> None:
    modes: list[Mode] = [args.mode] if args.mode else ["wait", "keep", "abort"]
    for mode in modes:
        if args.vllm:
            async with (
                tt.OpenAIClient(args.vllm) as client,
                tt.VLLMControl(args.vllm) as control,
            ):
                run = await async_rl(
                    mode, steps=args.steps, client=client, engines=[control], model=args.model
                )
        else:
            run = await async_rl(mode, steps=args.steps)
        print(
            f"{mode:>5}: {run.steps} steps in {run.seconds:.1f} s, {run.tokens} tokens trained "
            f"on ({run.tokens / run.seconds:.0f}/s), policy now v{run.policy['version']}, "
            f"{run.policy['cut']} calls cut and continued, {run.policy['restarted']} started "
            f"over ({run.policy['discarded_tokens']} tokens thrown away), {run.stale} stale "
            f"rollouts; rows' policy versions: "
            f"{sorted(run.versions_seen())}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["wait", "keep", "abort"], default=None)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--vllm", metavar="URL", help="a vLLM server (VLLM_SERVER_DEV_MODE=1)")
    parser.add_argument("--model", default="tiny", help="the model it serves (with --vllm)")
    args = parser.parse_args()
    if args.vllm:
        trio.run(_demo, args)
    else:
        from trio.testing import MockClock

        trio.run(_demo, args, clock=MockClock(autojump_threshold=0))  # virtual time


if __name__ == "__main__":
    main()
