"""The asyncio bridge, guest-mode direction: `trio_tasksets.aio.run_stream` / `run_trio` awaited
from `asyncio.run`, with asyncio sources and runs (SPEC section 6; R1-R8 of section 1 again).

These are plain sync tests that call `asyncio.run` (pytest-trio leaves sync tests alone). asyncio
has no MockClock: they run on the real clock, synchronise on events (never on timed sleeps),
and every wait that could hang sits under `asyncio.timeout(5)`.
"""

from __future__ import annotations

import asyncio
import contextvars
import faulthandler
import functools
import math
import signal
import sys
import threading
import time
from collections.abc import AsyncGenerator, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
import sniffio
import trio

import trio_tasksets as tt
from trio_tasksets import aio
from trio_tasksets.aio import _guest as aio_guest

T = TypeVar("T")

LIMIT = 5.0  # seconds: every potentially hanging wait sits under asyncio.timeout(LIMIT)
WATCHDOG = 2 * LIMIT


class Boom(Exception):
    pass


# --- helpers: an asyncio feed, an asyncio gate -----------------------------------------------


class _Changed:
    """'Something changed' broadcast for asyncio: wait until a predicate holds."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def fire(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def until(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self._event.wait()


_END = object()


class AioFeed:
    """An asyncio async generator fed by the test through an `asyncio.Queue`.

    `put(*items)`, `end()`, `fail(exc)`. With nothing queued the generator parks on
    `queue.get()` (a quiet feed) and `parked` is set. Counts `pulled`, `finally_runs` (its
    `finally` block), `cancelled` (an asyncio CancelledError arrived while parked) and records
    whether each step ran in an asyncio task.
    """

    def __init__(self, *items: Any) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.pulled = 0
        self.finally_runs = 0
        self.cancelled = 0
        self.parked = asyncio.Event()
        self.outside_asyncio = 0
        self.put(*items)

    def put(self, *items: Any) -> None:
        for item in items:
            self.queue.put_nowait(item)

    def end(self) -> None:
        self.queue.put_nowait(_END)

    def fail(self, error: BaseException) -> None:
        self.queue.put_nowait(error)

    # duplicates: test_bridge_env's QueueFeed parks alike, other counters; each suite owns its feed
    async def gen(self) -> AsyncGenerator[Any, None]:
        try:
            while True:
                if asyncio.current_task() is None:
                    self.outside_asyncio += 1
                if self.queue.empty():
                    self.parked.set()
                try:
                    item = await self.queue.get()
                except asyncio.CancelledError:
                    self.cancelled += 1
                    raise
                self.parked.clear()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                self.pulled += 1
                yield item
        finally:
            self.finally_runs += 1


class AioGate:
    """Holds asyncio runs until `open()`; records running, peak, started, finished, cancelled
    (an asyncio CancelledError seen by the run)."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._changed = _Changed()
        self.running = 0
        self.peak = 0
        self.started = 0
        self.finished = 0
        self.cancelled = 0

    def open(self) -> None:
        self._open.set()

    async def run(self, item: T) -> T:
        self.running += 1
        self.started += 1
        self.peak = max(self.peak, self.running)
        self._changed.fire()
        try:
            await self._open.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1
            self._changed.fire()
        self.finished += 1
        return item

    async def wait_running(self, n: int) -> None:
        await self._changed.until(lambda: self.running >= n)


