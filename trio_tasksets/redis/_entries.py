"""Tasks as Redis stream entries, what produced them (`Declaration`), and the feed URL.

A task entry has the field `task` (the JSON of `{"key", "data"}`) and, optionally:
`env` (a `Declaration`: the taskset, its config, the env class, the model a producer meant
the task for; a worker running another env refuses the entry), `rollout` (the slot's
rollout, default 0), `reply_to` (the stream its result goes to, instead of the worker's
`--results`) and `deadline` (epoch seconds: the producer's deadline; a worker runs the slot
under the time left, and answers an entry taken after it as timed out, without running it).
A group entry (`eval --via --group`: a task's rollouts, run and scored as one unit) adds `group` (the id its rows share) and
`rollouts` (how many: `rollout` .. `rollout + rollouts - 1`), and `advantage` (how the
group's advantages are computed when the env has no `score_group` of its own: `mean`,
`std` or `none`; default `mean`); one worker runs them as a group and answers with one
result entry whose `rows` field holds every row of the group.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs
import orjson
import trio

from .._core.exceptions import ConfigError
from .._core.tasksets import Task, Taskset
from .._env.env import task_data, task_key
from .._env.groups import ADVANTAGES, Advantage
from .._env.spec import TASK_FIELDS, Declaration, rebuild_task, taskset_arg
from .._transport import redact_url
from ..worker import EntryRefused, MalformedEntry
from ._resp import Address

__all__ = [
    "ADVANTAGE_FIELD",
    "DEADLINE_FIELD",
    "ENV_FIELD",
    "GROUP_FIELD",
    "REFUSED_FIELD",
    "REPLY_FIELD",
    "ROLLOUTS_FIELD",
    "ROLLOUT_FIELD",
    "ROWS_FIELD",
    "TASK_FIELD",
    "Declaration",
    "Delivery",
    "EntryRef",
    "EntryRefused",
    "Fields",
    "Log",
    "MalformedEntry",
    "RedisTask",
    "check_url",
    "deadline_field",
    "decode_entry",
    "decode_task",
    "encode_task",
    "is_nogroup",
    "plain_task",
    "redact",
    "stderr_log",
    "taskset_arg",
]

T = TypeVar("T")
Log = Callable[[str], None]
Fields = Mapping[str, str]

TASK_FIELD = "task"
"""The entry field holding a task: the JSON of `{"key": ..., "data": {...}}`."""
ENV_FIELD = "env"
"""The entry field holding the producer's `Declaration` (JSON), if it made one."""
ROLLOUT_FIELD = "rollout"
"""The entry field holding the slot's rollout number (default 0)."""
REPLY_FIELD = "reply_to"
"""The entry field naming the stream the task's result goes to (default: the worker's)."""
DEADLINE_FIELD = "deadline"
"""The entry field holding the slot's deadline, in epoch seconds (`time.time()`), if any."""
GROUP_FIELD = "group"
"""The entry field holding a group's id: the entry is a group of `rollouts` rollouts."""
ROLLOUTS_FIELD = "rollouts"
"""The entry field holding a group's size (with `group`; default 1)."""
ADVANTAGE_FIELD = "advantage"
"""The entry field saying how a group's advantages are computed (with `group`; default
`mean`): the eval's `advantage`, for an env without a `score_group` of its own."""
ROWS_FIELD = "rows"
"""In a result entry: a group's rows (a JSON list, in rollout order), instead of `row`."""
REFUSED_FIELD = "refused"
"""In a reply stream: a worker refused the entry named by `entry`, for this reason."""


# --- tasks as entries ------------------------------------------------------------------------


@attrs.frozen
class EntryRef:
    """Where a task entry lives: its stream, the consumer group that delivered it, its id."""

    stream: str
    group: str
    id: str


@attrs.frozen
class RedisTask(Task):
    """A `tt.Task` read from a stream, plus `entry`: what to acknowledge once it is done."""

    entry: EntryRef = attrs.field(kw_only=True, eq=False)


@attrs.frozen
class Delivery:
    """One claimed entry, decoded: the task's `key` and `data`, the slot's `rollout`, where
    its result goes (`reply_to`, None: the worker's results stream) and the producer's
    declaration as written (`declared`, None: the producer made none)."""

    entry: EntryRef
    key: str
    data: dict[str, Any]
    rollout: int = 0
    reply_to: str | None = None
    declared: str | None = None
    deadline: float | None = None  # epoch seconds (`time.time()`), None: no deadline
    group: str | None = None  # a group's id: the entry runs `rollouts` rollouts as one group
    rollouts: int = 1
    advantage: Advantage = "mean"  # a group's advantages, without a score_group of the env's


def encode_task(task: Any, *, any_data: bool = False) -> bytes:
    """The `task` field of an entry for `task`: JSON of its `key` and `data`.

    `data` must hold `prompt` and nothing beyond tt.Task's own fields (`prompt`, `answer`,
    `info`, `system_prompt`), all JSON-serialisable; with `any_data` (the taskset rebuilds its
    tasks with `task_from_data`) any JSON object will do. Anything else raises TypeError
    naming the task, before anything is written.
    """
    key = task_key(task)
    data = task_data(task)
    if not any_data:
        extra = sorted(set(data) - TASK_FIELDS)
        if "prompt" not in data or extra:
            detail = f"fields beyond tt.Task's: {extra}" if extra else "no prompt"
            raise TypeError(
                f"task {key!r} ({type(task).__name__}) cannot travel through a stream: its data "
                f"has {detail}; only tt.Task-shaped tasks (prompt, answer, info, system_prompt) "
                f"can, unless the taskset class defines task_from_data(data, key)"
            )
    try:
        return orjson.dumps({"key": key, "data": data})
    except TypeError as exc:
        raise TypeError(f"task {key!r}: its data is not JSON-serialisable ({exc})") from None


