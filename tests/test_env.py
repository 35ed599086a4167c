"""Env episodes, SPEC section 3: single-turn chat, rewards, whole-episode retries, on_complete."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from trio.testing import MockClock

import trio_tasksets as tt
from trio_tasksets._core.adaptive import AdaptiveWindow, Outcome
from trio_tasksets._core.limits import CallObserver, observe_calls
from trio_tasksets._env.env import WindowFeed, error_outcome
from trio_tasksets._env.spec import EnvSpec
from trio_tasksets._models import Completion, Sampling
from trio_tasksets.testing import ScriptedClient


class Flaky:
    """A model client that raises the given errors first, then echoes."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls = 0
        self.seen: list[list[dict[str, Any]]] = []

    async def chat(
        self, messages: list[dict[str, Any]], *, model: str, sampling: Sampling
    ) -> Completion:
        self.calls += 1
        self.seen.append(messages)
        await trio.sleep(1)
        if self.errors:
            raise self.errors.pop(0)
        return Completion(content=str(messages[-1]["content"]))

    async def aclose(self) -> None:
        pass


class Static(tt.Taskset[tt.Task, tt.TasksetConfig]):
    def load(self) -> list[tt.Task]:
        return [tt.Task("say hi", answer="HI")]


class RateLimited(Exception):
    pass


class Fatal(Exception):
    pass


def ctx(client: Any) -> tt.ModelContext:
    return tt.ModelContext(client, "test-model")


async def test_single_turn_chat_system_prompt_first_and_answer_match(
    autojump_clock: MockClock,
) -> None:
    client = Flaky()
    env: tt.Env[tt.Task] = tt.Env(Static(tt.TasksetConfig(system_prompt="be brief")))
    task = next(iter(env.taskset))
    episode = await env.run_slot(tt.RunSlot(task, rollout=3), ctx(client))
    assert client.seen[0] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "say hi"},
    ]
    assert episode.ok
    assert episode.reward == 1.0  # "HI" occurs in "say hi", case-insensitive
    assert episode.completion == "say hi"
    assert episode.messages[-1] == {"role": "assistant", "content": "say hi"}
    assert episode.rollout == 3
    assert episode.task.key == task.key
    assert episode.task.data["prompt"] == "say hi"
    assert episode.attempts == 1
    assert episode.timing["duration"] == 1


async def test_reward_from_env_or_taskset(autojump_clock: MockClock) -> None:
    class Scored(Static):
        def reward(self, task: tt.Task, completion: str) -> float:
            return 0.25

    async def async_reward(task: tt.Task, completion: str) -> float:
        return 0.5

    task = tt.Task("x", answer="nope")
    assert (await tt.Env(Static()).run_slot(tt.RunSlot(task), ctx(Flaky()))).reward == 0.0
    assert (await tt.Env(Scored()).run_slot(tt.RunSlot(task), ctx(Flaky()))).reward == 0.25
    env = tt.Env(Scored(), reward=async_reward)
    assert (await env.run_slot(tt.RunSlot(task), ctx(Flaky()))).reward == 0.5


async def test_included_error_is_retried_and_earlier_errors_are_kept(
    autojump_clock: MockClock,
) -> None:
    client = Flaky(RateLimited("slow down"), RateLimited("again"))
    env = tt.Env(Static(), retries=tt.RetryPolicy(max_retries=2, include=("RateLimited",)))
    episode = await env.run_slot(tt.RunSlot(tt.Task("a", answer="a")), ctx(client))
    assert episode.ok
    assert episode.attempts == 3
    assert [(e.type, e.message, e.attempt) for e in episode.errors] == [
        ("RateLimited", "slow down", 1),
        ("RateLimited", "again", 2),
    ]
    assert client.calls == 3


async def test_excluded_or_not_included_errors_are_not_retried(autojump_clock: MockClock) -> None:
    excluded = tt.Env(Static(), retries=tt.RetryPolicy(max_retries=5, exclude=("Fatal",)))
    episode = await excluded.run_slot(tt.RunSlot(tt.Task("a")), ctx(Flaky(Fatal("no"))))
    assert not episode.ok
    assert episode.attempts == 1
    assert [e.type for e in episode.errors] == ["Fatal"]
    only = tt.Env(Static(), retries=tt.RetryPolicy(max_retries=5, include=("RateLimited",)))
    episode = await only.run_slot(tt.RunSlot(tt.Task("a")), ctx(Flaky(Fatal("no"))))
    assert episode.attempts == 1


