"""Redis Streams as a feed and a results sink (issue 6); the optional extra `trio-tasksets[redis]`.

* `RedisStreamTaskset(url, stream, group, consumer)`: a streaming taskset over a consumer group.
  Each pull of its `stream()` claims **at most one** entry, and only when the runner pulls, so a
  worker never holds more entries than its window asks for. Per pull, in this order: the
  consumer's own pending entries left from an earlier life (XREADGROUP from id 0), then, when a
  reclaim pass is due (at start and every `min(claim_idle / 2, 30)` s), XAUTOCLAIM COUNT 1 of
  an entry idle longer than `claim_idle` (a dead consumer's), else XREADGROUP COUNT 1 BLOCK
  `block` of a new entry.
* `RedisResults(url, stream)`: `publish(episode, entry)` XADDs the episode's trace row to the
  results stream and XACKs its task entry in one MULTI/EXEC transaction; `keep_alive(consumer,
  entries)` resets the idle time of entries still running, so that they are not reclaimed.
* `enqueue(url, stream, tasks)`: XADDs tasks as entries, one field `task` holding the JSON of
  `{"key", "data"}`, which reads back as an equal `tt.Task` (a `RedisTask`).

The client is redis-py's synchronous client; each command runs in a trio worker thread
(`trio.to_thread.run_sync`). A blocking read waits at most `block` seconds, so a graceful stop
(`RedisStreamTaskset.stop()`) ends the stream within `block` without abandoning a read that may
already have claimed an entry; a hard cancellation abandons the thread at once. Every call
retries connection failures (Redis restarted or unreachable) with capped, jittered exponential
backoff and a log line naming the URL; redis-py's own retries are off so that no transaction is
replayed behind our back. docs/distributed.md explains the choice and the guarantees.
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import attrs
import orjson
import redis
import trio
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry
from redis.typing import EncodableT, FieldT, KeyT, StreamIdT

from .env import Episode, task_data, task_key
from .tasksets import Task, Taskset, TasksetConfig

__all__ = [
    "TASK_FIELD",
    "EntryRef",
    "MalformedEntry",
    "Published",
    "RedisResults",
    "RedisStreamTaskset",
    "RedisTask",
    "check_url",
    "decode_task",
    "encode_task",
    "enqueue",
]

T = TypeVar("T")
Log = Callable[[str], None]
Fields = Mapping[str, str]

TASK_FIELD = "task"
"""The entry field holding a task: the JSON of `{"key": ..., "data": {...}}`."""

_TASK_DATA = frozenset({"prompt", "answer", "info", "system_prompt"})
_BACKOFF_FIRST = 0.1
_BACKOFF_CAP = 3.0
_RECLAIM_EVERY_CAP = 30.0


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


def _client(url: str, read_timeout: float) -> redis.Redis:
    # No client-side retries: a replayed MULTI/EXEC could publish twice. _Link retries instead,
    # with a log line and a check before replaying a publish.
    return redis.Redis.from_url(
        url,
        protocol=2,  # the RESP2 reply shapes, the same in every redis-py >= 5
        decode_responses=True,
        retry=Retry(NoBackoff(), 0),
        socket_timeout=read_timeout,
        socket_connect_timeout=5.0,
    )


class _Stopped(Exception):
    """The stop event fired while a call was waiting to retry."""


class _Link:
    """A redis-py client whose calls run in worker threads and survive outages.

    `call` retries connection and timeout errors forever (capped, jittered exponential backoff,
    one log line per failure naming the URL, one when Redis answers again). Other errors
    (a ResponseError) are raised. Cancellation abandons the thread at once.
    """

    def __init__(self, url: str, *, read_timeout: float, log: Log) -> None:
        self.url = redact(url)
        self.client = _client(url, read_timeout)
        self._log = log

    async def call(
        self, what: str, fn: Callable[[redis.Redis, int], T], *, stop: trio.Event | None = None
    ) -> T:
        """`fn(client, attempt)` in a thread, retried while Redis is unreachable.

        `attempt` counts from 1, so `fn` can tell a replay. Raises `_Stopped` if `stop` is set
        while waiting to retry.
        """
        failures = 0
        while True:
            try:
                result = await trio.to_thread.run_sync(
                    fn, self.client, failures + 1, abandon_on_cancel=True
                )
            except (RedisConnectionError, RedisTimeoutError) as exc:
                failures += 1
                delay = min(_BACKOFF_CAP, _BACKOFF_FIRST * 2 ** (failures - 1))
                delay *= random.uniform(0.5, 1.0)
                self._log(
                    f"redis at {self.url} unreachable while {what} "
                    f"({type(exc).__name__}: {exc}); retry {failures} in {delay:.1f} s"
                )
                await _wait(delay, stop)
                continue
            except ResponseError:
                self._back(failures, what)  # Redis answered, with an error
                raise
            self._back(failures, what)
            return result

    def _back(self, failures: int, what: str) -> None:
        if failures:
            self._log(
                f"redis at {self.url} reachable again after {failures} failed "
                f"attempt{'s' if failures > 1 else ''} ({what})"
            )

    def close(self) -> None:
        self.client.close()


async def _wait(delay: float, stop: trio.Event | None) -> None:
    if stop is None:
        await trio.sleep(delay)
        return
    with trio.move_on_after(delay):
        await stop.wait()
    if stop.is_set():
        raise _Stopped


def _first_entry(response: Any) -> tuple[str, dict[str, str] | None] | None:
    """The one entry of an XREADGROUP COUNT 1 reply, or None (a timeout or an empty history)."""
    if not response:
        return None
    entries = response[0][1]
    if not entries:
        return None
    entry_id, fields = entries[0]
    return str(entry_id), fields


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
    retried with a log line (`log`, default: stderr) and never end the stream.
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
        check_url(url)
        for name, value in (("stream", stream), ("group", group), ("consumer", consumer)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty str, got {value!r}")
        if not claim_idle > 0:
            raise ValueError(f"claim_idle must be > 0 seconds, got {claim_idle!r}")
        if not 0 < block <= 60:
            raise ValueError(f"block must be in (0, 60] seconds, got {block!r}")
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
        link = _Link(self.url, read_timeout=10.0, log=self.log)
        keys, args = [self.stream_key], [self.group, self.consumer]

        def leave(client: redis.Redis, _attempt: int) -> bool:
            return bool(client.register_script(_LEAVE)(keys=keys, args=args, client=client))

        try:
            return await link.call("leaving the group", leave)
        finally:
            link.close()

    async def stream(self) -> AsyncIterator[RedisTask]:
        reader = _Reader(self)
        try:
            if not await reader.open():
                return
            while (task := await reader.next()) is not None:
                yield task
        finally:
            reader.close()


class _Reader:
    """One stream() of a RedisStreamTaskset: its connection and its place in each phase."""

    def __init__(self, taskset: RedisStreamTaskset) -> None:
        self._ts = taskset
        self._link = _Link(taskset.url, read_timeout=taskset.block + 10.0, log=taskset.log)
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
        except _Stopped:
            return False
        return True

    def _create_group(self, client: redis.Redis, _attempt: int) -> None:
        ts = self._ts
        try:
            client.xgroup_create(ts.stream_key, ts.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def next(self) -> RedisTask | None:
        """The next task (claiming exactly one entry), or None once stopped."""
        while not self._ts.stopping:
            try:
                found = await self._step()
            except _Stopped:
                return None
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                self._ts.log(f"group {self._ts.group} is gone (Redis lost its data?): recreating")
                await self.open()
                continue
            if found is not None:
                task = await self._task(*found)
                if task is not None:
                    return task  # even if stop() came meanwhile: it is ours now, run it
        return None

    async def _step(self) -> tuple[str, dict[str, str] | None] | None:
        if self._history is not None:
            return await self._own_pending()
        if trio.current_time() >= self._reclaim_at:
            return await self._reclaim()
        return await self._new()

    async def _own_pending(self) -> tuple[str, dict[str, str] | None] | None:
        ts = self._ts
        streams: dict[KeyT, StreamIdT] = {ts.stream_key: self._history or "0"}

        def read(client: redis.Redis, _attempt: int) -> Any:
            return client.xreadgroup(ts.group, ts.consumer, streams, count=1)

        found = _first_entry(
            await self._link.call("reading own pending entries", read, stop=ts._stop)
        )
        self._history = None if found is None else found[0]
        return found

    async def _reclaim(self) -> tuple[str, dict[str, str] | None] | None:
        ts, cursor = self._ts, self._cursor
        idle_ms = max(1, int(ts.claim_idle * 1000))

        def claim(client: redis.Redis, _attempt: int) -> list[Any]:
            return client.xautoclaim(ts.stream_key, ts.group, ts.consumer, idle_ms, cursor, 1)

        reply = await self._link.call("reclaiming idle entries", claim, stop=ts._stop)
        self._cursor = str(reply[0])
        if self._cursor == "0-0":  # the pass is complete
            self._reclaim_at = trio.current_time() + self._reclaim_every
        if not reply[1]:
            return None
        entry_id, fields = reply[1][0]
        ts.log(f"reclaimed entry {entry_id} of {ts.stream_key} (pending > {ts.claim_idle:g} s)")
        return str(entry_id), fields

    async def _new(self) -> tuple[str, dict[str, str] | None] | None:
        ts = self._ts
        block_ms = max(1, int(ts.block * 1000))
        streams: dict[KeyT, StreamIdT] = {ts.stream_key: ">"}

        def read(client: redis.Redis, _attempt: int) -> Any:
            return client.xreadgroup(ts.group, ts.consumer, streams, count=1, block=block_ms)

        return _first_entry(await self._link.call("waiting for entries", read, stop=ts._stop))

    async def _task(self, entry_id: str, fields: dict[str, str] | None) -> RedisTask | None:
        ts = self._ts
        entry = EntryRef(ts.stream_key, ts.group, entry_id)
        try:
            return decode_task(entry, fields)
        except MalformedEntry as exc:
            ts.log(f"{exc}: moved to {ts.dead_letter} and acknowledged")
            error = str(exc)

        def bury(client: redis.Redis, _attempt: int) -> None:
            raw = orjson.dumps(fields or {}).decode()
            with client.pipeline(transaction=True) as pipe:
                pipe.xadd(ts.dead_letter, {"entry": entry_id, "error": error, "fields": raw})
                pipe.xack(ts.stream_key, ts.group, entry_id)
                pipe.execute()

        await self._link.call("dead-lettering an entry", bury)
        return None


# --- the results sink ----------------------------------------------------------------------


@attrs.frozen
class Published:
    """What `publish` did: the result entry's id (None if it skipped a replay whose first try
    had gone through) and whether this transaction acknowledged the task entry (False: it was
    already acknowledged, e.g. reclaimed and finished elsewhere, so the result is a duplicate
    of one with the same `key`)."""

    result_id: str | None
    acked: bool


class RedisResults:
    """Publishes finished episodes to a results stream, acknowledging their task entries.

    Each result entry has the fields `key` (the task key: de-duplicate on it), `entry` and
    `stream` (the task entry it answers), `row` (the JSON of `Episode.to_row()`, the SPEC row)
    and any `meta` given to `publish`. The results stream must live on the feed's Redis (one
    transaction covers both; on a Redis Cluster give both keys the same {hash tag}).
    """

    def __init__(self, url: str, stream: str, *, log: Log | None = None) -> None:
        check_url(url)
        if not isinstance(stream, str) or not stream:
            raise ValueError(f"stream must be a non-empty str, got {stream!r}")
        self.url = url
        self.stream = stream
        self.log: Log = log if log is not None else stderr_log("trio_tasksets.redis")
        self._link = _Link(url, read_timeout=10.0, log=self.log)

    def close(self) -> None:
        self._link.close()

    async def publish(
        self, episode: Episode, entry: EntryRef, **meta: str | int | float
    ) -> Published:
        """XADD the episode's row and XACK `entry` in one MULTI/EXEC; call it only once the
        episode is complete.

        Retries while Redis is unreachable and returns once the transaction has run: the
        episode is held, never dropped. A replay first checks that the entry is still pending;
        if it is not (the first try went through, or another worker finished it), nothing is
        published. Cancellation abandons the attempt: the entry stays pending (at-least-once).
        """
        fields: dict[FieldT, EncodableT] = {
            "key": episode.task.key,
            "entry": entry.id,
            "stream": entry.stream,
        }
        for name, value in meta.items():
            fields[name] = value
        fields["row"] = orjson.dumps(episode.to_row())

        def transact(client: redis.Redis, attempt: int) -> Published:
            if attempt > 1 and not _pending(client, entry):
                return Published(None, acked=False)
            with client.pipeline(transaction=True) as pipe:
                pipe.xadd(self.stream, fields)
                pipe.xack(entry.stream, entry.group, entry.id)
                added, acked = pipe.execute(raise_on_error=False)
            if isinstance(added, Exception):
                raise added
            if isinstance(acked, Exception):
                self.log(f"published {added} but could not acknowledge {entry.id}: {acked}")
                return Published(str(added), acked=False)
            return Published(str(added), acked=bool(acked))

        done = await self._link.call(f"publishing the result of {entry.id}", transact)
        if done.result_id is not None and not done.acked:
            self.log(
                f"entry {entry.id} was already acknowledged: result {done.result_id} duplicates "
                f"one for task key {episode.task.key!r}"
            )
        return done

    async def keep_alive(self, consumer: str, entries: Sequence[EntryRef]) -> int:
        """Reset the idle time of those `entries` that `consumer` still owns, so that no
        worker reclaims the entry of an episode still running (the worker calls this every
        `claim_idle / 3` seconds for what it holds). One atomic script; returns how many were
        refreshed. An entry reclaimed by another consumer meanwhile is left to it."""
        if not entries:
            return 0
        keys = [entry.stream for entry in entries]
        args = [consumer, *(part for e in entries for part in (e.group, e.id))]

        def touch(client: redis.Redis, _attempt: int) -> int:
            return int(client.register_script(_KEEP_ALIVE)(keys=keys, args=args, client=client))

        return await self._link.call("keeping in-flight entries alive", touch)


# Deletes consumer ARGV[2] of group ARGV[1] only if it has no pending entry (deleting one that
# has would drop its entries from the pending list: they would never be delivered again).
_LEAVE = """
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) > 0 then return 0 end
redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
return 1
"""

# Resets the idle time of the entries ARGV[1] still owns (XCLAIM JUSTID keeps the delivery
# count); an entry another consumer has reclaimed meanwhile is left alone.
_KEEP_ALIVE = """
local n = 0
for i = 1, #KEYS do
  local group, id = ARGV[2 * i], ARGV[2 * i + 1]
  local row = redis.call('XPENDING', KEYS[i], group, id, id, 1)[1]
  if row and row[2] == ARGV[1] then
    redis.call('XCLAIM', KEYS[i], group, ARGV[1], 0, id, 'JUSTID')
    n = n + 1
  end
