"""`run_worker`: the long-running service over a Redis stream, running the user's env."""

from __future__ import annotations

import functools
import math
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs
import trio

from .. import dashboard
from ..batching import take_ready
from ..drain import stop_on
from ..env import (
    DeadlineExceededError,
    Env,
    Episode,
    EpisodeError,
    EpisodeTask,
    RetryPolicy,
    RunSlot,
    WindowFeed,
    task_data,
    task_key,
)
from ..envspec import rebuild_task
from ..health import Health
from ..limits import EndpointLimits, observe_calls
from ..models import ModelContext
from ..models.openai import OpenAIClient
from ..runner import as_completed, pick_one
from ..window import AdaptiveBounds, AdaptiveWindow, Window, build_window, window_spec
from .entries import (
    Declaration,
    Delivery,
    EntryRef,
    EntryRefused,
    Log,
    MalformedEntry,
    plain_task,
    redact,
    stderr_log,
    taskset_arg,
)
from .feed import RedisStreamTaskset
from .results import Answer, RedisResults

COMMANDS = ("worker", "enqueue")
_LEAVE_WITHIN = 2.0  # seconds a stopping worker spends trying to leave the group
_COALESCE = 0.001  # seconds between two publishing round trips
_PUBLISH_BATCH = 10_000  # most episodes in one publishing transaction (a window's worth)


def default_consumer() -> str:
    """`<hostname>-<pid>`: unique per process, so a restarted worker is a new consumer."""
    return f"{socket.gethostname()}-{os.getpid()}"


@attrs.frozen
class WorkerConfig:
    """A worker's settings; each field is a `trio-tasksets worker` option."""

    feed: str  # --feed
    stream: str  # --stream
    group: str  # --group
    results: str  # --results
    consumer: str = attrs.field(factory=default_consumer)  # --consumer
    # -c/--max-concurrent: N, or AdaptiveBounds(min, start, max) for an AdaptiveWindow
    max_concurrent: int | AdaptiveBounds = 32
    claim_idle: float = 60.0  # --claim-idle
    grace: float = 30.0  # --grace
    retries: int = 0  # --retries
    dashboard: bool = True  # --no-dashboard
    block: float = 0.5  # the longest one read waits (and a stop waits for it)
    time_limit: float | None = None  # --time-limit: shut down (as on SIGTERM) after S seconds
    metrics_port: int | None = None  # --metrics-port: Prometheus text on 127.0.0.1 (0: any)


@attrs.define
class WorkerReport:
    """What a worker did: episodes published, the most entries it held at once (claimed and
    not yet acknowledged; never above the `window`'s size), and runs cancelled at the grace
    deadline. `entries` are those held now, by entry id."""

    window: Window
    entries: dict[str, EntryRef] = attrs.Factory(dict)
    peak: int = 0
    published: int = 0
    cancelled: int = 0

    @property
    def held(self) -> int:
        return len(self.entries)

    def claimed(self, entry: EntryRef) -> None:
        self.entries[entry.id] = entry
        self.peak = max(self.peak, self.held)

    def released(self, entry: EntryRef) -> None:
        self.entries.pop(entry.id, None)

    def room(self) -> int:
        """How many more entries the window takes now."""
        return self.window.size - self.held

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
    """A claimed entry and the task rebuilt from it (of the env's own task type)."""

    delivery: Delivery
    task: Any


class _Claimed:
    """The feed's claims as the runner's source, counting each entry it hands out."""

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
        self._report.claimed(claim.delivery.entry)
        self._progress.planned()
        return claim

    async def aclose(self) -> None:
        aclose = getattr(self._claims, "aclose", None)
        if aclose is not None:
            await aclose()


class Builder:
    """Turns a delivery into a `Claim` for `env` (None: the plain default env), refusing an
    entry declared for another env (`EntryRefused`, with the reason and the fix)."""

    def __init__(self, env: Env[Any] | None, ctx: ModelContext) -> None:
        self._env = env
        self._own = None if env is None else Declaration.of(env, ctx)
        self._verdicts: dict[str, str | None] = {}  # a declaration as written -> why refused

    def __call__(self, delivery: Delivery) -> Claim:
        entry = delivery.entry
        if delivery.declared is not None:
            reason = self._verdict(delivery.declared)
            if reason is not None:
                raise EntryRefused(f"entry {entry.id}: {reason}")
        if self._env is None:
            return Claim(delivery, plain_task(delivery))
        taskset_cls = type(self._env.taskset)
        try:
            task = rebuild_task(taskset_cls, delivery.key, delivery.data)
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
        return Claim(delivery, task)

    def _verdict(self, declared: str) -> str | None:
        if declared in self._verdicts:
            return self._verdicts[declared]
        try:
            theirs = Declaration.from_json(declared)
        except MalformedEntry as exc:
            reason: str | None = str(exc)
        else:
            if self._own is None:
                reason = (
                    f"declared for taskset {theirs.taskset}, but this worker runs no TASKSET: "
                    f"start the worker with TASKSET {taskset_arg(theirs.taskset)}"
                )
            else:
                reason = theirs.differs(self._own)
        if len(self._verdicts) < 64:  # a stream carries a few declarations, not thousands
            self._verdicts[declared] = reason
        return reason


