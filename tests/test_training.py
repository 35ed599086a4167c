"""`tt.first` and `tt.Staleness` (SPEC 10) on trio's MockClock: examples, then hypothesis
properties over random durations, failures, cancellations, accept filters and advances.

Properties checked:

* `first` returns exactly `min(n, accepted available)` accepted results, the first ones in
  completion order, and when it returns nothing it started is still running (every run's
  cleanup has finished), the source is closed once;
* a run failure surfaces itself (R4) and leaves nothing running;
* under `Staleness`, no run does work more than `max_lag` versions stale unless it is
  withheld and marked, and every started run is answered exactly once (a result, or None
  for a run cancelled as stale).
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trio.testing import MockClock

import trio_tasksets as tt
from trio_tasksets.testing import Feed

PROPERTY = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@attrs.define
class Tracker:
    """What the runs did: who is running, who finished cleanup, who was cancelled."""

    running: set[int] = attrs.Factory(set)
    started: list[int] = attrs.Factory(list)
    cleaned: list[int] = attrs.Factory(list)
    cancelled: list[int] = attrs.Factory(list)

    def make(
        self, durations: dict[int, float], fail: frozenset[int] = frozenset(), cleanup: float = 0
    ) -> Any:
        async def run(item: int) -> int:
            self.running.add(item)
            self.started.append(item)
            try:
                await trio.sleep(durations[item])
                if item in fail:
                    raise RuntimeError(f"run {item} failed")
            except trio.Cancelled:
                self.cancelled.append(item)
                raise
            else:
                return item
            finally:
                with trio.CancelScope(shield=True):  # cleanup that takes time
                    await trio.sleep(cleanup)
                self.cleaned.append(item)
                self.running.discard(item)

        return run


class Closing:
    """A source of items 0..n-1 that counts its closes."""

    def __init__(self, n: int | None) -> None:
        self.n = n
        self.pulled = 0
        self.closes = 0

    def __aiter__(self) -> Closing:
        return self

    async def __anext__(self) -> int:
        await trio.lowlevel.checkpoint()
        if self.n is not None and self.pulled >= self.n:
            raise StopAsyncIteration
        self.pulled += 1
        return self.pulled - 1

    async def aclose(self) -> None:
        self.closes += 1


async def test_first_keeps_the_first_accepted_and_awaits_the_rest(
    autojump_clock: MockClock,
) -> None:
    tracker = Tracker()
    durations = {i: float(10 - i) for i in range(10)}  # later items finish first
    source = Closing(10)
    t0 = trio.current_time()
    got = await tt.first(
        2, source, tracker.make(durations, cleanup=1.0), window=10, accept=lambda r: r % 2 == 0
    )
    assert got == [8, 6]  # completion order: 9 (odd), 8, 7 (odd), 6
    # 6 is done at t=4 and returns after its 1 s cleanup; the cancelled runs' cleanup: 1 s more
    assert trio.current_time() - t0 == 4.0 + 1.0 + 1.0
    assert tracker.running == set()
    assert sorted(tracker.cleaned) == list(range(10))
    assert sorted(tracker.cancelled) == [0, 1, 2, 3, 4]  # 5 was done (in its cleanup) at t=5
    assert source.closes == 1


async def test_first_pulls_only_when_a_place_frees(autojump_clock: MockClock) -> None:
    tracker = Tracker()
    source = Closing(None)  # never ends
    durations = {i: 1.0 + i / 64 for i in range(100)}
    got = await tt.first(3, source, tracker.make(durations), window=2)
    assert got == [0, 1, 2]
    assert source.pulled <= 3 + 2  # R1: three results taken, window 2
    assert source.closes == 1
    assert tracker.running == set()


async def test_first_returns_fewer_when_the_source_ends(autojump_clock: MockClock) -> None:
    got = await tt.first(5, Closing(3), Tracker().make(dict.fromkeys(range(3), 1.0)), window=None)
    assert sorted(got) == [0, 1, 2]


async def test_first_zero_pulls_nothing_and_closes(autojump_clock: MockClock) -> None:
    source = Closing(3)
    assert await tt.first(0, source, Tracker().make({}), window=1) == []
    assert source.pulled == 0
    assert source.closes == 1


async def test_first_async_accept(autojump_clock: MockClock) -> None:
    async def big(result: int) -> bool:
        await trio.sleep(0.5)
        return result >= 2

    got = await tt.first(1, Closing(5), Tracker().make(dict.fromkeys(range(5), 1.0)), window=1,
                         accept=big)  # fmt: skip
    assert got == [2]


async def test_first_raises_a_run_failure_itself(autojump_clock: MockClock) -> None:
    tracker = Tracker()
    durations = {0: 5.0, 1: 1.0, 2: 5.0}
    with pytest.raises(RuntimeError, match="run 1 failed"):
        await tt.first(3, Closing(3), tracker.make(durations, frozenset({1})), window=3)
    assert tracker.running == set()


@pytest.mark.parametrize(
    ("kwargs", "error", "needle"),
    [
        ({"n": -1}, ValueError, "n must be >= 0"),
        ({"n": 1.5}, TypeError, "n must be an int"),
        ({"window": 0}, ValueError, "window must be >= 1"),
        ({"accept": 3}, TypeError, "accept must be a callable"),
    ],
)
async def test_first_refuses_bad_arguments_before_any_pull(
    kwargs: dict[str, Any], error: type[Exception], needle: str
) -> None:
    source = Closing(3)
    args: dict[str, Any] = {"n": 1, "window": 1, **kwargs}
    n = args.pop("n")
    with pytest.raises(error, match=needle):
        await tt.first(n, source, Tracker().make({}), **args)
    assert source.pulled == 0


@given(
    durations=st.lists(st.integers(1, 20), min_size=0, max_size=25),
    accepted=st.sets(st.integers(0, 24)),
    failing=st.sets(st.integers(0, 24), max_size=2),
    n=st.integers(0, 8),
    window=st.one_of(st.none(), st.integers(1, 6)),
    cleanup=st.sampled_from([0.0, 0.5, 3.0]),
    cancel_at=st.one_of(st.none(), st.integers(1, 40)),
)
@PROPERTY
async def test_property_first(
    autojump_clock: MockClock,
    durations: list[int],
    accepted: set[int],
    failing: set[int],
    n: int,
    window: int | None,
    cleanup: float,
    cancel_at: int | None,
) -> None:
    tracker = Tracker()
    source = Closing(len(durations))
    run = tracker.make(
        {i: d + 0.25 * (i % 3) for i, d in enumerate(durations)}, frozenset(failing), cleanup
    )
    outcome: list[int] | BaseException | None = None
    with trio.fail_after(10_000):
        with trio.move_on_after(cancel_at + 0.125 if cancel_at is not None else 1e9) as scope:
            try:
                outcome = await tt.first(
                    n, source, run, window=window, accept=accepted.__contains__
                )
            except RuntimeError as exc:
                outcome = exc
    # Whatever happened, nothing the call started is still running, and cleanup finished.
    assert tracker.running == set()
    assert sorted(tracker.cleaned) == sorted(tracker.started)
    assert source.closes == 1
    if scope.cancelled_caught:
        assert outcome is None
        return
    if isinstance(outcome, RuntimeError):
        assert int(str(outcome).split()[1]) in failing
        return
    assert isinstance(outcome, list)
    assert all(r in accepted for r in outcome)
    assert len(outcome) == len(set(outcome))
    assert len(outcome) <= n
    if len(outcome) < n:  # fewer only when every item ran and was seen
        assert source.pulled == len(durations)
        assert set(outcome) == accepted & set(range(len(durations))) - failing


# --- Staleness ---------------------------------------------------------------------------


async def test_staleness_cancels_runs_that_fall_behind(autojump_clock: MockClock) -> None:
    staleness = tt.Staleness(max_lag=1)
    tracker = Tracker()
    run = staleness.run(tracker.make({0: 10.0, 1: 10.0}))
    async with trio.open_nursery() as nursery:
        results: list[int | None] = []

        async def one(item: int) -> None:
            results.append(await run(item))

        nursery.start_soon(one, 0)
        await trio.sleep(1)
        assert staleness.advance() == 1  # run 0 is 1 behind: still fine
        nursery.start_soon(one, 1)
        await trio.sleep(1)
        assert tracker.cancelled == []
        staleness.advance()  # run 0 is now 2 behind: cancelled at once
        await trio.testing.wait_all_tasks_blocked()
        assert tracker.cancelled == [0]
    assert sorted(results, key=str) == [1, None]
    assert staleness.cancelled == 1


async def test_staleness_withhold_marks_episodes(autojump_clock: MockClock) -> None:
    staleness = tt.Staleness(max_lag=0, withhold=True)
    env = tt.Env(tt.testing.FeedTaskset())
    ctx = tt.ModelContext(tt.EchoClient(delay=5.0), "echo")
    task = tt.Task(prompt="hi", answer="hi")

    async def run_slot(slot: tt.RunSlot[tt.Task]) -> tt.Episode:
        return await env.run_slot(slot, ctx)

    run = staleness.run(run_slot)
    async with trio.open_nursery() as nursery:
        got: list[tt.Episode | None] = []

        async def one() -> None:
            got.append(await run(tt.RunSlot(task)))

        nursery.start_soon(one)
        await trio.sleep(1)
        staleness.advance()
        nursery.start_soon(one)
    assert None not in got
    old, new = sorted((e for e in got if e is not None), key=lambda e: e.policy_version or 0)
    assert (old.policy_version, old.stale, old.ok) == (0, True, True)
    assert (new.policy_version, new.stale) == (1, False)
    assert old.to_row()["stale"] is True
    assert old.to_row()["policy_version"] == 0
    assert staleness.withheld == 1


async def test_staleness_feed_pauses_while_the_trainer_is_behind(
    autojump_clock: MockClock,
) -> None:
    staleness = tt.Staleness(max_lag=1)
    feed = Feed(*range(10))
    fed = staleness.feed(feed)
    assert await fed.__anext__() == 0
    staleness.handed()
    staleness.handed()  # two batches handed, trainer at 0: 2 - 0 > 1
    assert staleness.behind
    with trio.move_on_after(100) as waited:
        await fed.__anext__()
    assert waited.cancelled_caught  # paused: nothing pulled
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fed.__anext__)
        await trio.sleep(5)
        staleness.advance()  # the trainer caught up one version: the pull goes ahead
    assert feed.pulled == 2
    await fed.aclose()  # type: ignore[attr-defined]
    await fed.aclose()  # type: ignore[attr-defined]
    assert feed.closed


def test_staleness_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="max_lag must be >= 0"):
        tt.Staleness(-1)
    with pytest.raises(TypeError, match="max_lag must be an int"):
        tt.Staleness(1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="withhold"):
        tt.Staleness(1, withhold="no")  # type: ignore[arg-type]


@given(
    starts=st.lists(
        st.tuples(st.integers(0, 30), st.integers(1, 30)), min_size=1, max_size=20
    ),  # (start time, duration)
    advances=st.lists(st.integers(0, 60), max_size=10),
    max_lag=st.integers(0, 3),
    withhold=st.booleans(),
)
@PROPERTY
async def test_property_no_run_works_more_than_max_lag_stale(
    autojump_clock: MockClock,
    starts: list[tuple[int, int]],
    advances: list[int],
    max_lag: int,
    withhold: bool,
) -> None:
    staleness = tt.Staleness(max_lag, withhold=withhold)
    answers: dict[int, list[object]] = {}
    violations: list[str] = []

    async def work(item: int) -> int:
        start_version = staleness.version
        duration = starts[item][1]
        for _ in range(duration):  # one unit of work per virtual second
            await trio.sleep(1)
            lag = staleness.version - start_version
            live = tt._core.training.current_run()
            assert live is not None
            if lag > max_lag and not (withhold and live.stale):
                violations.append(f"run {item} worked {lag} versions stale")
        return item

    run = staleness.run(work)

    async def one(item: int) -> None:
        await trio.sleep(starts[item][0] + 0.5)
        answers.setdefault(item, []).append(await run(item))

    async def trainer() -> None:
        now = 0.0
        for at in sorted(advances):
            await trio.sleep(at + 0.25 - now)
            now = at + 0.25
            staleness.advance()

    with trio.fail_after(10_000):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trainer)
            for item in range(len(starts)):
                nursery.start_soon(one, item)
    assert violations == []
    assert sorted(answers) == list(range(len(starts)))  # every run answered exactly once
    for item, (answer,) in answers.items():
        assert answer in (item, None)
        if withhold:
            assert answer == item  # withheld runs finish
