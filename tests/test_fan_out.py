"""`tt.fan_out` (SPEC 9, N1-N4): concurrent thunks on the enclosing window, at any depth.

Unit tests pin each point on small hand-built cases; the property tests draw random trees of
nested fan-outs (work before and after each fan-out, failures, a subtree cancelled by its own
deadline, an outside cancellation) under random windows (an int, a `tt.Window`, a
`tt.AdaptiveWindow`, none) and check, on trio's MockClock:

* N1: at every instant, the thunks and runs doing work <= the window's size;
* N2: no deadlock, and more: the window is never idle while work waits (between events, a
  thunk or a pull waits for a place only while the window is full of work: a caller waiting
  on its last thunks lends its place; the call ends no later than the sum of all the work),
  and at window 1 the whole tree runs one step at a time (it ends exactly at the sum);
* every thunk that starts is answered exactly once (completed, failed or cancelled), and
  every place lent comes back;
* N3: the first failure (in virtual time) is what the call raises, itself (never a group);
  every thunk still running when its run or its subtree is cancelled is cancelled, and
  nothing runs once the call has returned;
* N4: results come back in thunk order.

Every duration is whole virtual seconds; deadlines fall on half seconds, so they never tie with
work ending.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import pytest
import trio
from helpers import Concurrency
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trio.testing import MockClock

import trio_tasksets as tt

HANG = 100_000
T = TypeVar("T")

SETTINGS = settings(
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    deadline=None,
    max_examples=int(os.environ.get("TT_PROPERTY_EXAMPLES", "150")),
)


class Boom(Exception):
    pass


# --- unit tests -----------------------------------------------------------------------------


async def test_outside_any_window_runs_unbounded_and_returns_in_thunk_order(
    autojump_clock: MockClock,
) -> None:
    working = Concurrency()

    async def job(i: int) -> int:
        with working:
            await trio.sleep(10 - i)  # the last finishes first
        return i * i

    start = trio.current_time()
    results = await tt.fan_out([functools.partial(job, i) for i in range(10)])
    assert results == [i * i for i in range(10)]
    assert working.peak == 10
    assert trio.current_time() - start == 10


async def test_no_thunks_is_an_empty_list() -> None:
    assert await tt.fan_out([]) == []
    assert await tt.fan_out(iter(())) == []


async def test_bad_thunks_are_refused_before_anything_runs() -> None:
    ran = []

    async def job() -> None:
        ran.append(1)

    with pytest.raises(TypeError, match=r"thunks\[1\] must be a callable.*pass the function"):
        await tt.fan_out([job, job()])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="thunks must be an iterable"):
        await tt.fan_out(3)  # type: ignore[arg-type]
    assert ran == []
    with pytest.raises(TypeError, match=r"thunks\[0\] must return an awaitable"):
        await tt.fan_out([lambda: 3])  # type: ignore[arg-type]


@pytest.mark.parametrize("window", [1, 2, 3])
async def test_a_run_waiting_on_its_children_holds_no_place(
    autojump_clock: MockClock, window: int
) -> None:
    """N1 and N2: four runs of a best-of-4 under window w keep exactly w thunks working."""
    working = Concurrency()

    async def attempt() -> str:
        with working:
            await trio.sleep(1)
        return "a"

    async def best_of_4(_: int) -> list[str]:
        return await tt.fan_out([attempt] * 4)

    start = trio.current_time()
    results = await tt.run_stream(_count(4), best_of_4, window=window)
    assert results == [["a"] * 4] * 4
    assert working.peak == window
    assert trio.current_time() - start == math.ceil(16 / window)


async def test_window_one_nests_without_deadlock(autojump_clock: MockClock) -> None:
    async def leaf() -> int:
        await trio.sleep(1)
        return 1

    async def node(depth: int) -> int:
        if depth == 0:
            return await leaf()
        return sum(await tt.fan_out([lambda: node(depth - 1)] * 2))

    with trio.fail_after(100):
        assert await tt.run_stream(_count(2), lambda _: node(4), window=1) == [16, 16]
    assert trio.current_time() == 32  # one at a time: nothing idle, nothing concurrent


async def test_a_growing_window_wakes_waiting_children(autojump_clock: MockClock) -> None:
    window = tt.Window(1)
    working = Concurrency()

    async def job() -> None:
        with working:
            await trio.sleep(10)

    async def grow() -> None:
        await trio.sleep(5)
        window.size = 4

    async with trio.open_nursery() as nursery:
        nursery.start_soon(grow)
        await tt.run_stream(_count(1), lambda _: tt.fan_out([job] * 4), window=window)
    assert working.peak == 4
    assert trio.current_time() == 15  # the first from 0, the other three from 5
    assert window.in_flight == 0


async def test_an_adaptive_window_bounds_children(autojump_clock: MockClock) -> None:
    window = tt.AdaptiveWindow(1, 2, 8)
    working = Concurrency()

    async def job() -> None:
        with working:
            await trio.sleep(1)

    await tt.run_stream(_count(3), lambda _: tt.fan_out([job] * 3), window=window)
    assert working.peak == 2
    assert window.in_flight == 0


async def test_a_runner_without_a_window_masks_an_outer_one(autojump_clock: MockClock) -> None:
    """Inside `run_stream(window=None)` a fan-out is unbounded, even under an outer window."""
    working = Concurrency()

    async def job() -> None:
        with working:
            await trio.sleep(1)

    async def inner(_: int) -> None:
        await tt.run_stream(_count(1), lambda _: tt.fan_out([job] * 5), window=None)

    await tt.run_stream(_count(1), inner, window=1)
    assert working.peak == 5


async def test_the_first_failure_is_raised_itself_and_cancels_siblings(
    autojump_clock: MockClock,
) -> None:
    cancelled = []
    boom = Boom("first")

    async def slow(i: int) -> None:
        try:
            await trio.sleep(100)
        except trio.Cancelled:
            cancelled.append(i)
            raise

    async def fails() -> None:
        await trio.sleep(1)
        raise boom

    async def later() -> None:
        await trio.sleep(2)
        raise Boom("second")

    for window in (None, 1, 3):
        cancelled.clear()
        with pytest.raises(Boom) as info:
            await tt.run_stream(
                _count(1),
                lambda _: tt.fan_out([lambda: slow(0), fails, later, lambda: slow(3)]),
                window=window,
            )
        assert info.value is boom
        # at window 1 the caller's place runs them in turn: slow(0) ends, fails() fails and
        # nothing else has started; at window 3 slow(3) is still waiting for a place
        assert sorted(cancelled) == {None: [0, 3], 1: [], 3: [0]}[window]


async def test_a_failure_while_the_siblings_unwind_is_noted(autojump_clock: MockClock) -> None:
    async def fails() -> None:
        await trio.sleep(1)
        raise Boom("first")

    async def fails_on_cancel() -> None:
        try:
            await trio.sleep(100)
        except trio.Cancelled:
            raise Boom("cleanup") from None

    for window in (None, 2):
        with pytest.raises(Boom, match="first") as info:
            await tt.run_stream(
                _count(1), lambda _: tt.fan_out([fails_on_cancel, fails]), window=window
            )
        assert any("Boom was also raised: cleanup" in note for note in info.value.__notes__)


async def test_keyboard_interrupt_stays_itself(autojump_clock: MockClock) -> None:
    async def interrupted() -> None:
        await trio.sleep(1)
        raise KeyboardInterrupt

    async def interrupted_while_unwinding() -> None:
        try:
            await trio.sleep(100)
        except trio.Cancelled:
            raise KeyboardInterrupt from None

    async def fails() -> None:
        await trio.sleep(1)
        raise Boom("x")

    async def slow() -> None:
        await trio.sleep(100)

    with pytest.raises(KeyboardInterrupt):
        await tt.fan_out([slow, interrupted])
    with pytest.raises(KeyboardInterrupt):
        await tt.fan_out([interrupted_while_unwinding, fails])


async def test_cancelling_the_run_cancels_every_child(autojump_clock: MockClock) -> None:
    window = tt.Window(3)
    started = []
    cancelled = []

    async def child(i: int) -> None:
        started.append(i)
        try:
            await trio.sleep(100)
        except trio.Cancelled:
            cancelled.append(i)
            raise

    with trio.move_on_after(5) as scope:
        await tt.run_stream(
            _count(1),
            lambda _: tt.fan_out([functools.partial(child, i) for i in range(6)]),
            window=window,
        )
    assert scope.cancelled_caught
    assert sorted(started) == [0, 1, 2]  # the run's place and two more
    assert sorted(cancelled) == [0, 1, 2]
    assert window.in_flight == 0  # every place given back


async def test_a_failed_children_give_their_places_back(autojump_clock: MockClock) -> None:
    window = tt.Window(2)

    async def fails() -> None:
        await trio.sleep(1)
        raise Boom("x")

    async def run(i: int) -> str:
        if i == 0:
            try:
                await tt.fan_out([fails, fails, fails])
            except Boom:
                return "caught"
        await trio.sleep(3)
        return "done"

    assert await tt.run_stream(_count(3), run, window=window) == ["caught", "done", "done"]
    assert window.in_flight == 0


# --- the caller's place is lent while its last thunks run ------------------------------------


class Places:
    """Counts the thunks and runs doing work (each inside `work`), and when each began."""

    def __init__(self) -> None:
        self.working = Concurrency()
        self.began: dict[str, float] = {}

    async def work(self, name: str, seconds: float) -> str:
        self.began[name] = trio.current_time()
        with self.working:
            await trio.sleep(seconds)
        return name


async def _beside_holders(
    window: tt.Window, places: Places, run: Callable[[int], Awaitable[T]], second_at: float
) -> list[T]:
    """`run` once on `window` (2 places) beside two others that want a place on it: "first"
    from 0.5 s for 5 s of work, "second" from `second_at` for 1 s. No more than 2 ever work,
    and every place comes back."""

    async def hold(name: str, at: float, seconds: float) -> None:
        await trio.sleep(at)
        token = object()
        await window.acquire(token)
        try:
            await places.work(name, seconds)
        finally:
            window.release(token)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold, "first", 0.5, 5)
        nursery.start_soon(hold, "second", second_at, 1)
        results = await tt.run_stream(_count(1), run, window=window)
    assert places.working.peak == 2
    assert (window.in_flight, window.resting) == (0, 0)
    return results


async def test_at_window_one_a_caller_fanning_out_three_completes(
    autojump_clock: MockClock,
) -> None:
    window = tt.Window(1)
    places = Places()

    async def run(_: int) -> list[str]:
        return await tt.fan_out([functools.partial(places.work, f"c{i}", 1) for i in range(3)])

    with trio.fail_after(100):
        assert await tt.run_stream(_count(1), run, window=window) == [["c0", "c1", "c2"]]
    assert trio.current_time() == 3  # one at a time on the caller's place
    assert places.working.peak == 1
    assert (window.in_flight, window.resting) == (0, 0)


@pytest.mark.parametrize("kind", ["int", "Window"])
async def test_a_waiting_caller_lends_its_place_so_w_thunks_work(
    autojump_clock: MockClock, kind: str
) -> None:
    """Window 2: the run fans out S (1 s) and L; L fans out three thunks of 2 s. Once S is
    done the run has nothing left to start: its place goes to L's second thunk, so two work
    (not one beside an idle place): L's thunks end at 2, 3 and 4 instead of 2, 4 and 6."""
    window: int | tt.Window = 2 if kind == "int" else tt.Window(2)
    places = Places()

    async def inner() -> list[str]:
        return await tt.fan_out([functools.partial(places.work, f"l{i}", 2) for i in range(3)])

    async def run(_: int) -> list[object]:
        return await tt.fan_out([functools.partial(places.work, "S", 1), inner])

    with trio.fail_after(100):
        results = await tt.run_stream(_count(1), run, window=window)
    assert results == [["S", ["l0", "l1", "l2"]]]
    assert trio.current_time() == 4
    assert places.began == {"S": 0, "l0": 0, "l1": 1, "l2": 2}
    assert places.working.peak == 2
    if isinstance(window, tt.Window):
        assert (window.in_flight, window.resting) == (0, 0)


