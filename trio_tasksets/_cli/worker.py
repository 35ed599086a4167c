"""`trio-tasksets worker` (consume a Redis stream) and `trio-tasksets enqueue` (feed one).

These import the Redis client (hiredis, `pip install 'trio-tasksets[redis]'`) only when they
run."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

import attrs
import trio

from .._core.adaptive import build_window
from .._core.exceptions import ConfigError
from .._core.tasksets import Taskset
from .._core.window import Window
from .._env.env import Env
from .._eval.config import check_metrics_port
from .._models import ModelContext
from .env_options import (
    add_env_options,
    add_taskset_options,
    build_env,
    build_taskset,
    check_retry_flags,
    env_options,
    taskset_options,
)
from .heap import settle_heap
from .model_options import add_model_options, check_engine_metrics, model_context, model_options
from .options import (
    PARAMETER_FLAGS,
    HelpFormatter,
    UsageError,
    add_flags,
    add_metrics_option,
    add_time_limit_option,
    add_window_option,
    window_arg,
)

if TYPE_CHECKING:
    from ..redis._worker import WorkerConfig, WorkerReport
    from .options import Commands

_EXTRA = "pip install 'trio-tasksets[redis]'"


# --- the command line -------------------------------------------------------------------------


def _feed_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--feed", required=True, metavar="URL", help="the Redis URL, e.g. redis://127.0.0.1:6379/0"
    )
    add_flags(parser, {
        "--stream S": "the stream of tasks (the one `eval --via` writes by default)",
    }, default="tasks")  # fmt: skip


def add_parsers(subparsers: Commands) -> None:
    """Add `worker` and `enqueue` to the CLI's subcommands."""
    worker = subparsers.add_parser(
        "worker",
        help="consume a Redis stream of tasks until SIGTERM, publishing results",
        description="Consume a Redis stream through a consumer group for as long as it runs; "
        "publish each episode to --results and acknowledge its task in one transaction. "
        "TASKSET, if given, scores the stream's tasks (its reward, system prompt, env class).",
        formatter_class=HelpFormatter,
    )
    add_env_options(worker, optional_taskset=True)
    _feed_options(worker)
    worker.add_argument("--group", default="workers", metavar="G", help="the consumer group")
    add_flags(worker, {"--consumer NAME": "this worker's name (default host-pid)"})
    add_flags(worker, {
        "--results R": "the results stream of entries that name none (an `eval --via`'s name "
        "their own)",
    }, default="results")  # fmt: skip
    add_window_option(worker, help="the window: most episodes in flight, and most entries held")
    add_flags(worker, {
        "--claim-idle S": "reclaim a dead worker's entries once idle S seconds (default 60; "
        "live workers keep theirs fresh every S/3 s)",
    }, type=float, default=60.0)  # fmt: skip
    add_flags(worker, {"--grace S": "seconds for in-flight runs"}, type=float, default=30.0)
    add_time_limit_option(
        worker, what="shut down as on SIGTERM (in-flight runs get --grace seconds)"
    )
    worker.add_argument("--no-dashboard", action="store_true", help="plain log lines")
    add_metrics_option(worker)
    add_model_options(worker)

    enqueue = subparsers.add_parser(
        "enqueue",
        help="push a taskset's tasks into a Redis stream",
        description="Push a taskset's tasks (a static taskset, or the next N of a stream) "
        "into a Redis stream, one entry per task.",
        formatter_class=HelpFormatter,
    )
    _feed_options(enqueue)
    add_taskset_options(enqueue)
    enqueue.add_argument(
        "-n", "--num-examples", type=int, default=None, metavar="N",
        help="push N tasks; required on a streaming taskset (default: every task)",
    )  # fmt: skip


# The worker's settings (`WorkerConfig`'s fields), as its command line spells them.
FLAGS = {
    **PARAMETER_FLAGS,
    "feed": "--feed",
    "stream": "--stream",
    "group": "--group",
    "results": "--results",
    "consumer": "--consumer",
    "claim_idle": "--claim-idle",
    "grace": "--grace",
    "retries": "--retries",
    "time_limit": "--time-limit",
    "metrics_port": "--metrics-port",
    "num_examples": "-n/--num-examples",
}


def _usage(error: ConfigError) -> UsageError:
    return UsageError(error.spelled(FLAGS), fix=error.spelled_fix(FLAGS))


def _import_redis(command: str) -> None:
    """The Redis client's modules import, or a `UsageError` saying how to install them."""
    try:
        import hiredis  # noqa: F401
    except ImportError as exc:
        raise UsageError(f"{command} needs hiredis ({exc})", fix=_EXTRA) from None


def _check_url(feed: str) -> None:
    from ..redis._entries import check_url

    try:
        check_url(feed)
    except ValueError as exc:
        raise UsageError(f"--feed: {exc}") from None


@attrs.frozen
class WorkerCommand:
    """What `trio-tasksets worker` runs, built from its command line and checked."""

    config: WorkerConfig
    window: Window  # the window `config.max_concurrent` names
    env: Env[Any]
    ctx: ModelContext
    own_process: bool  # the CLI's own process: `settle_heap` may freeze its set-up


