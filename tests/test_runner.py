"""The runner contract, SPEC section 1: one test (or more) per point R1-R8."""

from __future__ import annotations

import signal
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import trio
import trio.testing
from trio.testing import MockClock

import trio_tasksets as tt
from trio_tasksets.testing import Feed, Gate


class Boom(Exception):
    pass


async def collect(channel: trio.abc.ReceiveChannel[tuple[int, Any]]) -> list[tuple[int, Any]]:
    return [pair async for pair in channel]


# --- R1 pull only when freed ----------------------------------------------------------------


@pytest.mark.parametrize("window", [1, 2, 5])
# duplicates: test_window's resize tests start the same way; each file reads alone, R1 here
async def test_r1_exactly_window_items_pulled_while_runs_are_held(
    autojump_clock: MockClock, window: int
) -> None:
    feed: Feed[int] = Feed(*range(20))
    feed.end()
    gate = Gate()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: tt.run_stream(feed, gate.run, window=window))
        with trio.fail_after(5):
            await gate.wait_running(window)
        await trio.testing.wait_all_tasks_blocked()
        assert feed.pulled == window
        assert gate.running == window
        gate.open()
    assert feed.pulled == 20
    assert gate.peak == window


async def test_r1_next_pull_follows_each_freed_slot(autojump_clock: MockClock) -> None:
    window = 3
    finished = 0
    finished_at_pull: list[int] = []

    async def source() -> AsyncIterator[int]:
        for i in range(10):
            finished_at_pull.append(finished)
            yield i

    async def run(item: int) -> int:
        nonlocal finished
        await trio.sleep(1 + item)  # distinct finishing times
        finished += 1
        return item

    assert await tt.run_stream(source(), run, window=window) == list(range(10))
    # Pull k (0-based) needs a free slot: at least k - window + 1 runs have finished.
    assert all(f >= k - window + 1 for k, f in enumerate(finished_at_pull))
    assert finished_at_pull[:window] == [0] * window  # the first window fills at once
    assert finished_at_pull[window] == 1  # the next waits for the first to finish


async def test_r1_as_completed_pulls_only_when_freed(autojump_clock: MockClock) -> None:
    feed: Feed[int] = Feed(*range(10))
    feed.end()
    gate = Gate()
    async with tt.as_completed(feed, gate.run, window=2) as results:
        with trio.fail_after(5):
            await gate.wait_running(2)
        await trio.testing.wait_all_tasks_blocked()
        assert feed.pulled == 2
        gate.open()
        got = await collect(results)
    assert sorted(i for i, _ in got) == list(range(10))


# --- R2 bounds ------------------------------------------------------------------------------


async def test_r2_window_none_is_unbounded(autojump_clock: MockClock) -> None:
    feed: Feed[int] = Feed(*range(50))
    feed.end()
    gate = Gate()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: tt.run_stream(feed, gate.run, window=None))
        with trio.fail_after(5):
            await gate.wait_running(50)
        gate.open()
    assert gate.peak == 50


@pytest.mark.parametrize("window", [0, -1, 1.5, "2", True])
async def test_r2_bad_window_raises_before_anything_is_pulled(
    autojump_clock: MockClock, window: Any
) -> None:
    feed: Feed[int] = Feed(1, 2, 3)
    with pytest.raises(ValueError, match="window"):
        await tt.run_stream(feed, Gate(opened=True).run, window=window)
    with pytest.raises(ValueError, match="window"):
        tt.as_completed(feed, Gate(opened=True).run, window=window)
    assert feed.pulled == 0


async def test_bad_source_and_run_name_the_argument(autojump_clock: MockClock) -> None:
    with pytest.raises(TypeError, match=r"source must be an async iterable.*sync iterable"):
        await tt.run_stream([1, 2], Gate(opened=True).run, window=1)  # type: ignore[arg-type]
    feed: Feed[int] = Feed(1)
    with pytest.raises(TypeError, match="run must be an async callable"):
        await tt.run_stream(feed, None, window=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="source"):
        tt.take(42, 1)  # type: ignore[arg-type]
    assert feed.pulled == 0


# --- R3 order -------------------------------------------------------------------------------