async def test_the_caller_takes_its_place_back_from_its_last_thunk(
    autojump_clock: MockClock,
) -> None:
    """Window 2 shared with two holders that queue at 0.5 s and 2 s. The run fans out S (1 s)
    and T (3 s), then works 1 s. At 1 s its idle place goes to the first holder; at 3 s T's
    place goes back to the run (not to the second holder, which waits until the run ends),
    so at no instant do more than 2 work."""
    window = tt.Window(2)
    places = Places()
    returned: list[float] = []

    async def run(_: int) -> None:
        await tt.fan_out(
            [functools.partial(places.work, "S", 1), functools.partial(places.work, "T", 3)]
        )
        returned.append(trio.current_time())
        await places.work("after", 1)

    await _beside_holders(window, places, run, second_at=2)
    assert returned == [3]
    assert places.began == {"S": 0, "T": 0, "first": 1, "after": 3, "second": 4}


async def test_a_caller_cancelled_while_lent_gets_its_place_back(
    autojump_clock: MockClock,
) -> None:
    """The fan-out's own deadline cancels T while the caller's place is lent: T's place goes
    back to the caller, which works on within the bound; the waiting holder starts when the
    run ends."""
    window = tt.Window(2)
    places = Places()

    async def run(_: int) -> None:
        with trio.move_on_after(2):
            await tt.fan_out(
                [functools.partial(places.work, "S", 1), functools.partial(places.work, "T", 10)]
            )
        await places.work("after", 1)

    await _beside_holders(window, places, run, second_at=1.5)
    assert places.began == {"S": 0, "T": 0, "first": 1, "after": 2, "second": 3}


