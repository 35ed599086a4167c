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
    tasks that are runnable now add goes into the same message. Bounded: one tick that adds
    nothing ends it, so a busy process still flushes."""
    count = -1
    while count != len(pending) and len(pending) < limit:
        count = len(pending)
        await trio.lowlevel.cancel_shielded_checkpoint()
