"""`RedisResults`: publish an episode and acknowledge its task in one transaction; `enqueue`."""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import orjson

from .._core.exceptions import ConfigError
from .._core.tasksets import Taskset
from .._env.env import Episode
from ._entries import (
    ENV_FIELD,
    GROUP_FIELD,
    ROWS_FIELD,
    TASK_FIELD,
    Declaration,
    EntryRef,
    Log,
    encode_task,
    is_nogroup,
    stderr_log,
)
from ._link import Link, redis_url
from ._resp import Arg, Command, Connection, ReplyError

# --- the results sink ----------------------------------------------------------------------


@attrs.frozen
class Published:
    """What `publish` did: the result entry's id (None if it skipped a replay whose first try
    had gone through) and whether this transaction acknowledged the task entry (False: it was
    already acknowledged, e.g. reclaimed and finished elsewhere, so the result is a duplicate
    of one with the same `key`)."""

    result_id: str | None
    acked: bool


@attrs.frozen
class Answer:
    """An episode to publish: the task entry it answers, the stream it goes to (None: the
    sink's own) and extra fields for its result entry. A group entry's answer holds every
    episode of the group in `group` (rollout order; `episode` is its first): one result
    entry whose `rows` field is the JSON list of their rows, and `group` their group's id."""

    episode: Episode
    entry: EntryRef
    to: str | None = None
    meta: Mapping[str, str | int | float] = attrs.field(factory=dict)
    group: Sequence[Episode] = ()