async def test_a_thunk_failing_while_the_caller_is_lent_raises_at_once(
    autojump_clock: MockClock,
) -> None:
    window = tt.Window(2)
    places = Places()

    async def fails() -> str:
        await places.work("T", 3)
        raise Boom("T")

    async def run(_: int) -> str:
        thunks: list[Callable[[], Awaitable[str]]] = [functools.partial(places.work, "S", 1), fails]
        try:
            await tt.fan_out(thunks)
        except Boom:
            return await places.work("after", 1)
        return "no failure"

    assert await _beside_holders(window, places, run, second_at=2) == ["after"]
    assert places.began == {"S": 0, "T": 0, "first": 1, "after": 3, "second": 4}


async def _count(n: int) -> AsyncGenerator[int, None]:
    for i in range(n):
        yield i


# --- property tests over random trees -------------------------------------------------------


@dataclass
class Node:
    before: int  # virtual seconds of work before the fan-out
    children: list[Node] | None  # the fan-out, if any
    after: int  # work after it
    fail: str | None = None  # "before" (instead of the fan-out) or "after" (at the end)
    deadline: int | None = None  # the fan-out runs under move_on_after(deadline + 0.5)
    id: int = -1
    parent: Node | None = field(default=None, repr=False)

    def walk(self) -> list[Node]:
        out = [self]
        for child in self.children or []:
            out.extend(child.walk())
        return out

    def work(self) -> int:
        return self.before + self.after + sum(c.work() for c in self.children or [])


