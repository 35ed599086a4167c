"""`run_worker`: the long-running service over a Redis stream, running the user's env.

It is the worker loop of every feed (`trio_tasksets.worker.consume`) over the Redis task
queue (`trio_tasksets.redis.RedisTaskQueue`), set up from a `WorkerConfig`."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import attrs
import trio

from .._core.adaptive import AdaptiveBounds, build_window
from .._core.window import Window
from .._env.env import Env
from .._models import ModelContext
from ..worker import WorkerReport, consume, run_by
from ._entries import Log, stderr_log
from ._queue import RedisTaskQueue

__all__ = ["COMMANDS", "WorkerConfig", "WorkerReport", "default_consumer", "run_by", "run_worker"]

COMMANDS = ("worker", "enqueue")


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

    Each entry runs as one slot of `env` (its rollout as the entry says; a group entry as
    one group of its rollouts, scored by `env.score_group`), its task rebuilt
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
    queue = RedisTaskQueue(
        config.feed, config.stream, config.group, config.consumer, config.results,
        claim_idle=config.claim_idle, block=config.block, log=say,
    )  # fmt: skip
    if window is None:
        window = build_window(config.max_concurrent, parameter="max_concurrent")
    return await consume(
        queue, ctx, window=window, env=env, retries=config.retries, grace=config.grace,
        time_limit=config.time_limit, live=config.dashboard, metrics_port=config.metrics_port,
        handle_signals=handle_signals, log=say, task_status=task_status,
    )  # fmt: skip