def arun(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """`asyncio.run(main())`, checking that the bridge left nothing behind."""

    async def checked() -> T:
        result = await main()
        assert asyncio.all_tasks() == {asyncio.current_task()}
        assert not trio.lowlevel.in_trio_run()  # the shared guest run has ended
        return result

    # asyncio.timeout cannot break a wait for runs that refuse to unwind (the bridge waits for
    # them, as trio does): a hard watchdog turns such a hang into a crash with tracebacks.
    faulthandler.dump_traceback_later(WATCHDOG, exit=True)
    try:
        return asyncio.run(checked())
    finally:
        faulthandler.cancel_dump_traceback_later()


async def spin(n: int = 20) -> None:
    """Yield to the loop n times (no timed sleep): lets a would-be extra pull happen."""
    for _ in range(n):
        await asyncio.sleep(0)


# --- R1 / R2: window and exact pull count ---------------------------------------------------


@pytest.mark.parametrize(("window", "items"), [(1, 20), (2, 20), (5, 20), (None, 10)])
def test_r1_r2_exactly_window_items_pulled_while_asyncio_runs_are_held(
    window: int | None, items: int
) -> None:
    """R1: `window` items pulled while the runs are held; R2: None is unbounded (all)."""
    held = items if window is None else window

    async def main() -> None:
        feed = AioFeed(*range(items))
        feed.end()
        gate = AioGate()
        async with asyncio.timeout(LIMIT):
            task = asyncio.create_task(aio.run_stream(feed.gen(), gate.run, window=window))
            await gate.wait_running(held)
            await spin()
            assert feed.pulled == held
            assert gate.running == held
            gate.open()
            assert await task == list(range(items))
        assert feed.pulled == items
        assert gate.peak == held
        assert feed.finally_runs == 1
        assert feed.outside_asyncio == 0

    arun(main)


@pytest.mark.parametrize("window", [0, -1, 1.5, "2", True])
def test_r2_bad_window_raises_value_error_before_anything_is_pulled(window: Any) -> None:
    async def main() -> None:
        feed = AioFeed(1, 2, 3)
        gate = AioGate()
        async with asyncio.timeout(LIMIT):
            with pytest.raises(ValueError, match="window"):
                await aio.run_stream(feed.gen(), gate.run, window=window)
        assert feed.pulled == 0
        assert gate.started == 0

    arun(main)


def test_bad_source_and_run_name_the_argument() -> None:
    async def run(item: int) -> int:
        return item

    async def main() -> None:
        async with asyncio.timeout(LIMIT):
            with pytest.raises(TypeError, match="source"):
                await aio.run_stream([1, 2], run, window=1)  # type: ignore[arg-type]
            feed = AioFeed()
            with pytest.raises(TypeError, match="run"):
                await aio.run_stream(feed.gen(), 42, window=1)  # type: ignore[arg-type]

    arun(main)


def test_r3_empty_source() -> None:
    async def main() -> None:
        feed = AioFeed()
        feed.end()
        gate = AioGate()
        async with asyncio.timeout(LIMIT):
            assert await aio.run_stream(feed.gen(), gate.run, window=3) == []
        assert feed.finally_runs == 1

    arun(main)


# --- R3: submission order ---------------------------------------------------------------------


def test_r3_results_in_submission_order_while_completion_order_differs() -> None:
    n = 6

    async def main() -> None:
        feed = AioFeed(*range(n))
        feed.end()
        release = {i: asyncio.Event() for i in range(n)}
        changed = _Changed()
        running: set[int] = set()
        completed: list[int] = []

        async def run(item: int) -> str:
            running.add(item)
            changed.fire()
            await release[item].wait()
            completed.append(item)
            changed.fire()
            return f"r{item}"

        async with asyncio.timeout(LIMIT):
            task = asyncio.create_task(aio.run_stream(feed.gen(), run, window=None))
            await changed.until(lambda: len(running) == n)
            for i in reversed(range(n)):  # finish in reverse order, one after the other
                release[i].set()
                await changed.until(lambda: len(completed) == n - i)  # noqa: B023
            assert await task == [f"r{i}" for i in range(n)]
        assert completed == list(reversed(range(n)))

    arun(main)


# --- R4: fail-fast while the feed is quiet ----------------------------------------------------


def test_r4_failure_while_the_feed_is_quiet_cancels_runs_closes_and_reraises_unwrapped() -> None:
    error = Boom("run 1 failed")

    async def main() -> None:
        feed = AioFeed(0, 1, 2)  # then quiet: parked on asyncio.Queue.get()
        gate = AioGate()

        async def run(item: int) -> int:
            if item == 1:
                await gate.wait_running(2)
                await feed.parked.wait()
                raise error
            return await gate.run(item)

        async with asyncio.timeout(LIMIT):
            start = time.perf_counter()
            with pytest.raises(Boom) as info:
                await aio.run_stream(feed.gen(), run, window=None)
            elapsed = time.perf_counter() - start
        assert info.value is error  # the run's own exception object, never an ExceptionGroup
        assert gate.cancelled == 2  # the other runs saw asyncio CancelledError
        assert gate.finished == 0
        assert feed.cancelled == 1  # the parked pull was cancelled...
        assert feed.finally_runs == 1  # ...and the generator's finally ran exactly once
        assert elapsed < 1.0  # raised at once, not when the feed speaks again

    arun(main)


def test_r4_feed_parked_on_a_bare_event_is_cancelled_at_once() -> None:
    closed: list[str] = []

    async def main() -> None:
        async def gen() -> AsyncGenerator[int, None]:
            try:
                yield 0
                await asyncio.Event().wait()  # never set: a feed that never speaks again
                yield 1
            finally:
                closed.append("finally")

        async def run(item: int) -> int:
            raise Boom(item)

        async with asyncio.timeout(LIMIT):
            with pytest.raises(Boom):
                await aio.run_stream(gen(), run, window=2)
        assert closed == ["finally"]

    arun(main)


def test_r4_a_second_failure_while_unwinding_is_attached_to_the_first() -> None:
    first = Boom("first")

    async def main() -> None:
        feed = AioFeed(0, 1)
        feed.end()
        started = asyncio.Event()

        async def run(item: int) -> int:
            if item == 0:
                try:
                    started.set()
                    await asyncio.Event().wait()
                except asyncio.CancelledError:
                    raise KeyError("while unwinding") from None
            await started.wait()
            raise first

        async with asyncio.timeout(LIMIT):
            with pytest.raises(Boom) as info:
                await aio.run_stream(feed.gen(), run, window=None)
        assert info.value is first
        assert any("KeyError" in note for note in getattr(info.value, "__notes__", []))

    arun(main)


def test_asyncio_code_cancelling_itself_is_a_clear_error_not_a_stray_cancel() -> None:
    async def main() -> None:
        feed = AioFeed(0, 1)
        feed.end()
        gate = AioGate()

        async def run(item: int) -> int:
            if item == 1:
                await gate.wait_running(1)
                task = asyncio.current_task()
                assert task is not None
                task.cancel()
                await asyncio.sleep(0)
            return await gate.run(item)

        async with asyncio.timeout(LIMIT):
            with pytest.raises(aio.AsyncioCancelled) as info:
                await aio.run_stream(feed.gen(), run, window=None)
        assert isinstance(info.value.__cause__, asyncio.CancelledError)
        assert gate.cancelled == 1
        assert feed.finally_runs == 1

    arun(main)


# --- R5: source errors ------------------------------------------------------------------------


def test_r5_source_error_cancels_the_runs_and_is_reraised_itself() -> None:
    error = Boom("feed broke")

    async def main() -> None:
        feed = AioFeed(0, 1)
        gate = AioGate()
        async with asyncio.timeout(LIMIT):
            task = asyncio.create_task(aio.run_stream(feed.gen(), gate.run, window=None))
            await gate.wait_running(2)
            feed.fail(error)
            with pytest.raises(Boom) as info:
                await task
        assert info.value is error
        assert gate.cancelled == 2
        assert feed.finally_runs == 1

    arun(main)


# --- R6: cancelling the asyncio task ----------------------------------------------------------


def test_r6_cancelling_the_asyncio_task_cancels_runs_and_closes_the_quiet_feed() -> None:
    async def main() -> None:
        feed = AioFeed(0, 1)  # then quiet
        gate = AioGate()
        async with asyncio.timeout(LIMIT):
            task = asyncio.create_task(aio.run_stream(feed.gen(), gate.run, window=3))
            await gate.wait_running(2)
            await feed.parked.wait()
            task.cancel("stop it")
            with pytest.raises(asyncio.CancelledError, match="stop it"):
                await task
        assert task.cancelled()
        assert gate.cancelled == 2
        assert feed.cancelled == 1
        assert feed.finally_runs == 1

    arun(main)


def test_r6_asyncio_timeout_around_the_call_becomes_timeout_error() -> None:
    async def main() -> None:
        feed = AioFeed(0)  # then quiet
        gate = AioGate()
        async with asyncio.timeout(LIMIT):
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.01):
                    await aio.run_stream(feed.gen(), gate.run, window=3)
        assert gate.cancelled == 1
        assert feed.finally_runs == 1

    arun(main)


