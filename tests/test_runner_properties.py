"""Property tests of the runner (SPEC section 1, R1 and R3-R7) over random schedules.

Each example draws a schedule: items with a run duration and failure flags (a failure is an
Exception, or a BaseException that is not one, as KeyboardInterrupt and SystemExit are), the
gaps the source waits before each item (then it ends, fails, or stays quiet forever), a
window (an int, or a `tt.Window` that a task resizes on a schedule), an optional outside
cancellation, the kind of source (a `Feed` fed by a task, an async
generator, a zero-buffer trio memory channel), optionally bounded by `take(source, k)`, and,
for `as_completed`, a consumer that reads slowly and may stop early.

All durations and gaps are whole virtual seconds and an outside cancellation falls on a half
second, so it never ties with another event. The k-th resize falls at a whole second plus
0.25 + k/64, so it ties with nothing but the pulls it causes: every event time is a whole
number plus at most one such fraction, and events that share a fraction descend from the
same resize. A pure-Python model (`simulate`) computes from
the schedule, with no trio, when every pull and run happens and when the call must end; the
test runs the real runner on trio's MockClock (autojump) and checks, per example:

* R1: at every pull, items requested <= runs delivered (or failed) + the window's size at that
  moment; at every run start the same for runs started, against the size when its item was
  requested (a pull requested before a shrink may return after it: shrinking cancels
  nothing); the peak of runs in flight <= the largest size;
* R4: no pull begins once a run has raised (not even in the same instant);
* R8: a `take(source, k)` never requests a (k+1)th item from the source;
* the timeline: every run starts at exactly the virtual time the model says (so no pull is
  early or late), and the call ends at exactly the model's time: the natural end, the first
  failure (zero extra virtual seconds, even on a quiet feed), the outside cancellation or
  the consumer leaving;
* R3: `run_stream` returns every result in submission order; `as_completed` yields each index
  at most once (exactly once on a normal end), with its value, in completion order;
* R4/R5: a failure (of a run, or of the source) raises exactly the first raised exception
  object (per the log of raises in virtual time), never an ExceptionGroup; a second failure
  in the same instant is attached to it (a note or the exception chain), not dropped;
* R6: an outside cancellation that fires first is caught by its scope, nothing is raised;
* R7: the source is closed exactly once, from the iterating task, never while a pull runs; an
  async generator's cleanup on close runs to its end (the close is shielded), also when
  `take` closes it mid-iteration;
* nothing is still running when the call has returned or raised.

The clock fixture is shared by all examples, so every time is a delta from the example's
start. Each example sits under `trio.fail_after`, so a runner that hangs fails the test.
"""

from __future__ import annotations

import math
import os
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

import trio
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from trio.testing import MockClock

import trio_tasksets as tt
from trio_tasksets._core.window import Window
from trio_tasksets.testing import Feed

Api = Literal["run_stream", "as_completed"]
Kind = Literal["feed", "agen", "channel"]

HANG = 100_000  # virtual seconds: far beyond any schedule here, so only a hang reaches it
INF = math.inf

SETTINGS = settings(
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    deadline=None,
    # More for a deeper search: TT_PROPERTY_EXAMPLES=20000 pytest tests/test_runner_properties.py
    max_examples=int(os.environ.get("TT_PROPERTY_EXAMPLES", "300")),
)


SOURCE = -1  # the index of the source's own failure


class Boom(Exception):
    """A run's (or the source's) failure; its message names it so notes can be matched."""

    def __init__(self, index: int) -> None:
        super().__init__("<source>" if index == SOURCE else f"<item {index}>")
        self.index = index


class Fatal(BaseException):
    """A run's failure that is not an Exception (as KeyboardInterrupt and SystemExit are not)."""

    def __init__(self, index: int) -> None:
        super().__init__(f"<fatal item {index}>")
        self.index = index


Failure = Boom | Fatal


def value_of(index: int) -> str:
    return f"r{index}"


