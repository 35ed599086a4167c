"""`RedisStreamTaskset`: a Redis stream read through a consumer group, as a taskset."""

from __future__ import annotations

import collections
import math
from collections.abc import AsyncIterator, Callable
from typing import Any, Generic, TypeVar

import orjson
import trio

from .._core.exceptions import ConfigError
from .._core.tasksets import Taskset, TasksetConfig
from ._entries import (
    REFUSED_FIELD,
    Delivery,
    EntryRef,
    Log,
    MalformedEntry,
    RedisTask,
    decode_entry,
    is_nogroup,
    plain_task,
    stderr_log,
)
from ._link import Link, Stopped, first_entry, redis_url
from ._resp import Command, Connection, ReplyError, entries, first_stream

T = TypeVar("T")
_RECLAIM_EVERY_CAP = 30.0

# Deletes consumer ARGV[2] of group ARGV[1] only if it has no pending entry (deleting one that
# has would drop its entries from the pending list: they would never be delivered again).
# A group that is gone (Redis lost its data) has nothing to leave: 0.
_LEAVE = """
local held = redis.pcall('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2])
if held.err or #held > 0 then return 0 end
redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
return 1
"""


# --- the feed ----------------------------------------------------------------------------------


class RedisStreamTaskset(Taskset[RedisTask, TasksetConfig]):
    """A streaming taskset reading a Redis stream through a consumer group.

    `stream()` creates the group if missing (from the stream's start, MKSTREAM) and yields one
    `RedisTask` per pull, claiming one entry per pull and only then (see the module docstring
    for the order: own pending, reclaim, new). It never acknowledges: whoever runs a task
    acknowledges its `entry` (`RedisResults.publish`). An entry that holds no task is moved to
    `dead_letter` (default `<stream>:dead`) and acknowledged, in one transaction.

    `claim_idle` (seconds): an entry pending that long is taken to belong to a dead consumer
    and is reclaimed; set it above the longest episode plus the publish. `block` (seconds):
    the longest one read waits, hence the longest `stop()` waits. Connection failures are
    retried with a log line (`log`, default: stderr) and never end the stream. A bad
    setting (a `url` that is not a Redis URL, an empty `stream`, `group` or `consumer`,
    `claim_idle` <= 0, `block` outside (0, 60]) raises a `ConfigError` naming it.
    """

    def __init__(
        self,
        url: str,
        stream: str,
        group: str,
        consumer: str,
        *,
        claim_idle: float = 300.0,
        block: float = 0.5,
        dead_letter: str | None = None,
        log: Log | None = None,
        config: TasksetConfig | None = None,
    ) -> None:
        super().__init__(config)
        redis_url(url)
        for name, value in (("stream", stream), ("group", group), ("consumer", consumer)):
            if not isinstance(value, str) or not value:
                raise ConfigError(
                    f"{{{name}}} must be a non-empty str, got {value!r}", parameter=name
                )
        if not claim_idle > 0:
            raise ConfigError(
                f"{{claim_idle}} must be > 0 seconds, got {claim_idle!r}", parameter="claim_idle"
            )
        if not 0 < block <= 60:
            raise ConfigError(
                f"{{block}} must be in (0, 60] seconds, got {block!r}", parameter="block"
            )
        self.url = url
        self.stream_key = stream
        self.group = group
        self.consumer = consumer
        self.claim_idle = float(claim_idle)
        self.block = float(block)
        self.dead_letter = dead_letter if dead_letter is not None else f"{stream}:dead"
        self.log: Log = log if log is not None else stderr_log("trio_tasksets.redis")
        self._stop = trio.Event()  # shared by views (copy.copy): stopping one stops them all

    def stop(self) -> None:
        """End every stream of this taskset: no new read starts; a read in progress (at most
        `block` seconds) still delivers the entry it claimed, then the stream ends."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    async def leave(self) -> bool:
        """Remove this consumer from the group if it holds no pending entry (one atomic
        script), so that names of stopped workers do not pile up in XINFO CONSUMERS. Returns
        whether it was removed; a consumer with pending entries stays, for them to be
        reclaimed. Retries while Redis is unreachable: bound it with a deadline."""
        link = Link(self.url, read_timeout=10.0, log=self.log)
        keys, args = [self.stream_key], [self.group, self.consumer]

        async def leave(redis: Connection, _attempt: int) -> bool:
            return bool(await redis.execute("EVAL", _LEAVE, 1, *keys, *args))

        try:
            return await link.call("leaving the group", leave)
        finally:
            link.close()

    def stream(self) -> AsyncIterator[RedisTask]:
        """The claimed entries as plain tasks (`claims` of `plain_task`)."""
        return self.claims(plain_task)

    async def claims(
        self, build: Callable[[Delivery], T], *, room: Callable[[], int] | None = None
    ) -> AsyncIterator[T]:
        """What `stream()` does, for any kind of task: each claimed entry, decoded, goes
        through `build`, and what it returns is yielded. An entry `build` rejects (raising
        `MalformedEntry`, e.g. `EntryRefused`) is dead-lettered with the reason and acknowledged,
        and, if it names a reply-to stream, the reason is added there (field `refused`).

        `room()`, if given, says how many entries the consumer can take now (at least the
        one being pulled): a read of new entries claims up to that many at once and yields
        them one per pull, so a window that frees several places at once costs one read."""
        reader = _Reader(self, build, room)
        try:
            if not await reader.open():
                return
            while (item := await reader.next()) is not None:
                yield item
        finally:
            reader.close()


class _Reader(Generic[T]):
    """One stream() of a RedisStreamTaskset: its connection and its place in each phase."""

    def __init__(
        self,
        taskset: RedisStreamTaskset,
        build: Callable[[Delivery], T],
        room: Callable[[], int] | None = None,
    ) -> None:
        self._ts = taskset
        self._build = build
        self._room = room
        self._claimed: collections.deque[tuple[str, dict[str, str] | None]] = collections.deque()
        self._link = Link(taskset.url, read_timeout=taskset.block + 10.0, log=taskset.log)
        self._history: str | None = "0"  # cursor over this consumer's own pending entries
        self._cursor = "0-0"  # XAUTOCLAIM's scan cursor
        self._reclaim_at = -math.inf  # a reclaim pass is due at once (on start)
        self._reclaim_every = min(taskset.claim_idle / 2, _RECLAIM_EVERY_CAP)

    def close(self) -> None:
        self._link.close()

    async def open(self) -> bool:
        """Create the group if missing; False if stopped first."""
        try:
            await self._link.call("creating the group", self._create_group, stop=self._ts._stop)
        except Stopped:
            return False
        return True

    async def _create_group(self, redis: Connection, _attempt: int) -> None:
        ts = self._ts
        try:
            await redis.execute("XGROUP", "CREATE", ts.stream_key, ts.group, "0", "MKSTREAM")
        except ReplyError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def next(self) -> T | None:
        """The next task (claiming one entry, or taking one claimed by the last read), or None
        once stopped and nothing claimed is left."""
        while True:
            if self._claimed:  # even if stop() came meanwhile: they are ours now, run them
                task = await self._task(*self._claimed.popleft())
                if task is not None:
                    return task
                continue
            if self._ts.stopping:
                return None
            try:
                found = await self._step()
            except Stopped:
                return None
            except ReplyError as exc:
                if not is_nogroup(exc):
                    raise
                ts = self._ts
                ts.log(
                    f"group {ts.group} of {ts.stream_key} is gone (Redis restarted without its "
                    f"data?): recreating it"
                )
                self._history = None  # a new group: nothing of ours is pending in it
                self._cursor = "0-0"
                await self.open()
                continue
            self._claimed.extend(found)

    async def _step(self) -> list[tuple[str, dict[str, str] | None]]:
        if self._history is not None:
            found = await self._own_pending()
        elif trio.current_time() >= self._reclaim_at:
            found = await self._reclaim()
        else:
            return await self._new()
        return [] if found is None else [found]

    async def _own_pending(self) -> tuple[str, dict[str, str] | None] | None:
        ts = self._ts
        since = self._history or "0"

        async def read(redis: Connection, _attempt: int) -> Any:
            return await redis.execute(
                "XREADGROUP", "GROUP", ts.group, ts.consumer, "COUNT", 1,
                "STREAMS", ts.stream_key, since,
            )  # fmt: skip

        found = first_entry(
            await self._link.call("reading own pending entries", read, stop=ts._stop)
        )
        self._history = None if found is None else found[0]
        return found

    async def _reclaim(self) -> tuple[str, dict[str, str] | None] | None:
        ts, cursor = self._ts, self._cursor
        idle_ms = max(1, int(ts.claim_idle * 1000))

        async def claim(redis: Connection, _attempt: int) -> list[Any]:
            command = ("XAUTOCLAIM", ts.stream_key, ts.group, ts.consumer, idle_ms, cursor,
                       "COUNT", 1)  # fmt: skip
            return list(await redis.execute(*command))

        reply = await self._link.call("reclaiming idle entries", claim, stop=ts._stop)
        self._cursor = str(reply[0])
        if self._cursor == "0-0":  # the pass is complete
            self._reclaim_at = trio.current_time() + self._reclaim_every
        found = entries(reply[1])
        if not found:
            return None
        entry_id, fields = found[0]
        ts.log(f"reclaimed entry {entry_id} of {ts.stream_key} (pending > {ts.claim_idle:g} s)")
        return str(entry_id), fields

    async def _new(self) -> list[tuple[str, dict[str, str] | None]]:
        ts = self._ts
        block_ms = max(1, int(ts.block * 1000))
        count = 1 if self._room is None else max(1, self._room())

        async def read(redis: Connection, _attempt: int) -> Any:
            return await redis.execute(
                "XREADGROUP", "GROUP", ts.group, ts.consumer, "COUNT", count, "BLOCK", block_ms,
                "STREAMS", ts.stream_key, ">",
            )  # fmt: skip

        reply = await self._link.call("waiting for entries", read, stop=ts._stop)
        return first_stream(reply)

    async def _task(self, entry_id: str, fields: dict[str, str] | None) -> T | None:
        ts = self._ts
        entry = EntryRef(ts.stream_key, ts.group, entry_id)
        delivery: Delivery | None = None
        try:
            delivery = decode_entry(entry, fields)
            return self._build(delivery)
        except MalformedEntry as exc:
            error = str(exc)
        ts.log(f"{error}: moved to {ts.dead_letter} and acknowledged")
        reply_to = delivery.reply_to if delivery is not None else None
        raw = orjson.dumps(fields or {}).decode()

        async def bury(redis: Connection, _attempt: int) -> None:
            commands: list[Command] = [
                ("XADD", ts.dead_letter, "*", "entry", entry_id, "error", error, "fields", raw),
                ("XACK", ts.stream_key, ts.group, entry_id),
            ]
            if reply_to is not None and delivery is not None:
                commands.append(
                    ("XADD", reply_to, "*", "entry", entry_id, "stream", ts.stream_key,
                     "key", delivery.key, "consumer", ts.consumer, REFUSED_FIELD, error)
                )  # fmt: skip
            replies = await redis.pipeline(commands, transaction=True, raise_errors=False)
            for reply in replies:
                if isinstance(reply, ReplyError):  # e.g. WRONGTYPE: a reply-to that is no stream
                    ts.log(f"dead-lettering {entry_id}: {reply}")

        await self._link.call("dead-lettering an entry", bury)
        return None