def _run_until_complete(main: Coroutine[Any, Any, None]) -> None:
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(main)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


@pytest.mark.skipif(sys.platform == "win32", reason="signal.raise_signal(SIGINT) on Windows")
@pytest.mark.parametrize("run", [asyncio.run, _run_until_complete])
def test_r6_ctrl_c_under_asyncio_cancels_closes_and_raises_keyboard_interrupt(
    run: Callable[[Coroutine[Any, Any, None]], None],
) -> None:
    """Under `asyncio.run` (its SIGINT handler) and under `run_until_complete` (none: trio
    installs its own for the life of the guest run, and delivers Ctrl-C to it)."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("needs Python's default SIGINT handler")
    feed = AioFeed(0, 1)
    gate = AioGate()

    async def main() -> None:
        async def ctrl_c() -> None:
            await gate.wait_running(2)
            await feed.parked.wait()
            signal.raise_signal(signal.SIGINT)

        async with asyncio.timeout(LIMIT):
            trigger = asyncio.create_task(ctrl_c())
            await aio.run_stream(feed.gen(), gate.run, window=None)
            await trigger

    with pytest.raises(KeyboardInterrupt):
        run(main())
    assert gate.cancelled == 2
    assert feed.finally_runs == 1
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert not trio.lowlevel.in_trio_run()


# --- R7: close-out ----------------------------------------------------------------------------


class AioIterator:
    """An asyncio async iterator (a class, not a generator) that checks how it is closed."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pulled = 0
        self.pulling = False
        self.close_calls = 0
        self.closed_while_pulling = False
        self.close_outside_asyncio = False

    def __aiter__(self) -> AioIterator:
        return self

    async def __anext__(self) -> int:
        self.pulling = True
        try:
            await asyncio.sleep(0)
            if self.pulled == self.n:
                raise StopAsyncIteration
            self.pulled += 1
            return self.pulled
        finally:
            self.pulling = False

    async def aclose(self) -> None:
        self.close_calls += 1
        self.closed_while_pulling = self.closed_while_pulling or self.pulling
        if asyncio.current_task() is None or sniffio.current_async_library() != "asyncio":
            self.close_outside_asyncio = True
        await asyncio.sleep(0)


