"""The distributed worker and the `worker` / `enqueue` commands (issue 6).

`run_worker` is the long-running service of docs/service.md over a Redis stream: it holds
`env.serving()`, reads `RedisStreamTaskset.channel()` through the windowed core
(`tt.as_completed`, window `-c`), runs each task with `env.run_slot`, and publishes each
finished episode with `RedisResults.publish` (result XADD + task XACK in one transaction)
*inside* the run, so an entry holds its window slot from the moment it is claimed until it is
acknowledged: this consumer never has more than `-c` entries pending. Every `claim_idle / 3`
seconds it resets the idle time of the entries it holds (`RedisResults.keep_alive`), so an
episode may run longer than `--claim-idle` without another worker reclaiming it; only the
entries of a worker that stopped answering for `--claim-idle` are reclaimed.

Shutdown (SIGTERM/SIGINT, or the `shut_down` callable handed to `nursery.start`): stop pulling
at once (a read in progress ends within `block`, and an entry it claimed still runs), let the
episodes in flight finish and publish within `--grace` seconds, then cancel the rest (their
entries stay pending for another worker to reclaim) and return; the command exits 0. A second
signal cancels at once.

This module imports without redis-py; `trio_tasksets.redis` is imported when a command runs.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import trio

from . import dashboard
from .env import Env, Episode, RetryPolicy, RunSlot
from .models import ModelContext
from .options import UsageError, add_model_options, model_context
from .runner import as_completed, pick_one

if TYPE_CHECKING:
    from .redis import EntryRef, Log, RedisResults, RedisTask

__all__ = ["COMMANDS", "WorkerConfig", "WorkerReport", "add_commands", "run_command", "run_worker"]

COMMANDS = ("worker", "enqueue")
_LEAVE_WITHIN = 2.0  # seconds a stopping worker spends trying to leave the group
_EXTRA = "pip install 'trio-tasksets[redis]'"


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
    max_concurrent: int = 32  # -c/--max-concurrent
    claim_idle: float = 60.0  # --claim-idle
    grace: float = 30.0  # --grace
    retries: int = 0  # --retries
    dashboard: bool = True  # --no-dashboard
    block: float = 0.5  # the longest one read waits (and a stop waits for it)


@attrs.define
class WorkerReport:
    """What a worker did: episodes published, the most entries it held at once (claimed and
    not yet acknowledged; never above `window`), and runs cancelled at the grace deadline.
    `entries` are those held now, by entry id."""

    window: int
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

    def line(self) -> str:
        return (
            f"stopped: published {self.published} episodes; peak in flight "
            f"{self.peak}/{self.window}; {self.cancelled} cancelled at the grace deadline "
            f"(left pending for another worker)"
        )


class _Claimed:
    """The taskset's channel as the runner's source, counting each entry it hands out."""

    def __init__(
        self,
        tasks: trio.abc.ReceiveChannel[RedisTask],
        report: WorkerReport,
        progress: dashboard.Progress,
    ) -> None:
        self._tasks = tasks
        self._report = report
        self._progress = progress

    def __aiter__(self) -> _Claimed:
        return self

    async def __anext__(self) -> RedisTask:
        try:
            task = await self._tasks.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None
        self._report.claimed(task.entry)
        self._progress.planned()
        return task


async def run_worker(
    config: WorkerConfig,
    ctx: ModelContext,
    *,
    handle_signals: bool = True,
    log: Log | None = None,
    task_status: trio.TaskStatus[Callable[[str], None]] = trio.TASK_STATUS_IGNORED,
) -> WorkerReport:
    """Consume `config.stream` until shut down; return what was done (see the module docstring).

    With `nursery.start(run_worker, ...)` the started value is `shut_down(reason)`, which acts
    like a signal. Failures of the machinery (not of an episode, nor a Redis outage, which is
    retried) are raised.
    """
    from .redis import RedisResults, RedisStreamTaskset, redact, stderr_log

    say = log if log is not None else stderr_log(f"worker {config.consumer}")
    taskset = RedisStreamTaskset(
        config.feed, config.stream, config.group, config.consumer,
        claim_idle=config.claim_idle, block=config.block, log=say,
    )  # fmt: skip
    results = RedisResults(config.feed, config.results, log=say)
    env: Env[RedisTask] = Env(taskset, retries=RetryPolicy(config.retries))
    report = WorkerReport(window=config.max_concurrent)
    progress = dashboard.Progress(title=f"worker {config.consumer}", growing=True)

    async def run(task: RedisTask) -> Episode:
        progress.started()
        try:
            episode = await env.run_slot(RunSlot(task), ctx)
            await results.publish(
                episode, task.entry, consumer=config.consumer, in_flight=report.held
            )
        except trio.Cancelled:
            report.cancelled += 1
            raise
        finally:
            report.released(task.entry)
        report.published += 1
        progress.finished(episode.ok, episode.reward)
        return episode

    say(
        f"consuming {config.stream} (group {config.group}) at {redact(config.feed)}; window "
        f"{config.max_concurrent}; results to {config.results}; claim idle "
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

            async with env.serving(), taskset.channel() as tasks, trio.open_nursery() as nursery:
                if handle_signals:
                    await nursery.start(_on_signals, shut_down)
                nursery.start_soon(_keep_alive, results, config, report)
                task_status.started(shut_down)
                async with (
                    dashboard.show(progress, live=config.dashboard),
                    as_completed(_Claimed(tasks, report, progress), run, window=report.window) as done,
                ):  # fmt: skip
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


async def _keep_alive(results: RedisResults, config: WorkerConfig, report: WorkerReport) -> None:
    """Every claim_idle / 3 s, reset the idle time of the entries held, so that no worker
    reclaims an entry whose episode is still running here, however long it runs."""
    while True:
        await trio.sleep(config.claim_idle / 3)
        await results.keep_alive(config.consumer, list(report.entries.values()))


async def _on_signals(
    shut_down: Callable[[str], None], *, task_status: trio.TaskStatus[None]
) -> None:
    import signal

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for signum in signals:
            shut_down(signal.Signals(signum).name)


# --- the command line -------------------------------------------------------------------------


def _feed_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--feed", required=True, metavar="URL", help="the Redis URL, e.g. redis://127.0.0.1:6379/0"
    )
    parser.add_argument("--stream", required=True, metavar="S", help="the stream of tasks")


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `worker` and `enqueue` subcommands to `trio-tasksets`' subparsers."""
    worker = subparsers.add_parser(
        "worker",
        help="consume a Redis stream of tasks until SIGTERM, publishing results",
        description="Consume a Redis stream through a consumer group for as long as it runs; "
        "publish each episode to --results and acknowledge its task in one transaction.",
    )
    _feed_options(worker)
    worker.add_argument("--group", required=True, metavar="G", help="the consumer group")
    worker.add_argument(
        "--consumer", default=None, metavar="NAME", help="this worker's name (default host-pid)"
    )
    worker.add_argument("--results", required=True, metavar="R", help="the results stream")
    worker.add_argument("-c", "--max-concurrent", type=int, default=32, metavar="C")
    worker.add_argument(
        "--claim-idle",
        type=float,
        default=60.0,
        metavar="S",
        help="reclaim a dead worker's entries once idle S seconds (default 60; live workers "
        "keep theirs fresh every S/3 s)",
    )
    worker.add_argument(
        "--grace", type=float, default=30.0, metavar="S", help="seconds for in-flight runs"
    )
    worker.add_argument("--retries", type=int, default=0, metavar="K")
    worker.add_argument("--no-dashboard", action="store_true", help="plain log lines")
    add_model_options(worker)
    worker.set_defaults(tt_subparser=worker)

    enqueue = subparsers.add_parser(
        "enqueue",
        help="push a taskset's tasks into a Redis stream",
        description="Push a taskset's tasks (a static taskset, or the next N of a stream) "
        "into a Redis stream, one entry per task.",
    )
    _feed_options(enqueue)
    enqueue.add_argument(
        "taskset", metavar="TASKSET", help="echo, echo-stream, file.py:Class or pkg.mod:Class"
    )
    enqueue.add_argument("-n", "--num-examples", type=int, default=None, metavar="N")
    enqueue.set_defaults(tt_subparser=enqueue)