async def run_worker(
    config: WorkerConfig,
    ctx: ModelContext,
    *,
    env: Env[Any] | None = None,
    window: Window | None = None,
    handle_signals: bool = True,
    log: Log | None = None,
    task_status: trio.TaskStatus[Callable[[str], None]] = trio.TASK_STATUS_IGNORED,
) -> WorkerReport:
    """Consume `config.stream` until shut down; return what was done (see the module docstring).

    Each entry runs as one slot of `env` (its rollout as the entry says), its task rebuilt
    from the entry's data as `type(env.taskset)` rebuilds it (`task_from_data`, else
    `tt.Task`), so a row equals the row an eval of `env` writes; an entry declared for another
    env is refused (dead-lettered with the reason). `env` None: a plain `Env` (the default
    reward, `config.retries`), which refuses every declared entry. With
    `nursery.start(run_worker, ...)` the started value is `shut_down(reason)`, which acts
    like a signal. Failures of the machinery (not of an episode, nor a Redis outage, which is
    retried) are raised.

    `window` (default: one made from `config.max_concurrent`) bounds the episodes in flight
    and the entries held; an `AdaptiveWindow` is fed by the episodes' model calls (their
    429s, 5xx and timeouts) and successes. `config.time_limit` shuts the worker down (as a
    signal does) after that many seconds.
    """
    say = log if log is not None else stderr_log(f"worker {config.consumer}")
    taskset = RedisStreamTaskset(
        config.feed, config.stream, config.group, config.consumer,
        claim_idle=config.claim_idle, block=config.block, log=say,
    )  # fmt: skip
    results = RedisResults(config.feed, config.results, log=say)
    build = Builder(env, ctx)
    if env is None:
        env = Env(taskset, retries=RetryPolicy(config.retries))
    if window is None:
        window = build_window(config.max_concurrent, parameter="max_concurrent")
    report = WorkerReport(window=window)
    limits = getattr(ctx.client, "limits", None)
    progress = dashboard.Progress(
        title=f"worker {config.consumer}", growing=True, window=window,
        connections=limits.connections if isinstance(limits, EndpointLimits) else None,
    )  # fmt: skip
    feed = WindowFeed(window)
    health = Health()
    progress.health = health.lag_text
    stats = getattr(ctx.client, "endpoint_stats", None)
    progress.endpoints = stats if callable(stats) else None  # many --base-url: a row each
    metrics = None
    if config.metrics_port is not None:
        from ..metrics import Metrics

        metrics = Metrics(health, window=window, endpoints=progress.endpoints)

    publisher = Publisher(results)

    async def run(claim: Claim) -> Episode:
        delivery = claim.delivery
        progress.started()
        health.started()
        try:
            with observe_calls(health), observe_calls(feed):
                slot = RunSlot(claim.task, delivery.rollout)
                episode = await run_by(env, slot, ctx, delivery.deadline)
            if metrics is not None:
                last = episode.errors[-1].type if episode.errors else None
                metrics.record(episode.ok, last, episode.usage)
            feed.ended(episode)
            meta: dict[str, str | int | float] = {
                "consumer": config.consumer,
                "in_flight": report.held,
            }
            await publisher.publish(Answer(episode, delivery.entry, delivery.reply_to, meta))
        except trio.Cancelled:
            report.cancelled += 1
            raise
        finally:
            health.finished()
            report.released(delivery.entry)
        report.published += 1
        progress.finished(episode.ok, episode.reward)
        return episode

    say(
        f"consuming {config.stream} (group {config.group}) at {redact(config.feed)}; window "
        f"{window_spec(window)}; results to {config.results}; claim idle "
        f"{config.claim_idle:g} s; grace {config.grace:g} s"
    )
    error: BaseException | None = None
    try:
        with trio.CancelScope() as everything:

            def shut_down(reason: str) -> None:
                if taskset.stopping:
                    say(f"{reason} again: cancelling {report.held} in flight now")
                    everything.cancel()
                    return
                say(f"{reason}: stopping; {report.held} in flight get {config.grace:g} s")
                taskset.stop()
                everything.deadline = min(everything.deadline, trio.current_time() + config.grace)

            limit = config.time_limit
            reached = "" if limit is None else f"--time-limit {limit:g}s reached"

            def on_stop(reason: str) -> None:
                if reason == reached and taskset.stopping:
                    return  # a signal came first: the time limit is no second one
                shut_down(reason)

            async with env.serving(), trio.open_nursery() as nursery:
                if handle_signals or limit is not None:
                    # Every signal shuts down (a second one cancels what runs), as does the
                    # time limit (as a first signal would).
                    await nursery.start(functools.partial(
                        stop_on, on_stop, signals=handle_signals, time_limit=limit,
                        time_reason=reached,
                    ))  # fmt: skip
                nursery.start_soon(_keep_alive, results, config, report)
                nursery.start_soon(publisher.loop)
                nursery.start_soon(health.probe)
                if isinstance(ctx.client, OpenAIClient) and ctx.client.has_engine_metrics:
                    # --engine-metrics: one endpoint's moves -c, many endpoints' each its own
                    nursery.start_soon(ctx.client.feed_engine_metrics, window)
                if metrics is not None:
                    from ..metrics import serve_metrics

                    bound = await nursery.start(serve_metrics, metrics, config.metrics_port)
                    say(f"metrics on http://127.0.0.1:{bound}/metrics")
                task_status.started(shut_down)
                room = report.room
                claims = _Claimed(taskset.claims(build, room=room), report, progress)
                async with (
                    dashboard.show(progress, live=config.dashboard),
                    as_completed(claims, run, window=report.window) as done,
                ):
                    async for _ in done:
                        pass
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        error = pick_one(group)
    finally:
        results.close()
    if error is not None:
        raise error  # outside the except block: the error keeps its own cause
    with trio.move_on_after(_LEAVE_WITHIN):
        await taskset.leave()  # only if it holds nothing: its name would be noise in the group
    say(report.line())
    return report


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
        message = "the entry's deadline passed while it ran: the episode was cancelled"
    else:
        message = f"the entry's deadline had passed {-left:.3g}s before a worker took it: not run"
    episode = slot.episode
    if episode is None:
        task = slot.task
        episode = Episode(uuid.uuid4().hex, EpisodeTask(task_key(task), task_data(task)),
                          slot.rollout)  # fmt: skip
    attempt = len(episode.errors) + 1  # the attempt it was in, or the first one
    episode.ok = False
    episode.errors.append(EpisodeError(DeadlineExceededError.__name__, message, attempt))
    episode.attempts = attempt if left > 0 else 0
    now = time.time()
    started = slot.started if slot.started is not None else now
    episode.timing = {"started": started, "finished": now, "duration": now - started}
    slot.episode, slot.done = episode, True
    return episode