@pytest.mark.parametrize("fail", [False, True])
def test_r7_source_closed_once_on_asyncio_never_while_pulling(fail: bool) -> None:
    async def main() -> None:
        source = AioIterator(5)

        async def run(item: int) -> int:
            if fail and item == 3:
                raise Boom
            await asyncio.sleep(0)
            return item

        async with asyncio.timeout(LIMIT):
            if fail:
                with pytest.raises(Boom):
                    await aio.run_stream(source, run, window=2)
            else:
                assert await aio.run_stream(source, run, window=2) == [1, 2, 3, 4, 5]
        assert source.close_calls == 1
        assert not source.closed_while_pulling
        assert not source.close_outside_asyncio

    arun(main)


# --- concurrent calls share one guest run ----------------------------------------------------


@pytest.mark.parametrize("calls", [2, 10])
def test_concurrent_calls_from_several_asyncio_tasks_are_independent(calls: int) -> None:
    async def main() -> None:
        async def one(call: int) -> list[tuple[int, int]]:
            feed = AioFeed(*range(call + 3))
            feed.end()

            async def run(item: int) -> tuple[int, int]:
                for _ in range(item % 3):
                    await asyncio.sleep(0)
                return (call, item)

            result = await aio.run_stream(feed.gen(), run, window=2)
            assert feed.finally_runs == 1
            return result

        async with asyncio.timeout(LIMIT):
            results = await asyncio.gather(*(one(c) for c in range(calls)))
        assert results == [[(c, i) for i in range(c + 3)] for c in range(calls)]

    arun(main)


