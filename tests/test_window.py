"""tt.Window (a resizable runner window), the adaptive controller and the CLI form."""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import AsyncGenerator
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from trio.testing import MockClock

import trio_tasksets as tt
from trio_tasksets._core.adaptive import (
    AdaptiveBounds,
    AdaptiveController,
    AdaptiveWindow,
    Change,
    Outcome,
    WindowArgumentError,
    build_window,
    check_window_spec,
    parse_window,
    window_spec,
)
from trio_tasksets._core.window import Window
from trio_tasksets.testing import Feed, Gate


class Boom(Exception):
    pass


class Held:
    """Runs that each wait for their own release: `release(i)` lets run i finish."""

    def __init__(self) -> None:
        self.events: dict[int, trio.Event] = {}
        self.running: set[int] = set()
        self.cancelled = 0

    def _event(self, item: int) -> trio.Event:
        return self.events.setdefault(item, trio.Event())

    async def run(self, item: int) -> int:
        self.running.add(item)
        try:
            await self._event(item).wait()
        except trio.Cancelled:
            self.cancelled += 1
            raise
        finally:
            self.running.discard(item)
        return item

    def release(self, item: int) -> None:
        self._event(item).set()


async def drive(api: str, source: Any, run: Any, window: Any) -> list[Any]:
    if api == "run_stream":
        return await tt.run_stream(source, run, window=window)
    async with tt.as_completed(source, run, window=window) as results:
        return [result async for _, result in results]


APIS = ["run_stream", "as_completed"]


# --- resizing while a runner uses the window -----------------------------------------------


@pytest.mark.parametrize("api", APIS)
async def test_growing_2_to_5_pulls_exactly_3_more_at_once(
    autojump_clock: MockClock, api: str
) -> None:
    feed: Feed[int] = Feed(*range(20))
    feed.end()
    gate = Gate()
    window = Window(2)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(drive, api, feed, gate.run, window)
        with trio.fail_after(5):
            await gate.wait_running(2)
        await trio.testing.wait_all_tasks_blocked()
        assert feed.pulled == 2
        before = trio.current_time()
        window.size = 5
        await trio.testing.wait_all_tasks_blocked()
        assert trio.current_time() == before  # at once: no virtual time passed
        assert feed.pulled == 5
        assert gate.running == 5
        assert window.in_flight == 5
        gate.open()
    assert feed.pulled == 20
    assert gate.peak == 5
    assert window.in_flight == 0


@pytest.mark.parametrize("api", APIS)
# duplicates: grow and shrink start alike (a feed, a gate, a window); each states its own rule
async def test_shrinking_5_to_1_cancels_nothing_and_pulls_nothing_until_in_flight_is_below(
    autojump_clock: MockClock, api: str
) -> None:
    feed: Feed[int] = Feed(*range(20))
    feed.end()
    held = Held()
    window = Window(5)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(drive, api, feed, held.run, window)
        await trio.testing.wait_all_tasks_blocked()
        assert feed.pulled == 5
        window.size = 1
        await trio.testing.wait_all_tasks_blocked()
        assert held.running == {0, 1, 2, 3, 4}  # nothing cancelled
        for item in range(4):
            held.release(item)
            await trio.testing.wait_all_tasks_blocked()
            assert feed.pulled == 5, f"pulled with {4 - item} runs still in flight"
        held.release(4)
        await trio.testing.wait_all_tasks_blocked()
        assert feed.pulled == 6  # in flight fell below 1: exactly one more
        assert held.running == {5}
        for item in range(5, 20):
            held.release(item)
    assert held.cancelled == 0
    assert window.in_flight == 0


async def test_r1_holds_against_the_current_size_over_a_schedule_of_resizes(
    autojump_clock: MockClock,
) -> None:
    window = Window(3)
    in_flight = peak_excess = 0
    sizes = {5: 6, 12: 1, 20: 4, 31: 2}

    async def run(item: int) -> int:
        nonlocal in_flight, peak_excess
        in_flight += 1
        peak_excess = max(peak_excess, in_flight - window.size)
        await trio.sleep(1 + item % 3)
        in_flight -= 1
        return item

    async def resize() -> None:
        for at, size in sizes.items():
            await trio.sleep_until(start + at)
            window.size = size

    async def source() -> AsyncGenerator[int, None]:
        for item in range(60):
            assert in_flight < window.size, "pulled with the window full"
            yield item

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(resize)
        assert await tt.run_stream(source(), run, window=window) == list(range(60))
    assert peak_excess == 0
    assert [size for _, size, _ in window.history] == [3, 6, 1, 4, 2]


