"""Tasks as Redis stream entries, what produced them (`Declaration`), and the feed URL.

A task entry has the field `task` (the JSON of `{"key", "data"}`) and, optionally:
`env` (a `Declaration`: the taskset, its config, the env class, the model a producer meant
the task for; a worker running another env refuses the entry), `rollout` (the slot's
rollout, default 0), `reply_to` (the stream its result goes to, instead of the worker's
`--results`) and `deadline` (epoch seconds: the producer's deadline; a worker runs the slot
under the time left, and answers an entry taken after it as timed out, without running it).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import PurePath
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import attrs
import orjson
import trio

from .._builtin import BUILTIN
from .._env import Env, task_data, task_key
from .._envspec import TravelError, config_to_json
from .._exceptions import TrioTasksetsError
from .._loading import object_spec
from .._models import ModelContext
from .._tasksets import Task, Taskset
from ._resp import Address

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
REFUSED_FIELD = "refused"
"""In a reply stream: a worker refused the entry named by `entry`, for this reason."""

_TASK_DATA = frozenset({"prompt", "answer", "info", "system_prompt"})


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


class MalformedEntry(TrioTasksetsError, ValueError):
    """A stream entry that does not hold a task (moved to the dead-letter stream)."""


class EntryRefused(MalformedEntry):
    """An entry this worker will not run (declared for another env): dead-lettered, and the
    reason is sent to its reply-to stream if it names one."""


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
        extra = sorted(set(data) - _TASK_DATA)
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
    return Delivery(entry, key, data, int(rollout), reply_to, fields.get(ENV_FIELD),
                    None if deadline is None else _epoch(entry, deadline))  # fmt: skip


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
    """The `RedisTask` a delivery holds; MalformedEntry unless its data is tt.Task-shaped."""
    data, entry = delivery.data, delivery.entry
    if "prompt" not in data:
        raise MalformedEntry(f"entry {entry.id}: {TASK_FIELD!r} has no prompt")
    if set(data) - _TASK_DATA:
        raise MalformedEntry(
            f"entry {entry.id}: unknown task fields {sorted(set(data) - _TASK_DATA)}"
        )
    return RedisTask(
        prompt=data["prompt"],
        answer=data.get("answer"),
        info=data.get("info") or {},
        system_prompt=data.get("system_prompt"),
        key=delivery.key,
        entry=entry,
    )


def decode_task(entry: EntryRef, fields: Fields | None) -> RedisTask:
    """The task an entry holds; raises MalformedEntry (saying why) if it holds none."""
    return plain_task(decode_entry(entry, fields))


# --- what produced an entry ------------------------------------------------------------------


def _name(cls: type) -> str:
    """`object_spec`'s name for a class, else `module:qualname` (compared, never imported)."""
    try:
        return object_spec(cls, "the class")
    except TravelError:
        return f"{cls.__module__}:{cls.__qualname__}"


def taskset_arg(name: str) -> str:
    """How a TASKSET argument names the class `name`: its built-in id if it has one."""
    for builtin_id, cls in BUILTIN.items():
        if name in (object_spec(cls, "the class"), f"{cls.__module__}:{cls.__qualname__}"):
            return builtin_id
    return name


def _same_class(a: str, b: str) -> bool:
    """The same class: the same name, or the same file name and class in two checkouts."""
    if a == b:
        return True
    (where_a, _, name_a), (where_b, _, name_b) = a.rpartition(":"), b.rpartition(":")
    files = where_a.endswith(".py") and where_b.endswith(".py")
    return files and name_a == name_b and PurePath(where_a).name == PurePath(where_b).name