async def test_retries_exhausted_and_base_class_names_match(autojump_clock: MockClock) -> None:
    env = tt.Env(Static(), retries=tt.RetryPolicy(max_retries=2, include=("Exception",)))
    client = Flaky(Fatal("1"), Fatal("2"), Fatal("3"), Fatal("4"))
    episode = await env.run_slot(tt.RunSlot(tt.Task("a")), ctx(client))
    assert not episode.ok
    assert episode.attempts == 3
    assert len(episode.errors) == 3
    assert client.calls == 3


async def test_backoff_is_jittered_and_bounded(autojump_clock: MockClock) -> None:
    policy = tt.RetryPolicy(max_retries=3, backoff=2.0, max_backoff=5.0)
    delays = [policy.delay(k) for k in (1, 2, 3, 4) for _ in range(50)]
    assert all(0 <= d <= 5.0 for d in delays)
    assert len(set(delays)) > 1


async def test_on_complete_runs_once_shielded(autojump_clock: MockClock) -> None:
    seen: list[str] = []

    async def on_complete(episode: tt.Episode) -> None:
        await trio.sleep(5)  # the caller's deadline passes meanwhile: shielded, so it finishes
        seen.append(episode.id)

    env = tt.Env(Static())
    with trio.move_on_after(2):
        await env.run_slot(tt.RunSlot(tt.Task("a")), ctx(Flaky()), on_complete=on_complete)
    assert len(seen) == 1


async def test_cancellation_propagates_and_skips_on_complete(autojump_clock: MockClock) -> None:
    seen: list[tt.Episode] = []
    slot = tt.RunSlot(tt.Task("a"))
    with trio.move_on_after(0.5) as scope:
        await tt.Env(Static()).run_slot(slot, ctx(Flaky()), on_complete=seen.append)
    assert scope.cancelled_caught
    assert seen == []
    assert not slot.done


def test_episode_row_round_trip() -> None:
    episode = tt.Episode(
        id="e1",
        task=tt.EpisodeTask(
            "k", {"prompt": "p", "answer": None, "info": {}, "system_prompt": None}
        ),
        rollout=1,
        ok=True,
        reward=1.0,
        completion="c",
        errors=[tt.EpisodeError("Boom", "x", 1)],
        attempts=2,
        usage={"prompt_tokens": 7, "completion_tokens": 2},
        finish_reason="length",
        turns=3,
        tool_calls=4,
        stop_reason="max_turns",
        metrics={"exact": 1.0},
    )
    row = episode.to_row()
    assert set(row) == {
        "id", "task", "rollout", "ok", "reward", "completion", "messages", "errors",
        "attempts", "timing", "usage", "finish_reason", "turns", "tool_calls", "stop_reason",
        "metrics",
    }  # fmt: skip
    assert row["task"] == {"key": "k", "data": episode.task.data}
    assert row["errors"] == [{"type": "Boom", "message": "x", "attempt": 1}]
    assert tt.Episode.from_row(row) == episode


def test_a_fresh_row_becomes_the_same_episode_as_from_row() -> None:
    """`Episode._from_fresh_row` (the served path's answers) takes a well-typed row's own
    dicts and lists; any other row goes through `from_row`, with its conversions and its
    errors."""
    data: dict[str, Any] = {"prompt": "p", "answer": None, "info": {}, "system_prompt": None}
    row = tt.Episode("i", tt.EpisodeTask("k", data), 0, ok=True, reward=1.0, completion="c",
                     messages=[{"role": "user", "content": "p"}], attempts=1,
                     timing={"started": 1.0, "finished": 2.0, "duration": 1.0}).to_row()  # fmt: skip
    episode = tt.Episode._from_fresh_row(row)
    assert episode == tt.Episode.from_row(row)
    assert episode.task.data is row["task"]["data"]
    assert episode.messages is row["messages"]
    assert episode.to_row() == row
    odd = [
        {**row, "errors": [{"type": "Boom", "message": "x", "attempt": 1}]},
        {**row, "reward": 1, "rollout": "0"},  # converted by from_row, as before
    ]
    for other in odd:
        assert tt.Episode._from_fresh_row(other) == tt.Episode.from_row(other)
    for bad in ({k: v for k, v in row.items() if k != "id"}, [row], "row", None):
        with pytest.raises((KeyError, TypeError)):
            tt.Episode._from_fresh_row(bad)