@pytest.mark.parametrize(
    ("api", "ending"),
    [
        *((api, ending) for api in APIS for ending in ["run fails", "source fails", "cancelled"]),
        ("as_completed", "consumer leaves"),
    ],
)
async def test_every_token_goes_back_to_the_window_on_every_exit(
    autojump_clock: MockClock, api: str, ending: str
) -> None:
    window = Window(3)
    feed: Feed[int] = Feed(0, 1, 2, 3)  # then quiet: one pull stays parked, holding a token

    async def run(item: int) -> int:
        await trio.sleep(1)
        if ending == "run fails" and item == 1:
            raise Boom(item)
        if ending == "source fails" and item == 3:
            feed.fail(Boom("source"))
        return item

    with trio.fail_after(60), trio.move_on_after(30):
        try:
            if api == "as_completed" and ending == "consumer leaves":
                async with tt.as_completed(feed, run, window=window) as results:
                    await results.receive()
            else:
                await drive(api, feed, run, window)
        except Boom:
            pass
    assert window.in_flight == 0
    assert window.limiter.statistics().borrowers == []


async def test_two_runners_sharing_a_window_are_bounded_together(
    autojump_clock: MockClock,
) -> None:
    window = Window(4)
    gate = Gate()
    a: Feed[int] = Feed(*range(10))
    b: Feed[int] = Feed(*range(10))
    a.end()
    b.end()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(drive, "run_stream", a, gate.run, window)
        nursery.start_soon(drive, "as_completed", b, gate.run, window)
        await trio.testing.wait_all_tasks_blocked()
        assert gate.running == 4
        assert a.pulled + b.pulled == 4
        gate.open()
    assert gate.peak == 4
    assert window.in_flight == 0


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True, None])
def test_window_size_is_an_int_of_at_least_one(bad: Any) -> None:
    with pytest.raises(ValueError, match="size"):
        Window(bad)
    window = Window(2)
    with pytest.raises(ValueError, match="size"):
        window.size = bad
    assert window.size == 2


async def test_history_records_every_size_with_its_reason_and_time(
    autojump_clock: MockClock,
) -> None:
    window = Window(4)
    await trio.sleep(2)
    window.size = 8
    window.size = 8  # unchanged: not recorded
    await trio.sleep(1.5)
    window.resize(3, "operator")
    assert window.history == [(0.0, 4, "start"), (2.0, 8, "set"), (3.5, 3, "operator")]
    assert json.loads(json.dumps(window.history)) == [
        [0.0, 4, "start"],
        [2.0, 8, "set"],
        [3.5, 3, "operator"],
    ]


def test_a_window_made_before_the_run_starts_its_clock_at_its_first_change() -> None:
    window = Window(2)
    window.size = 3  # outside a run: recorded at 0.0

    async def main() -> None:
        await trio.sleep(5)
        window.size = 4
        await trio.sleep(1)
        window.size = 5

    trio.run(main, clock=MockClock(autojump_threshold=0))
    assert window.history == [(0.0, 2, "start"), (0.0, 3, "set"), (0.0, 4, "set"), (1.0, 5, "set")]


# --- the controller, pure -------------------------------------------------------------------


def full_round(c: AdaptiveController, now: float = 0.0) -> list[Change]:
    """One round of successes with the window full."""
    changes = []
    for _ in range(max(c.size, c.min_round)):
        change = c.record(Outcome.SUCCESS, now, c.size)
        if change is not None:
            changes.append(change)
    return changes


def test_slow_start_doubles_per_full_clean_round_until_max() -> None:
    c = AdaptiveController(min=1, max=40, size=4)
    sizes = []
    for _ in range(6):
        full_round(c)
        sizes.append(c.size)
    assert sizes == [8, 16, 32, 40, 40, 40]


def test_a_round_is_max_of_size_and_min_round_successes() -> None:
    c = AdaptiveController(min=1, max=100, size=10)
    for _ in range(9):
        assert c.record(Outcome.SUCCESS, 0.0, 10) is None
    assert c.record(Outcome.SUCCESS, 0.0, 10) == Change(20, "slow start")
    small = AdaptiveController(min=1, max=100, size=1)
    for _ in range(3):
        assert small.record(Outcome.SUCCESS, 0.0, 1) is None
    assert small.record(Outcome.SUCCESS, 0.0, 1) == Change(2, "slow start")


def test_no_growth_while_under_used() -> None:
    c = AdaptiveController(min=1, max=100, size=10)
    for _ in range(50):  # 5 rounds with at most 7 of 10 in flight (< 0.8 * 10)
        assert c.record(Outcome.SUCCESS, 0.0, 7) is None
    assert c.size == 10
    for _ in range(10):  # one round in which in-flight reached 8 once: it counts
        c.record(Outcome.SUCCESS, 0.0, 8 if _ == 3 else 2)
    assert c.size == 20


