"""`RedisTaskQueue`: a Redis stream and its consumer group as the worker's `TaskQueue`.

The feed (`RedisStreamTaskset.claims`: own pending entries, then a dead worker's idle ones,
then new ones; malformed and refused entries dead-lettered) and the sink
(`RedisResults.publish_many`: each row `XADD`ed and its entry `XACK`ed in one `MULTI/EXEC`;
`keep_alive`: the idle time of held entries reset) behind the interface of
`trio_tasksets.worker`, which `trio_tasksets.worker.consume` runs. docs/distributed.md
says what each guarantee costs in Redis commands.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import TypeVar

import attrs

from ..worker import Finished, TaskEntry
from ._entries import Delivery, EntryRef, Log, redact
from ._feed import RedisStreamTaskset
from ._results import Answer, RedisResults

__all__ = ["RedisTaskQueue"]

T = TypeVar("T")


@attrs.frozen
class _Handle:
    """What a Redis entry's answer needs: the entry to acknowledge and where its result goes."""

    entry: EntryRef
    reply_to: str | None


def task_entry(delivery: Delivery) -> TaskEntry:
    """A decoded Redis entry as the loop's `TaskEntry`."""
    return TaskEntry(
        _Handle(delivery.entry, delivery.reply_to), delivery.entry.id, delivery.key,
        delivery.data, rollout=delivery.rollout, rollouts=delivery.rollouts,
        group=delivery.group, declared=delivery.declared, deadline=delivery.deadline,
        advantage=delivery.advantage,
    )  # fmt: skip


class RedisTaskQueue:
    """The task stream `stream` read by `consumer` in `group` at `url`, results to `results`
    (or to the stream an entry names). `claim_idle`: seconds after which an unacknowledged
    entry is taken for a dead worker's and reclaimed (held entries are kept alive every
    `claim_idle / 3` s); `block`: the longest one read waits (so a stop waits for it)."""

    # duplicates: RedisStreamTaskset's stream settings: a queue and a taskset over one stream
    def __init__(
        self,
        url: str,
        stream: str,
        group: str,
        consumer: str,
        results: str,
        *,
        claim_idle: float = 60.0,
        block: float = 0.5,
        log: Log,
    ) -> None:
        self.feed = RedisStreamTaskset(
            url, stream, group, consumer, claim_idle=claim_idle, block=block, log=log
        )
        self.results = RedisResults(url, results, log=log)

    @property
    def consumer(self) -> str:
        return self.feed.consumer

    @property
    def keep_alive_every(self) -> float:
        return self.feed.claim_idle / 3

    @property
    def stopping(self) -> bool:
        return self.feed.stopping

    def describe(self) -> str:
        feed = self.feed
        return (
            f"{feed.stream_key} (group {feed.group}) at {redact(feed.url)}; results to "
            f"{self.results.stream}; claim idle {feed.claim_idle:g} s"
        )

    def claims(
        self, build: Callable[[TaskEntry], T], *, room: Callable[[], int]
    ) -> AsyncIterator[T]:
        return self.feed.claims(lambda delivery: build(task_entry(delivery)), room=room)

    async def publish(self, batch: Sequence[Finished]) -> None:
        answers = []
        for finished in batch:
            handle: _Handle = finished.entry.handle
            episodes = finished.episodes
            group = episodes if finished.entry.group is not None else ()
            answers.append(Answer(episodes[0], handle.entry, handle.reply_to, finished.meta, group))
        await self.results.publish_many(answers)

    async def keep_alive(self, held: Sequence[TaskEntry]) -> None:
        await self.results.keep_alive(self.consumer, [entry.handle.entry for entry in held])

    def stop(self) -> None:
        self.feed.stop()

    async def close(self) -> None:
        """Leave the group if this consumer holds nothing (its name would be noise there);
        close the connections. Retries while Redis is unreachable: bound it in time."""
        self.results.close()
        await self.feed.leave()
