"""The asyncio bridge, trio-hosted direction: `tt.aio.bridge_env(aio_env)` (SPEC section 6).

An asyncio env written the way asyncio users write them (an `asyncio.Queue` feed, an
`asyncio.Semaphore` made in its asyncio `serving()`, an `asyncio.TaskGroup` and `asyncio.sleep`
in its rollout) is driven by the trio `run_eval`, by the service pattern and by `--serve`.

In-process tests run on trio's MockClock (`autojump_clock`): trio-asyncio's loop follows trio's
clock, so `asyncio.sleep` inside the env advances virtual time (asserted below). Every wait that
could hang on a quiet feed sits under `trio.fail_after`. Subprocess tests (CLI, served path,
the import-failure simulation) run on the real clock with bounded waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import forkserver
import pytest
import trio
import trio.testing

import trio_tasksets as tt
from trio_tasksets._env.loading import load_object, resolve_taskset
from trio_tasksets._env.spec import EnvSpec, TravelError

ROOT = Path(__file__).resolve().parent.parent
AIO_ENV = str(ROOT / "tests" / "fixtures" / "aio_env.py")
LIMIT = 30  # virtual seconds (MockClock): a hang becomes a TooSlowError, not a stuck test


class Boom(Exception):
    pass


_END = object()


# --- an asyncio env, as asyncio users write them ---------------------------------------------


@attrs.define
class FeedStats:
    """Shared by a feed and its views (`head(n)` copies the taskset, not this)."""

    pulled: int = 0
    finally_runs: int = 0
    cancelled_while_parked: int = 0
    parked: bool = False
    foreign: int = 0  # steps that did not run in an asyncio task


class QueueFeed(tt.aio.AsyncioTaskset[tt.Task, tt.TasksetConfig]):
    """An asyncio feed fed by the test through an `asyncio.Queue`: `put(*prompts)`, `end()`,
    `fail(exc)`. With nothing queued it parks on `queue.get()` (a quiet feed)."""

    def __init__(self, config: tt.TasksetConfig | None = None) -> None:
        super().__init__(config)
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.stats = FeedStats()

    def put(self, *prompts: str) -> None:
        for prompt in prompts:
            self.queue.put_nowait(tt.Task(prompt, answer=prompt.split()[-1]))

    def end(self) -> None:
        self.queue.put_nowait(_END)

    def fail(self, error: BaseException) -> None:
        self.queue.put_nowait(error)

    async def stream(self) -> AsyncIterator[tt.Task]:
        stats = self.stats
        try:
            while True:
                _check_asyncio(stats)
                stats.parked = True
                try:
                    item = await self.queue.get()
                except asyncio.CancelledError:
                    stats.cancelled_while_parked += 1
                    raise
                finally:
                    stats.parked = False
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                stats.pulled += 1
                yield item
        finally:
            stats.finally_runs += 1


def _check_asyncio(stats: FeedStats) -> None:
    try:
        asyncio.current_task()
    except RuntimeError:
        stats.foreign += 1


class AioEnv:
    """An asyncio env: `taskset`, an asyncio `serving()`, an asyncio `rollout`.

    Each rollout takes the env's `asyncio.Semaphore`, then, in an `asyncio.TaskGroup`, calls
    the model and sleeps `delay` (`asyncio.sleep`), waits for `gate` (an `asyncio.Event`) if
    set; a prompt containing "boom" raises Boom, "self-cancel" cancels its own task. Records
    the peak of rollouts in flight and the CancelledErrors it saw.
    """

    def __init__(self, taskset: Any, *, delay: float = 1.0, gate: bool = False) -> None:
        self.taskset = taskset
        self.delay = delay
        self.gate: asyncio.Event | None = asyncio.Event() if gate else None
        self.semaphore: asyncio.Semaphore | None = None
        self.running = 0
        self.peak = 0
        self.started = 0
        self.cancelled = 0
        self.log: list[str] = []
        self.exit_error: BaseException | None = None

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[AioEnv]:
        self.semaphore = asyncio.Semaphore(1000)
        self.log.append("serving: enter")
        try:
            yield self
        except BaseException as exc:
            self.exit_error = exc
            self.log.append(f"serving: exit with {type(exc).__name__}")
            raise
        else:
            self.log.append("serving: exit")

    async def rollout(
        self, task: tt.Task, ctx: tt.aio.AsyncioModelContext
    ) -> tuple[list[dict[str, Any]], str]:
        assert self.semaphore is not None, "rollout outside serving()"
        assert isinstance(task.prompt, str)
        messages: list[dict[str, Any]] = [{"role": "user", "content": task.prompt}]
        async with self.semaphore:
            self.started += 1
            self.running += 1
            self.peak = max(self.peak, self.running)
            try:
                async with asyncio.TaskGroup() as group:
                    reply = group.create_task(ctx.chat(messages))
                    group.create_task(asyncio.sleep(self.delay))
                    if self.gate is not None:
                        group.create_task(self.gate.wait())
                if "boom" in task.prompt:
                    raise Boom(task.prompt)
                if "self-cancel" in task.prompt:
                    current = asyncio.current_task()
                    assert current is not None
                    current.cancel()
                    await asyncio.sleep(0)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            finally:
                self.running -= 1
        completion = reply.result().content
        return [*messages, {"role": "assistant", "content": completion}], completion


def ctx() -> tt.ModelContext:
    return tt.ModelContext(tt.EchoClient(), "echo")


def config(tmp_path: Path, **kwargs: Any) -> tt.EvalConfig:
    return tt.EvalConfig(output_dir=str(tmp_path / "out"), dashboard=False, **kwargs)


def rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "traces.jsonl").read_text().splitlines()]


# --- run_eval through the bridge ------------------------------------------------------------


async def test_streaming_n3_pulls_exactly_3_and_writes_3_ok_rows(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    feed = QueueFeed()
    feed.put(*(f"say {i}" for i in range(10)))  # more than asked for, and never ended
    aio_env = AioEnv(feed, delay=5.0)
    env = tt.aio.bridge_env(aio_env)
    assert env.taskset is feed
    assert env.taskset.streaming
    began = trio.current_time()
    with trio.fail_after(LIMIT):
        result = await tt.run_eval(env, ctx(), config(tmp_path, num_examples=3, max_concurrent=2))
    # asyncio.sleep(5) inside the env ran on trio's virtual clock: 2 waves of the window.
    assert trio.current_time() - began == pytest.approx(10.0)
    assert feed.stats.pulled == 3  # never a 4th
    assert feed.stats.finally_runs == 1  # the asyncio generator was closed
    assert feed.stats.foreign == 0  # every step of the feed ran as asyncio code
    assert aio_env.log == ["serving: enter", "serving: exit"]
    written = rows(result.run_dir)
    assert len(written) == 3
    assert all(row["ok"] and row["reward"] == 1.0 for row in written)
    assert sorted(row["completion"] for row in written) == ["say 0", "say 1", "say 2"]


async def test_window_is_held_inside_the_asyncio_env_and_pulls_wait_for_a_free_slot(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    feed = QueueFeed()
    feed.put(*(f"say {i}" for i in range(20)))
    aio_env = AioEnv(feed, delay=0.0, gate=True)
    env = tt.aio.bridge_env(aio_env)
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                tt.run_eval, env, ctx(), config(tmp_path, num_examples=12, max_concurrent=3)
            )
            await trio.testing.wait_all_tasks_blocked()
            # Rollouts held at the asyncio gate: exactly the window was pulled (R1).
            assert (aio_env.running, aio_env.peak, feed.stats.pulled) == (3, 3, 3)
            assert aio_env.gate is not None
            aio_env.gate.set()
    assert aio_env.peak == 3
    assert aio_env.started == 12
    assert feed.stats.pulled == 12
    assert feed.stats.finally_runs == 1


async def test_fail_fast_a_feed_error_comes_back_itself_cancels_asyncio_rollouts_and_closes(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    feed = QueueFeed()
    feed.put("say 0", "say 1")
    feed.fail(Boom("the feed broke"))
    aio_env = AioEnv(feed, delay=100.0)
    env = tt.aio.bridge_env(aio_env)
    began = trio.current_time()
    with trio.fail_after(LIMIT), pytest.raises(Boom, match="the feed broke"):
        await tt.run_eval(env, ctx(), config(tmp_path, num_examples=5, max_concurrent=4))
    assert trio.current_time() - began == 0  # no waiting for the 100 s rollouts
    assert aio_env.cancelled == 2  # the asyncio side saw CancelledError
    assert aio_env.running == 0
    assert feed.stats.finally_runs == 1
    # The asyncio serving() saw the failure itself, not wrapped by run_eval's own nurseries.
    assert isinstance(aio_env.exit_error, Boom)


class RunSlotEnv:
    """An asyncio env with its own asyncio `run_slot` (no rollout): it builds the episode."""

    def __init__(self, taskset: Any, *, fail_after: float | None = None) -> None:
        self.taskset = taskset
        self.fail_after = fail_after
        self.cancelled = 0

    async def run_slot(self, slot: tt.RunSlot[tt.Task], ctx: tt.aio.AsyncioModelContext) -> Any:
        task = slot.task
        try:
            if self.fail_after is not None:
                await asyncio.sleep(self.fail_after)
                raise Boom("run_slot broke")
            assert isinstance(task.prompt, str)
            reply = await ctx.chat([{"role": "user", "content": task.prompt}])
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return tt.Episode(
            id=f"{task.key}-{slot.rollout}",
            task=tt.EpisodeTask(task.key, task.data),
            rollout=slot.rollout,
            ok=True,
            reward=1.0,
            completion=reply.content,
            attempts=1,
        )


async def test_fail_fast_while_the_asyncio_feed_is_quiet_raises_at_once_and_closes_it(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    feed = QueueFeed()
    feed.put("say 0")  # then the feed goes quiet, parked on queue.get()
    env = tt.aio.bridge_env(RunSlotEnv(feed, fail_after=1.0))
    began = trio.current_time()
    with trio.fail_after(LIMIT), pytest.raises(Boom, match="run_slot broke"):
        await tt.run_eval(env, ctx(), config(tmp_path, num_examples=5, max_concurrent=4))
    assert trio.current_time() - began == pytest.approx(1.0)  # at once, on the run's failure
    assert feed.stats.cancelled_while_parked == 1  # the parked asyncio pull was cancelled
    assert feed.stats.finally_runs == 1


async def test_an_asyncio_run_slot_builds_the_episodes(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    feed = QueueFeed()
    feed.put("say 0", "say 1", "say 2")
    env = tt.aio.bridge_env(RunSlotEnv(feed))
    with trio.fail_after(LIMIT):
        result = await tt.run_eval(
            env, ctx(), config(tmp_path, num_examples=3, rollouts_per_example=2)
        )
    written = rows(result.run_dir)
    assert len(written) == 6
    assert sorted(row["id"] for row in written) == sorted(
        f"{tt.Task(f'say {i}', answer=str(i)).key}-{r}" for i in range(3) for r in range(2)
    )


async def test_rollout_errors_and_self_cancellation_are_failed_rows_not_crashes(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    feed = QueueFeed()
    feed.put("say 0", "boom 1", "self-cancel 2")
    env = tt.aio.bridge_env(AioEnv(feed), retries=tt.RetryPolicy(1, backoff=0.0))
    with trio.fail_after(LIMIT):
        result = await tt.run_eval(env, ctx(), config(tmp_path, num_examples=3))
    by_prompt = {row["task"]["data"]["prompt"]: row for row in rows(result.run_dir)}
    assert by_prompt["say 0"]["ok"] is True
    failed = by_prompt["boom 1"]
    assert failed["ok"] is False
    assert [e["type"] for e in failed["errors"]] == ["Boom", "Boom"]  # retried once
    cancelled = by_prompt["self-cancel 2"]
    assert cancelled["ok"] is False
    # An asyncio CancelledError trio did not ask for is an ordinary error, never a stray cancel.
    assert cancelled["errors"][0]["type"] == "AsyncioCancelled"
    assert "cancelled from the asyncio side" in cancelled["errors"][0]["message"]


class SlowClient:
    """A trio model client that takes 10 s and records being cancelled."""

    def __init__(self) -> None:
        self.cancelled = 0

    async def chat(
        self, messages: list[dict[str, Any]], *, model: str, sampling: tt.Sampling
    ) -> tt.Completion:
        try:
            await trio.sleep(10)
        except trio.Cancelled:
            self.cancelled += 1
            raise
        return tt.Completion("late")  # pragma: no cover

    async def aclose(self) -> None:
        pass


async def test_an_asyncio_timeout_around_ctx_chat_cancels_the_trio_model_call(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    class Impatient:
        taskset = QueueFeed()

        async def rollout(
            self, task: tt.Task, ctx: tt.aio.AsyncioModelContext
        ) -> tuple[list[dict[str, Any]], str]:
            async with asyncio.timeout(1):
                reply = await ctx.chat([{"role": "user", "content": str(task.prompt)}])
            return [], reply.content  # pragma: no cover

    Impatient.taskset.put("say 0", "say 1")
    client = SlowClient()
    began = trio.current_time()
    with trio.fail_after(LIMIT):
        result = await tt.run_eval(
            tt.aio.bridge_env(Impatient()),
            tt.ModelContext(client, "slow"),
            config(tmp_path, num_examples=2),
        )
    assert trio.current_time() - began == pytest.approx(1.0)
    assert client.cancelled == 2  # asyncio's cancellation reached the trio call
    assert [e.errors[0].type for e in result.episodes] == ["TimeoutError", "TimeoutError"]


async def test_keyboard_interrupt_passes_through_serving_bare() -> None:
    aio_env = AioEnv(QueueFeed())
    with pytest.raises(KeyboardInterrupt):
        async with tt.aio.bridge_env(aio_env).serving():
            raise KeyboardInterrupt
    assert aio_env.log == ["serving: enter", "serving: exit with CancelledError"]


async def test_a_feed_that_cancels_itself_is_an_asyncio_cancelled_error(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    class SelfCancelling(tt.aio.AsyncioTaskset[tt.Task, tt.TasksetConfig]):
        async def stream(self) -> AsyncIterator[tt.Task]:
            yield tt.Task("say 0", answer="0")
            raise asyncio.CancelledError

    env = tt.aio.bridge_env(AioEnv(SelfCancelling(), delay=0.0))
    with trio.fail_after(LIMIT), pytest.raises(tt.aio.AsyncioCancelled):
        await tt.run_eval(env, ctx(), config(tmp_path, num_examples=3))


async def test_cancellation_from_trio_cancels_rollouts_closes_the_feed_and_exits_serving(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    feed = QueueFeed()
    feed.put("say 0", "say 1")  # then quiet
    aio_env = AioEnv(feed, delay=100.0)
    env = tt.aio.bridge_env(aio_env)
    with trio.move_on_after(5) as scope:
        await tt.run_eval(env, ctx(), config(tmp_path, num_examples=5, max_concurrent=4))
    assert scope.cancelled_caught  # the cancellation propagated unchanged, and stopped here
    assert aio_env.cancelled == 2
    assert feed.stats.cancelled_while_parked == 1
    assert feed.stats.finally_runs == 1
    assert aio_env.log == ["serving: enter", "serving: exit with CancelledError"]


async def test_a_static_taskset_and_a_plain_feed_object_work_too(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    class Static(tt.Taskset[tt.Task, tt.TasksetConfig]):
        def load(self) -> list[tt.Task]:
            return [tt.Task(f"say {i}", answer=str(i)) for i in range(4)]

    class PlainFeed:  # not a tt.Taskset at all: an object with an asyncio stream()
        def __init__(self) -> None:
            self.closed = False

        async def stream(self) -> AsyncIterator[tt.Task]:
            try:
                for i in range(100):
                    await asyncio.sleep(0.5)
                    yield tt.Task(f"say {i}", answer=str(i))
            finally:
                self.closed = True

    with trio.fail_after(LIMIT):
        static = await tt.run_eval(
            tt.aio.bridge_env(AioEnv(Static(), delay=0.0)), ctx(), config(tmp_path, run_name="s")
        )
        plain = PlainFeed()
        env = tt.aio.bridge_env(AioEnv(plain, delay=0.0))
        streamed = await tt.run_eval(env, ctx(), config(tmp_path, run_name="p", num_examples=3))
    assert [e.ok for e in static.episodes] == [True] * 4
    assert len(streamed.episodes) == 3
    assert plain.closed
    with pytest.raises(TravelError, match="top level"):
        EnvSpec.of(env)  # its wrapper cannot be named: refused before any server starts


async def test_system_prompt_head_views_and_config_class_apply_on_the_asyncio_path(
    autojump_clock: trio.testing.MockClock,
) -> None:
    @attrs.define
    class Config(tt.TasksetConfig):
        label: str = "x"

    class Labelled(tt.aio.AsyncioTaskset[tt.Task, Config]):
        async def stream(self) -> AsyncIterator[tt.Task]:
            for i in range(100):
                await asyncio.sleep(0)
                yield tt.Task(f"{self.config.label} {i}")

    assert type(Labelled().config) is Config
    taskset = Labelled(Config(system_prompt="be brief", label="q")).head(2)
    with trio.fail_after(LIMIT):
        async with taskset.channel() as tasks:  # no loop running: the channel opens its own
            got = [task async for task in tasks]
    assert [(t.prompt, t.system_prompt) for t in got] == [("q 0", "be brief"), ("q 1", "be brief")]


# --- the service pattern, serving() and its errors -------------------------------------------


async def test_service_pattern_over_a_bridged_env_for_a_bounded_number_of_episodes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    feed = QueueFeed()
    feed.put(*(f"say {i}" for i in range(50)))
    aio_env = AioEnv(feed, delay=1.0)
    env = tt.aio.bridge_env(aio_env)
    model = ctx()
    published: list[tt.Episode] = []

    async def run(task: tt.Task) -> tt.Episode:
        return await env.run_slot(tt.RunSlot(task), model)

    with trio.fail_after(LIMIT):
        async with (
            env.serving(),
            env.taskset.channel() as tasks,
            tt.as_completed(tasks, run, window=3) as results,
        ):
            async for _, episode in results:
                published.append(episode)
                if len(published) == 5:
                    break  # leaving cancels the runs in flight and closes the feed
    assert [e.ok for e in published] == [True] * 5
    assert aio_env.peak == 3
    assert aio_env.running == 0
    assert feed.stats.finally_runs == 1
    assert feed.stats.pulled <= 5 + 3  # what was published, plus at most a window in flight
    assert aio_env.log == ["serving: enter", "serving: exit"]


async def test_serving_passes_the_blocks_error_to_the_asyncio_manager_and_raises_it_bare(
    autojump_clock: trio.testing.MockClock,
) -> None:
    aio_env = AioEnv(QueueFeed())
    env = tt.aio.bridge_env(aio_env)
    with pytest.raises(KeyError, match="inside") as caught:
        async with env.serving():
            raise KeyError("inside")
    assert not isinstance(caught.value, BaseExceptionGroup)
    assert aio_env.log == ["serving: enter", "serving: exit with KeyError"]


async def test_a_failing_asyncio_serving_cancels_the_block_and_is_raised_itself(
    autojump_clock: trio.testing.MockClock,
) -> None:
    class Watchdog:
        """Its asyncio serving() runs a background task (in a TaskGroup) that fails."""

        taskset = QueueFeed()

        @contextlib.asynccontextmanager
        async def serving(self) -> AsyncIterator[None]:
            async def watch() -> None:
                await asyncio.sleep(3)
                raise Boom("the watchdog fired")

            async with asyncio.TaskGroup() as group:
                group.create_task(watch())
                yield

    env = tt.aio.bridge_env(Watchdog())
    began = trio.current_time()
    with trio.fail_after(LIMIT), pytest.raises(ExceptionGroup) as caught:
        async with env.serving():
            await trio.sleep_forever()
    # asyncio's own TaskGroup groups its error, as it would under asyncio: that group is the
    # exception, with no trio-asyncio layers around it.
    assert caught.value.subgroup(Boom) is not None
    assert [type(e) for e in caught.value.exceptions] == [Boom]
    assert trio.current_time() - began == pytest.approx(3.0)


async def test_failing_serving_enter_is_raised_itself() -> None:
    class Broken:
        taskset = QueueFeed()

        @contextlib.asynccontextmanager
        async def serving(self) -> AsyncIterator[None]:
            await asyncio.sleep(0)
            raise Boom("cannot start")
            yield  # pragma: no cover

    with pytest.raises(Boom, match="cannot start"):
        async with tt.aio.bridge_env(Broken()).serving():
            pytest.fail("the block must not run")  # pragma: no cover


class StuckRunSlotEnv:
    """An asyncio env whose own `run_slot` calls the model once, then hangs on
    `asyncio.sleep(hang)`: what the bridged env's rollout limits must cut."""

    def __init__(self, taskset: Any, *, hang: float = 100.0) -> None:
        self.taskset = taskset
        self.hang = hang
        self.calls = 0
        self.cancelled = 0

    async def run_slot(self, slot: tt.RunSlot[tt.Task], ctx: tt.aio.AsyncioModelContext) -> Any:
        self.calls += 1
        task = slot.task
        assert isinstance(task.prompt, str)
        reply = await ctx.chat([{"role": "user", "content": task.prompt}])
        try:
            await asyncio.sleep(self.hang)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return tt.Episode(
            id="own", task=tt.EpisodeTask(task.key, task.data), rollout=slot.rollout, ok=True,
            reward=1.0, completion=reply.content, attempts=1,
        )  # fmt: skip