def test_a_429_cuts_by_the_factor_once_per_cooldown_and_ends_slow_start() -> None:
    c = AdaptiveController(min=1, max=200, size=50)
    assert c.record(Outcome.RATE_LIMITED, 100.0, 50) == Change(40, "429")
    assert not c.slow_start
    for t in (100.0, 105.0, 114.9):  # calls made under the old size: no second cut
        assert c.record(Outcome.RATE_LIMITED, t, 45) is None
    assert c.size == 40
    # 429s have kept coming for a cooldown since the first: the overload persists, cut again.
    assert c.record(Outcome.RATE_LIMITED, 115.0, 45) == Change(32, "429")
    # After the first 429 growth is additive: +max(1, 5% of the size) per full clean round.
    full_round(c, 200.0)
    assert c.size == 33
    c.size = 60
    full_round(c, 300.0)
    assert c.size == 63


def test_a_429_pauses_growth_until_a_cooldown_without_one() -> None:
    """Calls that got a 429 and wait out their Retry-After still hold their slots, so rounds
    look full while the endpoint is saturated: growth waits for a cooldown free of 429s."""
    c = AdaptiveController(min=1, max=200, size=40, slow_start=False)
    assert c.record(Outcome.RATE_LIMITED, 0.0, 41) is None  # over-full: capped at 40 already
    for i in range(41):  # a round is 40 successes; a 429 among them (within the cooldown)
        c.record(Outcome.RATE_LIMITED if i == 20 else Outcome.SUCCESS, 1.0, 41)
    assert c.size == 40  # an unclean round does not grow
    assert full_round(c, 10.0) == []  # clean, but only 9 s after the last 429
    assert full_round(c, 16.0) == [Change(42, "grow")]


@pytest.mark.parametrize("outcome", [Outcome.SERVER_ERROR, Outcome.TIMEOUT])
def test_5xx_and_timeouts_pause_growth_and_never_cut(outcome: Outcome) -> None:
    c = AdaptiveController(min=1, max=200, size=20, slow_start=False)
    for i in range(25):  # a round of 20 successes, with 5 errors among them
        assert c.record(outcome if i % 5 == 0 else Outcome.SUCCESS, float(i), 20) is None
    for i in range(20):  # nothing but errors: still no cut
        assert c.record(outcome, float(i), 20) is None
    assert c.size == 20
    assert full_round(c) == []  # the round those errors fell in: paused
    assert full_round(c) == [Change(21, "grow")]  # the next clean round grows


def test_retry_after_never_extends_the_cooldown_so_the_size_never_freezes() -> None:
    """inspect_ai #5137: a cooldown extended by each Retry-After froze the limit. Here a 429
    with `Retry-After: 60` every second (from a full window) caps the size one lower each
    time and, the overload persisting, cuts it by the factor every 15 s, down to min; once
    the 429s stop, growth resumes a cooldown after the last one."""
    c = AdaptiveController(min=2, max=100, size=64, slow_start=False)
    cuts, sizes = [], []
    for t in range(120):
        before = c.size
        change = c.record(Outcome.RATE_LIMITED, float(t), c.size, retry_after=60.0)
        if change is not None and change.reason == "429":
            cuts.append(t)
            assert change.size == max(2, math.floor(before * 0.8))
        sizes.append(c.size)
    assert cuts == [15, 30, 45]  # then the size is at min
    assert sizes[:3] == [63, 62, 61]  # capped one lower per 429 in between
    assert sizes == sorted(sizes, reverse=True)
    assert sizes.index(2) < 60
    full_round(c, 121.0)  # the round the last 429s fell in: not clean
    full_round(c, 125.0)  # clean, but within 15 s of the last 429 (at 119)
    assert c.size == 2
    full_round(c, 134.0)  # 15 s after it, whatever the Retry-After said: growth is back
    assert c.size == 3


def test_a_429_caps_the_size_at_the_calls_the_endpoint_took() -> None:
    """After slow start, a growth step that overshoots is undone by one refused call per
    place too many, not by a cut of a fifth; a 429 with few calls in flight cuts by at most
    the factor."""
    c = AdaptiveController(min=1, max=100, size=40, slow_start=False)
    assert full_round(c, 0.0) == [Change(42, "grow")]
    assert c.record(Outcome.RATE_LIMITED, 0.1, 42) == Change(41, "429 cap")
    assert c.record(Outcome.RATE_LIMITED, 0.1, 41) == Change(40, "429 cap")
    assert c.record(Outcome.RATE_LIMITED, 0.1, 42) is None  # an older call: 40 already
    assert c.record(Outcome.RATE_LIMITED, 0.2, 3) == Change(32, "429 cap")  # at most x0.8