class RedisResults:
    """Publishes finished episodes to a results stream, acknowledging their task entries.

    Each result entry has the fields `key` (the task key: de-duplicate on it), `entry` and
    `stream` (the task entry it answers), `row` (the JSON of `Episode.to_row()`, the row an eval writes;
    for a group entry `rows`, the JSON list of the group's rows, and `group`, its id) and any
    `meta` given to `publish`. The results stream must live on the feed's Redis (one
    transaction covers both; on a Redis Cluster give both keys the same {hash tag}). A `url`
    that is not a Redis URL or an empty `stream` raises a `ConfigError` naming it.
    """

    def __init__(self, url: str, stream: str, *, log: Log | None = None) -> None:
        redis_url(url)
        if not isinstance(stream, str) or not stream:
            raise ConfigError(
                f"{{stream}} must be a non-empty str, got {stream!r}", parameter="stream"
            )
        self.url = url
        self.stream = stream
        self.log: Log = log if log is not None else stderr_log("trio_tasksets.redis")
        self._link = Link(url, read_timeout=10.0, log=self.log)

    def close(self) -> None:
        self._link.close()

    async def publish(
        self, episode: Episode, entry: EntryRef, *, to: str | None = None, **meta: str | int | float
    ) -> Published:
        """XADD the episode's row to `to` (default: this sink's stream) and XACK `entry` in
        one MULTI/EXEC; call it only once the episode is complete.

        Retries while Redis is unreachable and returns once the transaction has run: the
        episode is held, never dropped. A replay first checks that the entry is still pending;
        if it is not (the first try went through, or another worker finished it), nothing is
        published. A group that is gone (Redis restarted without its data) took any earlier
        try with it: the row is published, with nothing to acknowledge. If `to` cannot take
        the row (not a stream), it goes to this sink's stream with a `reply_error` field.
        Cancellation abandons the attempt: the entry stays pending (at-least-once).
        """
        [done] = await self.publish_many([Answer(episode, entry, to, meta)])
        return done

    async def publish_many(self, answers: Sequence[Answer]) -> list[Published]:
        """`publish` for several episodes in one MULTI/EXEC (one round trip): each row added
        and its entry acknowledged, as `publish` does for one."""
        rows = [_fields(answer) for answer in answers]
        targets = [a.to if a.to is not None else self.stream for a in answers]

        async def transact(redis: Connection, attempt: int) -> list[tuple[Published, str | None]]:
            todo = list(range(len(answers)))
            if attempt > 1:  # a replay: only what is still pending (the first try may be in)
                still = await _pending_many(redis, [a.entry for a in answers])
                todo = [i for i in todo if still[i]]
            outcome: list[tuple[Published, str | None]] = [(Published(None, False), None)] * len(
                answers
            )
            if not todo:
                return outcome
            commands: list[Command] = []
            for i in todo:
                entry = answers[i].entry
                commands.append(("XADD", targets[i], "*", *rows[i]))
                commands.append(("XACK", entry.stream, entry.group, entry.id))
            replies = await redis.pipeline(commands, transaction=True, raise_errors=False)
            for n, i in enumerate(todo):
                added, acked = replies[2 * n], replies[2 * n + 1]
                outcome[i] = await self._outcome(
                    redis, answers[i], targets[i], rows[i], added, acked
                )
            return outcome

        what = f"publishing {len(answers)} result{'s' if len(answers) > 1 else ''}"
        done = await self._link.call(what, transact)
        for _published, note in done:
            if note is not None:
                self.log(note)
        return [published for published, _ in done]

    async def _outcome(
        self,
        redis: Connection,
        answer: Answer,
        target: str,
        row: list[Arg],
        added: Any,
        acked: Any,
    ) -> tuple[Published, str | None]:
        """What one answer's XADD and XACK replies mean, and what to log about them."""
        entry, note = answer.entry, None
        if isinstance(added, ReplyError):
            if target == self.stream:
                raise added
            note = (
                f"cannot add the result of {entry.id} to {target} ({added}): sent to {self.stream}"
            )
            added = await redis.execute("XADD", self.stream, "*", *row, "reply_error", str(added))
        if isinstance(acked, ReplyError):
            note = f"published {added} but could not acknowledge {entry.id}: {acked}"
            return Published(str(added), acked=False), note
        if not acked and await _group_gone(redis, entry):
            note = (
                f"published {added}; group {entry.group} of {entry.stream} is gone (Redis "
                f"restarted without its data?), so there was nothing to acknowledge"
            )
            return Published(str(added), acked=False), note
        if not acked and not await redis.execute(
            "XRANGE", entry.stream, entry.id, entry.id, "COUNT", 1
        ):
            note = (
                f"published {added}; entry {entry.id} is no longer in {entry.stream} (lost "
                f"with Redis's data, or deleted once answered), so there was nothing to "
                f"acknowledge"
            )
            return Published(str(added), acked=False), note
        if not acked:
            note = (
                f"entry {entry.id} was already acknowledged: result {added} duplicates "
                f"one for task key {answer.episode.task.key!r}"
            )
        return Published(str(added), acked=bool(acked)), note

    async def keep_alive(self, consumer: str, entries: Sequence[EntryRef]) -> int:
        """Reset the idle time of those `entries` that `consumer` still owns, so that no
        worker reclaims the entry of an episode still running (the worker calls this every
        `claim_idle / 3` seconds for what it holds). One atomic script; returns how many were
        refreshed. An entry reclaimed by another consumer meanwhile is left to it."""
        if not entries:
            return 0
        keys = [entry.stream for entry in entries]
        args = [consumer, *(part for e in entries for part in (e.group, e.id))]

        async def touch(redis: Connection, _attempt: int) -> int:
            return int(await redis.execute("EVAL", _KEEP_ALIVE, len(keys), *keys, *args))

        return await self._link.call("keeping in-flight entries alive", touch)


# Resets the idle time of the entries ARGV[1] still owns (XCLAIM JUSTID keeps the delivery
# count); an entry another consumer has reclaimed meanwhile is left alone, and so is one whose
# group is gone (Redis restarted without its data).
_KEEP_ALIVE = """
local n = 0
for i = 1, #KEYS do
  local group, id = ARGV[2 * i], ARGV[2 * i + 1]
  local rows = redis.pcall('XPENDING', KEYS[i], group, id, id, 1)
  local row = (not rows.err) and rows[1]
  if row and row[2] == ARGV[1] then
    redis.call('XCLAIM', KEYS[i], group, ARGV[1], 0, id, 'JUSTID')
    n = n + 1
  end
end
return n
"""