def test_retry_policy_validates() -> None:
    for field in ("max_retries", "backoff", "max_backoff"):
        negative: dict[str, Any] = {field: -1}
        with pytest.raises(tt.ConfigError, match=f"{field} must be >= 0") as raised:
            tt.RetryPolicy(**negative)
        assert raised.value.parameter == field


async def test_a_non_finite_reward_is_an_episode_error(autojump_clock: MockClock) -> None:
    env = tt.Env(Static(), reward=lambda task, completion: float("nan"))
    episode = await env.run_slot(tt.RunSlot(tt.Task("a")), ctx(Flaky()))
    assert not episode.ok
    assert episode.errors[0].type == "ValueError"
    assert "finite" in episode.errors[0].message


def test_backoff_never_overflows_however_many_attempts() -> None:
    policy = tt.RetryPolicy(max_retries=10**6, backoff=0.5, max_backoff=30.0)
    assert 0 <= policy.delay(5000) <= 30.0


async def test_usage_sums_every_model_call_of_every_attempt(autojump_clock: MockClock) -> None:
    """An episode's `usage` adds up each reply's token counts over a multi-call rollout and a
    retried attempt; its `finish_reason` is the last reply's."""
    client = ScriptedClient(
        [Completion("a", {"prompt_tokens": 5, "completion_tokens": 1}, "stop"),
         Completion("b", {"prompt_tokens": 7, "completion_tokens": 2}, "length"),
         Completion("c", {"prompt_tokens": 11, "completion_tokens": 3}, "stop"),
         Completion("HI", {"prompt_tokens": 13, "completion_tokens": 4, "cached": 1}, "length")],
        delay=1,
    )  # fmt: skip

    class TwoCalls(tt.Env[tt.Task]):
        attempts = 0

        async def rollout(self, task: tt.Task, ctx: tt.ModelContext) -> Any:
            first = await ctx.chat([{"role": "user", "content": "1"}])
            second = await ctx.chat([{"role": "user", "content": first.content}])
            self.attempts += 1
            if self.attempts == 1:
                raise RateLimited("again")
            return [], second.content

    env = TwoCalls(Static(), retries=tt.RetryPolicy(1, backoff=0))
    episode = await env.run_slot(tt.RunSlot(next(iter(env.taskset))), ctx(client))
    assert episode.ok
    assert episode.attempts == 2
    assert episode.usage == {"prompt_tokens": 36, "completion_tokens": 10, "cached": 1}
    assert episode.finish_reason == "length"
    assert (episode.turns, episode.tool_calls) == (2, 0)  # the last attempt's model calls
    assert [call.messages for call in client.calls[2:]] == [
        [{"role": "user", "content": "1"}], [{"role": "user", "content": "c"}]
    ]  # fmt: skip
    assert tt.Episode.from_row(episode.to_row()) == episode


# --- rollout_timeout, waits in a row's timing, the window feed ---------------------------------