class Publisher:
    """Publishes the episodes that finish together in one transaction: `publish` waits
    until its episode is published (its entry acknowledged), and `loop` (a task) sends
    whatever is waiting, one `RedisResults.publish_many` round trip at a time."""

    def __init__(self, results: RedisResults) -> None:
        self._results = results
        self._in, self._out = trio.open_memory_channel[tuple[Answer, trio.Event]](math.inf)

    async def publish(self, answer: Answer) -> None:
        done = trio.Event()
        self._in.send_nowait((answer, done))
        await done.wait()

    async def loop(self) -> None:
        async for first in self._out:
            batch = take_ready(self._out, first, _PUBLISH_BATCH)
            await self._results.publish_many([answer for answer, _ in batch])
            for _, done in batch:
                done.set()
            # Let a few more finish before the next round trip: episodes end one by one, and
            # one transaction for several costs less than one each (an episode waits 0.5 ms
            # more on average; an episode that finishes alone goes at once).
            await trio.sleep(_COALESCE)


async def _keep_alive(results: RedisResults, config: WorkerConfig, report: WorkerReport) -> None:
    """Every claim_idle / 3 s, reset the idle time of the entries held, so that no worker
    reclaims an entry whose episode is still running here, however long it runs."""
    while True:
        await trio.sleep(config.claim_idle / 3)
        await results.keep_alive(config.consumer, list(report.entries.values()))
