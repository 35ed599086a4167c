"""Tasksets, SPEC section 2: views, the streaming flag, and channel() as the one read path."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from trio.testing import MockClock

import trio_tasksets as tt
from trio_tasksets.testing import Feed, FeedTaskset, Gate


@attrs.define
class CountConfig(tt.TasksetConfig):
    size: int = 6


class Numbers(tt.Taskset[tt.Task, CountConfig]):
    """A static taskset: tasks "0".."size-1"."""

    built = 0

    def load(self) -> Iterable[tt.Task]:
        for i in range(self.config.size):
            Numbers.built += 1
            yield tt.Task(str(i), answer=str(i), info={"i": i})


class Endless(tt.Taskset[tt.Task, tt.TasksetConfig]):
    INFINITE = True

    def load(self) -> Iterator[tt.Task]:
        i = 0
        while True:
            yield tt.Task(str(i))
            i += 1


class Bare(tt.Taskset[int, tt.TasksetConfig]):
    def load(self) -> list[int]:
        return [1, 2]


def prompts(tasks: Iterable[tt.Task]) -> list[str]:
    return [str(t.prompt) for t in tasks]


async def drain(taskset: tt.Taskset[tt.Task, Any]) -> list[str]:
    async with taskset.channel() as tasks:
        return [str(t.prompt) async for t in tasks]


# --- Task -----------------------------------------------------------------------------------


def test_task_key_is_a_stable_content_hash_unless_given() -> None:
    a = tt.Task("hi", answer="x", info={"b": 1, "a": 2})
    assert a.key == tt.Task("hi", answer="x", info={"a": 2, "b": 1}).key
    assert a.key != tt.Task("hi", answer="y").key
    assert tt.Task("hi", key="mine").key == "mine"
    prompted = a.with_system_prompt("be brief")
    assert prompted.system_prompt == "be brief"
    assert prompted.key == a.key  # the same task with a system prompt is the same task
    assert a.system_prompt is None  # frozen: the original is untouched
    assert a.data == {
        "prompt": "hi",
        "answer": "x",
        "info": {"b": 1, "a": 2},
        "system_prompt": None,
    }


# --- static views ---------------------------------------------------------------------------


def test_iteration_materializes_a_finite_taskset_with_the_config() -> None:
    assert prompts(Numbers()) == ["0", "1", "2", "3", "4", "5"]
    assert prompts(Numbers(CountConfig(size=2))) == ["0", "1"]
    assert isinstance(Numbers().config, CountConfig)  # the default config comes from ConfigT


def test_head_returns_the_same_type_and_only_builds_what_it_takes() -> None:
    Numbers.built = 0
    head = Numbers().head(2)
    assert type(head) is Numbers
    assert prompts(head) == ["0", "1"]
    assert Numbers.built == 2


def test_shuffle_is_reproducible_and_the_seed_changes_it() -> None:
    base = Numbers(CountConfig(size=20))
    once = prompts(base.shuffle(seed=1))
    assert once == prompts(base.shuffle(seed=1))
    assert sorted(once, key=int) == prompts(base)
    assert once != prompts(base.shuffle(seed=2))


def test_views_do_not_mutate_the_base() -> None:
    base = Numbers()
    base.head(1)
    base.shuffle(seed=3)
    base.view(lambda t: None)
    assert prompts(base) == ["0", "1", "2", "3", "4", "5"]


def test_view_maps_and_drops() -> None:
    odd = Numbers().view(lambda t: t if int(str(t.prompt)) % 2 else None)
    assert prompts(odd) == ["1", "3", "5"]
    assert prompts(odd.head(2)) == ["1", "3"]
    with pytest.raises(TypeError, match="transform must be callable"):
        Numbers().view(3)  # type: ignore[arg-type]


def test_shuffle_refused_on_infinite_and_streaming_unless_bounded_by_head() -> None:
    with pytest.raises(ValueError, match=r"INFINITE.*head\(n\)"):
        Endless().shuffle()
    with pytest.raises(ValueError, match="streaming"):
        FeedTaskset().shuffle()
    assert sorted(prompts(Endless().head(5).shuffle(seed=0)), key=int) == ["0", "1", "2", "3", "4"]
    FeedTaskset().head(3).shuffle(seed=0)  # fine: the head bounds it


def test_head_rejects_bad_n() -> None:
    with pytest.raises(ValueError, match="n must be >= 0"):
        Numbers().head(-1)
    with pytest.raises(TypeError, match="n must be an int"):
        Numbers().head("2")  # type: ignore[arg-type]


def test_system_prompt_applies_and_a_task_that_cannot_take_one_is_a_type_error() -> None:
    tasks = list(Numbers(CountConfig(system_prompt="sys")))
    assert {t.system_prompt for t in tasks} == {"sys"}
    with pytest.raises(TypeError, match=r"cannot take one.*with_system_prompt"):
        list(Bare(tt.TasksetConfig(system_prompt="sys")))


# --- streaming and channel() ----------------------------------------------------------------


async def test_default_stream_is_iteration(autojump_clock: MockClock) -> None:
    numbers = Numbers()
    assert numbers.streaming is False
    assert FeedTaskset().streaming is True
    assert [str(t.prompt) async for t in numbers.head(2).stream()] == ["0", "1"]
    assert await drain(numbers.head(2)) == prompts(numbers.head(2))
    assert await drain(numbers.shuffle(seed=4)) == prompts(numbers.shuffle(seed=4))


async def test_channel_pulls_on_demand_with_no_prefetch(autojump_clock: MockClock) -> None:
    feed = FeedTaskset()
    feed.put(*"abcdefgh")
    async with feed.channel() as tasks:
        await trio.testing.wait_all_tasks_blocked()
        assert feed.pulled == 0
        first = await tasks.receive()
        second = await tasks.receive()
        await trio.testing.wait_all_tasks_blocked()
        assert (first.prompt, second.prompt) == ("a", "b")
        assert feed.pulled == 2
    assert feed.closed  # leaving the block closes stream()


async def test_channel_applies_system_prompt_and_views_on_the_streaming_path(
    autojump_clock: MockClock,
) -> None:
    feed = FeedTaskset(tt.TasksetConfig(system_prompt="sys"))
    feed.put(*"abcdef")  # never ends: the head alone must end the stream
    upper = feed.view(lambda t: attrs.evolve(t, prompt=str(t.prompt).upper())).head(3)
    with trio.fail_after(5):
        async with upper.channel() as tasks:
            got = [t async for t in tasks]
    assert [t.prompt for t in got] == ["A", "B", "C"]
    assert {t.system_prompt for t in got} == {"sys"}
    assert feed.pulled == 3  # never an (n+1)th pull
    assert feed.closed


async def test_streaming_head_then_shuffle_buffers_only_the_head(autojump_clock: MockClock) -> None:
    feed = FeedTaskset()
    feed.put(*"abcdefgh")
    with trio.fail_after(5):
        got = await drain(feed.head(4).shuffle(seed=1))
    assert sorted(got) == ["a", "b", "c", "d"]
    assert feed.pulled == 4


async def test_closing_the_channel_closes_a_parked_stream(autojump_clock: MockClock) -> None:
    feed = FeedTaskset()
    feed.put("a")
    with trio.move_on_after(10) as scope:
        async with feed.channel() as tasks:
            async for _ in tasks:
                pass
    assert scope.cancelled_caught
    assert feed.pulled == 1
    assert feed.closed


async def test_the_runner_reads_a_taskset_channel_and_pulls_only_as_runs_free(
    autojump_clock: MockClock,
) -> None:
    feed = FeedTaskset()
    feed.put(*"abcdefghij")
    feed.end()
    gate = Gate()
    async with feed.channel() as tasks, trio.open_nursery() as nursery:
        nursery.start_soon(lambda: tt.run_stream(tasks, gate.run, window=2))
        with trio.fail_after(5):
            await gate.wait_running(2)
        await trio.testing.wait_all_tasks_blocked()
        assert feed.pulled == 2
        gate.open()
    assert feed.pulled == 10
    assert gate.peak == 2
    assert feed.closed


async def test_static_and_streaming_share_one_path(autojump_clock: MockClock) -> None:
    async def run(task: tt.Task) -> str:
        return str(task.prompt)

    async with Numbers().head(4).channel() as tasks:
        static = await tt.run_stream(tasks, run, window=2)
    feed = FeedTaskset()
    feed.put(*"0123")
    async with feed.head(4).channel() as tasks:
        with trio.fail_after(5):
            streamed = await tt.run_stream(tasks, run, window=2)
    assert static == streamed == ["0", "1", "2", "3"]


# --- merging two feeds ----------------------------------------------------------------------


class TwoFeeds(tt.Taskset[tt.Task, tt.TasksetConfig]):
    """The documented pattern (docs/tasksets.md): a feed that merges two sources."""

    def __init__(self, left: FeedTaskset, right: FeedTaskset) -> None:
        super().__init__()
        self.left, self.right = left, right

    async def stream(self) -> AsyncIterator[tt.Task]:
        merged = tt.merge(self.left.stream(), self.right.stream())
        try:
            async for task in merged:
                yield task
        finally:
            await merged.aclose()


async def test_a_feed_merging_two_sources(autojump_clock: MockClock) -> None:
    left, right = FeedTaskset(), FeedTaskset()
    merged = TwoFeeds(left, right)
    left.put("l1", "l2")
    right.put("r1")

    async def run(task: tt.Task) -> str:
        await trio.sleep(1)
        return str(task.prompt)

    async def later() -> None:
        await trio.sleep(5)  # the merged feed is quiet meanwhile; then both sides go on
        right.put("r2")
        left.end()
        right.end()

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery, merged.channel() as tasks:
            nursery.start_soon(later)
            results = await tt.run_stream(tasks, run, window=2)
    assert sorted(results) == ["l1", "l2", "r1", "r2"]
    assert left.closed
    assert right.closed


async def test_merge_error_is_raised_itself_and_closes_every_source(
    autojump_clock: MockClock,
) -> None:
    quiet: Feed[int] = Feed(1)
    broken: Feed[int] = Feed()
    broken.fail(KeyError("feed"))
    with trio.fail_after(5), pytest.raises(KeyError, match="feed"):
        await tt.run_stream(tt.merge(quiet, broken), Gate(opened=True).run, window=2)
    assert quiet.close_calls == 1
    assert broken.close_calls == 1


async def test_merge_under_outside_cancellation_closes_every_source(
    autojump_clock: MockClock,
) -> None:
    a: Feed[int] = Feed(1, 2)
    b: Feed[int] = Feed(3)
    with trio.move_on_after(3) as scope:
        await tt.run_stream(tt.merge(a, b), Gate(opened=True).run, window=1)
    assert scope.cancelled_caught
    assert a.close_calls == b.close_calls == 1


# --- a merge suspended at its yield, closed from every direction -----------------------------


async def forever(item: Any) -> Any:
    await trio.sleep_forever()
    return item


async def test_take_of_a_merge_closes_it_at_its_yield(autojump_clock: MockClock) -> None:
    a: Feed[int] = Feed(1, 2, 3)
    b: Feed[int] = Feed(10, 20)
    with trio.fail_after(5):
        got = await tt.run_stream(tt.take(tt.merge(a, b), 2), Gate(opened=True).run, window=1)
    assert len(got) == 2
    assert a.close_calls == b.close_calls == 1


async def test_outside_cancel_while_a_merge_sits_at_its_yield(autojump_clock: MockClock) -> None:
    a: Feed[int] = Feed(1, 2)
    b: Feed[int] = Feed(3)
    with trio.move_on_after(3) as scope:  # window=1 and a run that never ends: merge at yield
        await tt.run_stream(tt.merge(a, b), forever, window=1)
    assert scope.cancelled_caught
    assert a.close_calls == b.close_calls == 1


async def test_fail_fast_while_a_merge_sits_at_its_yield(autojump_clock: MockClock) -> None:
    a: Feed[int] = Feed(1, 2)
    b: Feed[int] = Feed(3)

    async def boom(item: int) -> int:
        await trio.sleep(1)
        raise KeyError(item)

    with trio.fail_after(5), pytest.raises(KeyError):
        await tt.run_stream(tt.merge(a, b), boom, window=1)
    assert a.close_calls == b.close_calls == 1


async def test_leaving_as_completed_early_over_a_merge(autojump_clock: MockClock) -> None:
    a: Feed[int] = Feed(*range(10))
    b: Feed[int] = Feed(*range(10))
    with trio.fail_after(5):
        async with tt.as_completed(tt.merge(a, b), Gate(opened=True).run, window=2) as results:
            await results.receive()
    assert a.close_calls == b.close_calls == 1


async def test_a_merged_feed_bounded_by_head_through_channel(autojump_clock: MockClock) -> None:
    left, right = FeedTaskset(), FeedTaskset()
    left.put("l1", "l2", "l3")
    right.put("r1", "r2")  # neither side ever ends: only the head ends the read
    with trio.fail_after(5):
        got = await drain(TwoFeeds(left, right).head(3))
    assert len(got) == 3
    assert left.closed
    assert right.closed


async def test_a_merged_feed_fail_fast_through_channel(autojump_clock: MockClock) -> None:
    left, right = FeedTaskset(), FeedTaskset()
    left.put("l1")
    right.put("r1")

    async def boom(task: tt.Task) -> str:
        await trio.sleep(1)
        raise KeyError(task.prompt)

    with trio.fail_after(5), pytest.raises(KeyError):
        async with TwoFeeds(left, right).channel() as tasks:
            await tt.run_stream(tasks, boom, window=1)
    assert left.closed
    assert right.closed


@pytest.mark.parametrize("wrap", ["take", "merge"])
async def test_an_unstarted_take_or_merge_still_closes_its_source(
    autojump_clock: MockClock, wrap: str
) -> None:
    feed: Feed[int] = Feed(1, 2)
    source = tt.take(feed, 2) if wrap == "take" else tt.merge(feed)
    with trio.CancelScope() as scope:
        scope.cancel()  # cancelled before the runner's first pull
        await tt.run_stream(source, Gate(opened=True).run, window=1)
    assert feed.pulled == 0
    assert feed.close_calls == 1


# --- merge as a channel (trio.as_safe_channel): safe in any consumer --------------------------


async def test_merge_as_a_channel_takes_a_timeout_around_each_receive(
    autojump_clock: MockClock,
) -> None:
    """The case that breaks a bare merge (a cancel scope entered and left around each pull,
    while the merge's nursery sits on the iterating task): as a channel it is just a receive."""
    a: Feed[int] = Feed(1, 2)
    b: Feed[int] = Feed(3)  # neither side ends: after 3 items every receive times out
    got: list[int] = []
    timeouts = 0
    async with tt.merge(a, b) as merged:
        for _ in range(5):
            with trio.move_on_after(1) as scope:
                got.append(await merged.receive())
            timeouts += scope.cancelled_caught
    assert sorted(got) == [1, 2, 3]
    assert timeouts == 2
    assert a.close_calls == b.close_calls == 1
    assert not a.foreign_close
    assert not b.foreign_close


async def test_merge_as_a_channel_raises_a_source_error_itself(autojump_clock: MockClock) -> None:
    quiet: Feed[int] = Feed(1)
    broken: Feed[int] = Feed()
    error = KeyError("feed")
    broken.fail(error)
    with trio.fail_after(5), pytest.raises(KeyError) as info:
        async with tt.merge(quiet, broken) as merged:
            await tt.run_stream(merged, Gate(opened=True).run, window=2)
    assert info.value is error
    assert quiet.close_calls == broken.close_calls == 1


async def test_take_of_a_merge_channel_closes_both_sides_under_a_failure(
    autojump_clock: MockClock,
) -> None:
    a: Feed[int] = Feed(*range(10))
    b: Feed[int] = Feed(*range(10))

    async def boom(item: int) -> int:
        raise KeyError(item)

    with trio.fail_after(5), pytest.raises(KeyError):
        async with tt.merge(a, b) as merged:
            await tt.run_stream(tt.take(merged, 1), boom, window=2)
    assert a.close_calls == b.close_calls == 1


async def test_leaving_a_merge_channel_early_closes_every_source(autojump_clock: MockClock) -> None:
    a: Feed[int] = Feed(*range(10))
    b: Feed[int] = Feed(*range(10))
    with trio.fail_after(5):
        async with tt.merge(a, b) as merged:
            await merged.receive()
    assert a.close_calls == b.close_calls == 1
    assert not a.closed_while_pulling
    assert not b.closed_while_pulling


async def test_a_merge_is_used_once(autojump_clock: MockClock) -> None:
    merged = tt.merge(Feed(1))
    async with merged:
        pass
    with pytest.raises(RuntimeError, match="already used"):
        await merged.__anext__()
    bare = tt.merge(Feed(1))
    assert await bare.__anext__() == 1
    with pytest.raises(RuntimeError, match="already used"):
        async with bare:
            pass
    await bare.aclose()