async def _stuck_episode(
    limits: tt.RolloutLimits, *, caller: tt.RolloutLimits | None = None, **kwargs: Any
) -> tuple[tt.Episode, float, StuckRunSlotEnv]:
    aio_env = StuckRunSlotEnv(tt.Taskset(), **kwargs)
    env = tt.aio.bridge_env(aio_env, rollout_limits=limits)
    slot = tt.RunSlot(tt.Task("say 7", answer="7"), limits=caller)
    with trio.fail_after(LIMIT):
        async with env.serving():
            began = trio.current_time()
            episode = await env.run_slot(slot, ctx())
            took = trio.current_time() - began
    return episode, took, aio_env


async def test_an_asyncio_run_slot_is_cancelled_at_the_rollout_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    episode, took, aio_env = await _stuck_episode(tt.RolloutLimits(rollout_timeout=2.0))
    assert took == pytest.approx(2.0)
    assert aio_env.cancelled == 1  # the asyncio side saw the cancellation
    assert (episode.ok, [e.type for e in episode.errors]) == (False, ["RolloutTimeoutError"])
    assert episode.attempts == 1
    assert episode.timing["duration"] == pytest.approx(2.0)


async def test_an_asyncio_run_slot_that_stalls_is_a_stalled_error_retried_per_policy(
    autojump_clock: trio.testing.MockClock,
) -> None:
    aio_env = StuckRunSlotEnv(tt.Taskset())
    env = tt.aio.bridge_env(
        aio_env, rollout_limits=tt.RolloutLimits(stall_timeout=3.0),
        retries=tt.RetryPolicy(1, backoff=0.0),
    )  # fmt: skip
    with trio.fail_after(LIMIT):
        async with env.serving():
            began = trio.current_time()
            episode = await env.run_slot(tt.RunSlot(tt.Task("say 7", answer="7")), ctx())
    assert trio.current_time() - began == pytest.approx(6.0)  # two attempts of 3 s
    assert aio_env.calls == 2
    assert [(e.type, e.attempt) for e in episode.errors] == [("StalledError", 1),
                                                              ("StalledError", 2)]  # fmt: skip
    assert (episode.ok, episode.attempts) == (False, 2)