async def test_r3_results_in_submission_order_while_completion_order_differs(
    autojump_clock: MockClock,
) -> None:
    feed: Feed[int] = Feed(3, 2, 1, 0)
    feed.end()
    finished: list[int] = []

    async def run(item: int) -> str:
        await trio.sleep(item)
        finished.append(item)
        return f"r{item}"

    results = await tt.run_stream(feed, run, window=None)
    assert finished == [0, 1, 2, 3]
    assert results == ["r3", "r2", "r1", "r0"]


async def test_r3_as_completed_yields_in_completion_order_with_indices(
    autojump_clock: MockClock,
) -> None:
    feed: Feed[int] = Feed(3, 2, 1, 0)
    feed.end()

    async def run(item: int) -> str:
        await trio.sleep(item)
        return f"r{item}"

    async with tt.as_completed(feed, run, window=None) as results:
        got = await collect(results)
    assert got == [(3, "r0"), (2, "r1"), (1, "r2"), (0, "r3")]


async def test_r3_unread_result_holds_its_slot_and_back_pressures_the_feed(
    autojump_clock: MockClock,
) -> None:
    feed: Feed[int] = Feed(*range(100))

    async def run(item: int) -> int:
        return item

    async with tt.as_completed(feed, run, window=3) as results:
        await trio.testing.wait_all_tasks_blocked()
        # Nothing read: 3 results wait for the consumer, holding the 3 slots; no 4th pull.
        assert feed.pulled == 3
        first = await results.receive()
        await trio.testing.wait_all_tasks_blocked()
        assert feed.pulled == 4
    assert first[0] in (0, 1, 2)
    assert feed.close_calls == 1


async def test_r3_empty_source(autojump_clock: MockClock) -> None:
    feed: Feed[int] = Feed()
    feed.end()
    assert await tt.run_stream(feed, Gate(opened=True).run, window=2) == []
    assert feed.close_calls == 1


# --- R4 fail-fast ---------------------------------------------------------------------------


@pytest.mark.parametrize("window", [3, None])
async def test_r4_failure_cancels_the_rest_reraises_unwrapped_and_closes(
    autojump_clock: MockClock, window: int | None
) -> None:
    feed: Feed[int] = Feed(0, 1, 2)
    cancelled: list[int] = []
    boom = Boom("boom")

    async def run(item: int) -> int:
        try:
            if item == 1:
                await trio.sleep(1)
                raise boom
            await trio.sleep_forever()
        except trio.Cancelled:
            cancelled.append(item)
            raise
        return item

    with pytest.raises(Boom) as info:
        await tt.run_stream(feed, run, window=window)
    assert info.value is boom
    assert sorted(cancelled) == [0, 2]
    assert feed.pulled == 3
    assert feed.close_calls == 1
    assert not feed.closed_while_pulling


@pytest.mark.parametrize("window", [2, None])
async def test_r4_failure_while_the_feed_is_quiet_raises_at_once(
    autojump_clock: MockClock, window: int | None
) -> None:
    feed: Feed[int] = Feed(7)  # one item, then the feed goes quiet forever

    async def run(item: int) -> int:
        await trio.sleep(2)
        raise Boom(item)

    start = trio.current_time()
    with trio.fail_after(60), pytest.raises(Boom):
        await tt.run_stream(feed, run, window=window)
    assert trio.current_time() - start == 2  # at the virtual time of the failure, not later
    assert feed.close_calls == 1
    assert not feed.closed_while_pulling
    assert not feed.foreign_close


async def test_r4_as_completed_failure_while_consumer_waits(autojump_clock: MockClock) -> None:
    feed: Feed[int] = Feed(1)

    async def run(item: int) -> int:
        await trio.sleep(1)
        raise Boom(item)

    with trio.fail_after(60), pytest.raises(Boom):
        async with tt.as_completed(feed, run, window=2) as results:
            await collect(results)
    assert feed.close_calls == 1


async def test_r4_a_second_failure_while_unwinding_is_attached_to_the_first(
    autojump_clock: MockClock,
) -> None:
    feed: Feed[int] = Feed(0, 1)

    async def run(item: int) -> int:
        if item == 0:
            await trio.sleep(1)
            raise Boom("first")
        try:
            await trio.sleep_forever()
        finally:
            raise KeyError("second, during cleanup")
        return item

    with pytest.raises(Boom, match="first") as info:
        await tt.run_stream(feed, run, window=2)
    notes = getattr(info.value, "__notes__", [])
    assert any("KeyError" in note and "second" in note for note in notes)