def test_a_429s_cap_counts_the_calls_that_succeeded_while_it_was_under_way() -> None:
    """The endpoint refused the call while it still held calls whose replies had not yet
    reached the caller: given the 429's latency, the successes recorded since the call began
    count as in flight (up to a full window), so the cap never lands below the endpoint's
    capacity; without a latency, or for successes from before the call began, nothing is
    added."""
    c = AdaptiveController(min=1, max=100, size=8, slow_start=False)
    for at in (0.5, 1.0, 1.02, 1.04):
        assert c.record(Outcome.SUCCESS, at, 8) is None
    # 6 in flight as the 429 comes at 1.05 (itself included), 2 ended since it began (1.01)
    assert c.record(Outcome.RATE_LIMITED, 1.05, 6, latency=0.04) == Change(7, "429 cap")
    assert c.record(Outcome.RATE_LIMITED, 1.05, 7) == Change(6, "429 cap")  # no latency
    d = AdaptiveController(min=1, max=100, size=8, slow_start=False)
    for at in (0.5, 0.9):
        d.record(Outcome.SUCCESS, at, 8)
    assert d.record(Outcome.RATE_LIMITED, 1.05, 6, latency=0.1) == Change(6, "429 cap")
    # a 429 that waited on a busy caller while many succeeded: up to a full window, no more
    e = AdaptiveController(min=1, max=100, size=8, slow_start=False)
    for i in range(6):
        e.record(Outcome.SUCCESS, 1.0 + i / 100, 8)
    assert e.record(Outcome.RATE_LIMITED, 1.1, 5, latency=0.2) == Change(7, "429 cap")


def test_a_concurrency_limit_overshot_by_more_than_twice_keeps_its_cap() -> None:
    """Issue 32, the zoo's concurrency limit of 110 and a client-bound loop: slow start
    doubles once 0.8 of the size is in flight, so 105 calls of a window of 128, none refused,
    took it to 256, 2.3x the limit. The caps came down a call at a time, and at 128 (half
    the size at which the 429s began) the endpoint still refused: taken for a rate limit,
    the window went back to 256. A slow start overshoots by at most 2 / utilization: the
    caps go on down to the limit."""
    c = AdaptiveController(min=1, max=256, size=128)
    for _ in range(128):
        c.record(Outcome.SUCCESS, 0.0, 105)
    assert c.size == 256
    now, reasons = 1.0, []
    while c.size > 110 and now < 10.0:  # the endpoint holds 110: each call more is refused
        now += 0.01
        c.record(Outcome.SUCCESS, now, min(c.size, 110))
        change = c.record(Outcome.RATE_LIMITED, now, c.size)
        if change is not None:
            reasons.append(change.reason)
    assert c.size == 110
    assert "429 not concurrency" not in reasons
    assert c.record(Outcome.SUCCESS, now + 0.01, 110) is None  # and there it stays


def test_never_below_min_nor_above_max() -> None:
    c = AdaptiveController(min=3, max=5, size=4)
    for t in range(10):
        c.record(Outcome.RATE_LIMITED, 100.0 * t, 4)
    assert c.size == 3
    for t in range(10):
        full_round(c, 1000.0 + t)
    assert c.size == 5