async def test_an_asyncio_run_slot_cut_at_its_working_limit_is_scored_on_its_last_reply(
    autojump_clock: trio.testing.MockClock,
) -> None:
    episode, took, _ = await _stuck_episode(tt.RolloutLimits(working_limit=2.0))
    assert took == pytest.approx(2.0)
    assert (episode.ok, episode.stop_reason, episode.turns) == (True, "working_limit", 1)
    assert "say 7" in (episode.completion or "")  # the echo model's reply
    assert episode.reward == 1.0  # answer_match on the last reply
    assert episode.id != "own"  # the bridge's record: the asyncio run_slot never returned


async def test_a_slots_own_limits_tighten_a_bridged_envs(
    autojump_clock: trio.testing.MockClock,
) -> None:
    episode, took, _ = await _stuck_episode(
        tt.RolloutLimits(rollout_timeout=50.0), caller=tt.RolloutLimits(rollout_timeout=4.0)
    )
    assert took == pytest.approx(4.0)
    assert [e.type for e in episode.errors] == ["RolloutTimeoutError"]


async def test_an_asyncio_run_slot_within_its_limits_returns_its_own_episode(
    autojump_clock: trio.testing.MockClock,
) -> None:
    episode, took, _ = await _stuck_episode(
        tt.RolloutLimits(rollout_timeout=5.0, working_limit=5.0, stall_timeout=5.0), hang=1.0
    )
    assert took == pytest.approx(1.0)
    assert (episode.id, episode.ok, episode.errors) == ("own", True, [])


