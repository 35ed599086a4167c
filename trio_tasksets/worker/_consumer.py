"""`consume`: the worker loop, over any `TaskQueue` (`trio_tasksets.worker`).

What every worker does, whatever feeds it (`trio-tasksets worker` is this loop over
`trio_tasksets.redis.RedisTaskQueue`):

* **Claims only what the window can run.** The runner (`tt.as_completed` over `window`)
  pulls only when a place is free; a pull claims as many entries as the window has free
  places (`room`), a group entry counting one place per rollout (from the first group seen:
  a read cannot know the size of what it has not read yet). An entry holds its place from
  its claim to its acknowledgement, so at most `window.size` entries are held at once, and
  a group's rollouts take further places of the same window (`fan_out`), so at most
  `window.size` rollouts run at once. (A group's idle place is not lent while its last
  rollouts finish, as an eval's is: that would let one more entry be claimed than the
  window holds.)
* **Runs each entry in the user's env.** Its task is rebuilt as the env's taskset class
  does (`task_from_data`, else `tt.Task`); an entry declared for another env (its
  `Declaration` differs) is refused with the reason and the fix, never scored with the
  wrong env. A slot runs under its entry's deadline (`run_by`), and under the rollout limits
  its declaration carries (the producer's env's, each tightening the worker's own:
  `RunSlot.limits`); a group entry runs its rollouts together (`run_group`, scored with the
  env's `score_group`) under them.
* **Publishes what finishes together together**: one `queue.publish` for whatever is ready,
  at most one per millisecond; a group's rows in one `Finished`. Every row carries the
  consumer's name as `worker`.
* **Keeps its entries alive** (`queue.keep_alive` every `queue.keep_alive_every` s).
* **Drains on a signal or its time limit**: stops claiming, gives the episodes in flight
  `grace` seconds, cancels the rest (their entries stay unacknowledged, for another worker),
  then closes the queue. A second signal cancels at once.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs
import trio

from .._core.adaptive import AdaptiveWindow, window_spec
from .._core.batching import take_ready
from .._core.drain import stop_on
from .._core.exceptions import ConfigError, EntryRefused, MalformedEntry
from .._core.health import Health
from .._core.limits import observe_calls
from .._core.runner import as_completed, pick_one
from .._core.tasksets import Task, Taskset, TasksetConfig
from .._core.window import Window
from .._env.env import (
    # duplicates: the env names the consumer uses, which the package also exports flat
    DeadlineExceededError,
    Env,
    Episode,
    EpisodeError,
    EpisodeTask,
    RetryPolicy,
    RolloutLimits,
    RunSlot,
    WindowFeed,
    new_id,
    task_data,
    task_key,
)
from .._env.groups import Group, cause_first, run_group
from .._env.spec import Declaration, rebuild_task, taskset_arg
from .._models import ModelContext, describe
from .._monitor import dashboard
from ._queue import Finished, TaskEntry, TaskQueue, plain_task

__all__ = ["WorkerReport", "consume", "run_by", "run_group_by"]

Log = Callable[[str], None]
_LEAVE_WITHIN = 2.0  # seconds a stopping worker spends closing its queue
_COALESCE = 0.001  # seconds between two publishing round trips
_PUBLISH_BATCH = 10_000  # most entries in one publish (a window's worth)


@attrs.define
class WorkerReport:
    """What a worker did: episodes published, the most entries it held at once (claimed and
    not yet acknowledged; never above the `window`'s size), and runs cancelled at the grace
    deadline. `entries` are those held now, by entry id."""

    window: Window
    entries: dict[str, TaskEntry] = attrs.Factory(dict)
    peak: int = 0
    published: int = 0
    cancelled: int = 0
    _places: int = 0  # the rollouts the entries held may run at once
    _unit: int = 1  # the most places one entry took so far (a group's size)

    @property
    def held(self) -> int:
        return len(self.entries)

    def claimed(self, entry: TaskEntry) -> None:
        self.entries[entry.id] = entry
        places = min(entry.rollouts, self.window.size)
        self._places += places
        self._unit = max(self._unit, places)
        self.peak = max(self.peak, self.held)

    def released(self, entry: TaskEntry) -> None:
        if self.entries.pop(entry.id, None) is not None:
            self._places -= min(entry.rollouts, self.window.size)

    def room(self) -> int:
        """How many more entries the window takes now: its free places, over the places
        the largest entry so far took (a group entry takes one per rollout)."""
        return max(0, self.window.size - self._places) // self._unit

    def line(self) -> str:
        window = self.window
        adapts = f" (adaptive {window_spec(window)})" if isinstance(window, AdaptiveWindow) else ""
        return (
            f"stopped: published {self.published} episodes; peak in flight "
            f"{self.peak}/{window.size}{adapts}; {self.cancelled} cancelled at the grace "
            f"deadline (left pending for another worker)"
        )


@attrs.frozen
class Claim:
    """A claimed entry, the task rebuilt from it (of the env's own task type), and the
    rollout limits its declaration carries (None: none)."""

    entry: TaskEntry
    task: Any
    limits: RolloutLimits | None = None

    def slot(self, rollout: int) -> RunSlot[Any]:
        """The slot of rollout `rollout` of the entry's task, under the entry's limits."""
        return RunSlot(self.task, rollout, limits=self.limits)


class _Claimed:
    """The queue's claims as the runner's source, counting each entry it hands out."""

    def __init__(
        self, claims: AsyncIterator[Claim], report: WorkerReport, progress: dashboard.Progress
    ) -> None:
        self._claims = claims
        self._report = report
        self._progress = progress

    def __aiter__(self) -> _Claimed:
        return self

    async def __anext__(self) -> Claim:
        claim = await self._claims.__anext__()
        self._report.claimed(claim.entry)
        self._progress.planned(claim.entry.rollouts)
        return claim

    async def aclose(self) -> None:
        aclose = getattr(self._claims, "aclose", None)
        if aclose is not None:
            await aclose()


class Builder:
    """Turns an entry into a `Claim` for `env` (None: the plain default env), refusing an
    entry declared for another env (`EntryRefused`, with the reason and the fix)."""

    def __init__(self, env: Env[Any] | None, ctx: ModelContext) -> None:
        self._env = env
        self._own = None if env is None else Declaration.of(env, ctx)
        # a declaration as written -> why refused (None: it is not), and its limits
        self._verdicts: dict[str, tuple[str | None, RolloutLimits | None]] = {}

    def __call__(self, entry: TaskEntry) -> Claim:
        limits = None
        if entry.declared is not None:
            reason, limits = self._verdict(entry.declared)
            if reason is not None:
                raise EntryRefused(f"entry {entry.id}: {reason}")
        if self._env is None:
            return Claim(entry, plain_task(entry), limits)
        taskset_cls = type(self._env.taskset)
        try:
            task = rebuild_task(taskset_cls, entry.key, entry.data)
        except Exception as exc:  # the taskset's own task_from_data: this entry only
            raise EntryRefused(
                f"entry {entry.id}: {taskset_cls.__name__} cannot build a task from its data "
                f"({type(exc).__name__}: {exc})"
            ) from None
        # The worker's own system prompt (`--system-prompt`) overrides the task's, as an
        # eval's taskset applies its prompt to each task it yields.
        prompt = getattr(self._env.taskset.config, "system_prompt", None)
        if prompt is not None and hasattr(task, "with_system_prompt"):
            task = task.with_system_prompt(prompt)
        return Claim(entry, task, limits)

    def _verdict(self, declared: str) -> tuple[str | None, RolloutLimits | None]:
        if declared in self._verdicts:
            return self._verdicts[declared]
        limits = None
        try:
            theirs = Declaration.from_json(declared)
        except MalformedEntry as exc:
            reason: str | None = str(exc)
        else:
            limits = theirs.limits
            if self._own is None:
                reason = (
                    f"declared for taskset {theirs.taskset}, but this worker runs no taskset: "
                    f"start the worker with taskset {taskset_arg(theirs.taskset)}"
                )
            else:
                reason = theirs.differs(self._own)
        if len(self._verdicts) < 64:  # a stream carries a few declarations, not thousands
            self._verdicts[declared] = (reason, limits)
        return reason, limits


class _Plain(Taskset[Task, TasksetConfig]):
    """The taskset of a worker given no env: its default reward; it holds no task."""

    def load(self) -> list[Task]:
        return []


async def consume(
    queue: TaskQueue,
    ctx: ModelContext,
    *,
    window: Window,
    env: Env[Any] | None = None,
    retries: int = 0,
    grace: float = 30.0,
    time_limit: float | None = None,
    live: bool = True,
    metrics_port: int | None = None,
    handle_signals: bool = True,
    log: Log,
    task_status: trio.TaskStatus[Callable[[str], None]] = trio.TASK_STATUS_IGNORED,
) -> WorkerReport:
    """Consume `queue` until shut down; return what was done (see the module docstring).

    Each entry runs as one slot of `env` (its rollout as the entry says), or as one group of
    its rollouts; its task rebuilt as `type(env.taskset)` rebuilds it, so a row equals the
    row an eval of `env` writes. `env` None: a plain `Env` (the default reward, `retries`),
    which refuses every declared entry. `window` bounds the rollouts in flight and the
    entries held; an `AdaptiveWindow` is fed by the episodes' model calls. With
    `nursery.start(consume, ...)` the started value is `shut_down(reason)`, which acts like
    a signal; `time_limit` seconds act like one too. `live`: the dashboard (else a log line
    every few seconds); `metrics_port`: Prometheus text on 127.0.0.1. Failures of the
    machinery (not an episode's, nor a transient one the queue retries) are raised.
    """
    if grace < 0:
        raise ConfigError(f"{{grace}} must be >= 0 seconds, got {grace!r}", parameter="grace")
    say = log
    consumer = queue.consumer
    build = Builder(env, ctx)
    if env is None:
        env = Env(_Plain(), retries=RetryPolicy(retries))
    report = WorkerReport(window=window)
    limits = describe(ctx.client).limits
    progress = dashboard.Progress(
        title=f"worker {consumer}", growing=True, window=window,
        connections=None if limits is None else limits.connections,
    )  # fmt: skip
    feed = WindowFeed(window)
    health = Health()
    progress.health = health.dashboard_text
    progress.endpoints = describe(ctx.client).endpoint_stats  # many --base-url: a row each
    metrics = None
    if metrics_port is not None:
        from .._monitor.metrics import Metrics

        metrics = Metrics(health, window=window, endpoints=progress.endpoints)
    publisher = _Publisher(queue)
    running_env = env

    async def rollout(slot: RunSlot[Any], deadline: float | None) -> Episode:
        progress.started()
        health.started()
        try:
            with observe_calls(health), observe_calls(feed):
                episode = await run_by(running_env, slot, ctx, deadline)
            feed.ended(episode)
        finally:
            health.finished()
        if metrics is not None:
            last = episode.errors[-1].type if episode.errors else None
            metrics.record(episode.ok, last, episode.usage)
        return episode

    async def run(claim: Claim) -> list[Episode]:
        entry = claim.entry
        try:
            if entry.group is None:
                episodes = [await rollout(claim.slot(entry.rollout), entry.deadline)]
            else:
                slots = [claim.slot(entry.rollout + i) for i in range(entry.rollouts)]
                group = Group(claim.task, slots, id=entry.group, advantage=entry.advantage)
                episodes = await run_group_by(running_env, group, entry.deadline, rollout)
            for episode in episodes:
                episode.worker = consumer
            meta: dict[str, str | int | float] = {"consumer": consumer, "in_flight": report.held}
            await publisher.publish(Finished(entry, episodes, meta))
        except trio.Cancelled:
            report.cancelled += 1
            raise
        finally:
            report.released(entry)
        report.published += len(episodes)
        for episode in cause_first(episodes):
            progress.finished(episode.ok, episode.reward)
        return episodes

    say(f"consuming {queue.describe()}; window {window_spec(window)}; grace {grace:g} s")
    error: BaseException | None = None
    try:
        with trio.CancelScope() as everything:

            def shut_down(reason: str) -> None:
                if queue.stopping:
                    say(f"{reason} again: cancelling {report.held} in flight now")
                    everything.cancel()
                    return
                say(f"{reason}: stopping; {report.held} in flight get {grace:g} s")
                queue.stop()
                everything.deadline = min(everything.deadline, trio.current_time() + grace)

            reached = "" if time_limit is None else f"time_limit {time_limit:g}s reached"

            def on_stop(reason: str) -> None:
                if reason == reached and queue.stopping:
                    return  # a signal came first: the time limit is no second one
                shut_down(reason)

            async with env.serving(), trio.open_nursery() as nursery:
                if handle_signals or time_limit is not None:
                    # Every signal shuts down (a second one cancels what runs), as does the
                    # time limit (as a first signal would).
                    await nursery.start(functools.partial(
                        stop_on, on_stop, signals=handle_signals, time_limit=time_limit,
                        time_reason=reached,
                    ))  # fmt: skip
                nursery.start_soon(_keep_alive, queue, report)
                nursery.start_soon(publisher.loop)
                nursery.start_soon(health.probe)
                if (engines := describe(ctx.client).engine_metrics) is not None:
                    # --engine-metrics: one endpoint's moves -c, many endpoints' each its own
                    nursery.start_soon(engines, window)
                if metrics is not None:
                    from .._monitor.metrics import serve_metrics

                    bound = await nursery.start(serve_metrics, metrics, metrics_port)
                    say(f"metrics on http://127.0.0.1:{bound}/metrics")
                task_status.started(shut_down)
                claims = _Claimed(queue.claims(build, room=report.room), report, progress)
                async with (
                    dashboard.show(progress, live=live),
                    as_completed(claims, run, window=report.window) as done,
                ):
                    async for _ in done:
                        pass
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        error = pick_one(group)
    if error is not None:
        with trio.CancelScope(shield=True), trio.move_on_after(_LEAVE_WITHIN):
            await queue.close()
        raise error  # outside the except block: the error keeps its own cause
    with trio.move_on_after(_LEAVE_WITHIN):
        await queue.close()  # e.g. leave the group if it holds nothing
    say(report.line())
    return report


def _timed_out(slot: RunSlot[Any], message: str, ran: bool) -> Episode:
    """`slot`'s episode (a blank one if it has none) ended by its entry's deadline."""
    episode = slot.episode
    if episode is None:
        task = slot.task
        episode = Episode(new_id(), EpisodeTask(task_key(task), task_data(task)),
                          slot.rollout)  # fmt: skip
    attempt = len(episode.errors) + 1  # the attempt it was in, or the first one
    episode.ok = False
    episode.errors.append(EpisodeError(DeadlineExceededError.__name__, message, attempt))
    episode.attempts = attempt if ran else 0
    now = time.time()
    started = slot.started if slot.started is not None else now
    episode.timing = {"started": started, "finished": now, "duration": now - started}
    slot.episode, slot.done = episode, True
    return episode


_CUT = "the entry's deadline passed while it ran: the episode was cancelled"


def _late(left: float) -> str:
    return f"the entry's deadline had passed {-left:.3g}s before a worker took it: not run"


async def run_by(
    env: Env[Any], slot: RunSlot[Any], ctx: ModelContext, deadline: float | None
) -> Episode:
    """`env.run_slot(slot, ctx)` under the time left until `deadline` (epoch seconds, an
    entry's `deadline`; None: no bound). A slot cut at its deadline, or taken after it (then
    not run), ends as a failed episode whose last error is a `DeadlineExceededError`."""
    if deadline is None:
        return await env.run_slot(slot, ctx)
    left = deadline - time.time()
    if left > 0:
        with trio.move_on_after(left):
            return await env.run_slot(slot, ctx)
        return _timed_out(slot, _CUT, ran=True)
    return _timed_out(slot, _late(left), ran=False)


async def run_group_by(
    env: Env[Any],
    group: Group,
    deadline: float | None,
    rollout: Callable[[RunSlot[Any], float | None], Any],
) -> list[Episode]:
    """`run_group(env, group, ...)` (each rollout `rollout(slot, deadline)`, e.g. `run_by`)
    under the time left until `deadline`. A group cut at its deadline, or taken after it (then
    not run), comes back as one failed episode per rollout, each ending in a
    `DeadlineExceededError` (a rollout that had finished keeps its row, marked so)."""

    async def one(slot: RunSlot[Any]) -> Episode:
        return await rollout(slot, None)  # type: ignore[no-any-return]

    if deadline is None:
        return await run_group(env, group, one)
    left = deadline - time.time()
    if left > 0:
        with trio.move_on_after(left):
            return await run_group(env, group, one)
        episodes = [_timed_out(slot, _CUT, ran=True) for slot in group.slots]
    else:
        episodes = [_timed_out(slot, _late(left), ran=False) for slot in group.slots]
    for episode in episodes:
        episode.group = group.id
    return episodes


class _Publisher:
    """Publishes the entries that finish together in one `queue.publish`: `publish` waits
    until its entry is published (acknowledged), and `loop` (a task) sends whatever is
    waiting, one call at a time."""

    def __init__(self, queue: TaskQueue) -> None:
        self._queue = queue
        self._in, self._out = trio.open_memory_channel[tuple[Finished, trio.Event]](math.inf)

    async def publish(self, finished: Finished) -> None:
        done = trio.Event()
        self._in.send_nowait((finished, done))
        await done.wait()

    async def loop(self) -> None:
        async for first in self._out:
            batch = take_ready(self._out, first, _PUBLISH_BATCH)
            await self._queue.publish([finished for finished, _ in batch])
            for _, done in batch:
                done.set()
            # Let a few more finish before the next round trip: episodes end one by one, and
            # one transaction for several costs less than one each (an episode waits 0.5 ms
            # more on average; an episode that finishes alone goes at once).
            await trio.sleep(_COALESCE)


async def _keep_alive(queue: TaskQueue, report: WorkerReport) -> None:
    """Every `queue.keep_alive_every` s, keep the entries held alive, so that no worker
    takes over an entry whose episode is still running here, however long it runs."""
    every = queue.keep_alive_every
    if every == math.inf:
        return
    while True:
        await trio.sleep(every)
        await queue.keep_alive(list(report.entries.values()))