# --- the schedule -------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    durations: tuple[int, ...]  # virtual seconds each run takes
    fails: tuple[bool, ...]  # the run raises Boom at its end
    fatal: tuple[bool, ...]  # ... Fatal instead of Boom
    cleanup_fails: tuple[bool, ...]  # cancelled after a failure, the run raises Boom too
    gaps: tuple[int, ...]  # the source waits this long before yielding each item
    end_gap: int  # ... and this long before it ends
    quiet: bool  # after the items the source parks forever instead of ending
    source_fails: bool  # instead of ending, the source raises Boom(SOURCE) (feed and agen)
    window: int | None
    cancel_at: float | None  # outside cancellation, a half second
    kind: Kind
    delays: tuple[int, ...]  # as_completed: the consumer sleeps this long after each receive
    stop_after: int | None  # as_completed: the consumer leaves after this many results
    take: int | None = None  # the runner reads take(source, take)
    use_window: bool = False  # pass tt.Window(window) rather than the int
    resizes: tuple[tuple[int, int], ...] = ()  # (whole second, new size), in order

    @property
    def resize_times(self) -> list[tuple[float, int]]:
        return [(at + 0.25 + k / 64, size) for k, (at, size) in enumerate(self.resizes)]

    @property
    def largest(self) -> int | None:
        if self.window is None:
            return None
        return max([self.window, *(size for _, size in self.resizes)])

    @property
    def n(self) -> int:
        return len(self.durations)

    @property
    def truncated(self) -> bool:
        """take ends the iteration after its k-th item, without asking the source again."""
        return self.take is not None and self.take <= self.n

    @property
    def m(self) -> int:
        """The items the runner gets."""
        return min(self.n, self.take) if self.take is not None else self.n