async def test_run_slot_outside_serving_is_a_clear_error() -> None:
    feed = QueueFeed()
    env = tt.aio.bridge_env(AioEnv(feed))
    with pytest.raises(RuntimeError, match=r"env\.serving\(\)"):
        await env.run_slot(tt.RunSlot(tt.Task("say 0")), ctx())


def test_bridge_env_refuses_what_is_not_an_asyncio_env() -> None:
    with pytest.raises(TypeError, match="already a trio env"):
        tt.aio.bridge_env(tt.Env(QueueFeed()))
    with pytest.raises(TypeError, match="needs a `taskset`"):
        tt.aio.bridge_env(object())

    class Odd:
        taskset = 42

    with pytest.raises(TypeError, match=r"must be a tt\.Taskset"):
        tt.aio.bridge_env(Odd())
    with pytest.raises(TypeError, match="aio_env_class"):
        tt.aio.BridgedEnv()


def test_bridge_env_checks_signatures_before_any_run() -> None:
    class OneArgRunSlot:
        taskset = QueueFeed()

        async def run_slot(self, slot: tt.RunSlot[tt.Task]) -> tt.Episode:
            raise AssertionError("never called")

    class SyncRollout:
        taskset = QueueFeed()

        def rollout(self, task: tt.Task, ctx: Any) -> tuple[list[Any], str]:
            raise AssertionError("never called")

    class ServingWithArgs:
        taskset = QueueFeed()

        def serving(self, pool: int) -> Any:
            raise AssertionError("never called")

    class FeedNeedsArgs:
        def stream(self, source: str) -> Any:
            raise AssertionError("never called")

    class OddFeed:
        taskset = FeedNeedsArgs()

    with pytest.raises(TypeError, match=r"OneArgRunSlot\.run_slot\(slot\).*run_slot\(slot, ctx\)"):
        tt.aio.bridge_env(OneArgRunSlot())
    with pytest.raises(TypeError, match=r"SyncRollout\.rollout must be a coroutine function"):
        tt.aio.bridge_env(SyncRollout())
    with pytest.raises(TypeError, match=r"ServingWithArgs\.serving\(pool\).*serving\(\)"):
        tt.aio.bridge_env(ServingWithArgs())
    with pytest.raises(
        TypeError, match=r"OddFeed\.taskset\.stream\(source\) cannot be called as stream\(\)"
    ):
        tt.aio.bridge_env(OddFeed())