def decode_entry(entry: EntryRef, fields: Fields | None) -> Delivery:
    """What an entry holds; raises MalformedEntry (saying why) if it holds no task."""
    if not fields:
        raise MalformedEntry(f"entry {entry.id} has no fields (deleted from the stream?)")
    raw = fields.get(TASK_FIELD)
    if raw is None:
        raise MalformedEntry(f"entry {entry.id} has no {TASK_FIELD!r} field: {sorted(fields)}")
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise MalformedEntry(f"entry {entry.id}: {TASK_FIELD!r} is not JSON ({exc})") from None
    key = value.get("key") if isinstance(value, dict) else None
    data = value.get("data") if isinstance(value, dict) else None
    if not isinstance(key, str) or not isinstance(data, dict):
        raise MalformedEntry(f"entry {entry.id}: {TASK_FIELD!r} is not a {{key, data}} task")
    rollout = fields.get(ROLLOUT_FIELD, "0")
    if not rollout.isdigit():  # an ASCII count: no sign, no spaces
        raise MalformedEntry(f"entry {entry.id}: {ROLLOUT_FIELD!r} is not a count: {rollout!r}")
    reply_to = fields.get(REPLY_FIELD)
    if reply_to is not None and (not reply_to or reply_to == entry.stream):
        raise MalformedEntry(f"entry {entry.id}: {REPLY_FIELD!r} must name another stream")
    deadline = fields.get(DEADLINE_FIELD)
    group = fields.get(GROUP_FIELD)
    rollouts = fields.get(ROLLOUTS_FIELD, "1")
    if not (rollouts.isascii() and rollouts.isdigit()) or int(rollouts) < 1:
        raise MalformedEntry(
            f"entry {entry.id}: {ROLLOUTS_FIELD!r} is not a count >= 1: {rollouts!r}"
        )
    if group is not None and not group:
        raise MalformedEntry(f"entry {entry.id}: {GROUP_FIELD!r} must be a non-empty id")
    if group is None and rollouts != "1":
        raise MalformedEntry(f"entry {entry.id}: {ROLLOUTS_FIELD!r} needs {GROUP_FIELD!r}")
    advantage = fields.get(ADVANTAGE_FIELD, "mean")
    if advantage not in ADVANTAGES:
        raise MalformedEntry(
            f"entry {entry.id}: {ADVANTAGE_FIELD!r} must be one of {', '.join(ADVANTAGES)}: "
            f"{advantage!r}"
        )
    return Delivery(entry, key, data, int(rollout), reply_to, fields.get(ENV_FIELD),
                    None if deadline is None else _epoch(entry, deadline),
                    group, int(rollouts), advantage)  # fmt: skip


def _epoch(entry: EntryRef, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise MalformedEntry(f"entry {entry.id}: {DEADLINE_FIELD!r} is not epoch seconds: {text!r}")
    return value


def deadline_field() -> str | None:
    """The `deadline` field for an entry enqueued now from a trio task: the epoch time of
    `trio.current_effective_deadline()`, or None when it is infinite."""
    left = trio.current_effective_deadline() - trio.current_time()
    return None if left == math.inf else repr(time.time() + left)


def plain_task(delivery: Delivery) -> RedisTask:
    """The `RedisTask` a delivery holds, rebuilt by the one task decoder (`rebuild_task`);
    MalformedEntry unless its data is tt.Task-shaped."""
    entry = delivery.entry
    try:
        task: RedisTask = rebuild_task(
            Taskset, delivery.key, delivery.data, task_cls=RedisTask, entry=entry
        )
    except (TypeError, ValueError) as exc:
        raise MalformedEntry(f"entry {entry.id}: {exc}") from None
    return task


def decode_task(entry: EntryRef, fields: Fields | None) -> RedisTask:
    """The task an entry holds; raises MalformedEntry (saying why) if it holds none."""
    return plain_task(decode_entry(entry, fields))


# --- the connection: one client, every call retried on connection failures -------------------


def check_url(url: str) -> None:
    """Raise `ConfigError` (a ValueError) naming ``url``, saying what is wrong, unless `url`
    is a Redis URL (`resp.Address`).

    Parses only: nothing connects.
    """
    if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(
            f"{url!r} is not a Redis URL: use redis://[[user]:password@]host[:port][/db], "
            f"rediss://... (TLS) or unix:///path/to/redis.sock",
            parameter="url",
        )
    try:
        Address.parse(url)
    except ValueError as exc:
        raise ConfigError(f"{url!r} is not a valid Redis URL: {exc}", parameter="url") from None


def redact(url: str) -> str:
    """`url` with its password (if any) replaced by ***, for log lines (`redact_url`)."""
    return redact_url(url)


def stderr_log(prefix: str) -> Log:
    """A log function printing `prefix: message` lines to stderr."""

    def log(message: str) -> None:
        print(f"{prefix}: {message}", file=sys.stderr, flush=True)

    return log


def is_nogroup(error: Exception) -> bool:
    """A NOGROUP reply: the stream or its group is gone (Redis restarted without its data)."""
    return str(error).startswith("NOGROUP")
