"""`batching`: the one helper behind the loops that send many small messages in one trip."""

from __future__ import annotations

import trio

from trio_tasksets._core.batching import coalesce, take_ready


async def test_take_ready_takes_what_is_queued_up_to_the_limit_without_waiting() -> None:
    send, receive = trio.open_memory_channel[int](100)
    for i in range(1, 8):
        send.send_nowait(i)
    assert take_ready(receive, 0, 5) == [0, 1, 2, 3, 4]  # the limit counts the first
    assert take_ready(receive, 9, 100) == [9, 5, 6, 7]  # then what is left; no wait
    assert take_ready(receive, 10, 100) == [10]  # an empty channel: the first alone
    with send, receive:
        pass


async def test_coalesce_gathers_what_runnable_tasks_add_and_ends_on_a_quiet_tick() -> None:
    pending: list[int] = [0]
    async with trio.open_nursery() as nursery:
        for i in range(1, 4):
            nursery.start_soon(lambda i=i: _add(pending, i))  # type: ignore[misc]
        await coalesce(pending, 100)
        assert sorted(pending) == [0, 1, 2, 3]  # all added before the message goes
    full = [0, 1, 2]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_add, full, 3)
        await coalesce(full, 3)  # at its limit already: it goes as it is
        assert full == [0, 1, 2]


async def _add(pending: list[int], value: int) -> None:
    pending.append(value)
