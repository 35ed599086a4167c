"""Batching: many small messages into one round trip, without making any of them wait long.

Two shapes of the same idea, used by every loop that batches:

* `take_ready(channel, first, limit)`: the item a loop just received, plus whatever is
  queued on the channel already (up to `limit`), without waiting. The Redis coordinator's
  enqueue loop and a worker's publisher send each such batch in one pipelined round trip.
* `coalesce(pending, limit)`: yield to the scheduler while a list of pending messages keeps
  growing, so what the tasks runnable now add goes into the same message (the served path's
  WebSocket writers). One tick that adds nothing ends it, so a busy process still flushes.
"""

from __future__ import annotations

from typing import Any, TypeVar

import trio

__all__ = ["coalesce", "take_ready"]

T = TypeVar("T")


def take_ready(channel: trio.MemoryReceiveChannel[T], first: T, limit: int) -> list[T]:
    """`[first, ...]`: `first`, then what `channel` holds now, at most `limit` in all."""
    batch = [first]
    while len(batch) < limit:
        try:
            batch.append(channel.receive_nowait())
        except trio.WouldBlock:
            break
    return batch


async def coalesce(pending: list[Any], limit: int) -> None:
    """Yield to the scheduler while `pending` keeps growing (until it holds `limit`): what the
    tasks that are runnable now add goes into the same message. Bounded: two ticks in a row
    that add nothing end it, so a busy process still flushes. (Two, because trio runs a batch
    of runnable tasks in either order: this task may run first in the tick after it yields,
    before the others have added anything; by the next tick they all have run.)"""
    count, quiet = len(pending), 0
    while quiet < 2 and len(pending) < limit:
        await trio.lowlevel.cancel_shielded_checkpoint()
        if len(pending) == count:
            quiet += 1
        else:
            count, quiet = len(pending), 0