def nodes() -> st.SearchStrategy[Node]:
    leaf = st.builds(
        Node,
        before=st.integers(0, 3),
        children=st.none(),
        after=st.just(0),
        fail=st.sampled_from([None, None, None, None, "before"]),
    )

    def extend(inner: st.SearchStrategy[Node]) -> st.SearchStrategy[Node]:
        return st.builds(
            Node,
            before=st.integers(0, 2),
            children=st.lists(inner, min_size=0, max_size=4),
            after=st.integers(0, 2),
            fail=st.sampled_from([None, None, None, None, None, "before", "after"]),
            deadline=st.none() | st.none() | st.integers(0, 8),
        )

    return st.recursive(leaf, extend, max_leaves=16)


# Built once: a strategy built inside each draw is validated again each example (most of
# this test's time went there, not in the runs).
ROOTS = st.lists(nodes(), min_size=1, max_size=5)

WindowKind = str


@dataclass(frozen=True)
class Forest:
    roots: list[Node]
    window: int | None
    kind: WindowKind  # "int", "Window", "Adaptive"
    cancel_at: int | None  # outside cancellation at cancel_at + 0.5


@st.composite
def forests(draw: st.DrawFn) -> Forest:
    roots = draw(ROOTS)
    counter = 0
    for root in roots:
        for node in root.walk():
            node.id = counter
            counter += 1
            for child in node.children or []:
                child.parent = node
    window = draw(st.none() | st.integers(1, 2) | st.integers(1, 5))
    kind = draw(st.sampled_from(["int", "Window", "Adaptive"]))
    cancel_at = draw(st.none() | st.none() | st.integers(0, 20))
    return Forest(roots, window, kind, cancel_at)