# --- trio-asyncio missing (Python 3.14) ------------------------------------------------------


def test_without_trio_asyncio_bridge_env_says_why_and_guest_mode_still_works(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "trio_asyncio", None)  # `import trio_asyncio` now fails
    with pytest.raises(tt.aio.TrioAsyncioUnavailable, match=r"trio-asyncio#160") as caught:
        tt.aio.bridge_env(AioEnv(QueueFeed()))
    message = str(caught.value)
    assert "Python 3.14" in message
    assert "tt.aio.run_stream" in message
    assert isinstance(caught.value, ImportError)

    async def double(n: int) -> int:
        await asyncio.sleep(0)
        return 2 * n

    async def numbers() -> AsyncIterator[int]:
        for n in range(4):
            yield n

    async def main() -> list[int]:
        return await tt.aio.run_stream(numbers(), double, window=2)

    assert asyncio.run(main()) == [0, 2, 4, 6]


def test_on_a_python_where_trio_asyncio_fails_to_import_the_package_still_works() -> None:
    """Simulates Python 3.14 (the import raises AttributeError) in a fresh interpreter."""
    script = textwrap.dedent(
        """
        import asyncio, sys

        class Python314:
            def find_spec(self, name, path=None, target=None):
                if name == "trio_asyncio" or name.startswith("trio_asyncio."):
                    raise AttributeError(
                        "module 'asyncio' has no attribute 'AbstractChildWatcher'")
                return None

        sys.meta_path.insert(0, Python314())
        import trio_tasksets as tt

        class Feed(tt.aio.AsyncioTaskset):
            async def stream(self):
                yield tt.Task("x")

        class AioEnv:
            taskset = Feed()

        try:
            tt.aio.bridge_env(AioEnv())
        except tt.aio.TrioAsyncioUnavailable as exc:
            print("refused:", exc)

        async def main():
            async def run(n):
                await asyncio.sleep(0)
                return n + 1
            async def source():
                for n in range(3):
                    yield n
            return await tt.aio.run_stream(source(), run, window=2)

        print("guest mode:", asyncio.run(main()))
        """
    )
    done = forkserver.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert "refused: trio_tasksets.aio.bridge_env needs trio-asyncio" in done.stdout
    assert "AbstractChildWatcher" in done.stdout
    assert "guest mode: [1, 2, 3]" in done.stdout