# --- R5 source errors -----------------------------------------------------------------------


async def test_r5_source_error_cancels_the_runs_and_is_reraised_itself(
    autojump_clock: MockClock,
) -> None:
    feed: Feed[int] = Feed(0, 1)
    error = Boom("feed broke")
    gate = Gate()

    async def run(item: int) -> int:
        if item == 1:
            feed.fail(error)  # the next pull raises it while runs 0 and 1 are held
        return await gate.run(item)

    with trio.fail_after(5), pytest.raises(Boom) as info:
        await tt.run_stream(feed, run, window=3)
    assert info.value is error
    assert gate.cancelled == 2
    assert feed.close_calls == 1


async def test_r5_async_generator_source_error(autojump_clock: MockClock) -> None:
    closed: list[bool] = []

    async def source() -> AsyncGenerator[int, None]:
        try:
            yield 1
            raise Boom("from the generator")
        finally:
            closed.append(True)

    with pytest.raises(Boom, match="from the generator"):
        await tt.run_stream(source(), Gate(opened=True).run, window=2)
    assert closed == [True]


# --- R6 outside cancellation ----------------------------------------------------------------


@pytest.mark.parametrize("window", [2, None])
async def test_r6_cancelling_the_caller_closes_a_feed_parked_on_its_next_item(
    autojump_clock: MockClock, window: int | None
) -> None:
    feed: Feed[int] = Feed(1, 2)
    gate = Gate(opened=True)
    with trio.move_on_after(5) as scope:
        await tt.run_stream(feed, gate.run, window=window)
    assert scope.cancelled_caught
    assert feed.pulled == 2
    assert feed.close_calls == 1
    assert not feed.closed_while_pulling


async def test_r6_cancellation_propagates_as_cancelled_not_a_group(
    autojump_clock: MockClock,
) -> None:
    feed: Feed[int] = Feed(1)
    seen: list[BaseException] = []
    with trio.CancelScope() as scope:
        scope.deadline = trio.current_time() + 1
        try:
            await tt.run_stream(feed, Gate().run, window=2)
        except BaseException as exc:
            seen.append(exc)
            raise
    assert len(seen) == 1
    assert isinstance(seen[0], trio.Cancelled)
    assert feed.close_calls == 1


async def test_r6_keyboard_interrupt_stays_keyboard_interrupt(autojump_clock: MockClock) -> None:
    feed: Feed[int] = Feed(0, 1, 2)

    async def run(item: int) -> int:
        if item == 1:
            raise KeyboardInterrupt
        await trio.sleep_forever()
        return item

    with pytest.raises(KeyboardInterrupt):
        await tt.run_stream(feed, run, window=3)
    assert feed.close_calls == 1


async def test_r6_a_real_sigint_is_keyboard_interrupt(autojump_clock: MockClock) -> None:
    feed: Feed[int] = Feed(0)

    async def run(item: int) -> int:
        signal.raise_signal(signal.SIGINT)
        await trio.sleep_forever()
        return item

    with pytest.raises(KeyboardInterrupt):
        await tt.run_stream(feed, run, window=1)
    assert feed.close_calls == 1


# --- R7 close-out ---------------------------------------------------------------------------


# duplicates: test_until builds a feed as these do; the close-out rules are this file's
async def test_r7_close_once_from_the_iterating_task_on_normal_end(
    autojump_clock: MockClock,
) -> None:
    feed: Feed[int] = Feed(*range(5))
    feed.end()
    assert await tt.run_stream(feed, Gate(opened=True).run, window=2) == list(range(5))
    assert feed.close_calls == 1
    assert not feed.foreign_close


async def test_r7_as_completed_consumer_leaving_early_closes_and_cancels(
    autojump_clock: MockClock,
) -> None:
    feed: Feed[int] = Feed(*range(10))
    gate = Gate()

    async def slow(item: int) -> int:
        await trio.sleep(item)
        return item

    async with tt.as_completed(feed, gate.wrap(slow), window=3) as results:
        gate.open()
        await results.receive()
    assert feed.close_calls == 1
    assert gate.running == 0
    assert not feed.closed_while_pulling