@given(
    bounds=st.tuples(st.integers(1, 20), st.integers(0, 20), st.integers(0, 40)),
    script=st.lists(
        st.tuples(
            st.sampled_from(list(Outcome)),
            st.floats(0, 30),  # seconds since the previous outcome
            st.floats(0, 1.2),  # in flight, as a fraction of the size
        ),
        max_size=300,
    ),
)
def test_the_size_stays_within_bounds_and_moves_only_as_the_rules_allow(
    bounds: tuple[int, int, int], script: list[tuple[Outcome, float, float]]
) -> None:
    low, extra, more = bounds
    c = AdaptiveController(min=low, max=low + extra + more, size=low + extra)
    now = 0.0
    last_cut = last_429 = since = independent_until = -math.inf
    size_at_429s = 0  # the size when the current run of 429s began
    seen_429 = False
    peak = below = 0  # the most calls ever in flight; 429s in a row at half of it or less
    for outcome, gap, load in script:
        now += gap
        before = c.size
        in_flight = math.floor(load * before)
        change = c.record(outcome, now, in_flight)
        assert c.min <= c.size <= c.max
        first = False
        peak = max(peak, in_flight)  # (at least the most a 429-free round had in flight)
        if outcome is Outcome.RATE_LIMITED and now < independent_until:
            outcome = Outcome.REQUEST_RATE  # 429s found not to depend on concurrency
        if outcome is Outcome.REQUEST_RATE:
            assert change is None  # paced, never cut
            continue
        if outcome is Outcome.RATE_LIMITED:
            below = below + 1 if peak >= 2 and 2 * in_flight <= peak else 0
            first, seen_429 = not seen_429, True
            if now - last_429 >= c.cooldown:
                since, size_at_429s = now, before
            last_429 = now
        if change is None:
            assert c.size == before
            continue
        assert change.size == c.size != before
        if change.reason == "429":
            assert outcome is Outcome.RATE_LIMITED
            assert now - last_cut >= c.cooldown
            assert first or now - since >= c.cooldown
            assert c.size == max(c.min, math.floor(before * c.cut))
            last_cut = now
        elif change.reason == "429 cap":
            assert outcome is Outcome.RATE_LIMITED
            cap = max(c.min, in_flight - 1, math.floor(before * c.cut))
            assert c.size == cap < before
        elif change.reason == "429 not concurrency":
            # refused at the least size, at `utilization` of half the size at which these
            # 429s began, or three times in a row at half the calls in flight the endpoint
            # once took: back to that size, and 429s are the request rate's for a while
            assert outcome is Outcome.RATE_LIMITED
            assert (
                (before == c.min and in_flight <= c.min)
                or 2 * before <= c.utilization * size_at_429s
                or below >= 3
            )
            assert c.size == min(c.max, max(before, size_at_429s)) > before
            independent_until = now + max(4 * c.cooldown, 120.0)
        else:
            assert outcome is Outcome.SUCCESS
            assert c.size > before
            assert now - last_429 >= c.cooldown


