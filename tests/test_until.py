"""`tt.until(source, stop)` (issue 25): a feed until a stop, under the runner contract R1-R8;
`tt.Env` without a taskset, `tt.chat_messages`, and `tt.run_stream` awaited from asyncio."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
import trio.testing
from trio.testing import MockClock

import trio_tasksets as tt
from trio_tasksets.testing import Feed, Gate


class Boom(Exception):
    pass


# --- the stops ----------------------------------------------------------------------------


async def test_an_event_cancels_a_parked_pull_and_the_runs_in_flight_finish(
    autojump_clock: MockClock,
) -> None:
    feed: Feed[int] = Feed(0, 1, 2)  # then quiet forever
    stop = trio.Event()
    finished: list[int] = []

    async def run(item: int) -> int:
        await trio.sleep(10)
        finished.append(item)
        return item

    async def stop_later() -> None:
        await trio.sleep(1)  # every run is in flight, the runner parked on the quiet feed
        stop.set()

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stop_later)
            results = await tt.run_stream(tt.until(feed, stop), run, window=8)
    assert results == [0, 1, 2]
    assert sorted(finished) == [0, 1, 2]  # the stop cancelled the pull, not the runs
    assert trio.current_time() == 10
    assert feed.pulled == 3
    assert feed.close_calls == 1
    assert not feed.closed_while_pulling
    assert not feed.foreign_close


async def test_a_predicate_is_checked_before_each_pull(autojump_clock: MockClock) -> None:
    feed: Feed[int] = Feed(*range(100))
    done: list[int] = []

    async def run(item: int) -> int:
        done.append(item)
        return item

    results = await tt.run_stream(tt.until(feed, lambda: len(done) >= 5), run, window=1)
    assert results == [0, 1, 2, 3, 4]
    assert feed.pulled == 5  # nothing pulled after the stop
    assert feed.close_calls == 1


async def test_stop_from_a_run_ends_the_feed_and_nothing_pulled_is_lost(
    autojump_clock: MockClock,
) -> None:
    feed: Feed[int] = Feed(*range(50))
    feed.end()
    ran: list[int] = []

    async def run(item: int) -> int:
        ran.append(item)
        if item == 3:
            source.stop()
        await trio.sleep(1)
        return item

    source = tt.until(feed)
    results = await tt.run_stream(source, run, window=4)
    assert source.stopped
    assert results == ran  # every item pulled ran
    assert feed.pulled == len(ran) <= 5
    assert feed.close_calls == 1


async def test_an_event_set_before_the_first_pull_pulls_nothing(
    autojump_clock: MockClock,
) -> None:
    feed: Feed[int] = Feed(1, 2)
    stop = trio.Event()
    stop.set()
    assert await tt.run_stream(tt.until(feed, stop), Gate(opened=True).run, window=2) == []
    assert feed.pulled == 0
    assert feed.close_calls == 1


# --- a pull parked on a quiet feed (issue 35) -------------------------------------------------


@pytest.mark.parametrize("through", ["until", "take"])
async def test_a_predicate_on_the_runs_stops_a_pull_parked_on_a_quiet_feed(
    autojump_clock: MockClock, through: str
) -> None:
    """The runs make the predicate true while the runner waits on the quiet feed: it is looked
    at again as each run ends, so the parked pull is cancelled and the stream ends."""
    feed: Feed[int] = Feed(0, 1, 2)  # then quiet forever
    done: list[int] = []

    async def run(item: int) -> int:
        await trio.sleep(1 + item)
        done.append(item)
        return item

    source = tt.until(feed, lambda: len(done) >= 2)
    with trio.fail_after(60):
        results = await tt.run_stream(
            source if through == "until" else tt.take(source, 10), run, window=8
        )
    assert results == [0, 1, 2]  # nothing pulled is lost: the third run finished too
    assert trio.current_time() == 3
    assert source.stopped
    assert (feed.pulled, feed.close_calls, feed.closed_while_pulling) == (3, 1, False)


async def test_a_predicate_that_raises_as_a_run_ends_fails_the_runner(
    autojump_clock: MockClock,
) -> None:
    feed: Feed[int] = Feed(0)  # then quiet
    boom = Boom("predicate")
    calls: list[int] = []

    def stop() -> bool:
        calls.append(1)
        if len(calls) > 2:  # the checks before the two pulls pass; the run's end raises
            raise boom
        return False

    with trio.fail_after(60), pytest.raises(Boom) as info:
        await tt.run_stream(tt.until(feed, stop), Gate(opened=True).run, window=2)
    assert info.value is boom
    assert feed.close_calls == 1


async def test_an_event_ends_a_plain_async_for_and_closes_the_source_once(
    autojump_clock: MockClock,
) -> None:
    """Without a runner to close it, the stream closes its source itself when it ends."""
    feed: Feed[int] = Feed(0, 1)  # then quiet
    stop = trio.Event()
    got: list[int] = []

    async def set_later() -> None:
        await trio.sleep(5)
        stop.set()

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(set_later)
            async for item in tt.until(feed, stop):
                got.append(item)
    assert got == [0, 1]
    assert trio.current_time() == 5
    assert (feed.close_calls, feed.foreign_close) == (1, False)


# --- R1-R8 hold through it ------------------------------------------------------------------


@pytest.mark.parametrize("window", [1, 3])
async def test_r1_pulls_only_when_a_place_frees(autojump_clock: MockClock, window: int) -> None:
    feed: Feed[int] = Feed(*range(20))
    feed.end()
    gate = Gate()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: tt.run_stream(tt.until(feed, trio.Event()), gate.run,
                                                 window=window))  # fmt: skip
        with trio.fail_after(5):
            await gate.wait_running(window)
        await trio.testing.wait_all_tasks_blocked()
        assert feed.pulled == window
        gate.open()
    assert feed.pulled == 20


async def test_r2_r3_order_and_bounds(autojump_clock: MockClock) -> None:
    feed: Feed[int] = Feed(*range(6))
    feed.end()

    async def run(item: int) -> int:
        await trio.sleep(6 - item)
        return item * 10

    assert await tt.run_stream(tt.until(feed), run, window=3) == [0, 10, 20, 30, 40, 50]
    with pytest.raises(ValueError, match="window"):
        await tt.run_stream(tt.until(Feed(1)), run, window=0)
    with pytest.raises(TypeError, match=r"stop must be a trio\.Event"):
        tt.until(Feed(1), stop=3)  # type: ignore[arg-type]


@pytest.mark.parametrize("stop", ["event", "none"])
async def test_r4_a_failure_while_the_feed_is_quiet_raises_itself_at_once(
    autojump_clock: MockClock, stop: str
) -> None:
    feed: Feed[int] = Feed(7)
    boom = Boom("boom")

    async def run(item: int) -> int:
        await trio.sleep(2)
        raise boom

    source = tt.until(feed, trio.Event() if stop == "event" else None)
    with trio.fail_after(60), pytest.raises(Boom) as info:
        await tt.run_stream(source, run, window=2)
    assert info.value is boom
    assert trio.current_time() == 2
    assert feed.close_calls == 1
    assert not feed.closed_while_pulling
    assert not feed.foreign_close


@pytest.mark.parametrize("stop", ["event", "none"])
async def test_r5_a_source_error_is_raised_itself(autojump_clock: MockClock, stop: str) -> None:
    feed: Feed[int] = Feed(1)
    boom = Boom("feed broke")
    feed.fail(boom)  # after the first item
    source = tt.until(feed, trio.Event() if stop == "event" else None)
    with pytest.raises(Boom) as info:
        await tt.run_stream(source, Gate(opened=True).run, window=2)
    assert info.value is boom
    assert feed.pulled == 1


async def test_r6_an_outside_cancel_is_not_taken_for_a_stop(autojump_clock: MockClock) -> None:
    feed: Feed[int] = Feed(1)  # then quiet
    with trio.move_on_after(3) as scope:
        await tt.run_stream(tt.until(feed, trio.Event()), Gate(opened=True).run, window=2)
        pytest.fail("the runner returned as if the feed had ended")
    assert scope.cancelled_caught
    assert feed.close_calls == 1


async def test_r6_keyboard_interrupt_stays_keyboard_interrupt(autojump_clock: MockClock) -> None:
    async def source() -> AsyncIterator[int]:
        yield 1
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        await tt.run_stream(tt.until(source(), trio.Event()), Gate(opened=True).run, window=1)


async def test_r7_closed_once_from_the_iterating_task_on_every_end(
    autojump_clock: MockClock,
) -> None:
    ended: Feed[int] = Feed(1, 2)
    ended.end()
    assert await tt.run_stream(tt.until(ended), Gate(opened=True).run, window=2) == [1, 2]
    assert (ended.close_calls, ended.foreign_close) == (1, False)

    channel_send, channel = trio.open_memory_channel[int](5)
    await channel_send.send(1)
    async with tt.as_completed(tt.until(channel, trio.Event()), Gate(opened=True).run,
                               window=2) as results:  # fmt: skip
        assert await results.receive() == (0, 1)
    with pytest.raises(trio.ClosedResourceError):
        await channel.receive()  # the runner closed the channel through until

    unused: Feed[int] = Feed(1)
    source = tt.until(unused)
    await source.aclose()
    await source.aclose()
    assert unused.close_calls == 1
    with pytest.raises(StopAsyncIteration):
        await source.__anext__()


async def test_r8_take_of_until_pulls_exactly_n(autojump_clock: MockClock) -> None:
    feed: Feed[int] = Feed(*range(10))
    results = await tt.run_stream(tt.take(tt.until(feed, trio.Event()), 3),
                                  Gate(opened=True).run, window=2)  # fmt: skip
    assert results == [0, 1, 2]
    assert feed.pulled == 3
    assert feed.close_calls == 1


async def test_a_bare_merge_is_refused_and_the_channel_form_works(
    autojump_clock: MockClock,
) -> None:
    async def numbers(start: int) -> AsyncIterator[int]:
        for i in range(start, start + 3):
            yield i

    with pytest.raises(TypeError, match=r"async with tt\.merge"):
        tt.until(tt.merge(numbers(0), numbers(10)))
    async with tt.merge(numbers(0), numbers(10)) as merged:
        results = await tt.run_stream(tt.until(merged, lambda: False), Gate(opened=True).run,
                                      window=2)  # fmt: skip
    assert sorted(results) == [0, 1, 2, 10, 11, 12]


# --- an env without a taskset, chat_messages -----------------------------------------------


async def test_an_env_without_a_taskset_runs_the_tasks_it_is_given(
    autojump_clock: MockClock,
) -> None:
    env: tt.Env[tt.Task] = tt.Env(reward=lambda task, completion: float(completion == "hi"))
    assert list(env.taskset) == []
    ctx = tt.ModelContext(tt.EchoClient(), "echo")
    async with env.serving():
        episode = await env.run_slot(tt.RunSlot(tt.Task("hi")), ctx)
    assert (episode.ok, episode.reward, episode.completion) == (True, 1.0, "hi")


def test_chat_messages_is_public_and_copies_a_message_prompt() -> None:
    prompt = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    task = tt.Task(prompt, system_prompt="sys")
    messages = tt.chat_messages(task)
    assert messages == [{"role": "system", "content": "sys"}, *prompt]
    messages[1]["content"] = "changed"
    assert prompt[0]["content"] == "a"
    assert tt.chat_messages(tt.Task("q")) == [{"role": "user", "content": "q"}]


# --- from asyncio: a clear error naming tt.aio -------------------------------------------------


@pytest.mark.parametrize("api", ["run_stream", "as_completed", "run_eval"])
def test_awaiting_the_trio_api_from_asyncio_names_tt_aio(api: str) -> None:
    async def main() -> Any:
        async def run(item: int) -> int:
            return item

        if api == "run_stream":
            return await tt.run_stream(Feed(1), run, window=1)
        if api == "as_completed":
            async with tt.as_completed(Feed(1), run, window=1):
                return None
        env: tt.Env[tt.Task] = tt.Env(tt.Taskset())
        return await tt.run_eval(env, tt.ModelContext(tt.EchoClient(), "echo"), tt.EvalConfig())

    named = "run_stream" if api == "as_completed" else api  # tt.aio has no as_completed
    with pytest.raises(RuntimeError, match=rf"use `await tt\.aio\.{named}\(\.\.\.\)`") as info:
        asyncio.run(main())
    assert "awaited from asyncio" in str(info.value)
    assert "RunContext" not in str(info.value)


def test_tt_aio_run_stream_still_works_from_asyncio() -> None:
    async def main() -> list[int]:
        async def run(item: int) -> int:
            return item * 2

        async def source() -> AsyncIterator[int]:
            for i in range(3):
                yield i

        return await tt.aio.run_stream(source(), run, window=2)

    assert asyncio.run(main()) == [0, 2, 4]