@attrs.frozen
class Declaration:
    """What a producer meant its entries for: the taskset class (as `object_spec` names it),
    its config (JSON fields, without `system_prompt`, which each task carries), and from an
    eval the env class, the model and the sampling. A field left None is not declared (and
    not checked). A worker refuses an entry whose declaration `differs` from its own."""

    taskset: str
    config: dict[str, Any] | None = None
    env_class: str | None = None
    model: str | None = None
    sampling: dict[str, Any] | None = None

    @classmethod
    def of_taskset(cls, taskset: Taskset[Any, Any]) -> Declaration:
        try:
            config: dict[str, Any] | None = config_to_json(taskset)
        except TravelError:
            config = None  # not plain JSON: not declared, not checked
        if config is not None:
            config.pop("system_prompt", None)
        return cls(_name(type(taskset)), config)

    @classmethod
    def of(cls, env: Env[Any], ctx: ModelContext | None = None) -> Declaration:
        """The declaration of `env` (and of the model in `ctx`, if given)."""
        base = cls.of_taskset(env.taskset)
        sampling = None if ctx is None else orjson.loads(orjson.dumps(attrs.asdict(ctx.sampling)))
        return attrs.evolve(
            base,
            env_class=_name(type(env)),
            model=None if ctx is None else ctx.model,
            sampling=sampling,
        )

    def to_json(self) -> str:
        fields = {k: v for k, v in attrs.asdict(self).items() if v is not None}
        return orjson.dumps(fields, option=orjson.OPT_SORT_KEYS).decode()

    @classmethod
    def from_json(cls, raw: str) -> Declaration:
        """The declaration an entry carries; MalformedEntry if it is not one."""
        try:
            value = orjson.loads(raw)
            return cls(**value)
        except (orjson.JSONDecodeError, TypeError) as exc:
            raise MalformedEntry(f"{ENV_FIELD!r} is not a declaration ({exc})") from None

    def differs(self, own: Declaration) -> str | None:
        """Why an entry declared so cannot run on a worker whose env is `own`, or None."""
        if not _same_class(self.taskset, own.taskset):
            return (
                f"declared for taskset {self.taskset}, but this worker runs {own.taskset}: "
                f"start the worker with TASKSET {taskset_arg(self.taskset)}"
            )
        if None not in (self.config, own.config) and self.config != own.config:
            args = orjson.dumps(self.config).decode()
            return (
                f"declared with taskset config {args}, but this worker's is "
                f"{orjson.dumps(own.config).decode()}: start the worker with -a '{args}'"
            )
        mine, theirs = self.env_class, own.env_class
        if mine is not None and theirs is not None and not _same_class(mine, theirs):
            return (
                f"declared for env class {mine}, but this worker runs {theirs}: start the "
                f"worker with --env-class {mine}"
            )
        if None not in (self.model, own.model) and self.model != own.model:
            return (
                f"declared for model {self.model!r}, but this worker runs {own.model!r}: give "
                f"the eval and the worker the same -m/--model"
            )
        if None not in (self.sampling, own.sampling) and self.sampling != own.sampling:
            return (
                f"declared with sampling {self.sampling}, but this worker samples with "
                f"{own.sampling}: give the eval and the worker the same sampling flags"
            )
        return None


# --- the connection: one client, every call retried on connection failures -------------------


def check_url(url: str) -> None:
    """Raise ValueError, saying what is wrong, unless `url` is a Redis URL (`resp.Address`).

    Parses only: nothing connects.
    """
    if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(
            f"{url!r} is not a Redis URL: use redis://[[user]:password@]host[:port][/db], "
            f"rediss://... (TLS) or unix:///path/to/redis.sock"
        )
    try:
        Address.parse(url)
    except ValueError as exc:
        raise ValueError(f"{url!r} is not a valid Redis URL: {exc}") from None


def redact(url: str) -> str:
    """`url` with its password (if any) replaced by ***, for log lines."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def stderr_log(prefix: str) -> Log:
    """A log function printing `prefix: message` lines to stderr."""

    def log(message: str) -> None:
        print(f"{prefix}: {message}", file=sys.stderr, flush=True)

    return log


def is_nogroup(error: Exception) -> bool:
    """A NOGROUP reply: the stream or its group is gone (Redis restarted without its data)."""
    return str(error).startswith("NOGROUP")