@settings(max_examples=60, deadline=None)
@given(
    objective=st.sampled_from(["knee", "throughput", "p99=0.5"]),
    capacity=st.integers(1, 200),
    fall=st.floats(0.0, 1.5),  # past the capacity, throughput falls as size ** -fall
    noise=st.floats(0.0, 0.3),
    seed=st.integers(0, 2**16),
)
def test_the_latency_signal_goes_back_only_to_sizes_it_has_held(
    objective: str, capacity: int, fall: float, noise: float, seed: int
) -> None:
    """On any server whose throughput rises to a capacity and then stays or falls, with any
    noise: a step given up (`no gain`, `lost throughput`) goes back to a size the window
    held before (for `throughput`, the size the step came from or a smaller one measured
    lately that clearly delivered more), and the size stays within its bounds."""
    rng = random.Random(seed)
    c = AdaptiveController(1, 256, 8, cooldown=5.0, objective=objective)
    now, held, undone = 0.0, {c.size}, 0
    for _ in range(4000):
        size = c.size
        rate = 10.0 * min(size, capacity) * (max(1.0, size / capacity) ** -fall)
        latency = size / rate * max(0.05, 1 + rng.gauss(0, noise))
        now += latency / size
        change = c.record(Outcome.SUCCESS, now, size, latency=latency)
        assert c.min <= c.size <= c.max
        if change is not None and change.reason in ("no gain", "lost throughput"):
            assert change.size in held, (change, held)
            undone += 1
        held.add(c.size)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"min": 0, "max": 4, "size": 2}, "min must be >= 1"),
        ({"min": 3, "max": 4, "size": 2}, "min <= start <= max"),
        ({"min": 1, "max": 4, "size": 5}, "min <= start <= max"),
        ({"min": 1, "max": 4, "size": 2, "cut": 1.0}, "cut"),
        ({"min": 1, "max": 4, "size": 2, "cooldown": -1}, "cooldown"),
        ({"min": 1, "max": 4, "size": 2, "utilization": 0}, "utilization"),
    ],
)
def test_controller_options_are_checked(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AdaptiveController(**kwargs)


def test_outcome_from_http_status() -> None:
    assert Outcome.from_status(200) is Outcome.SUCCESS
    assert Outcome.from_status(429) is Outcome.RATE_LIMITED
    assert Outcome.from_status(503) is Outcome.SERVER_ERROR
    assert Outcome.from_status(408) is Outcome.TIMEOUT
    assert Outcome.from_status(404) is None


# --- AdaptiveWindow: the controller applied to a live window --------------------------------


async def test_adaptive_window_moves_its_limiter_and_records_why(autojump_clock: MockClock) -> None:
    window = AdaptiveWindow(1, 4, 16, cooldown=10)
    tokens = [object() for _ in range(8)]
    for token in tokens[:4]:
        await window.limiter.acquire_on_behalf_of(token)
    for _ in range(4):
        window.success()  # 4 in flight of 4: a full clean round
    assert window.size == window.limiter.total_tokens == 8
    for token in tokens[4:]:
        await window.limiter.acquire_on_behalf_of(token)
    await trio.sleep(3)
    window.record(429, retry_after=30)  # the first 429: the cut
    assert window.size == 6
    window.record(404)  # says nothing about capacity
    window.rate_limited()  # within the cooldown, 8 in flight: the cap (7) is above 6
    await trio.sleep(5)
    window.rate_limited()
    await trio.sleep(5)
    window.server_error()
    window.timeout()
    assert window.size == 6
    window.rate_limited()  # 429s for a cooldown since the first: the overload persists
    assert window.size == 4
    for token in tokens[4:]:
        window.limiter.release_on_behalf_of(token)
    window.rate_limited()  # 4 in flight: capped at 3
    for token in tokens[:4]:
        window.limiter.release_on_behalf_of(token)
    assert window.history == [
        (0.0, 4, "start"),
        (0.0, 8, "slow start"),
        (3.0, 6, "429"),
        (13.0, 4, "429"),
        (13.0, 3, "429 cap"),
    ]
    assert window.limiter.total_tokens == 3


async def test_adaptive_window_in_a_runner_grows_while_runs_succeed(
    autojump_clock: MockClock,
) -> None:
    window = AdaptiveWindow(1, 2, 32)
    peak = in_flight = 0

    async def call(item: int) -> int:
        nonlocal peak, in_flight
        in_flight += 1
        peak = max(peak, in_flight)
        await trio.sleep(1)
        window.success()  # recorded while this run still holds its slot
        in_flight -= 1
        return item

    results = await tt.run_stream(tt.take(Feed(*range(200)), 200), call, window=window)
    assert results == list(range(200))
    assert [size for _, size, _ in window.history] == [2, 4, 8, 16, 32]
    assert peak == 32


def test_adaptive_window_resized_by_hand_stays_within_its_bounds() -> None:
    window = AdaptiveWindow(2, 4, 8)
    window.size = 8
    assert window.controller.size == 8
    with pytest.raises(ValueError, match=r"within \[2, 8\]"):
        window.size = 9
    with pytest.raises(ValueError, match="min <= start <= max"):
        AdaptiveWindow(4, 2, 8)


# --- the CLI form -----------------------------------------------------------------------------


def test_parse_window_forms() -> None:
    assert parse_window("64") == 64
    assert parse_window("1-8-512") == AdaptiveBounds(1, 8, 512)
    assert parse_window(" 2 - 2 - 2 ") == AdaptiveBounds(2, 2, 2)
    assert isinstance(build_window(parse_window("1-8-512")), AdaptiveWindow)
    assert build_window(parse_window("3")).size == 3


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "expected N or MIN-START-MAX"),
        ("1-8", "expected N or MIN-START-MAX"),
        ("a", "expected N or MIN-START-MAX"),
        ("-3", "expected N or MIN-START-MAX"),
        ("1.5", "expected N or MIN-START-MAX"),
        ("0", "N must be >= 1"),
        ("8-4-16", "1 <= MIN <= START <= MAX"),
        ("0-1-2", "1 <= MIN <= START <= MAX"),
    ],
)
def test_parse_window_names_the_parameter_and_the_form(text: str, match: str) -> None:
    with pytest.raises(WindowArgumentError, match=match) as info:
        parse_window(text, parameter="max_connections")
    assert str(info.value).startswith("max_connections: ")
    assert info.value.parameter == "max_connections"
    assert "--" not in str(info.value)  # the library names parameters, never flags


def test_parse_window_keeps_its_message_under_argparse(capsys: pytest.CaptureFixture[str]) -> None:
    from trio_tasksets._cli.options import window_option  # the CLI's argparse type of it

    parser = argparse.ArgumentParser(prog="tt")
    parser.add_argument("-c", type=window_option)
    assert parser.parse_args(["-c", "1-8-64"]).c == AdaptiveBounds(1, 8, 64)
    with pytest.raises(SystemExit):
        parser.parse_args(["-c", "8-4-16"])
    assert "1 <= MIN <= START <= MAX, got '8-4-16'" in capsys.readouterr().err
    assert issubclass(WindowArgumentError, ValueError)
    assert issubclass(WindowArgumentError, tt.TrioTasksetsError)