@st.composite
def scenarios(draw: st.DrawFn, *, consumer: bool) -> Scenario:
    n = draw(st.integers(0, 10))
    ints = st.integers
    durations = tuple(draw(st.lists(ints(0, 5), min_size=n, max_size=n)))
    fails = fatal = cleanup_fails = (False,) * n
    if draw(st.booleans()):
        fails = tuple(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
        cleanup_fails = tuple(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
        if draw(st.integers(0, 3)) == 0:
            fatal = tuple(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    gaps = tuple(draw(st.lists(st.sampled_from([0, 0, 1, 2, 3]), min_size=n, max_size=n)))
    end_gap = draw(ints(0, 3))
    quiet = draw(st.booleans())
    window = draw(st.none() | ints(1, 2) | ints(1, 6))
    cancel_at = draw(st.none() | ints(0, 30).map(lambda s: s + 0.5))
    kind: Kind = draw(st.sampled_from(["feed", "agen", "channel"]))
    source_fails = not quiet and kind != "channel" and draw(st.integers(0, 3)) == 0
    delays: tuple[int, ...] = (0,) * n
    stop_after = None
    if consumer:
        delays = tuple(draw(st.lists(st.sampled_from([0, 0, 1, 3]), min_size=n, max_size=n)))
        if n and draw(st.integers(0, 3)) == 0:
            stop_after = draw(ints(1, n))
    take = draw(st.none() | ints(0, n + 1))
    use_window = window is not None and draw(st.booleans())
    resizes: tuple[tuple[int, int], ...] = ()
    if use_window:
        resizes = tuple(sorted(draw(st.lists(st.tuples(ints(0, 25), ints(1, 6)), max_size=4))))
    truncated = take is not None and take <= n
    taken_fail = any(fails[: take if truncated else n])
    if quiet and not truncated and not taken_fail and cancel_at is None and stop_after is None:
        cancel_at = 500.5  # a correct runner waits for a quiet feed forever: end it from outside
    return Scenario(
        durations,
        fails,
        fatal,
        cleanup_fails,
        gaps,
        end_gap,
        quiet,
        source_fails,
        window,
        cancel_at,
        kind,
        delays,
        stop_after,
        take,
        use_window,
        resizes,
    )


# --- the model ------------------------------------------------------------------------------


@dataclass
class Model:
    start: list[float]  # when run i starts (INF: never within the horizon)
    end: list[float]  # when run i ends
    received: list[float]  # as_completed: when the consumer receives its k-th result
    natural: float  # when the call ends if nothing fails or cancels it (INF: never)
    source_end: float  # when the source ends (or raises)


def simulate(sc: Scenario, api: Api) -> Model:
    """Virtual times of every pull, run and receive, for a runner that takes a window slot
    before each pull (the terminal one too) and frees it when the result is delivered (stored
    for run_stream, received by the consumer for as_completed); a pull needs fewer slots
    taken than the window's current size. Ignores failures: nothing changes before the first
    one, and the test only compares events before the call ends. Steps from one event time to
    the next.
    """
    n = sc.m  # a truncating take answers the pull after its last item at once, with the end
    cum = [sum(sc.gaps[: i + 1]) for i in range(n)]
    start = [INF] * n
    end = [INF] * n
    finished = [False] * n
    received: list[float] = []
    held = 0  # window slots taken: pending pull + runs + results not yet received
    next_request = 0  # index of the next pull; index n is the terminal pull
    pending: tuple[int, float] | None = None  # (index, when the source answers)
    source_done = False
    source_end = INF
    last_taken = 0.0
    waiting = 0  # as_completed: finished results not yet received
    consumer_ready = 0.0
    natural = INF
    window = sc.window
    resizes = sc.resize_times
    t = 0.0
    while True:
        while resizes and resizes[0][0] <= t:
            window = resizes.pop(0)[1]
        changed = True
        while changed:
            changed = False
            for i in range(n):
                if end[i] == t and not finished[i]:
                    finished[i] = True
                    changed = True
                    if api == "run_stream":
                        held -= 1
                    else:
                        waiting += 1
            if api == "as_completed" and waiting and consumer_ready <= t:
                waiting -= 1
                held -= 1
                consumer_ready = t + sc.delays[len(received)]
                received.append(t)
                changed = True
            if pending is not None and pending[1] <= t:
                index, _ = pending
                pending = None
                changed = True
                if index < n:
                    start[index] = t
                    end[index] = t + sc.durations[index]
                    last_taken = t
                else:
                    source_done = True
                    source_end = t
                    held -= 1
            if pending is None and next_request <= n and (window is None or held < window):
                index = next_request
                next_request += 1
                held += 1
                changed = True
                answer: float
                if index == n and sc.truncated:
                    answer = t
                elif index == n and sc.quiet:
                    answer = INF
                elif sc.kind == "feed":
                    answer = cum[index] if index < n else sum(sc.gaps) + sc.end_gap
                else:
                    base = t if sc.kind == "agen" else last_taken
                    answer = base + (sc.gaps[index] if index < n else sc.end_gap)
                pending = (index, answer)
        if source_done and all(finished) and waiting == 0:
            natural = max(t, consumer_ready) if api == "as_completed" else t
            break
        upcoming = [e for i, e in enumerate(end) if not finished[i] and e < INF]
        if pending is not None:
            upcoming.append(pending[1])
        if api == "as_completed" and waiting:
            upcoming.append(consumer_ready)
        if resizes:
            upcoming.append(resizes[0][0])
        later = [u for u in upcoming if t < u < INF]
        if not later:
            break  # a quiet source: nothing more ever happens
        t = min(later)
    assert (sc.quiet and not sc.truncated) or natural < INF, "model: a finite schedule must end"
    assert all(s < INF for s in start), "model: every item is pulled"
    return Model(start, end, received, natural, source_end)


# --- what the test observes ---------------------------------------------------------------


@dataclass
class Observed:
    api: Api
    window: int | None  # the size now
    t0: float
    largest: int | None = None  # the largest size so far
    running: int = 0
    peak: int = 0
    started: int = 0
    exited: int = 0  # runs that left `run` by any path
    exited_badly: int = 0  # ... by an exception (failed or cancelled)
    requests: int = 0  # pulls requested from the source (feed and agen)
    size_at_request: list[int | None] = field(default_factory=list)
    starts: dict[int, float] = field(default_factory=dict)
    raised: list[tuple[float, Failure]] = field(default_factory=list)
    pulls_after_failure: int = 0
    got: list[tuple[int, str, float]] = field(default_factory=list)  # as_completed receives
    violations: list[str] = field(default_factory=list)
    gen_finally: int = 0
    gen_closed_by_aclose: bool = False
    gen_cleaned: int = 0  # the async cleanup in the generator's `finally` ran to its end
    gen_pullers: set[trio.lowlevel.Task] = field(default_factory=set)
    gen_closer: trio.lowlevel.Task | None = None

    def now(self) -> float:
        return trio.current_time() - self.t0

    def delivered(self) -> int:
        """Runs whose window slot the runner may have freed by now."""
        if self.api == "run_stream":
            return self.exited
        return len(self.got) + self.exited_badly

    def check_window(self, what: str, count: int, size: int | None) -> None:
        if size is not None and count > self.delivered() + size:
            self.violations.append(
                f"at t={self.now()}: {what} {count} > delivered {self.delivered()} + window {size}"
            )

    def size_when_requested(self, index: int) -> int | None:
        """The size in force when item `index` was requested (unobserved: the largest yet)."""
        if index < len(self.size_at_request):
            return self.size_at_request[index]
        return self.largest

    def on_pull(self) -> None:
        self.requests += 1
        self.size_at_request.append(self.window)
        self.check_window("pull", self.requests, self.window)
        if any(error.index != SOURCE for _, error in self.raised):
            self.pulls_after_failure += 1


class RecordingFeed(Feed[int]):
    """A Feed that checks the window at every pull and logs the error it raises."""

    def __init__(self, obs: Observed) -> None:
        super().__init__()
        self._obs = obs

    async def __anext__(self) -> int:
        self._obs.on_pull()
        try:
            return await super().__anext__()
        except Boom as error:
            self._obs.raised.append((self._obs.now(), error))
            raise


Source = Feed[int] | AsyncGenerator[int, None] | trio.MemoryReceiveChannel[int]


def open_source(
    sc: Scenario, obs: Observed, helpers: trio.Nursery
) -> tuple[Source, RecordingFeed | None, trio.MemoryReceiveChannel[int] | None]:
    """The scenario's source (a feed, an async generator or a channel), its producer started
    in `helpers`; with the feed or the channel, for the checks that read them afterwards."""
    if sc.kind == "feed":
        feed = RecordingFeed(obs)
        helpers.start_soon(feeder, sc, feed)
        return feed, feed, None
    if sc.kind == "agen":
        return generator(sc, obs), None, None
    send, receive = trio.open_memory_channel[int](0)
    helpers.start_soon(producer, sc, obs, send)
    return receive, None, receive


def taken_and_windowed(
    sc: Scenario, obs: Observed, helpers: trio.Nursery, source: Source
) -> tuple[Source, int | Window | None]:
    """`source` cut at the scenario's `take`, and its window: with `use_window` a `Window`,
    its resizer started in `helpers`."""
    if sc.take is not None:
        source = tt.take(source, sc.take)  # type: ignore[assignment]
    if not sc.use_window:
        return source, sc.window
    assert sc.window is not None
    window = Window(sc.window)
    helpers.start_soon(resizer, sc, obs, window)
    return source, window


async def feeder(sc: Scenario, feed: Feed[int]) -> None:
    for i in range(sc.n):
        await trio.sleep(sc.gaps[i])
        feed.put(i)
    await trio.sleep(sc.end_gap)
    if sc.source_fails:
        feed.fail(Boom(SOURCE))
    elif not sc.quiet:
        feed.end()


async def resizer(sc: Scenario, obs: Observed, window: Window) -> None:
    for at, size in sc.resize_times:
        await trio.sleep_until(obs.t0 + at)
        obs.window = size
        obs.largest = max(size, obs.largest or size)
        window.size = size


async def producer(sc: Scenario, obs: Observed, send: trio.MemorySendChannel[int]) -> None:
    try:
        async with send:
            for i in range(sc.n):
                await trio.sleep(sc.gaps[i])
                await send.send(i)
                obs.check_window("take", i + 1, obs.largest)  # weaker than at the request
            await trio.sleep(sc.end_gap)
            if sc.quiet:
                await trio.sleep_forever()
    except trio.BrokenResourceError:
        pass  # the runner closed the receiving end


def generator(sc: Scenario, obs: Observed) -> AsyncGenerator[int, None]:
    async def gen() -> AsyncGenerator[int, None]:
        try:
            for i in range(sc.n):
                obs.gen_pullers.add(trio.lowlevel.current_task())
                obs.on_pull()
                await trio.sleep(sc.gaps[i])
                yield i
            obs.gen_pullers.add(trio.lowlevel.current_task())
            obs.on_pull()
            await trio.sleep(sc.end_gap)
            if sc.source_fails:
                error = Boom(SOURCE)
                obs.raised.append((obs.now(), error))
                raise error
            if sc.quiet:
                await trio.sleep_forever()
        except GeneratorExit:
            obs.gen_closed_by_aclose = True
            # An async cleanup on aclose(): a close that is not shielded has it cut short by
            # a cancel. (Only here: on the way out with the source's own error, a checkpoint
            # would let a run fail first, and the log of raises would be out of order.)
            await trio.lowlevel.checkpoint()
            obs.gen_cleaned += 1
            raise
        finally:
            obs.gen_finally += 1
            obs.gen_closer = trio.lowlevel.current_task()

    return gen()


# --- one example --------------------------------------------------------------------------


async def execute(sc: Scenario, api: Api) -> None:
    model = simulate(sc, api)
    event(f"source: {sc.kind}{' (quiet)' if sc.quiet else ''}")
    obs = Observed(api, sc.window, trio.current_time(), largest=sc.window)

    async def run(i: int) -> str:
        obs.running += 1
        obs.started += 1
        obs.peak = max(obs.peak, obs.running)
        obs.starts[i] = obs.now()
        obs.check_window("run start", obs.started, obs.size_when_requested(i))
        ok = False
        try:
            try:
                await trio.sleep(sc.durations[i])
            except trio.Cancelled:
                if sc.cleanup_fails[i] and obs.raised:
                    # A second real failure while the runs unwind from the first.
                    error = Boom(i)
                    obs.raised.append((obs.now(), error))
                    raise error from None
                raise
            if sc.fails[i]:
                failure: Failure = Fatal(i) if sc.fatal[i] else Boom(i)
                obs.raised.append((obs.now(), failure))
                raise failure
            ok = True
            return value_of(i)
        finally:
            obs.running -= 1
            obs.exited += 1
            if not ok:
                obs.exited_badly += 1

    feed: RecordingFeed | None = None
    receive: trio.MemoryReceiveChannel[int] | None = None
    results: list[str] | None = None
    raised: Failure | None = None
    unexpected: BaseException | None = None
    channel_closed = True
    cancel_deadline = obs.t0 + sc.cancel_at if sc.cancel_at is not None else INF

    with trio.fail_after(HANG):
        async with trio.open_nursery() as helpers:
            source, feed, receive = open_source(sc, obs, helpers)
            source, window = taken_and_windowed(sc, obs, helpers, source)
            with trio.CancelScope(deadline=cancel_deadline) as outside:
                try:
                    if api == "run_stream":
                        results = await tt.run_stream(source, run, window=window)
                    else:
                        async with tt.as_completed(source, run, window=window) as channel:
                            async for index, value in channel:
                                obs.got.append((index, value, obs.now()))
                                if len(obs.got) == sc.stop_after:
                                    break
                                await trio.sleep(sc.delays[len(obs.got) - 1])
                except (Boom, Fatal) as exc:
                    raised = exc
                except trio.Cancelled:
                    raise
                except BaseException as exc:  # an ExceptionGroup, a RuntimeError, ...
                    unexpected = exc
            t_end = obs.now()
            running_after = obs.running
            if receive is not None:
                try:
                    receive.receive_nowait()
                except trio.ClosedResourceError:
                    pass
                else:
                    channel_closed = False
            helpers.cancel_scope.cancel()

    # Right after the call: a bare exception, nothing running, the source closed once, properly.
    assert unexpected is None, f"the call raised {unexpected!r}, not a run's own exception"
    assert running_after == 0, f"{running_after} runs still running after the call"
    if feed is not None:
        assert feed.close_calls == 1
        assert not feed.closed_while_pulling
        assert not feed.foreign_close
    if sc.kind == "agen" and not obs.gen_pullers:
        assert sc.take == 0  # take(source, 0) never starts the generator: nothing to clean up
        assert obs.gen_finally == 0
    elif sc.kind == "agen":
        assert obs.gen_finally == 1
        assert len(obs.gen_pullers) == 1
        assert obs.gen_closer in obs.gen_pullers, "closed from a task that never pulled"
        if obs.gen_closed_by_aclose:
            event("agen closed at a yield")
            assert obs.gen_cleaned == 1, "the close was not shielded"
    assert channel_closed, "the memory channel source was not closed"

    # R1: the window bounds pulls and runs in flight.
    assert not obs.violations, obs.violations
    largest = sc.largest
    if largest is not None:
        assert obs.peak <= largest
    if isinstance(window, Window):
        event("window: tt.Window" + (" resized" if sc.resizes else ""))
        assert window.in_flight == 0, "the call kept window tokens"
    # R4: nothing is pulled once a run has failed. R8: take never over-pulls.
    assert obs.pulls_after_failure == 0, f"{obs.pulls_after_failure} pulls after a failure"
    if sc.truncated and sc.kind != "channel":
        assert sc.take is not None
        assert obs.requests <= sc.take, f"take({sc.take}) requested {obs.requests}"

    # What should have ended the call, and when.
    first_fail = min((model.end[i] for i in range(sc.m) if sc.fails[i]), default=INF)
    if sc.source_fails and not sc.truncated:
        first_fail = min(first_fail, model.source_end)
    stop = INF
    if sc.stop_after is not None and len(model.received) >= sc.stop_after:
        stop = model.received[sc.stop_after - 1]
    cancel = sc.cancel_at if sc.cancel_at is not None else INF
    expected_end = min(first_fail, stop, cancel, model.natural)
    assert expected_end < INF
    assert t_end == expected_end, f"call ended at +{t_end}, model says +{expected_end}"

    # The timeline up to the end matches the model exactly.
    for i, at in obs.starts.items():
        assert at == model.start[i], f"run {i} started at +{at}, model says +{model.start[i]}"
    missing = [i for i in range(sc.m) if model.start[i] < t_end and i not in obs.starts]
    assert not missing, f"runs {missing} should have started before +{t_end}"

    # Every raise is logged; the call raised the first one, at once, unwrapped.
    assert all(at == first_fail for at, _ in obs.raised)
    if cancel < min(first_fail, stop, model.natural):
        event("outcome: cancelled from outside")
        assert outside.cancelled_caught
        assert raised is None
        assert results is None
        assert not obs.raised
    elif first_fail == expected_end and (raised is not None or first_fail < stop):
        # (a consumer leaving at the very instant of a failure may win the race)
        culprit = "the source" if raised is not None and raised.index == SOURCE else "a run"
        event(f"outcome: {culprit} failed ({len(obs.raised)} raised in that instant)")
        assert not outside.cancelled_caught
        assert raised is not None, "a run failed but the call did not raise"
        assert obs.raised, "the call raised a failure no run raised"
        assert raised is obs.raised[0][1], (raised, obs.raised)
        if raised.index == SOURCE:
            assert model.source_end == first_fail
        else:
            assert sc.fails[raised.index]
            assert model.end[raised.index] == first_fail
        for _, later in obs.raised[1:]:
            assert attached(raised, later), f"{later!r} dropped silently"
    else:
        event("outcome: consumer left" if stop == expected_end else "outcome: normal end")
        assert not outside.cancelled_caught
        assert raised is None
        assert not obs.raised, f"a failure was dropped: {obs.raised}"
        if api == "run_stream":
            assert results == [value_of(i) for i in range(sc.m)]

    if api == "as_completed":
        check_received(sc, model, obs, t_end, complete=raised is None)


def attached(error: BaseException, extra: Failure) -> bool:
    """`extra` is visible on `error`: in a note, or in its cause/context chain."""
    if any(str(extra) in note for note in getattr(error, "__notes__", [])):
        return True
    seen: BaseException | None = error
    while seen is not None:
        if seen is extra:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def check_received(sc: Scenario, model: Model, obs: Observed, t_end: float, complete: bool) -> None:
    indices = [index for index, _, _ in obs.got]
    assert len(set(indices)) == len(indices), f"an index delivered twice: {indices}"
    for index, value, _ in obs.got:
        assert value == value_of(index)
    # Completion order: a result that finished earlier is received no later.
    ends = [model.end[index] for index in indices]
    assert ends == sorted(ends), f"not in completion order: {indices}"
    # Receive times follow the model (a receive at the very instant of a failure may or may
    # not happen).
    times = [at for _, _, at in obs.got]
    assert times == model.received[: len(times)]
    assert len(times) >= sum(1 for at in model.received if at < t_end)
    if complete and (sc.cancel_at is None or t_end < sc.cancel_at):
        wanted = sc.m if sc.stop_after is None else min(sc.stop_after, sc.m)
        assert len(indices) == wanted
        if sc.stop_after is None:
            assert sorted(indices) == list(range(sc.m))


# --- the tests ----------------------------------------------------------------------------


@SETTINGS
@given(sc=scenarios(consumer=False))
async def test_run_stream_holds_its_invariants_on_random_schedules(
    autojump_clock: MockClock, sc: Scenario
) -> None:
    await execute(sc, "run_stream")


# duplicates: not one parametrized test: each API draws scenarios of its own (a consumer or not)
@SETTINGS
@given(sc=scenarios(consumer=True))
async def test_as_completed_holds_its_invariants_on_random_schedules(
    autojump_clock: MockClock, sc: Scenario
) -> None:
    await execute(sc, "as_completed")


def by_hand(
    durations: tuple[int, ...],
    gaps: tuple[int, ...],
    end_gap: int,
    window: int,
    *,
    use_window: bool = False,
    resizes: tuple[tuple[int, int], ...] = (),
) -> Scenario:
    """A scenario to check by hand: an async generator of len(durations) items that all
    succeed, `gaps` apart, under `window`."""
    n = len(durations)
    none = (False,) * n
    return Scenario(durations=durations, fails=none, fatal=none, cleanup_fails=none, gaps=gaps,
                    end_gap=end_gap, quiet=False, source_fails=False, window=window,
                    cancel_at=None, kind="agen", delays=(0,) * n, stop_after=None,
                    use_window=use_window, resizes=resizes)  # fmt: skip


def test_the_model_on_a_hand_checked_schedule() -> None:
    """The model itself, on a schedule worked out by hand (window 2, an async generator)."""
    sc = by_hand((3, 1, 1, 0), (0, 1, 0, 2), end_gap=1, window=2)
    model = simulate(sc, "run_stream")
    # item 0 at 0 (runs to 3); item 1 asked at 0, yielded at 1 (runs to 2); item 2 asked at 2
    # when run 1 frees its slot, yielded at 2 (runs to 3); item 3 asked at 3, yielded at 5;
    # the end asked at 5, answered at 6.
    assert model.start == [0, 1, 2, 5]
    assert model.end == [3, 2, 3, 5]
    assert model.natural == 6


def test_the_model_on_a_hand_checked_schedule_with_a_resize() -> None:
    """Window 1 grows to 3 at +1.25: the two items waiting start then, not when run 0 ends."""
    sc = by_hand((4, 4, 4), (0, 0, 0), end_gap=0, window=1, use_window=True, resizes=((1, 3),))
    model = simulate(sc, "run_stream")
    assert model.start == [0, 1.25, 1.25]
    assert model.natural == 5.25


# --- runs that fan out ----------------------------------------------------------------------


@SETTINGS
@given(sc=scenarios(consumer=False), shape=st.lists(st.integers(1, 3), min_size=10, max_size=10))
async def test_runs_that_fan_out_keep_the_bound_and_answer_every_child(
    autojump_clock: MockClock, sc: Scenario, shape: list[int]
) -> None:
    """The same random schedules (sources, gaps, windows and resizes, failures, outside
    cancellations), with each run's work split over 1 to 3 thunks of a `tt.fan_out` (the
    last failing when the run would), then a second of the run's own work after it (or
    none). With fan_out lending a waiting run's place: at every instant, the thunks and runs
    doing work <= the window's largest size; every thunk that starts is answered exactly
    once (completed, failed or cancelled); nothing works once the call is over; every lent
    place comes back; and what the call raises is a failure itself, never a group."""
    obs = Observed("run_stream", sc.window, trio.current_time(), largest=sc.window)
    working = peak = 0
    answers: dict[tuple[int, int], list[str]] = {}
    failures: list[BaseException] = []

    async def work(seconds: int) -> None:
        nonlocal working, peak
        working += 1
        peak = max(peak, working)
        try:
            await trio.sleep(seconds)
        finally:
            working -= 1

    def thunk(i: int, j: int, seconds: int, fails: bool) -> Callable[[], Awaitable[int]]:
        async def one() -> int:
            outcome = "failed"
            try:
                await work(seconds)
                if fails:
                    error = Boom(i)
                    failures.append(error)
                    raise error
            except trio.Cancelled:
                outcome = "cancelled"
                raise
            else:
                outcome = "completed"
                return j
            finally:
                answers.setdefault((i, j), []).append(outcome)

        return one

    async def run(i: int) -> str:
        k, total = shape[i], sc.durations[i]
        parts = [total // k + (1 if j < total % k else 0) for j in range(k)]
        thunks = [thunk(i, j, parts[j], sc.fails[i] and j == k - 1) for j in range(k)]
        assert await tt.fan_out(thunks) == list(range(k))
        await work(i % 2)
        return value_of(i)

    error: BaseException | None = None
    cancel_deadline = obs.t0 + sc.cancel_at if sc.cancel_at is not None else INF
    with trio.fail_after(HANG):
        async with trio.open_nursery() as helpers:
            source, window = taken_and_windowed(sc, obs, helpers, open_source(sc, obs, helpers)[0])
            with trio.CancelScope(deadline=cancel_deadline):
                try:
                    await tt.run_stream(source, run, window=window)
                except Exception as exc:
                    error = exc
            working_after = working
            helpers.cancel_scope.cancel()
    assert working_after == 0
    if sc.largest is not None:
        assert peak <= sc.largest
    assert all(len(outcomes) == 1 for outcomes in answers.values()), answers
    if error is not None:  # a thunk's (or the source's) own exception, never a group
        assert any(error is raised for raised in failures + [e for _, e in obs.raised])
    if isinstance(window, Window):
        assert (window.in_flight, window.resting) == (0, 0)
        assert window.limiter.total_tokens == window.size
