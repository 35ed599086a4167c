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
from .._core.exceptions import ConfigError
from .._core.window import Window
from .._env.env import Env
from .._models import ModelContext
from ..worker import WorkerReport, consume, run_by
from ._entries import Log, stderr_log
from ._link import redis_url
from ._queue import RedisTaskQueue

__all__ = ["COMMANDS", "WorkerConfig", "WorkerReport", "default_consumer", "run_by", "run_worker"]

COMMANDS = ("worker", "enqueue")


def default_consumer() -> str:
    """`<hostname>-<pid>`: unique per process, so a restarted worker is a new consumer."""
    return f"{socket.gethostname()}-{os.getpid()}"


def _redis_url(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    redis_url(value, attribute.name)


def _name(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(
            f"{{{attribute.name}}} must be a non-empty name, got {value!r}",
            parameter=attribute.name,
        )


def _window(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    build_window(value, parameter=attribute.name)  # a WindowArgumentError naming it


def _seconds(
    minimum: float, *, strict: bool
) -> Callable[[object, attrs.Attribute[Any], Any], None]:
    rule = f"> {minimum:g}" if strict else f">= {minimum:g}"

    def check(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None and attribute.default is None:
            return
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or not (value > minimum if strict else value >= minimum):
            raise ConfigError(
                f"{{{attribute.name}}} must be a number of seconds {rule}, got {value!r}",
                parameter=attribute.name,
            )

    return check


def _count(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(
            f"{{{attribute.name}}} must be an int >= 0, got {value!r}", parameter=attribute.name
        )


def _port(instance: object, attribute: attrs.Attribute[int | None], value: int | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ConfigError(
            f"{{{attribute.name}}} must be a port number 0-65535 (0: a free one), got {value!r}",
            parameter=attribute.name,
        )


@attrs.frozen
class WorkerConfig:
    """A worker's settings, valid once built: a bad one raises a `ConfigError` naming its
    field (each field is a `trio-tasksets worker` option of the same name)."""

    feed: str = attrs.field(validator=_redis_url)  # the Redis URL
    stream: str = attrs.field(validator=_name)  # the stream of tasks
    group: str = attrs.field(validator=_name)  # the consumer group
    results: str = attrs.field(validator=_name)  # results of entries that name no stream
    consumer: str = attrs.field(factory=default_consumer, validator=_name)
    # N, or AdaptiveBounds(min, start, max) for an AdaptiveWindow
    max_concurrent: int | AdaptiveBounds = attrs.field(default=32, validator=_window)
    claim_idle: float = attrs.field(default=60.0, validator=_seconds(0, strict=True))
    grace: float = attrs.field(default=30.0, validator=_seconds(0, strict=False))
    retries: int = attrs.field(default=0, validator=_count)
    dashboard: bool = True  # else a log line every few seconds
    # the longest one read waits (and a stop waits for it)
    block: float = attrs.field(default=0.5, validator=_seconds(0, strict=True))
    # shut down (as on SIGTERM) after S seconds
    time_limit: float | None = attrs.field(default=None, validator=_seconds(0, strict=True))
    # Prometheus text on 127.0.0.1 (0: any free port)
    metrics_port: int | None = attrs.field(default=None, validator=_port)

    def __attrs_post_init__(self) -> None:
        if self.results == self.stream:
            raise ConfigError(
                f"{{results}} must differ from {{stream}} (both {self.stream!r})",
                parameter=("results", "stream"),
            )


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