async def _pending_many(redis: Connection, entries: Sequence[EntryRef]) -> list[bool]:
    """Whether each entry still waits for its result (so a replay must publish it): pending
    in its group, or no longer in its stream or its group at all (Redis lost its data, and
    any earlier try's result with it; or the entry was deleted once answered, and a second
    result is a duplicate the consumers drop). False: acknowledged and still there, so the
    first try went through (or another worker answered it)."""
    commands: list[Command] = []
    for entry in entries:
        commands.append(("XPENDING", entry.stream, entry.group, entry.id, entry.id, 1))
        commands.append(("XRANGE", entry.stream, entry.id, entry.id, "COUNT", 1))
    replies = await redis.pipeline(commands, raise_errors=False)
    still: list[bool] = []
    for held, present in zip(replies[::2], replies[1::2], strict=True):
        if isinstance(held, ReplyError) and is_nogroup(held):
            still.append(True)
        elif isinstance(held, ReplyError):
            raise held
        else:
            still.append(bool(held) or not present)
    return still


def _fields(answer: Answer) -> list[Arg]:
    """The result entry's fields, flat: `key`, `entry`, `stream`, the meta fields, `row` (a
    group's: `group` and `rows`)."""
    entry, episode = answer.entry, answer.episode
    fields: dict[str, Arg] = {"key": episode.task.key, "entry": entry.id, "stream": entry.stream}
    fields.update(answer.meta)
    if answer.group:
        fields[GROUP_FIELD] = episode.group or ""
        fields[ROWS_FIELD] = orjson.dumps([e.to_row() for e in answer.group])
    else:
        fields["row"] = orjson.dumps(episode.to_row())
    return [part for pair in fields.items() for part in pair]


async def _group_gone(redis: Connection, entry: EntryRef) -> bool:
    try:
        await redis.execute("XPENDING", entry.stream, entry.group)
    except ReplyError as exc:
        if is_nogroup(exc):
            return True
        raise
    return False


# --- producers -----------------------------------------------------------------------------


async def enqueue(
    url: str,
    stream: str,
    tasks: Iterable[Any] | AsyncIterable[Any],
    *,
    batch: int = 500,
    declare: Declaration | Taskset[Any, Any] | None = None,
    any_data: bool | None = None,
    log: Log | None = None,
) -> list[str]:
    """XADD each task as an entry of `stream` (a `task` field, see `encode_task`); return the
    entry ids in order.

    `declare` (a `Declaration`, or the taskset the tasks come from) goes into each entry's
    `env` field: a worker running another taskset refuses them (dead-letters them, saying
    why) instead of scoring them with the wrong env. `any_data`: the tasks may hold any JSON
    data (their taskset class rebuilds them with `task_from_data`); by default, whether
    `declare`'s class does. A sync iterable is sent in MULTI/EXEC batches of `batch`;
    an async iterable (a feed) one entry as each task arrives. Every task of a batch is
    encoded before it is sent, so a task that cannot travel raises TypeError before its
    batch is written. Connection failures are retried like the worker's (a replayed batch
    may add duplicates, marked by task key).
    """
    if batch < 1:
        raise ConfigError(f"{{batch}} must be >= 1, got {batch}", parameter="batch")
    if isinstance(declare, Taskset):
        if any_data is None:
            any_data = getattr(type(declare), "task_from_data", None) is not None
        declare = Declaration.of_taskset(declare)
    any_data = bool(any_data)
    extra: list[Arg] = [] if declare is None else [ENV_FIELD, declare.to_json()]
    link = Link(url, read_timeout=10.0, log=log or stderr_log("trio_tasksets.redis"))
    ids: list[str] = []

    async def send(chunk: list[bytes]) -> None:
        async def add(redis: Connection, _attempt: int) -> list[Any]:
            commands = [("XADD", stream, "*", TASK_FIELD, raw, *extra) for raw in chunk]
            return await redis.pipeline(commands, transaction=len(chunk) > 1)

        ids.extend(str(i) for i in await link.call(f"adding entries to {stream}", add))

    try:
        if isinstance(tasks, AsyncIterable):
            async for task in tasks:
                await send([encode_task(task, any_data=any_data)])
        else:
            chunk: list[bytes] = []
            for task in tasks:
                chunk.append(encode_task(task, any_data=any_data))
                if len(chunk) >= batch:
                    await send(chunk)
                    chunk = []
            if chunk:
                await send(chunk)
    finally:
        link.close()
    return ids