@dataclass
class Probe:
    bound: int | None
    working: Concurrency = field(default_factory=Concurrency)
    entered: set[int] = field(default_factory=set)
    exited: dict[int, float] = field(default_factory=dict)
    cancelled: set[int] = field(default_factory=set)
    completed: set[int] = field(default_factory=set)
    raised: list[tuple[float, Boom]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    answers: dict[int, list[str]] = field(default_factory=dict)  # how each node's run ended

    async def work(self, seconds: int) -> None:
        with self.working:
            if self.bound is not None and self.working.now > self.bound:
                self.problems.append(f"{self.working.now} working > window {self.bound}")
            await trio.sleep(seconds)


def thunk_for(node: Node, probe: Probe) -> Callable[[], Awaitable[int]]:
    async def run() -> int:
        if node.id in probe.entered:
            probe.problems.append(f"node {node.id} started twice")
        probe.entered.add(node.id)
        outcome = "failed"
        try:
            await probe.work(node.before)
            if node.fail == "before":
                raise _boom(node, probe)
            if node.children is not None:
                thunks = [thunk_for(child, probe) for child in node.children]
                if node.deadline is None:
                    results = await tt.fan_out(thunks)
                    if results != [child.id for child in node.children]:
                        probe.problems.append(f"node {node.id}: results {results} out of order")
                else:
                    with trio.move_on_after(node.deadline + 0.5):
                        await tt.fan_out(thunks)
                    # N3: everything under this fan-out is over once it returns
                    now = trio.current_time()
                    for below in node.walk()[1:]:
                        if below.id in probe.entered and probe.exited.get(below.id, math.inf) > now:
                            probe.problems.append(f"{below.id} outlived {node.id}'s fan-out")
            await probe.work(node.after)
            if node.fail == "after":
                raise _boom(node, probe)
        except trio.Cancelled:
            probe.cancelled.add(node.id)
            outcome = "cancelled"
            raise
        else:
            probe.completed.add(node.id)
            outcome = "completed"
            return node.id
        finally:
            probe.exited[node.id] = trio.current_time()
            probe.answers.setdefault(node.id, []).append(outcome)

    return run


def _boom(node: Node, probe: Probe) -> Boom:
    exc = Boom(f"node {node.id}")
    probe.raised.append((trio.current_time(), exc))
    return exc


def _window(forest: Forest) -> int | tt.Window | None:
    if forest.window is None or forest.kind == "int":
        return forest.window
    if forest.kind == "Window":
        return tt.Window(forest.window)
    return tt.AdaptiveWindow(1, forest.window, forest.window + 3)  # nothing moves it here


@SETTINGS
@given(forest=forests())
async def test_fan_out_trees_hold_their_invariants(
    autojump_clock: MockClock, forest: Forest
) -> None:
    probe = Probe(forest.window)
    window = _window(forest)
    roots = forest.roots
    t0 = trio.current_time()
    error: BaseException | None = None
    results: list[int] | None = None

    async def run(index: int) -> int:
        return await thunk_for(roots[index], probe)()

    async def watch(window: tt.Window) -> None:
        # Between events (every event falls on a whole or half second): a place idles while
        # a thunk or a pull waits for one only if a caller waiting on its thunks kept it.
        await trio.sleep(0.25)
        while True:
            waiting = window.limiter.statistics().tasks_waiting
            if waiting and probe.working.now < window.size:
                probe.problems.append(
                    f"at {trio.current_time() - t0}: {probe.working.now} working < window "
                    f"{window.size} while {waiting} wait for a place"
                )
            await trio.sleep(1)

    with trio.fail_after(HANG):
        cancel = math.inf if forest.cancel_at is None else forest.cancel_at + 0.5
        async with trio.open_nursery() as watching:
            if isinstance(window, tt.Window):
                watching.start_soon(watch, window)
            with trio.move_on_after(cancel):
                try:
                    results = await tt.run_stream(_count(len(roots)), run, window=window)
                except Boom as exc:
                    error = exc
            watching.cancel_scope.cancel()
    elapsed = trio.current_time() - t0
    assert probe.problems == []
    # every thunk that started was answered once: it completed, failed or was cancelled
    assert set(probe.answers) == probe.entered
    assert all(len(answers) == 1 for answers in probe.answers.values()), probe.answers
    # N1
    if forest.window is not None:
        assert probe.working.peak <= forest.window
    # nothing still running, every place given back
    assert probe.working.now == 0
    assert probe.entered == set(probe.exited)
    if isinstance(window, tt.Window):
        assert window.in_flight == 0
        assert window.resting == 0  # every lent place came back
        assert window.limiter.total_tokens == window.size
    # N2: never idle while work waits; at window 1, strictly one step at a time
    total = sum(root.work() for root in roots)
    assert elapsed <= total
    finished = forest.cancel_at is None and not probe.raised
    if (
        forest.window == 1
        and finished
        and not any(node.deadline is not None for root in roots for node in root.walk())
    ):
        assert elapsed == total
    # N3: the first failure itself
    if probe.raised:
        first_at = min(at for at, _ in probe.raised) - t0
        if error is not None:
            assert any(error is exc for at, exc in probe.raised if at - t0 == first_at)
            assert elapsed == first_at  # raised at once, nothing waited for
            notes = "\n".join(getattr(error, "__notes__", []))
            for at, other in probe.raised:
                if at - t0 == first_at and other is not error:
                    assert f"was also raised: {other}" in notes
        else:
            pytest.fail(f"a failure was raised at {first_at} but the call did not raise")
    elif forest.cancel_at is None:
        assert error is None
        assert results == [root.id for root in roots]
    # N3: cancelling the run cancels every child still running
    if forest.cancel_at is not None and error is None and results is None:
        assert elapsed == forest.cancel_at + 0.5
        for node_id in probe.entered - probe.completed:
            assert node_id in probe.cancelled
            assert probe.exited[node_id] - t0 <= elapsed


async def test_elastic_places_bound_fan_outs_by_the_runs_in_flight(
    autojump_clock: MockClock,
) -> None:
    """An env server's runs (`ElasticPlaces`): each brings a place, their fan-outs share them."""
    from trio_tasksets._core.runner import ElasticPlaces

    places = ElasticPlaces()
    working = Concurrency()

    async def job() -> None:
        with working:
            await trio.sleep(1)

    async def request() -> None:
        async with places.run():
            await tt.fan_out([job] * 3)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(request)
        nursery.start_soon(request)
    assert working.peak == 2
    assert trio.current_time() == 3
    assert (places.runs, places.in_flight) == (0, 0)
    assert await tt.fan_out([job] * 4) == [None] * 4  # outside: unbounded again
    assert working.peak == 4


async def test_failures_noted_in_a_nested_fan_out_reach_the_error_raised(
    autojump_clock: MockClock,
) -> None:
    # One run fails; the other run's nested fan_out fails twice while it unwinds (two thunks
    # whose cleanup raises). The second is noted on the first, which is noted on the error
    # the runner raises: a note of a note is copied up, never dropped.
    async def first(_: int) -> None:
        await trio.sleep(1)
        raise Boom("first")

    def fails_on_cancel(name: str) -> Callable[[], Awaitable[None]]:
        async def thunk() -> None:
            try:
                await trio.sleep(100)
            except trio.Cancelled:
                raise Boom(name) from None

        return thunk

    async def inner() -> None:
        await tt.fan_out([fails_on_cancel("A"), fails_on_cancel("B")])

    async def waits() -> None:
        await trio.sleep(100)

    async def run(index: int) -> None:
        if index == 0:
            await first(index)
        await tt.fan_out([inner, waits])

    for window in (None, 4):
        with pytest.raises(Boom, match="first") as info:
            await tt.run_stream(_count(2), run, window=window)
        notes = "\n".join(info.value.__notes__)
        assert "Boom was also raised: A" in notes, notes
        assert "Boom was also raised: B" in notes, notes