def _need(condition: bool, message: str) -> None:
    if not condition:
        raise UsageError(message)


def _check_feed(args: argparse.Namespace) -> None:
    try:
        from .redis import check_url
    except ImportError as exc:
        raise UsageError(f"{args.command} needs redis-py ({exc}): {_EXTRA}") from None
    try:
        check_url(args.feed)
    except ValueError as exc:
        raise UsageError(f"--feed: {exc}") from None
    _need(bool(args.stream), "--stream must name a stream, e.g. --stream tasks")


def _worker_config(args: argparse.Namespace) -> WorkerConfig:
    _check_feed(args)
    _need(bool(args.group), "--group must name a consumer group, e.g. --group workers")
    _need(bool(args.results), "--results must name a stream, e.g. --results results")
    _need(args.results != args.stream, "--results must differ from --stream")
    _need(args.consumer is None or bool(args.consumer), "--consumer must not be empty")
    _need(args.max_concurrent >= 1, f"-c/--max-concurrent must be >= 1, got {args.max_concurrent}")
    _need(args.claim_idle > 0, f"--claim-idle must be > 0 seconds, got {args.claim_idle}")
    _need(args.grace >= 0, f"--grace must be >= 0 seconds, got {args.grace}")
    _need(args.retries >= 0, f"--retries must be >= 0, got {args.retries}")
    return WorkerConfig(
        feed=args.feed, stream=args.stream, group=args.group, results=args.results,
        consumer=args.consumer or default_consumer(), max_concurrent=args.max_concurrent,
        claim_idle=args.claim_idle, grace=args.grace, retries=args.retries,
        dashboard=not args.no_dashboard,
    )  # fmt: skip