# --- by name: the command line and the served path (subprocesses, real clock) ----------------


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TT_PULL_LOG": str(tmp_path / "pulls.log")}
    return forkserver.run(
        [sys.executable, "-m", "trio_tasksets", "eval", *args, "-o", str(tmp_path / "out"),
         "--no-dashboard"],
        capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
    )  # fmt: skip


def _pulls(tmp_path: Path) -> int:
    return len((tmp_path / "pulls.log").read_text().splitlines())


def test_cli_runs_an_asyncio_feed_n3(tmp_path: Path) -> None:
    done = _cli(tmp_path, f"{AIO_ENV}:Questions", "-n", "3", "--run-name", "q")
    assert done.returncode == 0, done.stderr
    written = rows(tmp_path / "out" / "q")
    assert len(written) == 3
    assert all(row["ok"] for row in written)
    assert _pulls(tmp_path) == 3


# duplicates: the feed test's command with the bridged env: apart, each names what failed
def test_cli_runs_a_bridged_asyncio_env_n3(tmp_path: Path) -> None:
    done = _cli(tmp_path, f"{AIO_ENV}:QuestionsEnv", "-n", "3", "--run-name", "q")
    assert done.returncode == 0, done.stderr
    written = rows(tmp_path / "out" / "q")
    assert len(written) == 3
    assert all(row["ok"] for row in written)
    assert all("(asyncio rollout, pid" in row["completion"] for row in written)
    assert _pulls(tmp_path) == 3