def worker_command(args: argparse.Namespace) -> WorkerCommand:
    """The worker's objects from its command line; a bad value is a `UsageError` naming its
    flag (the only function of `worker` that reads `args`)."""
    _import_redis(args.command)
    _check_url(args.feed)
    from ..redis._worker import WorkerConfig, default_consumer

    try:
        config = WorkerConfig(
            feed=args.feed, stream=args.stream, group=args.group, results=args.results,
            consumer=default_consumer() if args.consumer is None else args.consumer,
            max_concurrent=window_arg(args), claim_idle=args.claim_idle, grace=args.grace,
            retries=args.retries, dashboard=not args.no_dashboard, time_limit=args.time_limit,
            metrics_port=args.metrics_port,
        )  # fmt: skip
        check_metrics_port(config.metrics_port)
        window = build_window(config.max_concurrent, parameter="max_concurrent")
    except ConfigError as exc:
        raise _usage(exc) from None
    given, model = env_options(args), model_options(args)
    check_engine_metrics(model, args.max_concurrent)
    check_retry_flags(given)
    env = build_env(given, endpoint=model.base_url is not None)
    ctx = model_context(model)
    return WorkerCommand(config, window, env, ctx, own_process=args.tt_own_process)


async def _work(command: WorkerCommand) -> WorkerReport:
    from ..redis._link import login_refused, server_run_id, unusable
    from ..redis._resp import OddServer, RedisError, ReplyError
    from ..redis._worker import run_worker

    config, ctx = command.config, command.ctx
    try:
        try:
            await server_run_id(config.feed)  # an odd server is named before any work
        except OddServer:
            raise
        except RedisError:
            pass  # unreachable, or a refused login: run_worker waits, or says so
        return await run_worker(config, ctx, env=command.env, window=command.window)
    except OddServer as exc:
        message, fix = unusable("--feed", config.feed, exc)
        raise UsageError(message, fix=fix) from None
    except ReplyError as exc:
        if login_refused(exc):
            message, fix = unusable("--feed", config.feed, exc)
            raise UsageError(message, fix=fix) from None
        raise
    finally:
        with trio.CancelScope(shield=True):
            await ctx.client.aclose()


def run_worker_command(args: argparse.Namespace) -> int:
    """`trio-tasksets worker`: exit 0 once shut down by a signal."""
    command = worker_command(args)
    settle_heap(command.own_process)  # the set-up is done: full collections no longer walk it
    trio.run(_work, command)
    return 0


@attrs.frozen
class EnqueueCommand:
    """What `trio-tasksets enqueue` pushes, built from its command line and checked."""

    feed: str
    stream: str
    taskset: Taskset[Any, Any]
    n: int | None  # None: every task of a static taskset


def enqueue_command(args: argparse.Namespace) -> EnqueueCommand:
    """The enqueue's objects from its command line; a bad value is a `UsageError` naming its
    flag (the only function of `enqueue` that reads `args`)."""
    _import_redis(args.command)
    _check_url(args.feed)
    if not args.stream:
        raise UsageError("--stream must name a stream, e.g. --stream tasks")
    n: int | None = args.num_examples
    if n is not None and n < 0:
        raise UsageError(f"-n/--num-examples must be >= 0, got {n}")
    taskset, _env_class = build_taskset(taskset_options(args))  # a bad one: a UsageError too
    if (taskset.streaming or taskset.INFINITE) and n is None:
        kind = "streams its tasks" if taskset.streaming else "is INFINITE"
        raise UsageError(
            f"taskset {type(taskset).__name__} {kind}: bound it with -n/--num-examples N"
        )
    return EnqueueCommand(args.feed, args.stream, taskset, n)


def run_enqueue(args: argparse.Namespace) -> int:
    """`trio-tasksets enqueue`: print how many tasks went in."""
    command = enqueue_command(args)
    _ping(command.feed)
    ids = trio.run(_enqueue, command)
    span = f" ({ids[0]} .. {ids[-1]})" if ids else ""
    print(f"enqueued {len(ids)} tasks to {command.stream}{span}")
    return 0


def _ping(url: str) -> None:
    from ..redis._link import server_run_id, unusable
    from ..redis._resp import RedisError

    try:
        trio.run(server_run_id, url)
    except RedisError as exc:
        message, fix = unusable("--feed", url, exc)
        raise UsageError(message, fix=fix) from None


async def _enqueue(command: EnqueueCommand) -> list[str]:
    from ..redis._entries import Declaration
    from ..redis._results import enqueue

    url, stream, taskset, n = command.feed, command.stream, command.taskset, command.n
    # The taskset class only, not its -a config: workers may run the class with their own.
    declare = Declaration(Declaration.of_taskset(taskset).taskset)
    any_data = getattr(type(taskset), "task_from_data", None) is not None
    view = taskset.head(n) if n is not None else taskset
    if not view.streaming:
        return await enqueue(url, stream, list(view), declare=declare, any_data=any_data)
    async with view.channel() as tasks:
        return await enqueue(url, stream, tasks, declare=declare, any_data=any_data)