async def test_a_rollout_over_its_timeout_is_cancelled_and_becomes_an_episode_error(
    autojump_clock: MockClock,
) -> None:
    """Without retries the slow attempt is the episode's error; the adaptive rollout window
    of the eval hears a timeout (growth pauses)."""
    heard: list[Outcome] = []

    class Watch(CallObserver):
        def on_outcome(self, outcome: Outcome, retry_after: float | None) -> None:
            heard.append(outcome)

    env = tt.Env(Static(), rollout_timeout=2.5)
    t0 = trio.current_time()
    with observe_calls(Watch()):
        episode = await env.run_slot(tt.RunSlot(Static().load()[0]), ctx(tt.EchoClient(delay=9)))
    assert trio.current_time() - t0 == pytest.approx(2.5)
    assert not episode.ok
    assert [(e.type, e.attempt) for e in episode.errors] == [("RolloutTimeoutError", 1)]
    assert isinstance(tt.RolloutTimeoutError("x"), TimeoutError)  # --retry-on TimeoutError
    assert heard == [Outcome.TIMEOUT]
    assert episode.timing["duration"] == pytest.approx(2.5)


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan"), "5", True])
def test_rollout_timeout_must_be_seconds_above_zero(bad: Any) -> None:
    with pytest.raises(tt.ConfigError, match="rollout_timeout must be a number of seconds > 0"):
        tt.Env(Static(), rollout_timeout=bad)


def test_a_rollout_timeout_travels_in_the_env_spec() -> None:
    env = tt.Env(Static(), rollout_timeout=7.5)
    spec = EnvSpec.of(env)
    assert spec.limits == tt.RolloutLimits(rollout_timeout=7.5)
    assert EnvSpec.from_json(spec.to_json()) == spec  # it travels as data
    assert spec.build(Static()).rollout_timeout == 7.5
    assert EnvSpec.of(tt.Env(Static())).limits == tt.RolloutLimits()


async def test_a_rows_timing_has_its_waits_and_old_rows_still_read(
    autojump_clock: MockClock,
) -> None:
    episode = await tt.Env(Static()).run_slot(tt.RunSlot(Static().load()[0]), ctx(Flaky()))
    row = episode.to_row()
    assert row["timing"]["waited_connection"] == row["timing"]["waited_rate"] == 0.0
    old = {**row, "timing": {"started": 1.0, "finished": 2.0, "duration": 1.0}}
    assert tt.Episode.from_row(old).timing == {"started": 1.0, "finished": 2.0, "duration": 1.0}


def test_an_episodes_errors_tell_a_remote_window_what_the_endpoint_said() -> None:
    def error(kind: str, message: str, status: int | None = None) -> tt.EpisodeError:
        return tt.EpisodeError(kind, message, status=status)

    assert error_outcome(error("ModelHTTPError", "rate limited", 429)) is Outcome.RATE_LIMITED
    assert error_outcome(error("ModelHTTPError", "busy", 503)) is Outcome.SERVER_ERROR
    assert error_outcome(error("ModelHTTPError", "bad request", 400)) is None
    assert error_outcome(error("ModelTimeoutError", "timed out")) is Outcome.TIMEOUT
    assert error_outcome(error("RolloutTimeoutError", "slow")) is Outcome.TIMEOUT
    # The status is data: a message that merely mentions one says nothing.
    assert error_outcome(error("ValueError", "HTTP 429")) is None
    assert error_outcome(error("ModelHTTPError", "u returned HTTP 429 after 4 attempts")) is None


def test_an_http_status_is_kept_on_the_episode_error_and_its_row() -> None:
    exc = tt.ModelHTTPError("u returned HTTP 429", status=429)
    recorded = tt.EpisodeError.of(exc, 2)
    assert recorded == tt.EpisodeError("ModelHTTPError", "u returned HTTP 429", 2, 429)
    assert recorded.to_dict()["status"] == 429
    assert "status" not in tt.EpisodeError.of(ValueError("x"), 1).to_dict()  # only when set
    assert tt.EpisodeError(**recorded.to_dict()) == recorded  # a row reads back


async def test_a_remote_window_feed_reads_the_episode(autojump_clock: MockClock) -> None:
    window = AdaptiveWindow(1, 10, 20)
    await window.acquire("run")
    feed = WindowFeed(window, remote=True)
    episode = tt.Episode("id", tt.EpisodeTask("k", {}), 0, ok=True)
    episode.errors = [tt.EpisodeError("ModelHTTPError", "u returned HTTP 429", status=429)]
    feed.ended(episode)  # a 429 (the first: the cut), then a success
    assert window.size == 8
    assert [reason for _, _, reason in window.history] == ["start", "429"]
    assert WindowFeed(tt.Window(3)).window is None  # a fixed window is left alone
