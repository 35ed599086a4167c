"""Rate limiters (GCRA, requests and tokens per minute) and concurrency per endpoint."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from trio.testing import MockClock

from trio_tasksets._core.adaptive import AdaptiveBounds, AdaptiveWindow, Outcome
from trio_tasksets._core.limits import (
    CallObserver,
    ConnectionLimiter,
    EndpointLimits,
    RateLimiter,
    TokenLimiter,
    observe_calls,
    report_outcome,
    rest,
)
from trio_tasksets._core.window import Window

EPS = 1e-9


# --- GCRA -----------------------------------------------------------------------------------


async def test_a_burst_at_rpm_600_spreads_one_per_100_ms(autojump_clock: MockClock) -> None:
    limiter = RateLimiter(600)
    t0 = trio.current_time()
    starts: list[float] = []
    waits: list[float] = []

    async def call() -> None:
        waits.append(await limiter.acquire())
        starts.append(trio.current_time() - t0)

    async with trio.open_nursery() as nursery:
        for _ in range(10):
            nursery.start_soon(call)
    assert starts == pytest.approx([0.1 * k for k in range(10)])
    assert sorted(waits) == pytest.approx([0.1 * k for k in range(10)])
    assert limiter.calls == 10
    assert limiter.waited == pytest.approx(4.5)
    # Idle for a while: the next call goes at once (no credit beyond the burst, no debt).
    await trio.sleep(10)
    assert await limiter.acquire() == 0.0
    assert await limiter.acquire() == pytest.approx(0.1)


async def test_a_burst_allowance_lets_that_many_through_at_once(autojump_clock: MockClock) -> None:
    limiter = RateLimiter(60, burst=3)  # one a second, three at once
    t0 = trio.current_time()
    starts = []
    for _ in range(6):
        await limiter.acquire()
        starts.append(trio.current_time() - t0)
    assert starts == pytest.approx([0, 0, 0, 1, 2, 3])


async def test_tpm_holds_across_calls_of_different_sizes(autojump_clock: MockClock) -> None:
    tpm = TokenLimiter(6000)  # 100 tokens a second
    t0 = trio.current_time()
    sizes = [50, 400, 10, 250, 1000, 5, 90]
    starts = []
    for size in sizes:
        async with tpm.reserve(size) as metered:
            starts.append(trio.current_time() - t0)
            metered.used(size)
    # Each call goes as soon as everything before it fits the rate: sum(before) / 100 s.
    expected = [sum(sizes[:k]) / 100 for k in range(len(sizes))]
    assert starts == pytest.approx(expected)


@settings(deadline=None, max_examples=200)
@given(
    per_minute=st.sampled_from([60, 600, 6000, 90_000]),
    burst=st.sampled_from([1, 5, 1000]),
    calls=st.lists(
        st.tuples(st.floats(0, 3), st.integers(0, 1000)),  # (arrival gap in seconds, cost)
        max_size=30,
    ),
)
def test_gcra_never_lets_more_through_than_rate_and_burst_allow(
    per_minute: int, burst: int, calls: list[tuple[float, int]]
) -> None:
    """Over any span [a, b] of start times, the units started <= burst + rate * (b - a) +
    the largest single cost (a call bigger than the burst goes when the bucket is empty)."""
    limiter = RateLimiter(per_minute, burst=burst)
    starts: list[tuple[float, int]] = []

    async def main() -> None:
        async def call(at: float, cost: int) -> None:
            await trio.sleep_until(at)
            await limiter.acquire(cost)
            starts.append((trio.current_time(), cost))

        async with trio.open_nursery() as nursery:
            at = 0.0
            for gap, cost in calls:
                at += gap
                nursery.start_soon(call, at, cost)

    trio.run(main, clock=MockClock(autojump_threshold=0))
    rate = per_minute / 60
    biggest = max((cost for _, cost in calls), default=0)
    starts.sort()
    for i, (a, _) in enumerate(starts):
        total = 0
        for b, cost in starts[i:]:
            total += cost
            assert total <= burst + rate * (b - a) + max(0, biggest - burst) + EPS


async def test_tokens_metered_after_the_fact_are_paid_off_by_the_next_call(
    autojump_clock: MockClock,
) -> None:
    tpm = TokenLimiter(6000)  # 100 tokens a second
    async with tpm.reserve() as metered:  # nothing reserved: goes at once
        assert metered.waited == 0.0
        metered.used(300)
    async with tpm.reserve() as metered:  # waits until the bucket (1 token) has room again
        assert metered.waited == pytest.approx(2.99)
        metered.used(0)


async def test_using_less_than_reserved_refunds_the_difference(autojump_clock: MockClock) -> None:
    tpm = TokenLimiter(6000)
    async with tpm.reserve(1000) as metered:
        metered.used(100)
    async with tpm.reserve(0) as metered:
        assert metered.waited == pytest.approx(0.99)  # 100 tokens charged, not 1000
    metered.used(0)
    with pytest.raises(RuntimeError, match="already"):
        metered.used(0)


async def test_without_used_the_reservation_stands(autojump_clock: MockClock) -> None:
    tpm = TokenLimiter(6000)
    async with tpm.reserve(500):
        pass  # the call failed before any usage came back
    async with tpm.reserve() as metered:
        assert metered.waited == pytest.approx(4.99)


async def test_a_caller_cancelled_while_waiting_gives_its_reservation_back(
    autojump_clock: MockClock,
) -> None:
    limiter = RateLimiter(60)  # one a second
    await limiter.acquire()
    with trio.move_on_after(0.5):
        await limiter.acquire()  # would go at +1 s; cancelled
    t0 = trio.current_time()
    await limiter.acquire()
    assert trio.current_time() - t0 == pytest.approx(0.5)  # at +1 s, not +2 s
    assert limiter.calls == 2


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: RateLimiter(0), "per_minute must be > 0"),
        (lambda: RateLimiter(float("inf")), "finite"),
        (lambda: RateLimiter(60, burst=0.5), "burst"),
        (lambda: TokenLimiter("1000"), "per_minute"),  # type: ignore[arg-type]
        (lambda: EndpointLimits(rpm=-1), "rpm must be > 0"),
        (lambda: EndpointLimits(tpm=0), "tpm must be > 0"),
        (lambda: ConnectionLimiter(0), "limit must be an int >= 1"),
        (lambda: ConnectionLimiter(AdaptiveBounds(4, 2, 8)), "min <= start <= max"),
        (lambda: ConnectionLimiter(4, cut=0.5), "need MIN-START-MAX"),
    ],
)
def test_bad_limits_name_the_argument(make: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


async def test_a_negative_cost_is_refused(autojump_clock: MockClock) -> None:
    with pytest.raises(ValueError, match="cost must be a number >= 0"):
        await RateLimiter(60).acquire(-1)


# --- concurrency per endpoint ---------------------------------------------------------------


async def test_connections_are_bounded_per_key_across_tasks(autojump_clock: MockClock) -> None:
    limits = ConnectionLimiter(2)
    in_flight: dict[str, int] = {"a": 0, "b": 0}
    peak: dict[str, int] = {"a": 0, "b": 0}
    waited: list[float] = []

    async def call(key: str) -> None:
        async with limits.slot(key) as slot:
            waited.append(slot.waited)
            in_flight[key] += 1
            peak[key] = max(peak[key], in_flight[key])
            await trio.sleep(1)
            in_flight[key] -= 1

    async with trio.open_nursery() as nursery:
        for key in "aaaaab":
            nursery.start_soon(call, key)
    assert peak == {"a": 2, "b": 1}
    assert sorted(waited) == [0, 0, 0, 1, 1, 2]
    assert set(limits.windows) == {"a", "b"}
    assert all(window.in_flight == 0 for window in limits.windows.values())


async def test_one_task_may_hold_two_slots_of_one_endpoint(autojump_clock: MockClock) -> None:
    limits = ConnectionLimiter(2)
    async with limits.slot("a"), limits.slot("a"):
        assert limits.window("a").in_flight == 2


async def test_an_adaptive_endpoint_is_cut_by_its_own_429s_only(autojump_clock: MockClock) -> None:
    limits = ConnectionLimiter(AdaptiveBounds(1, 10, 20), cooldown=5)
    async with limits.slot("a") as slot:
        slot.record(429, retry_after=1)  # the first 429: cut by the factor
        slot.record(Outcome.RATE_LIMITED)  # within the cooldown, 1 in flight: capped (x0.8)
    async with limits.slot("b") as slot:
        slot.record(200)
    a, b = limits.window("a"), limits.window("b")
    assert isinstance(a, AdaptiveWindow)
    assert (a.size, b.size) == (6, 10)
    assert [reason for _, _, reason in a.history] == ["start", "429", "429 cap"]


async def test_a_fixed_endpoint_ignores_outcomes(autojump_clock: MockClock) -> None:
    limits = ConnectionLimiter(3)
    async with limits.slot("a") as slot:
        slot.record(429)
    window = limits.window("a")
    assert type(window) is Window
    assert window.size == 3


async def test_endpoint_limits_report_what_each_call_waited_for(autojump_clock: MockClock) -> None:
    limits = EndpointLimits(connections=1, rpm=60, tpm=6000)
    waits: list[tuple[float, float]] = []

    async def call(tokens: int) -> None:
        async with limits.call("endpoint", reserve_tokens=tokens) as call:
            waits.append((call.waited_connection, call.waited_rate))
            await trio.sleep(0.5)
            call.record(200, tokens=tokens)

    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(call, 50)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(call, 50)
    # The second waits 0.5 s for the connection, then 0.5 s more for rpm (one a second).
    assert waits == [(0.0, 0.0), pytest.approx((0.5, 0.5))]
    assert trio.current_time() - t0 == pytest.approx(1.5)


async def test_endpoint_limits_feed_an_adaptive_connection_window(
    autojump_clock: MockClock,
) -> None:
    limits = EndpointLimits(connections=AdaptiveBounds(1, 4, 8))
    async with limits.call(("http://127.0.0.1:1/v1", "OPENAI_API_KEY")) as call:
        call.record(429, retry_after=2)
        assert call.waited == 0.0
    assert limits.connections is not None
    assert limits.connections.window(("http://127.0.0.1:1/v1", "OPENAI_API_KEY")).size == 3


async def test_endpoint_limits_with_no_limits_are_a_pass_through(
    autojump_clock: MockClock,
) -> None:
    limits = EndpointLimits()
    async with limits.call("x", reserve_tokens=100) as call:
        call.record(200, tokens=5)
    assert call.waited == 0.0
    assert limits.rate_limiters("x") == (None, None)


# --- observers ----------------------------------------------------------------------------------


@attrs.define
class Recorder(CallObserver):
    name: str
    log: list[tuple[str, str, Any]]

    def on_wait(self, connection: float, rate: float) -> None:
        self.log.append((self.name, "wait", (connection, rate)))

    def on_outcome(self, outcome: Outcome, retry_after: float | None) -> None:
        self.log.append((self.name, "outcome", (outcome, retry_after)))

    @asynccontextmanager
    async def resting(self, outcome: Outcome | None) -> AsyncIterator[None]:
        self.log.append((self.name, "rest", (outcome, trio.current_time())))
        yield
        self.log.append((self.name, "rested", trio.current_time()))


async def test_observers_nest_and_hear_waits_outcomes_and_rests_of_their_tasks(
    autojump_clock: MockClock,
) -> None:
    log: list[tuple[str, str, Any]] = []
    limits = EndpointLimits(rpm=60)
    report_outcome(429)  # no observer: nothing to tell
    await rest(0.0)
    with observe_calls(Recorder("outer", log)):

        async def call() -> None:
            async with limits.call("e"):
                report_outcome(429, retry_after=2.0)
            await rest(2.0, outcome=Outcome.RATE_LIMITED)

        async with trio.open_nursery() as nursery:  # a task started inside hears too
            nursery.start_soon(call)
        with observe_calls(Recorder("inner", log)):
            async with limits.call("e"):
                report_outcome(404)  # says nothing about load: not passed on
                report_outcome(Outcome.SUCCESS)
    assert log == [
        ("outer", "wait", (0.0, 0.0)),
        ("outer", "outcome", (Outcome.RATE_LIMITED, 2.0)),
        ("outer", "rest", (Outcome.RATE_LIMITED, 0.0)),
        ("outer", "rested", 2.0),
        ("outer", "wait", (0.0, 0.0)),  # rpm: one a second, and 2 s went by
        ("inner", "wait", (0.0, 0.0)),
        ("outer", "outcome", (Outcome.SUCCESS, None)),
        ("inner", "outcome", (Outcome.SUCCESS, None)),
    ]