def test_build_window_is_the_one_constructor_and_names_the_parameter() -> None:
    own = tt.Window(3)
    assert build_window(own) is own
    assert build_window(4).size == 4
    assert isinstance(build_window((1, 2, 8)), AdaptiveWindow)
    for bad in (0, True, 2.5, "4", (4, 2, 8), (1, 2)):
        with pytest.raises(WindowArgumentError, match=r"^max_connections") as info:
            build_window(bad, parameter="max_connections")  # type: ignore[arg-type]
        assert info.value.parameter == "max_connections"


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "4", None, (4, 2, 8), (0, 1, 2), (1, 2)])
def test_every_holder_of_a_spec_refuses_it_by_the_one_check(bad: object) -> None:
    """`check_window_spec` is the check: `build_window` and `EvalConfig.max_concurrent` say
    exactly what it says."""
    with pytest.raises(WindowArgumentError) as checked:
        check_window_spec(bad, parameter="max_concurrent")
    with pytest.raises(WindowArgumentError) as built:
        build_window(bad, parameter="max_concurrent")  # type: ignore[arg-type]
    with pytest.raises(tt.EvalConfigError) as configured:
        tt.EvalConfig(max_concurrent=bad)  # type: ignore[arg-type]
    assert str(built.value) == str(configured.value) == str(checked.value)
    assert configured.value.parameters == ("max_concurrent",)


def test_a_spec_checked_is_normalized_and_its_text_form_checked_alike() -> None:
    own = tt.Window(2)
    assert check_window_spec(own) is own
    assert check_window_spec((1, 2, 8)) == AdaptiveBounds(1, 2, 8)
    assert type(check_window_spec((1, 2, 8))) is AdaptiveBounds
    assert check_window_spec(5) == 5
    with pytest.raises(WindowArgumentError, match="1 <= MIN <= START <= MAX, got '8-4-16'"):
        parse_window("8-4-16")
    with pytest.raises(WindowArgumentError, match=r"1 <= min <= start <= max, got \(8, 4, 16\)"):
        check_window_spec((8, 4, 16))


async def test_a_token_handed_over_in_the_instant_of_a_shrink_is_queued_again(
    autojump_clock: MockClock,
) -> None:
    window = Window(2)
    await window.acquire("a")
    await window.acquire("b")
    got: list[str] = []

    async def waiter() -> None:
        await window.acquire("c")
        got.append("c")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        window.release("a")  # hands "a"'s token to "c"...
        window.size = 1  # ... in the same instant as the window shrinks below it
        await trio.testing.wait_all_tasks_blocked()
        assert got == []
        assert window.in_flight == 1
        window.release("b")
    assert got == ["c"]
    window.release("c")
    assert window.in_flight == 0


async def test_history_since_counts_from_a_given_start(autojump_clock: MockClock) -> None:
    eval_start = trio.current_time()
    await trio.sleep(3)
    window = Window(2)
    await trio.sleep(2)
    window.size = 4
    assert window.history == [(0.0, 2, "start"), (2.0, 4, "set")]
    assert window.history_since(eval_start) == [(3.0, 2, "start"), (5.0, 4, "set")]


async def test_an_adaptive_window_finds_a_hidden_capacity(autojump_clock: MockClock) -> None:
    """Rollouts against a simulated endpoint that answers 429 (Retry-After: 1 s) above a
    hidden concurrency of 40, with 50 ms calls (the issue's benchmark, in-process and on
    virtual time). From 8, slow start overshoots to 64; the first 429 cuts to 51 and the
    429s of that burst cap it down to exactly 40 (each refused rollout rests, lending its
    place, so the endpoint stays full). Fewer than 1% of calls are answered 429 and the
    throughput is within 0.95x of a window fixed at 40 (800 rollouts/s)."""
    capacity, latency, n = 40, 0.05, 3000
    window = AdaptiveWindow(1, 8, 512)
    active = calls = limited = 0

    async def rollout(item: int) -> int:
        nonlocal active, calls, limited
        while True:
            calls += 1
            if active >= capacity:
                limited += 1
                window.rate_limited(retry_after=1.0)
                async with window.rest():
                    await trio.sleep(1.0)
                continue
            active += 1
            await trio.sleep(latency)
            active -= 1
            window.success()
            return item

    async def items() -> AsyncGenerator[int, None]:
        for item in range(n):
            yield item

    start = trio.current_time()
    assert await tt.run_stream(items(), rollout, window=window) == list(range(n))
    elapsed = trio.current_time() - start
    assert limited / calls < 0.01
    assert n / elapsed > 0.95 * capacity / latency
    assert window.size == capacity
    assert [size for _, size, _ in window.history][:6] == [8, 16, 32, 64, 51, 50]
    assert window.in_flight == window.resting == 0


