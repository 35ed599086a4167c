"""Tasks as Redis stream entries, and the feed URL."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import attrs
import orjson
import redis

from ..env import task_data, task_key
from ..tasksets import Task

T = TypeVar("T")
Log = Callable[[str], None]
Fields = Mapping[str, str]

TASK_FIELD = "task"
"""The entry field holding a task: the JSON of `{"key": ..., "data": {...}}`."""

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


class MalformedEntry(ValueError):
    """A stream entry that does not hold a task (moved to the dead-letter stream)."""


def encode_task(task: Any) -> bytes:
    """The `task` field of an entry for `task`: JSON of its `key` and `data`.

    `data` must hold `prompt` and nothing beyond tt.Task's own fields (`prompt`, `answer`,
    `info`, `system_prompt`), all JSON-serialisable; anything else raises TypeError naming the
    task, before anything is written.
    """
    key = task_key(task)
    data = task_data(task)
    extra = sorted(set(data) - _TASK_DATA)
    if "prompt" not in data or extra:
        detail = f"fields beyond tt.Task's: {extra}" if extra else "no prompt"
        raise TypeError(
            f"task {key!r} ({type(task).__name__}) cannot travel through a stream: its data has "
            f"{detail}; only tt.Task-shaped tasks (prompt, answer, info, system_prompt) can"
        )
    try:
        return orjson.dumps({"key": key, "data": data})
    except TypeError as exc:
        raise TypeError(f"task {key!r}: its data is not JSON-serialisable ({exc})") from None


def decode_task(entry: EntryRef, fields: Fields | None) -> RedisTask:
    """The task an entry holds; raises MalformedEntry (saying why) if it holds none."""
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
    if not isinstance(key, str) or not isinstance(data, dict) or "prompt" not in data:
        raise MalformedEntry(f"entry {entry.id}: {TASK_FIELD!r} is not a {{key, data}} task")
    if set(data) - _TASK_DATA:
        raise MalformedEntry(
            f"entry {entry.id}: unknown task fields {sorted(set(data) - _TASK_DATA)}"
        )
    return RedisTask(
        prompt=data["prompt"],
        answer=data.get("answer"),
        info=data.get("info") or {},
        system_prompt=data.get("system_prompt"),
        key=key,
        entry=entry,
    )


# --- the connection: one client, every call retried on connection failures -------------------


def check_url(url: str) -> None:
    """Raise ValueError, saying what is wrong, unless `url` is a Redis URL redis-py accepts.

    Parses only: nothing connects.
    """
    if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(
            f"{url!r} is not a Redis URL: use redis://[[user]:password@]host[:port][/db], "
            f"rediss://... (TLS) or unix:///path/to/redis.sock"
        )
    try:
        redis.ConnectionPool.from_url(url)
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