async def test_r7_close_error_is_raised_when_nothing_else_failed(autojump_clock: MockClock) -> None:
    class BadClose(Feed[int]):
        async def aclose(self) -> None:
            await super().aclose()
            raise Boom("close failed")

    feed = BadClose(1)
    feed.end()
    with pytest.raises(Boom, match="close failed"):
        await tt.run_stream(feed, Gate(opened=True).run, window=1)
    assert feed.close_calls == 1


# duplicates: each R5/R7 test writes its own generator source: its finally block is the point
async def test_r7_close_is_shielded_even_when_cancelled(autojump_clock: MockClock) -> None:
    closed_fully: list[bool] = []

    async def source() -> AsyncGenerator[int, None]:
        try:
            yield 1
            yield 2
        finally:
            await trio.sleep(1)  # an async cleanup: would be cut short without the shield
            closed_fully.append(True)

    async def forever(item: int) -> int:
        await trio.sleep_forever()
        return item

    # window=1: the generator sits at its first yield when the caller is cancelled.
    with trio.move_on_after(3):
        await tt.run_stream(source(), forever, window=1)
    assert closed_fully == [True]


async def test_r7_memory_channel_source(autojump_clock: MockClock) -> None:
    send, receive = trio.open_memory_channel[int](0)

    async def produce() -> None:
        async with send:
            for i in range(5):
                await send.send(i)

    async def double(item: int) -> int:
        return item * 2

    async with trio.open_nursery() as nursery:
        nursery.start_soon(produce)
        assert await tt.run_stream(receive, double, window=2) == [0, 2, 4, 6, 8]
    with pytest.raises(trio.ClosedResourceError):
        receive.receive_nowait()


async def test_r7_a_distinct_iterator_and_source_are_each_closed_once(
    autojump_clock: MockClock,
) -> None:
    class Source:
        def __init__(self) -> None:
            self.closes = 0
            self.feed: Feed[int] = Feed(1, 2)
            self.feed.end()

        def __aiter__(self) -> AsyncIterator[int]:
            return self.feed

        async def aclose(self) -> None:
            self.closes += 1

    source = Source()
    assert await tt.run_stream(source, Gate(opened=True).run, window=1) == [1, 2]
    assert source.closes == 1
    assert source.feed.close_calls == 1


# --- R8 take --------------------------------------------------------------------------------


async def test_r8_take_never_requests_an_extra_item_and_closes(autojump_clock: MockClock) -> None:
    feed: Feed[int] = Feed(0, 1, 2, 3)  # no end: a 5th pull would park forever
    with trio.fail_after(5):
        got = [item async for item in tt.take(feed, 2)]
    assert got == [0, 1]
    assert feed.pulled == 2
    assert feed.close_calls == 1


async def test_r8_take_fewer_when_the_source_ends(autojump_clock: MockClock) -> None:
    feed: Feed[int] = Feed(0, 1)
    feed.end()
    assert [item async for item in tt.take(feed, 5)] == [0, 1]
    assert feed.close_calls == 1


async def test_r8_take_zero_pulls_nothing_and_negative_raises(autojump_clock: MockClock) -> None:
    feed: Feed[int] = Feed(0)
    assert [item async for item in tt.take(feed, 0)] == []
    assert feed.pulled == 0
    assert feed.close_calls == 1
    with pytest.raises(ValueError, match="n must be >= 0"):
        tt.take(Feed(), -1)
    with pytest.raises(TypeError, match="n must be an int"):
        tt.take(Feed(), 1.5)  # type: ignore[arg-type]


async def test_r8_take_feeds_the_runner_on_a_never_ending_feed(autojump_clock: MockClock) -> None:
    feed: Feed[int] = Feed(*range(100))  # never ends
    gate = Gate(opened=True)
    with trio.fail_after(5):
        results = await tt.run_stream(tt.take(feed, 7), gate.run, window=3)
    assert results == list(range(7))
    assert feed.pulled == 7
    assert feed.close_calls == 1


async def test_a_tasks_rollouts_are_windowed_one_by_one(autojump_clock: MockClock) -> None:
    feed: Feed[int] = Feed(*range(50))
    feed.end()

    async def slow(item: int) -> int:
        await trio.sleep(0.1)
        return item

    gate = Gate(opened=True)
    results = await tt.run_stream(feed, gate.wrap(slow), window=1)
    assert results == list(range(50))
    assert gate.peak == 1
    assert feed.close_calls == 1