def test_concurrent_calls_share_one_guest_run_and_a_failure_stays_in_its_call() -> None:
    async def root() -> object:
        await trio.lowlevel.checkpoint()
        return trio.lowlevel.current_root_task()

    async def main() -> None:
        ok = AioFeed(*range(4))
        ok.end()
        gate = AioGate()
        bad = AioFeed(0)
        bad.end()

        async def fail(item: int) -> int:
            await gate.wait_running(4)
            raise Boom

        async with asyncio.timeout(LIMIT):
            held = asyncio.create_task(aio.run_stream(ok.gen(), gate.run, window=None))
            roots = await asyncio.gather(*(aio.run_trio(root) for _ in range(5)))
            failed = await asyncio.gather(
                aio.run_stream(bad.gen(), fail, window=1), return_exceptions=True
            )
            assert isinstance(failed[0], Boom)
            assert gate.cancelled == 0  # the other call's runs were not touched
            gate.open()
            assert await held == [0, 1, 2, 3]
        assert len({id(r) for r in roots}) == 1

    arun(main)


def test_sequential_calls_restart_the_guest_and_cancelled_caller_never_blocks_others() -> None:
    async def main() -> None:
        async with asyncio.timeout(LIMIT):
            for _ in range(3):
                await aio.run_trio(trio.sleep, 0)
                assert not trio.lowlevel.in_trio_run()  # stopped after the last call
            # One call cancelled while another keeps the guest busy.
            event = trio.Event()
            slow = asyncio.create_task(aio.run_trio(event.wait))
            doomed = asyncio.create_task(aio.run_trio(trio.sleep_forever))
            await asyncio.sleep(0)
            doomed.cancel()
            with pytest.raises(asyncio.CancelledError):
                await doomed
            await aio.run_trio(functools.partial(_set, event))
            await slow

    arun(main)


async def _set(event: trio.Event) -> None:
    event.set()


def test_nested_call_from_an_asyncio_run() -> None:
    async def main() -> list[list[int]]:
        async def inner_run(item: int) -> int:
            return item * 10

        async def outer_run(item: int) -> list[int]:
            feed = AioFeed(item, item + 1)
            feed.end()
            return await aio.run_stream(feed.gen(), inner_run, window=1)

        outer = AioFeed(1, 5)
        outer.end()
        async with asyncio.timeout(LIMIT):
            return await aio.run_stream(outer.gen(), outer_run, window=2)

    assert arun(main) == [[10, 20], [50, 60]]


# --- run_trio and trio-flavored runs and sources ---------------------------------------------


