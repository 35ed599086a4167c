"""`Env(working_limit=S)` / `--working-limit S`: a rollout's working time is wall
time minus the time it was parked in the runner's own waits (connection window, rpm/tpm,
Retry-After rests, retry backoff), measured where those waits happen and while they last
(inspect #2902: endless 429s must not trip the limit). All on the autojump clock."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import forkserver
import pytest
import trio
import trio.testing

import trio_tasksets as tt
from trio_tasksets._core.adaptive import Outcome
from trio_tasksets._core.limits import EndpointLimits, parked, rest
from trio_tasksets._env.spec import EnvSpec
from trio_tasksets._models import Completion, ModelContext


class One(tt.Taskset[tt.Task, tt.TasksetConfig]):
    def load(self) -> list[tt.Task]:
        return [tt.Task("hi", answer="hi")]


TASK = tt.Task("hi", answer="hi")


class Parked(tt.Env[tt.Task]):
    """A rollout that works `work` seconds (in 1 s model calls), parked between its calls
    on the endpoint's limiters: one Retry-After rest of 120 s after the first call, then
    `rpm=1` spaces the calls 60 s apart (3 waits of 59 s): 297 s parked in all."""

    def __init__(self, taskset: Any, *, work: float, calls: int = 5, **kwargs: Any) -> None:
        super().__init__(taskset, **kwargs)
        self.work = work
        self.calls = calls
        self.limits = EndpointLimits(connections=1, rpm=1)

    async def rollout(self, task: tt.Task, ctx: ModelContext) -> tuple[list[Any], str]:
        replies: list[str] = []
        per_call = self.work / self.calls
        for i in range(self.calls):
            async with self.limits.call("endpoint"):
                reply = await ctx.chat([{"role": "user", "content": f"{task.prompt} {i}"}])
                await trio.sleep(per_call)  # the endpoint's latency: working time
            replies.append(reply.content)
            if i == 0:
                await rest(120.0, outcome=Outcome.RATE_LIMITED, kind="retry_after")
        return [], " ".join(replies)


def _env(work: float, limit: float, **kwargs: Any) -> Parked:
    taskset = One()
    return Parked(taskset, work=work, working_limit=limit, reward=lambda task, c: 1.0, **kwargs)


async def _one(env: tt.Env[Any]) -> tt.Episode:
    return await env.run_slot(tt.RunSlot(TASK), ModelContext(tt.EchoClient(), "echo"))


async def test_300_parked_seconds_and_5_of_work_under_a_10s_limit_finish_ok(
    autojump_clock: trio.testing.MockClock,
) -> None:
    start = trio.current_time()
    episode = await _one(_env(work=5.0, limit=10.0))
    wall = trio.current_time() - start
    assert wall == pytest.approx(302.0)  # 297 s parked
    assert episode.ok
    assert episode.stop_reason is None
    assert episode.timing["working"] == pytest.approx(5.0)
    assert episode.completion == "hi 0 hi 1 hi 2 hi 3 hi 4"


async def test_11s_of_work_stops_at_the_working_limit_scored(
    autojump_clock: trio.testing.MockClock,
) -> None:
    start = trio.current_time()
    episode = await _one(_env(work=11.0, limit=10.0))
    # 10 s of work (the 5th call, of 2.2 s, is cut 1.2 s in), plus 293.4 s parked (a
    # 120 s rest, three rpm waits of 57.8 s): the limit is not tripped while parked.
    assert trio.current_time() - start == pytest.approx(303.4)
    assert episode.ok  # a working limit ends the rollout normally, scored
    assert episode.stop_reason == "working_limit"
    assert episode.reward == 1.0
    assert episode.errors == []
    assert episode.timing["working"] == pytest.approx(10.0)
    # What the rollout had received when it was cut: the last model reply.
    assert episode.completion == "hi 4"
    assert episode.to_row()["stop_reason"] == "working_limit"
    assert tt.Episode.from_row(episode.to_row()).stop_reason == "working_limit"


async def test_a_wait_in_progress_is_not_working_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """inspect #2902: the wait must count while it lasts, not once it has ended (a rollout
    parked on endless 429s past its working limit must not be cut)."""

    class Waiting(tt.Env[tt.Task]):
        async def rollout(self, task: tt.Task, ctx: ModelContext) -> tuple[list[Any], str]:
            await trio.sleep(4.0)  # working
            with parked("rpm"):
                await trio.sleep(1000.0)
            await trio.sleep(4.0)  # working
            return [], "done"

    env = Waiting(One(), working_limit=10.0)
    episode = await _one(env)
    assert (episode.ok, episode.stop_reason, episode.completion) == (True, None, "done")
    assert episode.timing["working"] == pytest.approx(8.0)
    assert episode.timing["duration"] == pytest.approx(1008.0)


async def test_retry_backoff_is_parked_and_the_limit_is_per_attempt(
    autojump_clock: trio.testing.MockClock,
) -> None:
    calls = 0

    class Flaky(tt.Env[tt.Task]):
        async def rollout(self, task: tt.Task, ctx: ModelContext) -> tuple[list[Any], str]:
            nonlocal calls
            calls += 1
            await trio.sleep(6.0)
            if calls == 1:
                raise ValueError("first attempt fails")
            return [], "second"

    policy = tt.RetryPolicy(max_retries=1, backoff=500.0, max_backoff=500.0)
    env = Flaky(One(), working_limit=10.0, retries=policy)
    episode = await _one(env)
    assert (episode.ok, episode.attempts, episode.stop_reason) == (True, 2, None)
    assert episode.timing["working"] == pytest.approx(12.0)  # backoff excluded


async def test_a_rollout_with_no_reply_yet_is_scored_on_an_empty_completion(
    autojump_clock: trio.testing.MockClock,
) -> None:
    class Busy(tt.Env[tt.Task]):
        async def rollout(self, task: tt.Task, ctx: ModelContext) -> tuple[list[Any], str]:
            await trio.sleep(60.0)
            return [], "never"

    seen: list[str] = []

    def reward(task: Any, completion: str) -> float:
        seen.append(completion)
        return 0.25

    env = Busy(One(), working_limit=2.0, reward=reward)
    start = trio.current_time()
    episode = await _one(env)
    assert trio.current_time() - start == pytest.approx(2.0)
    assert (episode.ok, episode.stop_reason, episode.reward, seen) == (
        True,
        "working_limit",
        0.25,
        [""],
    )


def test_working_limit_is_checked() -> None:
    for bad in (0, -1, float("nan"), float("inf"), True, "5"):
        with pytest.raises(tt.ConfigError, match="working_limit") as raised:
            tt.RolloutLimits(working_limit=bad)
        assert raised.value.parameter == "working_limit"
    assert tt.RolloutLimits().working_limit is None
    assert tt.RolloutLimits(working_limit=3).working_limit == 3.0
    assert type(tt.RolloutLimits(working_limit=3).working_limit) is float


def test_an_unlimited_env_has_no_working_limit() -> None:
    env = tt.Env(One())
    assert env.working_limit is None
    _ = Completion  # the replies a cut rollout had received are Completions


def test_the_working_limit_travels_in_an_env_spec() -> None:
    env = tt.Env(One(), working_limit=7.5)
    spec = EnvSpec.of(env)
    assert spec.limits == tt.RolloutLimits(working_limit=7.5)
    assert EnvSpec.from_json(spec.to_json()).limits.working_limit == 7.5  # it travels as data
    assert spec.build(One).working_limit == 7.5


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "trio_tasksets", "eval", "echo", *args, "-o",
            str(tmp_path / "out"), "--no-dashboard", "--run-name", "run"]  # fmt: skip
    return forkserver.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)


def test_eval_working_limit_flag(tmp_path: Path) -> None:
    done = _cli(tmp_path, "-n", "3", "--working-limit", "30")
    assert done.returncode == 0, done.stderr
    run_dir = tmp_path / "out" / "run"
    assert json.loads((run_dir / "config.json").read_text())["limits"]["working_limit"] == 30.0
    rows = [json.loads(line) for line in (run_dir / "traces.jsonl").read_text().splitlines()]
    assert [row["stop_reason"] for row in rows] == [None, None, None]
    assert all(row["timing"]["working"] <= row["timing"]["duration"] for row in rows)
    bad = _cli(tmp_path, "-n", "3", "--working-limit", "0")
    assert bad.returncode == 2
    assert "--working-limit" in bad.stderr