@pytest.mark.parametrize("window", [1, 3])
async def test_r4_nothing_more_is_pulled_after_a_failure_from_an_instant_source(
    autojump_clock: MockClock, window: int
) -> None:
    pulled = 0

    async def instant() -> AsyncGenerator[int, None]:  # never awaits: no checkpoint of its own
        nonlocal pulled
        while True:
            pulled += 1
            yield pulled

    async def boom(item: int) -> int:
        raise KeyError(item)

    with trio.fail_after(5), pytest.raises(KeyError):
        await tt.run_stream(instant(), boom, window=window)
    assert pulled == window


async def test_as_completed_never_hands_out_a_group(autojump_clock: MockClock) -> None:
    """The consumer's own error and a run's failure in the same instant: one of them, bare,
    the other attached as a note."""
    feed: Feed[int] = Feed(0, 1)
    feed.end()

    async def run(item: int) -> int:
        await trio.sleep(1)
        if item == 1:
            raise KeyError("run")
        return item

    async def consume() -> None:
        async with tt.as_completed(feed, run, window=2) as results:
            await results.receive()
            raise ValueError("consumer")

    with trio.fail_after(5), pytest.raises((KeyError, ValueError)) as info:
        await consume()
    assert not isinstance(info.value, BaseExceptionGroup)


# --- issue 9: the runner's last edges ---------------------------------------------------------


class SlowCloseFeed(Feed[int]):
    """A Feed whose `aclose` takes a virtual second (an async cleanup that can be cut)."""

    async def aclose(self) -> None:
        await super().aclose()
        await trio.sleep(1)


class SplitSource:
    """A source whose `aiter()` is a distinct Feed, each with its own `aclose` to count."""

    def __init__(self, *items: int) -> None:
        self.closes = 0
        self.feed: Feed[int] = SlowCloseFeed(*items)

    def __aiter__(self) -> AsyncIterator[int]:
        return self.feed

    async def aclose(self) -> None:
        self.closes += 1


async def test_r8_take_closes_exactly_once_when_a_failure_lands_during_its_close(
    autojump_clock: MockClock,
) -> None:
    """take(source, 1) with window=2: the second pull finds take exhausted and closes the
    source; run 0 fails while that close is at a checkpoint. The close must still finish."""
    source = SplitSource(0, 1, 2)

    async def boom(item: int) -> int:
        raise Boom(item)

    with trio.fail_after(5), pytest.raises(Boom):
        await tt.run_stream(tt.take(source, 1), boom, window=2)
    assert source.feed.close_calls == 1
    assert source.closes == 1


async def test_r8_take_lets_a_generator_finish_its_cleanup_when_a_failure_lands_there(
    autojump_clock: MockClock,
) -> None:
    cleaned: list[str] = []

    async def source() -> AsyncGenerator[int, None]:
        try:
            for i in range(10):
                yield i
        finally:
            await trio.sleep(1)  # an async cleanup, interrupted without a shield
            cleaned.append("done")

    async def boom(item: int) -> int:
        raise Boom(item)

    with trio.fail_after(5), pytest.raises(Boom):
        await tt.run_stream(tt.take(source(), 1), boom, window=2)
    assert cleaned == ["done"]


async def test_r8_take_exhausted_under_an_outside_cancel_still_closes_fully(
    autojump_clock: MockClock,
) -> None:
    """Iterated by hand: the cancel lands while take closes its exhausted source."""
    source = SplitSource(0, 1)
    taken = tt.take(source, 1)
    with trio.CancelScope() as scope:
        assert await taken.__anext__() == 0
        scope.cancel()
        with pytest.raises(StopAsyncIteration):
            await taken.__anext__()
    assert source.feed.close_calls == 1
    assert source.closes == 1


async def run_with(
    api: str, source: Any, run: Callable[[Any], Awaitable[Any]], *, window: int
) -> list[Any]:
    """Run the source through `run_stream`, or through `as_completed` read to the end."""
    if api == "run_stream":
        return await tt.run_stream(source, run, window=window)
    async with tt.as_completed(source, run, window=window) as results:
        return [result async for _, result in results]


class RequestCountingFeed(Feed[int]):
    """A Feed that also counts pulls begun (`requests`), not only items handed out."""

    requests = 0

    async def __anext__(self) -> int:
        self.requests += 1
        return await super().__anext__()