# --- resting runs lend their place ------------------------------------------------------------


async def test_a_resting_run_lends_its_place_and_takes_one_back_in_turn(
    autojump_clock: MockClock,
) -> None:
    """A run resting (on a 429's Retry-After) lets one more start; when it is done resting it
    queues for a place behind the pull already waiting, so nothing runs above size + resting
    and a resting run is never passed over by later pulls."""
    window = AdaptiveWindow(1, 2, 8)
    held = Held()
    order: list[str] = []

    async def rest_then_finish(item: int) -> int:
        async with window.rest():
            order.append(f"rest {item}")
            await trio.sleep(1)
        order.append(f"back {item}")
        return await held.run(item)

    async def run(item: int) -> int:
        return await (rest_then_finish(item) if item == 0 else held.run(item))

    feed = Feed(*range(5))
    feed.end()
    with trio.fail_after(60):
        await resting_scenario(window, held, order, feed, run)
    assert window.in_flight == 0
    assert window.limiter.total_tokens == window.size == 2


async def resting_scenario(
    window: AdaptiveWindow, held: Held, order: list[str], feed: Feed[int], run: Any
) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(drive, "run_stream", feed, run, window)
        await trio.testing.wait_all_tasks_blocked()
        # 0 rests, lending its place: 1 and 2 run, 3 waits for a place.
        assert held.running == {1, 2}
        assert (window.size, window.resting, window.in_flight) == (2, 1, 3)
        await trio.sleep(1.5)  # 0 is done resting: it queues behind the pull of 3
        assert order == ["rest 0"]
        assert window.resting == 1
        held.release(1)  # a place frees: the waiting pull takes it (3 starts) ...
        await trio.testing.wait_all_tasks_blocked()
        assert held.running == {2, 3}
        assert order == ["rest 0"]
        held.release(2)  # ... the next one is 0's, before any later pull
        await trio.testing.wait_all_tasks_blocked()
        assert order == ["rest 0", "back 0"]
        assert held.running == {0, 3}
        assert (window.resting, window.in_flight) == (0, 2)
        held.release(0)
        await trio.testing.wait_all_tasks_blocked()
        assert held.running == {3, 4}
        for item in (3, 4):
            held.release(item)


async def test_a_rest_left_by_cancellation_gives_its_place_back(autojump_clock: MockClock) -> None:
    window = AdaptiveWindow(1, 2, 4)
    await window.acquire("run")
    await window.acquire("peer")  # the window is full
    with trio.move_on_after(1):  # cancelled while resting
        async with window.rest():
            assert window.limiter.total_tokens == 3
            await trio.sleep(5)
    assert (window.resting, window.limiter.total_tokens) == (0, 2)
    with trio.move_on_after(1):
        async with window.rest():
            await window.acquire("other")  # another run takes the lent place
        # done resting, queueing for a place ("other" holds it): cancelled there
    assert (window.resting, window.limiter.total_tokens, window.in_flight) == (0, 2, 3)
    window.release("other")  # over-full until both are gone: nothing else may start
    assert window.in_flight == 2
    window.release("run")
    window.release("peer")
    assert window.in_flight == 0


async def test_at_its_minimum_a_resting_run_keeps_its_place(autojump_clock: MockClock) -> None:
    """An endpoint that refuses every call (a token budget smaller than one call): the 429
    caps take the window to `min`, and no cap goes lower. Were a rest there to lend its
    place, each fresh run's 429 would send it to rest and lend in turn, without end (the
    zoo saw 5,288 runs pile up in 5 s). At `min`, a run rests in its place."""
    window = AdaptiveWindow(1, 4, 8)
    started: list[int] = []

    async def run(item: int) -> None:
        await window.acquire(item)
        started.append(item)
        try:
            window.rate_limited()  # every call refused
            async with window.rest():
                await trio.sleep(10)
        finally:
            window.release(item)

    async with trio.open_nursery() as nursery:
        for item in range(50):
            nursery.start_soon(run, item)
        await trio.sleep(1)
        assert window.size == 1
        # the runs refused above the minimum rested on lent places; none since
        assert len(started) == window.resting + 1 <= 8
    assert len(started) == 50  # (each in turn, as the runs before it end)
    assert window.in_flight == window.resting == 0


def test_window_spec_is_the_cli_form() -> None:
    assert window_spec(32) == "32"
    assert window_spec(AdaptiveBounds(1, 8, 512)) == "1-8-512"
    assert window_spec(Window(5)) == "5"
    assert window_spec(AdaptiveWindow(2, 4, 16)) == "2-4-16"