def test_run_trio_returns_raises_unwrapped_and_maps_cancellation() -> None:
    error = Boom("trio side")
    seen: list[str] = []

    async def add(a: int, b: int) -> int:
        await trio.lowlevel.checkpoint()
        return a + b

    async def fails() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)
            await trio.lowlevel.checkpoint()
            raise error

    async def forever() -> None:
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            seen.append("trio.Cancelled")
            raise

    async def main() -> None:
        async with asyncio.timeout(LIMIT):
            assert await aio.run_trio(add, 2, 3) == 5
            with pytest.raises(ExceptionGroup) as group:  # a trio nursery's own group
                await aio.run_trio(fails)
            assert group.value.exceptions == (error,)
            task = asyncio.create_task(aio.run_trio(forever))
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert seen == ["trio.Cancelled"]

    arun(main)


def test_trio_run_flag_and_trio_channel_source() -> None:
    async def trio_run(item: int) -> int:
        await trio.sleep(0.001)
        assert sniffio.current_async_library() == "trio"
        return item + 100

    async def main() -> None:
        send, receive = trio.open_memory_channel[int](math.inf)
        for i in range(5):
            send.send_nowait(i)
        send.close()
        feed = AioFeed(1, 2)
        feed.end()
        async with asyncio.timeout(LIMIT):
            # a trio ReceiveChannel is detected as a trio source
            assert await aio.run_stream(receive, trio_run, window=2, trio_run=True) == [
                100,
                101,
                102,
                103,
                104,
            ]
            # an asyncio source with a trio run
            assert await aio.run_stream(feed.gen(), trio_run, window=2, trio_run=True) == [
                101,
                102,
            ]

    arun(main)


def test_asyncio_runs_see_asyncio_and_the_callers_contextvars() -> None:
    request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id")

    async def main() -> None:
        async def handler(rid: str) -> list[tuple[str, str, bool]]:
            request_id.set(rid)
            feed = AioFeed(1, 2)
            feed.end()

            async def run(item: int) -> tuple[str, str, bool]:
                await asyncio.sleep(0)
                return (
                    request_id.get(),
                    sniffio.current_async_library(),
                    asyncio.current_task() is not None,
                )

            return await aio.run_stream(feed.gen(), run, window=2)

        async with asyncio.timeout(LIMIT):
            a, b = await asyncio.gather(handler("a"), handler("b"))
        assert a == [("a", "asyncio", True)] * 2
        assert b == [("b", "asyncio", True)] * 2

    arun(main)


def test_called_without_a_running_asyncio_loop_is_a_runtime_error() -> None:
    async def under_trio() -> None:
        with pytest.raises(RuntimeError, match="no running event loop"):
            await aio.run_trio(trio.sleep, 0)

    trio.run(under_trio)


def test_source_keeps_its_contextvars_across_pulls() -> None:
    var: contextvars.ContextVar[int] = contextvars.ContextVar("var", default=0)
    seen: list[int] = []

    async def gen() -> AsyncGenerator[int, None]:
        for i in range(1, 4):
            seen.append(var.get())
            var.set(i)  # as in one asyncio task, the next pull still sees it
            yield i

    async def run(item: int) -> int:
        return var.get()  # runs get the caller's context, not the generator's

    async def main() -> list[int]:
        async with asyncio.timeout(LIMIT):
            return await aio.run_stream(gen(), run, window=1)

    assert arun(main) == [0, 0, 0]
    assert seen == [0, 1, 2]


# --- the guest's life: one per thread, restarted on demand, cleaned up at exit ---------------


def test_calls_arriving_while_the_guest_stops_start_a_new_one() -> None:
    async def root() -> object:
        await trio.lowlevel.checkpoint()
        return trio.lowlevel.current_root_task()

    async def main() -> None:
        async def staggered(i: int) -> int:
            for _ in range(i):
                await asyncio.sleep(0)
            return await aio.run_trio(_identity, i)

        async def when_stopping() -> object:
            # (white-box: waits for the private "stopping" state to hit that path for sure)
            while (guest := getattr(aio_guest._local, "guest", None)) is None or not guest.stopping:  # noqa: ASYNC110
                await asyncio.sleep(0)
            return await aio.run_trio(root)

        async with asyncio.timeout(LIMIT):
            assert await asyncio.gather(*(staggered(i) for i in range(40))) == list(range(40))
            late = asyncio.create_task(when_stopping())
            first = await aio.run_trio(root)
            second = await late
        assert first is not second  # the late call ran on a new guest run

    arun(main)