@pytest.mark.parametrize("fatal", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("api", ["run_stream", "as_completed"])
async def test_r4_no_pull_after_a_run_raises_keyboard_interrupt_or_system_exit(
    autojump_clock: MockClock, fatal: type[BaseException], api: str
) -> None:
    feed = RequestCountingFeed(*range(10))

    async def run(item: int) -> int:
        raise fatal()

    with trio.fail_after(5), pytest.raises(fatal):
        await run_with(api, feed, run, window=1)
    assert feed.requests == 1  # as for a ValueError: the failure stops the pulls
    assert feed.close_calls == 1


async def test_r4_system_exit_is_raised_itself_and_a_later_failure_is_noted(
    autojump_clock: MockClock,
) -> None:
    feed: Feed[int] = Feed(0, 1)
    first = SystemExit(3)

    async def run(item: int) -> int:
        if item == 0:
            await trio.sleep(1)
            raise first
        try:
            await trio.sleep_forever()
        finally:
            raise KeyError("second")
        return item

    with trio.fail_after(5), pytest.raises(SystemExit) as info:
        await tt.run_stream(feed, run, window=2)
    assert info.value is first
    assert any("KeyError" in note for note in getattr(first, "__notes__", []))


# duplicates: a hand-written source as test_training's Closing; each counts what its test asks
class TriggerFeed:
    """Pulling item `trigger_at` sets `event` and returns the item at once (no checkpoint),
    so a run waiting on `event` fails in the same tick as the pull returns. Records, for
    every pull, whether a run had already failed when it began."""

    def __init__(self, trigger_at: int) -> None:
        self.event = trio.Event()
        self.trigger_at = trigger_at
        self.failed = False
        self.pulls_after_failure = 0
        self.pulled = 0

    def __aiter__(self) -> TriggerFeed:
        return self

    async def __anext__(self) -> int:
        if self.failed:
            self.pulls_after_failure += 1
        index = self.pulled
        self.pulled += 1
        if index == self.trigger_at:
            self.event.set()
        return index


@pytest.mark.parametrize("api", ["run_stream", "as_completed"])
async def test_r4_no_pull_begins_after_a_failure_in_the_same_tick_as_a_pull_returns(
    autojump_clock: MockClock, api: str
) -> None:
    feed = TriggerFeed(trigger_at=1)

    async def run(item: int) -> int:
        if item == 0:
            await feed.event.wait()
            feed.failed = True
            raise Boom(item)
        await trio.sleep_forever()
        return item

    with trio.fail_after(5), pytest.raises(Boom):
        await run_with(api, feed, run, window=4)
    assert feed.pulls_after_failure == 0


async def test_a_sync_run_is_named_with_the_fix(autojump_clock: MockClock) -> None:
    feed: Feed[int] = Feed(1, 2, 3)

    def double(item: int) -> int:
        return 2 * item

    with trio.fail_after(5), pytest.raises(TypeError, match=r"run\(item\) returned int") as info:
        await tt.run_stream(feed, double, window=1)  # type: ignore[arg-type]
    assert "async def" in str(info.value)
    assert feed.pulled == 1  # a plain function may return an awaitable: known only once called
    assert feed.close_calls == 1


async def test_a_run_that_cannot_return_an_awaitable_is_refused_before_any_pull(
    autojump_clock: MockClock,
) -> None:
    async def agen(item: int) -> AsyncGenerator[int, None]:
        yield item

    def gen(item: int) -> Any:
        yield item

    runs: list[Any] = [agen, gen, int]
    for run in runs:
        feed: Feed[int] = Feed(1)
        with pytest.raises(TypeError, match="run must be an async callable"):
            await tt.run_stream(feed, run, window=1)
        with pytest.raises(TypeError, match="run must be an async callable"):
            tt.as_completed(feed, run, window=1)
        assert feed.pulled == 0


async def test_a_type_error_raised_inside_run_is_not_rewritten(autojump_clock: MockClock) -> None:
    feed: Feed[int] = Feed(1)
    error = TypeError("inside run")

    async def run(item: int) -> int:
        raise error

    with pytest.raises(TypeError) as info:
        await tt.run_stream(feed, run, window=1)
    assert info.value is error