end
return n
"""


def _pending(client: redis.Redis, entry: EntryRef) -> bool:
    rows = client.xpending_range(entry.stream, entry.group, entry.id, entry.id, 1)
    return bool(rows)


# --- producers -----------------------------------------------------------------------------


async def enqueue(
    url: str,
    stream: str,
    tasks: Iterable[Any] | AsyncIterable[Any],
    *,
    batch: int = 500,
    log: Log | None = None,
) -> list[str]:
    """XADD each task as an entry of `stream` (a `task` field, see `encode_task`); return the
    entry ids in order.

    A sync iterable is sent in MULTI/EXEC batches of `batch`; an async iterable (a feed) one
    entry as each task arrives. Every task of a batch is encoded before it is sent, so a task
    that cannot travel raises TypeError before its batch is written. Connection failures are
    retried like the worker's (a replayed batch may add duplicates, marked by task key).
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    link = _Link(url, read_timeout=10.0, log=log or stderr_log("trio_tasksets.redis"))
    ids: list[str] = []

    async def send(chunk: list[bytes]) -> None:
        def add(client: redis.Redis, _attempt: int) -> list[Any]:
            with client.pipeline(transaction=len(chunk) > 1) as pipe:
                for raw in chunk:
                    pipe.xadd(stream, {TASK_FIELD: raw})
                return pipe.execute()

        ids.extend(str(i) for i in await link.call(f"adding entries to {stream}", add))

    try:
        if isinstance(tasks, AsyncIterable):
            async for task in tasks:
                await send([encode_task(task)])
        else:
            chunk: list[bytes] = []
            for task in tasks:
                chunk.append(encode_task(task))
                if len(chunk) >= batch:
                    await send(chunk)
                    chunk = []
            if chunk:
                await send(chunk)
    finally:
        link.close()
    return ids