async def test_served_path_rebuilds_the_bridged_env_by_name_in_a_server(tmp_path: Path) -> None:
    taskset_cls = resolve_taskset(f"{AIO_ENV}:Questions")  # loads the file as the CLI does
    env_cls = load_object(f"{AIO_ENV}:QuestionsEnv")
    env = env_cls(taskset_cls())
    spec = EnvSpec.of(env)
    assert spec.taskset.endswith("aio_env.py:Questions")
    assert spec.env_class is not None
    assert spec.env_class.endswith("aio_env.py:QuestionsEnv")
    with trio.fail_after(120):
        result = await tt.run_eval(env, ctx(), config(tmp_path, num_examples=3, serve=True))
    assert [e.ok for e in result.episodes] == [True] * 3
    pids = {e.completion.rsplit("pid ", 1)[1].rstrip(")") for e in result.episodes if e.completion}
    assert len(pids) == 1
    assert pids != {str(os.getpid())}


# --- asyncio_loop = "thread": a stdlib asyncio loop in a thread of its own --------------------
# These run on the real clock: the env's asyncio code is on its own loop and clock, so an
# autojump MockClock would see trio idle while the other thread works. They synchronise on
# events that cross the bridge, never on sleeps; every wait is bounded.


class GatedModel:
    """A trio model client: each call records itself, then waits for `release`."""

    def __init__(self) -> None:
        self.arrived = trio.Event()
        self.release = trio.Event()
        self.threads: set[int] = set()

    async def chat(
        self, messages: list[dict[str, Any]], *, model: str, sampling: tt.Sampling
    ) -> tt.Completion:
        self.threads.add(threading.get_ident())
        self.arrived.set()
        await self.release.wait()
        return tt.Completion(f"echo {messages[-1]['content']}")

    async def aclose(self) -> None:
        pass