async def _work(config: WorkerConfig, ctx: ModelContext) -> WorkerReport:
    try:
        return await run_worker(config, ctx)
    finally:
        with trio.CancelScope(shield=True):
            await ctx.client.aclose()


def _worker_command(args: argparse.Namespace) -> int:
    config = _worker_config(args)
    ctx = model_context(args)
    trio.run(_work, config, ctx)
    return 0


def _enqueue_command(args: argparse.Namespace) -> int:
    from . import cli

    _check_feed(args)
    n = args.num_examples
    _need(n is None or n >= 0, f"-n/--num-examples must be >= 0, got {n}")
    taskset = cli.resolve_taskset(args.taskset)()  # a bad TASKSET is a UsageError too
    if (taskset.streaming or taskset.INFINITE) and n is None:
        kind = "streams its tasks" if taskset.streaming else "is INFINITE"
        raise UsageError(
            f"taskset {type(taskset).__name__} {kind}: bound it with -n/--num-examples N"
        )
    _ping(args.feed)
    ids = trio.run(_enqueue, args.feed, args.stream, taskset, n)
    span = f" ({ids[0]} .. {ids[-1]})" if ids else ""
    print(f"enqueued {len(ids)} tasks to {args.stream}{span}")
    return 0


def _ping(url: str) -> None:
    import redis

    from .redis import redact

    client = redis.Redis.from_url(url, socket_connect_timeout=5.0, socket_timeout=5.0)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise UsageError(
            f"--feed {redact(url)}: cannot reach Redis ({type(exc).__name__}: {exc}); start "
            f"redis-server there or fix the URL"
        ) from None
    finally:
        client.close()


async def _enqueue(url: str, stream: str, taskset: Any, n: int | None) -> list[str]:
    from .redis import enqueue

    view = taskset.head(n) if n is not None else taskset
    if not view.streaming:
        return await enqueue(url, stream, list(view))
    async with view.channel() as tasks:
        return await enqueue(url, stream, tasks)


def run_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run `worker` or `enqueue` (`args.command`); a bad command line exits 2 with the
    command's usage and a message naming the flag, before any work."""
    try:
        if args.command == "worker":
            return _worker_command(args)
        return _enqueue_command(args)
    except UsageError as exc:
        usage = getattr(args, "tt_subparser", parser)
        usage.print_usage(sys.stderr)
        print(f"trio-tasksets {args.command}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print(f"trio-tasksets {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        print(f"trio-tasksets {args.command}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m trio_tasksets.distributed worker|enqueue ...` (same as `trio-tasksets`)."""
    parser = argparse.ArgumentParser(prog="trio-tasksets")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_commands(commands)
    return run_command(parser.parse_args(argv), parser)


if __name__ == "__main__":
    sys.exit(main())
