"""`RedisResults`: publish an episode and acknowledge its task in one transaction; `enqueue`."""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterable, Sequence
from typing import Any

import attrs
import orjson
import redis
from redis.typing import EncodableT, FieldT

from ..env import Episode
from .entries import TASK_FIELD, EntryRef, Log, check_url, encode_task, stderr_log
from .link import Link

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
        self._link = Link(url, read_timeout=10.0, log=self.log)

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
    link = Link(url, read_timeout=10.0, log=log or stderr_log("trio_tasksets.redis"))
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