class ThreadedAioEnv:
    """An asyncio env recording the threads its code runs in and how its rollouts end."""

    def __init__(self) -> None:
        self.taskset = tt.Taskset[tt.Task, tt.TasksetConfig]()
        self.threads: set[int] = set()
        self.log: list[str] = []

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[ThreadedAioEnv]:
        self.threads.add(threading.get_ident())
        self.log.append("enter")
        yield self
        self.threads.add(threading.get_ident())
        self.log.append("exit")

    async def rollout(
        self, task: tt.Task, ctx: tt.aio.AsyncioModelContext
    ) -> tuple[list[dict[str, Any]], str]:
        self.threads.add(threading.get_ident())
        asyncio.get_running_loop()  # a real running asyncio loop
        if task.prompt == "boom":
            raise Boom("boom")
        try:
            reply = await ctx.chat([{"role": "user", "content": task.prompt}])
        except asyncio.CancelledError:
            self.log.append("rollout cancelled")
            raise
        return [], reply.content


class ThreadedEnv(tt.aio.BridgedEnv[tt.Task]):
    aio_env_class = ThreadedAioEnv
    asyncio_loop = "thread"


async def test_a_thread_loop_runs_the_env_natively_in_its_own_thread_and_calls_back_to_trio() -> (
    None
):
    env = ThreadedEnv()
    model = GatedModel()
    model.release.set()
    with trio.fail_after(10):
        async with env.serving():
            ok = await env.run_slot(tt.RunSlot(tt.Task("hi")), tt.ModelContext(model, "m"))
            failed = await env.run_slot(tt.RunSlot(tt.Task("boom")), tt.ModelContext(model, "m"))
    aio_env = env.aio_env
    (loop_thread,) = aio_env.threads  # serving and rollouts: one thread, not trio's
    assert loop_thread != threading.get_ident()
    assert model.threads == {threading.get_ident()}  # ctx.chat ran in trio
    assert (ok.ok, ok.completion) == (True, "echo hi")
    assert (failed.ok, [e.type for e in failed.errors]) == (False, ["Boom"])
    assert aio_env.log == ["enter", "exit"]
    assert loop_thread not in {t.ident for t in threading.enumerate()}  # joined


async def test_a_thread_loop_cancellation_unwinds_the_asyncio_side_first() -> None:
    env = ThreadedEnv()
    model = GatedModel()  # never released: the rollout waits in ctx.chat
    with trio.fail_after(10):
        async with env.serving():
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    slot = tt.RunSlot(tt.Task("hold"))
                    nursery.start_soon(env.run_slot, slot, tt.ModelContext(model, "m"))
                    await model.arrived.wait()
                    scope.cancel()
            assert scope.cancelled_caught
            assert env.aio_env.log == ["enter", "rollout cancelled"]  # unwound before we go on
    assert env.aio_env.log == ["enter", "rollout cancelled", "exit"]


class FutureAioEnv(AioEnv):
    """`AioEnv` whose rollout first awaits a bare `asyncio.Future()`: asyncio's C code binds it
    to the thread's running loop, which in guest mode is the host's."""

    async def rollout(
        self, task: tt.Task, ctx: tt.aio.AsyncioModelContext
    ) -> tuple[list[dict[str, Any]], str]:
        future: asyncio.Future[None] = asyncio.Future()
        asyncio.get_running_loop().call_soon(future.set_result, None)
        await future
        return await super().rollout(task, ctx)


def test_a_bridged_env_under_an_asyncio_host_runs_on_the_host_loop(tmp_path: Path) -> None:
    """`tt.aio.run_eval` from `asyncio.run` (trio guest mode): the env's feed, serving() and
    rollouts run on the host's own loop (on a trio-asyncio loop inside the guest run, a bare
    `asyncio.Future()` would be "attached to a different loop"), and `ctx.chat` calls back
    into trio."""
    feed = QueueFeed()
    feed.put("say a", "say b", "say c")
    aio_env = FutureAioEnv(feed, delay=0.0)
    env = tt.aio.bridge_env(aio_env)

    async def main() -> tt.EvalResult:
        run = tt.aio.run_eval(env, ctx(), config(tmp_path, num_examples=3))
        return await asyncio.wait_for(run, 30)

    result = asyncio.run(main())
    assert [(r["ok"], r["completion"]) for r in rows(result.run_dir)] == [
        (True, "say a"),
        (True, "say b"),
        (True, "say c"),
    ]
    assert (feed.stats.pulled, feed.stats.finally_runs, feed.stats.foreign) == (3, 1, 0)
    assert aio_env.log == ["serving: enter", "serving: exit"]