async def _identity(value: T) -> T:
    await trio.lowlevel.checkpoint()
    return value


def test_one_guest_per_thread_two_loops_in_two_threads() -> None:
    barrier = threading.Barrier(2, timeout=LIMIT)
    results: dict[int, Any] = {}

    def worker(n: int) -> None:
        async def main() -> list[int]:
            feed = AioFeed(*range(n))
            feed.end()

            async def run(item: int) -> int:
                if item == 0:  # both threads' guest runs are alive at once
                    await asyncio.to_thread(barrier.wait)
                return item * n

            async with asyncio.timeout(LIMIT):
                return await aio.run_stream(feed.gen(), run, window=2)

        try:
            results[n] = asyncio.run(main())
        except BaseException as exc:  # reported by the assertion below
            results[n] = exc

    threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in (3, 4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WATCHDOG)
    assert results == {3: [0, 3, 6], 4: [0, 4, 8, 12]}


def test_a_call_left_running_when_asyncio_run_exits_is_cancelled_and_cleaned_up() -> None:
    state: dict[str, Any] = {}

    async def main() -> None:
        errors: list[dict[str, Any]] = []
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: errors.append(ctx))
        feed = AioFeed(0, 1)  # then quiet
        gate = AioGate()
        state.update(feed=feed, gate=gate, errors=errors)
        asyncio.create_task(aio.run_stream(feed.gen(), gate.run, window=None))  # noqa: RUF006
        async with asyncio.timeout(LIMIT):
            await gate.wait_running(2)
            await feed.parked.wait()
        # return without awaiting it: asyncio.run cancels the task (and the runs' own tasks)

    faulthandler.dump_traceback_later(WATCHDOG, exit=True)
    try:
        asyncio.run(main())
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert state["gate"].cancelled == 2
    assert state["feed"].finally_runs == 1
    assert state["errors"] == []
    assert not trio.lowlevel.in_trio_run()


def test_run_eval_from_asyncio_writes_the_traces(tmp_path: Path) -> None:
    """`tt.aio.run_eval` runs the trio eval on the asyncio loop, next to other asyncio work."""
    from trio_tasksets._core.builtin import EchoTaskset

    async def main() -> tuple[tt.EvalResult, list[int]]:
        env = tt.Env(EchoTaskset())
        ctx = tt.ModelContext(tt.EchoClient(), "echo")
        config = tt.EvalConfig(num_examples=4, rollouts_per_example=2, output_dir=str(tmp_path),
                               run_name="aio", dashboard=False)  # fmt: skip

        async def beside() -> list[int]:
            await asyncio.sleep(0)
            return [1, 2]

        async with asyncio.timeout(5):
            result, other = await asyncio.gather(aio.run_eval(env, ctx, config), beside())
        return result, other

    result, other = asyncio.run(main())
    assert other == [1, 2]
    assert len(result.episodes) == 8
    assert all(e.ok for e in result.episodes)
    assert len((tmp_path / "aio" / "traces.jsonl").read_text().splitlines()) == 8


def test_run_eval_from_asyncio_refuses_bad_settings_unwrapped(tmp_path: Path) -> None:
    from trio_tasksets._core.builtin import EchoStreamTaskset

    async def main() -> None:
        env = tt.Env(EchoStreamTaskset())
        ctx = tt.ModelContext(tt.EchoClient(), "echo")
        await aio.run_eval(env, ctx, tt.EvalConfig(output_dir=str(tmp_path), dashboard=False))

    with pytest.raises(tt.EvalConfigError, match="num_examples"):
        asyncio.run(main())
    assert not any(tmp_path.iterdir())
