"""The windowed runner: `run_stream`, `as_completed` and `take`.

One core (`_drive`) consumes an async source with at most `window` runs in flight. It takes a
window slot (a `trio.CapacityLimiter` token) *before* each pull, pulls inside the nursery that
owns the runs, and hands each result to one of two deliveries: stored by index (`run_stream`)
or sent over a zero-buffer memory channel (`as_completed`, so an unread result keeps its slot).
A `tt.Window` is such a limiter whose `total_tokens` may change while the call runs.

Guarantees (each one a test in tests/test_runner.py):

* item k+1 is requested only once fewer than `window` runs are in flight;
* the first failure (of a run or of the source) cancels every other run and the pending pull,
  waits for them to unwind and is re-raised *itself*; later failures are attached to it as
  notes;
* outside cancellation and KeyboardInterrupt propagate unchanged;
* the source is closed exactly once, shielded, from the task that iterates it, after the last
  pull has returned, on every exit path.
"""

from __future__ import annotations

import contextvars
import inspect
import itertools
import math
import operator
import reprlib
import sys
from collections import deque
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Sequence,
)
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, TypeVar, cast

import trio

from .exceptions import ConfigError, ConfigTypeError, TrioTasksetsError
from .window import Window, take_place

__all__ = ["ElasticPlaces", "as_completed", "fan_out", "run_stream"]

T = TypeVar("T")
R = TypeVar("R")


# --- argument checks: each names the argument and runs before anything is pulled ------------


def _check_window(window: object) -> int | Window | None:
    if window is None or isinstance(window, Window):
        return window
    if isinstance(window, bool) or not isinstance(window, int):
        # ValueError, not TypeError, for a non-int too: one error for every bad window.
        raise ConfigError(
            f"{{window}} must be an int >= 1, a tt.Window, or None (no bound), got {window!r} "
            f"({type(window).__name__})",
            parameter="window",
        )
    if window < 1:
        raise ConfigError(
            f"{{window}} must be >= 1 (or None for no bound), got {window}", parameter="window"
        )
    return window


def check_source(source: object) -> None:
    if not hasattr(type(source), "__aiter__"):
        hint = ""
        if hasattr(type(source), "__iter__"):
            hint = (
                "; it is a sync iterable: wrap it in an async generator, or read a taskset "
                "through `async with taskset.channel() as tasks`"
            )
        raise ConfigTypeError(
            f"{{source}} must be an async iterable (an async generator, a trio "
            f"ReceiveChannel, a taskset channel), got {type(source).__name__}{hint}",
            parameter="source",
        )


def _check_run(run: object) -> None:
    """Refuse what can never return an awaitable, before anything is pulled.

    A plain `def` may return one (`lambda item: client.call(item)`), so it is only known once
    called: `_not_awaitable` explains that case at the first item.
    """
    if not callable(run):
        raise ConfigTypeError(
            f"{{run}} must be an async callable taking one item, got {type(run).__name__}",
            parameter="run",
        )
    call = run if inspect.isroutine(run) or isinstance(run, type) else type(run).__call__
    kind = ""
    if inspect.isasyncgenfunction(call):
        kind = "an async generator function"
    elif inspect.isgeneratorfunction(call):
        kind = "a generator function"
    elif isinstance(run, type) and not hasattr(run, "__await__"):
        kind = "a class whose instances are not awaitable"
    if kind:
        raise ConfigTypeError(
            f"{{run}} must be an async callable taking one item, got {kind} "
            f"({getattr(run, '__qualname__', type(run).__name__)}): {_RUN_FIX}",
            parameter="run",
        )


_RUN_FIX = (
    "define it with `async def run(item): ...`; to call a sync function `fn`, wrap it: "
    "`async def run(item): return fn(item)` (blocking work: "
    "`return await trio.to_thread.run_sync(fn, item)`)"
)
_UNSET: Any = object()


def _not_awaitable(run: object, item: object, returned: object) -> TypeError:
    name = getattr(run, "__qualname__", type(run).__name__)
    return ConfigTypeError(
        f"{{run}} must be an async callable taking one item: run(item) returned "
        f"{type(returned).__name__}, not an awaitable (run={name}, item={reprlib.repr(item)}); "
        f"{_RUN_FIX}",
        parameter="run",
    )


# --- closing and error selection ----------------------------------------------------------


async def close_iterator(iterator: object, source: object) -> BaseException | None:
    """Close the iterator (and the source, if it is a distinct closable object).

    Opens no cancel scope of its own: a source may hold a scope it entered while it was pulled
    (a `merge` suspended at its yield), and closing it must exit that scope before any scope
    entered after it. Callers shield the close with a scope they entered *before* the first
    pull (`_drive` does). Returns the first exception a close raised instead of raising it.
    """
    error: BaseException | None = None
    targets = [iterator] if iterator is source else [iterator, source]
    for target in targets:
        aclose = getattr(target, "aclose", None)
        if aclose is None:
            continue
        try:
            await aclose()
        except Exception as exc:
            if error is None:
                error = exc
            else:
                add_note(error, "while closing the source", exc)
    return error


class SourceIterator(AsyncIterator[T]):
    """An async iterator class over `source` (not a generator: closable before it starts, and
    it holds no cancel scope between pulls) that closes `source` once, as the runners do. The
    iterators the core hands back (`take`, `until`, `Staleness.feed`) build on it."""

    def __init__(self, source: AsyncIterable[T]) -> None:
        self._source = source
        self._iterator = aiter(source)
        self._closed = False

    async def aclose(self) -> None:
        """Close `source` (once); raises the first exception its close raised."""
        if not self._closed:
            self._closed = True
            error = await close_iterator(self._iterator, self._source)
            if error is not None:
                raise error

    def _run_ended(self) -> None:
        """A run of the runner this iterator feeds has ended, its result delivered: an
        iterator that stops on a condition of its own looks at it again (`until`'s
        predicate), one that wraps another passes it on."""
        if isinstance(self._iterator, SourceIterator):
            self._iterator._run_ended()


def add_note(error: BaseException, when: str, extra: BaseException) -> None:
    """Attach `extra` to `error` as a note, with the failures already noted on `extra` (a
    nested fan_out's siblings that failed at the same time), so none is lost one level up."""
    error.add_note(f"trio_tasksets: {when}, {type(extra).__name__} was also raised: {extra}")
    kept = getattr(error, "__notes__", [])
    for note in getattr(extra, "__notes__", ()):
        if note.startswith("trio_tasksets: ") and note not in kept:
            error.add_note(note)


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            out.extend(_leaves(exc))
        else:
            out.append(exc)
    return out


def pick_one(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one exception a nursery of the runner stands for.

    KeyboardInterrupt wins; then the first non-Cancelled error (any others are attached to it
    as notes, never dropped); then a Cancelled (outside cancellation, propagated unchanged).
    Never a group: the caller raises it *after* its `except` block, so the exception keeps
    its own `__cause__` and `__context__`.
    """
    leaves = _leaves(group)
    real = [exc for exc in leaves if not isinstance(exc, trio.Cancelled)]
    interrupts = [exc for exc in real if isinstance(exc, KeyboardInterrupt)]
    chosen: BaseException = (interrupts or real or leaves)[0]
    for other in real:
        if other is not chosen:
            add_note(chosen, "at the same time", other)
    return chosen


# --- the core -----------------------------------------------------------------------------


async def _drive(
    source: AsyncIterable[T],
    run: Callable[[T], Awaitable[R]],
    window: int | Window | None,
    results: list[Any] | None,
    send: trio.MemorySendChannel[tuple[int, R]] | None,
) -> None:
    """Run `run` over `source` with at most `window` in flight; deliver into `results` or `send`.

    Raises the first failure itself, or the outside cancellation / KeyboardInterrupt unchanged.
    """
    # A Window's limiter may be shared with other runners: this call's borrowers are its
    # indices offset by a base of its own, and every token it takes is given back on every
    # exit path. Window.acquire also waits out a shrink that lands as a token is handed over.
    base = 0
    if isinstance(window, Window):
        limiter = window.limiter
        base = next(_borrower_bases)
        acquire = window.acquire
    else:
        limiter = trio.CapacityLimiter(window if window is not None else math.inf)
        acquire = limiter.acquire_on_behalf_of
    bounded = window is not None
    # as_completed keeps the plain acquire: its slot is freed when the consumer takes a result,
    # and the consumer should get to run before the next pull.
    fast = bounded and send is None
    # failures[0] is the first failure (of a run, the source or its close); every later one is
    # appended too, once it has been noted on the first.
    failures: list[BaseException] = []
    iterator = aiter(source)
    # A stop condition of the source's own (`tt.until`'s predicate) is looked at again as each
    # run ends: the runs may make it true while the pull waits on a quiet feed.
    run_ended = iterator._run_ended if isinstance(iterator, SourceIterator) else None
    error: BaseException | None = None

    def fail(exc: BaseException, cancel_scope: trio.CancelScope) -> None:
        if failures:
            add_note(failures[0], "while the other runs unwound", exc)
        else:
            cancel_scope.cancel()
        failures.append(exc)

    store = cast(list[Any], results)  # bound once: a per-item cast costs ~2% of run_stream
    try:
        async with trio.open_nursery() as nursery:
            scope = nursery.cancel_scope

            async def one(index: int, item: T, borrower: int) -> None:
                pending = _UNSET
                try:
                    pending = run(item)
                    result = await pending
                    if send is None:
                        store[index] = result
                    else:
                        try:
                            await send.send((index, result))
                        except trio.BrokenResourceError:
                            scope.cancel()  # the consumer closed its channel: stop quietly
                    if run_ended is not None:
                        run_ended()  # what it raises fails the runner, as a run's error
                except Exception as exc:
                    if isinstance(exc, TypeError) and not (
                        pending is _UNSET or inspect.isawaitable(pending)
                    ):
                        explained = _not_awaitable(run, item, pending)
                        explained.__cause__ = exc
                        exc = explained
                    fail(exc, scope)
                except trio.Cancelled:
                    raise
                except BaseException as exc:
                    # KeyboardInterrupt, SystemExit: stop the pulls *before* the slot is freed,
                    # then let it reach the nursery (a KeyboardInterrupt wins over everything).
                    fail(exc, scope)
                    raise
                finally:
                    if bounded:
                        limiter.release_on_behalf_of(borrower)

            # `guard` is entered before the first pull and shielded only for the close, so the
            # close is shielded without entering a scope after the source's own (see close_iterator).
            held: int | None = None  # a token taken for a pull, not yet handed to a run
            with trio.CancelScope() as guard:
                # The runs (spawned from here, so they inherit it) and the fan_outs inside them
                # draw their places from this window.
                places = _places.set(
                    _Places(limiter, acquire, window if isinstance(window, Window) else None)
                    if bounded
                    else None
                )
                try:
                    index = 0
                    while True:
                        borrower = base + index
                        if fast:
                            # run_stream takes a free slot without a trip through the
                            # scheduler (a third of its per-item cost).
                            try:
                                limiter.acquire_on_behalf_of_nowait(borrower)
                            except trio.WouldBlock:
                                await acquire(borrower)
                            held = borrower
                        elif bounded:
                            await acquire(borrower)
                            held = borrower
                        # No pull begins once a run has failed or the caller is cancelled, even
                        # when the failure landed while this task was taking its slot.
                        await trio.lowlevel.checkpoint_if_cancelled()
                        try:
                            item = await iterator.__anext__()
                        except StopAsyncIteration:
                            break
                        except Exception as exc:
                            fail(exc, scope)
                            break
                        if results is not None:
                            results.append(None)
                        nursery.start_soon(one, index, item, borrower)
                        held = None
                        index += 1
                finally:
                    _places.reset(places)
                    if held is not None:
                        limiter.release_on_behalf_of(held)
                    # Close here, in the nursery body: the task that pulled, after its last
                    # pull, before the nursery exits.
                    guard.shield = True
                    close_error = await close_iterator(iterator, source)
                    guard.shield = False
                    if close_error is not None:
                        fail(close_error, scope)
    except BaseExceptionGroup as group:
        error = pick_one(group)

    if failures and not isinstance(error, KeyboardInterrupt):
        first = failures[0]
        if not (error is None or isinstance(error, trio.Cancelled) or _among(error, failures)):
            add_note(first, "while the runs unwound", error)
        error = first
    if error is not None:
        raise error


# Runner calls sharing a Window take tokens for distinct borrowers: call k uses k * 2**64 +
# its item indices (ints: cheaper to make and hash than tuples).
_borrower_bases = itertools.count(1 << 64, 1 << 64)


def _among(error: BaseException, errors: list[BaseException]) -> bool:
    return any(error is other for other in errors)


# --- the public API -----------------------------------------------------------------------


def require_trio(api: str, instead: str | None = None) -> None:
    """RuntimeError naming what to use (`instead`, default `await tt.aio.<api>(...)`) when
    `tt.<api>` is awaited outside a trio run (from asyncio: `asyncio.run`, a notebook, a web
    server), instead of trio's own `AttributeError: 'RunContext' object has no attribute
    'runner'`."""
    use = instead if instead is not None else f"`await tt.aio.{api}(...)`"
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        pass
    else:
        return
    asyncio = sys.modules.get("asyncio")
    try:
        hosted = asyncio is not None and asyncio.get_running_loop() is not None
    except RuntimeError:
        hosted = False
    if hosted:
        raise RuntimeError(
            f"tt.{api} was awaited from asyncio (asyncio.run, a notebook, a web server), but "
            f"it runs on trio: use {use}, which runs it on the running asyncio loop (trio "
            f"guest mode)"
        )
    raise RuntimeError(
        f"tt.{api} must be awaited inside a trio run (trio.run(main)); from asyncio use {use}"
    )


async def run_stream(
    source: AsyncIterable[T], run: Callable[[T], Awaitable[R]], *, window: int | Window | None
) -> list[R]:
    """Run `run(item)` for every item of `source`, at most `window` at once.

    Returns the results in submission (pull) order once the source has ended and the last run
    is done. The next item is pulled only when a window slot is free. The first failure cancels
    the rest and is re-raised itself. The source is always closed (`aclose()`), exactly once.
    `window=None` means no bound; a `tt.Window` may be resized while the call runs.

    Raises, before anything is pulled, a `ConfigError` naming `window` (not an int >= 1, a
    `tt.Window` or None), `source` (not an async iterable) or `run` (not an async callable;
    a `ConfigTypeError`, also a TypeError); awaited from asyncio, a RuntimeError naming
    `tt.aio.run_stream`. Then what a run or the source raised, itself.
    """
    require_trio("run_stream")
    checked = _check_window(window)
    check_source(source)
    _check_run(run)
    results: list[Any] = []
    await _drive(source, run, checked, results, None)
    return cast(list[R], results)


def as_completed(
    source: AsyncIterable[T], run: Callable[[T], Awaitable[R]], *, window: int | Window | None
) -> AbstractAsyncContextManager[trio.abc.ReceiveChannel[tuple[int, R]]]:
    """Run `run` over `source` and yield `(index, result)` pairs in completion order.

    Use as `async with tt.as_completed(src, run, window=w) as results: async for i, r in
    results: ...`. A result not yet received holds its window slot, so a slow consumer
    back-pressures the runs and the feed (memory stays O(window)). Leaving the block cancels
    whatever is still running and closes the source; a failure cancels the block and is
    re-raised itself. Bad arguments raise here, before the block is entered: a
    `ConfigError` naming `window`, `source` or `run`, as `run_stream` does.
    """
    checked = _check_window(window)
    check_source(source)
    _check_run(run)
    return _as_completed(source, run, checked)


@asynccontextmanager
async def _as_completed(
    source: AsyncIterable[T], run: Callable[[T], Awaitable[R]], window: int | Window | None
) -> AsyncGenerator[trio.abc.ReceiveChannel[tuple[int, R]], None]:
    require_trio(
        "as_completed",
        "`await tt.aio.run_stream(...)`, or `await tt.aio.run_trio(fn)` for a trio function "
        "`fn` that uses tt.as_completed",
    )
    send, receive = trio.open_memory_channel[tuple[int, R]](0)

    async def produce() -> None:
        # Close `send` only on success: on failure the consumer must see the failure (its block
        # is cancelled), not an EndOfChannel that would pass for a normal end.
        await _drive(source, run, window, None, send)
        send.close()

    error: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(produce)
            with receive:
                yield receive
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        error = pick_one(group)
    if error is not None:
        raise error


# --- fan_out: one window at any depth -------------------------------------------------------


class _Places:
    """The window the current run draws its places from: its limiter, how to wait for a
    token, and how to lend one more place (for a caller that waits on its children: it holds no place meanwhile).

    `owner` keeps the count of lent places where something else also sets the limiter's
    `total_tokens` (a `Window`'s resize, an `ElasticPlaces`' runs); with none, the limiter
    is the runner's own and lending moves its `total_tokens` by one."""

    __slots__ = ("acquire", "limiter", "owner")

    def __init__(
        self,
        limiter: trio.CapacityLimiter,
        acquire: Callable[[Any], Awaitable[None]],
        owner: Window | ElasticPlaces | None = None,
    ) -> None:
        self.limiter = limiter
        self.acquire = acquire
        self.owner = owner

    def lend(self) -> None:
        """One more place: a waiting acquirer may start on it at once."""
        if self.owner is None:
            self.limiter.total_tokens += 1
        else:
            self.owner._lend()

    def unlend(self) -> None:
        """The lent place comes back: called just before a holder releases its token, so the
        release hands its place to the lender instead of to a waiter."""
        if self.owner is None:
            self.limiter.total_tokens -= 1
        else:
            self.owner._unlend()


# The window the current run draws its places from, or None outside any window (and inside a
# runner with `window=None`). `_drive` sets it in the task that spawns the runs, so every run,
# and every task a run's fan_outs spawn, inherits it.
_places: contextvars.ContextVar[_Places | None] = contextvars.ContextVar(
    "trio_tasksets_window_places", default=None
)


async def fan_out(thunks: Iterable[Callable[[], Awaitable[R]]]) -> list[R]:
    """Run every thunk (a callable taking no argument and returning an awaitable)
    concurrently and return their results in thunk order.

    Inside a run driven by `run_stream`, `as_completed` or an eval, the thunks run **on the
    enclosing window**, so one budget bounds live work at any depth:

    * each running thunk holds a place of the window; the caller, while it waits for them,
      holds none: `window=w` means at most `w` thunks or runs doing work at once, however
      deeply fan_outs nest (a `tt.Window` or `tt.AdaptiveWindow` included: its current size
      bounds new places);
    * the caller's own place goes to its first thunk (and, as each finishes, to the next
      one not yet started), so a fan-out makes progress at `window=1` and under any nesting;
      the other thunks take the places free at once, or wait for one in turn with the
      runner's pulls (first come, first served), and give it back when they end;
    * once the caller has no thunk left to start, its place is lent to the window while its
      last thunks run, and the last of them to end hands its own place back to the caller
      (not to the next waiter), however it ends: no place idles while the caller waits, and
      the caller resumes at once, within the bound;
    * the first thunk that fails cancels its siblings, waits for them to unwind and is
      re-raised *itself* (not an ExceptionGroup; a second failure is attached to it as a
      note); cancelling the caller cancels every thunk; KeyboardInterrupt stays itself.

    Outside any window (or under `window=None`) the thunks run unbounded. Raises a
    `ConfigTypeError` (a `ConfigError` and a TypeError) naming `thunks`, before anything
    runs, when `thunks` is not iterable or holds something not callable.
    """
    return await fan_out_placing(operator.call, _check_thunks(thunks), None)


async def fan_out_placing(
    run: Callable[[T], Awaitable[R]],
    items: Sequence[T],
    on_start: Callable[[int], None] | None,
    accept: Callable[[R], object] | None = None,
) -> list[R]:
    """`fan_out` of `run(item)` for each of `items` (no thunk to build per item), calling
    `on_start(n)` (if given) as `n` more runs are given their places, before they run
    (outside a window: all at once), and failing fast on a result that `accept` refuses
    (falsy) as on a raised exception: the others are cancelled and awaited, then `ResultRefused`
    is raised, carrying every item's result so far. How a group runs its rollouts
    (`groups.run_group`): they are counted placed as they get their places (the runner pulls
    the next group once none waits for one), and a failed rollout fails the group."""
    if len(items) <= 1:
        # Nothing to run beside it: the caller's place runs it, inline (its failure raised
        # itself, a cancellation propagating as ever).
        if not items:
            await trio.lowlevel.checkpoint()
            return []
        if on_start is not None:
            on_start(1)
        awaitable = run(items[0])
        if not inspect.isawaitable(awaitable):
            raise _run_not_awaitable(0, run, items[0], awaitable)
        result = await awaitable
        if accept is not None and not accept(result):
            raise ResultRefused(0, result, [result])
        return [result]
    places = _places.get()
    error: BaseException | None = None
    fan: _FanOut | None = None
    try:
        async with trio.open_nursery() as nursery:
            fan = _FanOut(run, items, nursery, places, on_start, accept)
            pending = fan.pending
            first = pending.popleft()
            if places is None:
                for index, item in pending:
                    nursery.start_soon(fan.run, index, item)
                pending.clear()
                if on_start is not None:
                    on_start(len(items))
                await fan.run(*first)
            else:
                # This task holds the caller's place: it runs the first item on it. The
                # others take the places free now, at once, and a drawing task waits for
                # places for the rest; as each run on the caller's place ends, the caller
                # runs the next item not yet started.
                started = fan.take_free()
                if on_start is not None:
                    on_start(1 + started)  # the first (the caller's place), those on free ones
                drawing = None
                if pending:
                    drawing = trio.CancelScope()
                    nursery.start_soon(fan.draw, drawing)
                await fan.run(*first)
                while pending and not fan.failures:
                    if on_start is not None:
                        on_start(1)
                    await fan.run(*pending.popleft())
                if drawing is not None:
                    drawing.cancel()
                if fan.drawn and not fan.failures:
                    # Nothing left to start: the caller's place is lent to the window while
                    # the last runs go on, and the last of them to end hands its own place
                    # back to the caller (`_FanOut.run`), so no place idles and the
                    # caller resumes at once, within the bound.
                    fan.lent = True
                    places.lend()
    except BaseExceptionGroup as group:
        error = pick_one(group)
    finally:
        if fan is not None and fan.lent:  # (every run has ended: only if trio broke off)
            fan.lent = False
            cast(_Places, places).unlend()
    failures = [] if fan is None else fan.failures
    if failures and not isinstance(error, KeyboardInterrupt):
        first_failure = failures[0]
        if not (error is None or isinstance(error, trio.Cancelled) or _among(error, failures)):
            add_note(first_failure, "while the other thunks unwound", error)
        error = first_failure
        if isinstance(error, ResultRefused):
            error.results = cast(_FanOut, fan).results
    if error is not None:
        raise error
    return cast(list[R], fan.results)  # type: ignore[union-attr]


class ResultRefused(TrioTasksetsError):
    """A result `fan_out_placing`'s `accept` refused: the fan-out failed fast on it (a
    group's failed rollout; `groups.run_group` catches it, so it never reaches a user).
    `result` is that result (of item `index`), `results` every item's result once the
    others have unwound (None for an item with none: cancelled, or never started)."""

    def __init__(self, index: int, result: Any, results: list[Any] | None = None) -> None:
        super().__init__(f"the result of item {index} was refused")
        self.index = index
        self.result: Any = result
        self.results: list[Any] = [] if results is None else results


class ElasticPlaces:
    """A window for runs that a service starts one by one, outside `run_stream` (an env
    server's requests): each run brings its own place, so the window is as large as the
    runs in flight, and the fan_outs inside them draw from it. The runs' admission is
    bounded elsewhere (an env server's runs by the eval's `-c`); their fan-outs are then
    bounded by the same number, at any depth.

    ``async with places.run():`` around a run. A run may wait for its place while thunks
    of the runs before it hold the free ones: it starts when one ends, in turn.
    """

    def __init__(self) -> None:
        self._limiter = trio.CapacityLimiter(1)  # trio's floor; the size is max(1, runs)
        self._runs = 0
        self._lent = 0  # places lent by fan_out callers waiting on their last thunks
        self._view = _Places(self._limiter, self._limiter.acquire_on_behalf_of, self)

    @property
    def runs(self) -> int:
        return self._runs

    @property
    def in_flight(self) -> int:
        """Places held: runs working, and their thunks."""
        return self._limiter.borrowed_tokens

    def run(self) -> AbstractAsyncContextManager[None]:
        """``async with places.run():`` holds one place for the run inside, which is the
        window its fan_outs draw from."""
        return _ElasticRun(self)

    # duplicates: four counter steps (and two error builders above), alike but too small to share
    def _enter(self) -> None:
        self._runs += 1
        self._resize()

    def _leave(self) -> None:
        self._runs -= 1
        self._resize()

    def _lend(self) -> None:
        self._lent += 1
        self._resize()

    def _unlend(self) -> None:
        self._lent -= 1
        self._resize()

    def _resize(self) -> None:
        # (trio's floor is 1: with no run, the limiter keeps one token)
        total = max(1, self._runs) + self._lent
        if total != self._limiter.total_tokens:
            self._limiter.total_tokens = total


class _ElasticRun:
    """One run's place of an `ElasticPlaces` (a class, not a generator: it is on the served
    path of every slot)."""

    __slots__ = ("_held", "_places", "_token")

    def __init__(self, places: ElasticPlaces) -> None:
        self._places = places
        self._held = False

    async def __aenter__(self) -> None:
        places = self._places
        limiter = places._limiter
        places._enter()
        try:
            await take_place(limiter, self)
        except BaseException:
            places._leave()
            raise
        self._held = True
        self._token = _places.set(places._view)

    async def __aexit__(self, *exc_info: object) -> None:
        if self._held:
            _places.reset(self._token)
            self._places._limiter.release_on_behalf_of(self)
            self._held = False
        self._places._leave()


class _FanOut:
    """One fan-out's runs: their results, the failures, the items not yet started, the runs
    on places drawn from the window (`drawn`), and whether the caller's own place is lent
    meanwhile (once it has no item left to start). The last drawn run to end while the
    caller's place is lent hands its own place to the caller instead of to the window's
    next waiter, whatever way it ends: the caller resumes without waiting, and the window
    never holds more than its size. (`call(item)` is each run: `operator.call` of a thunk
    for `fan_out`, a group's rollout of a slot for `run_group`.)"""

    __slots__ = (
        "accept", "call", "drawn", "failures", "lent", "nursery", "on_start", "pending",
        "places", "results",
    )  # fmt: skip

    def __init__(
        self,
        call: Callable[[Any], Awaitable[Any]],
        items: Sequence[Any],
        nursery: trio.Nursery,
        places: _Places | None,
        on_start: Callable[[int], None] | None,
        accept: Callable[[Any], object] | None,
    ) -> None:
        self.call = call
        self.results: list[Any] = [None] * len(items)
        self.failures: list[BaseException] = []
        self.pending = deque(enumerate(items))
        self.nursery = nursery
        # (read only when `places` is not None: the drawing methods run only then)
        self.places = cast(_Places, places)
        self.on_start = on_start
        self.accept = accept
        self.drawn = 0
        self.lent = False

    async def run(self, index: int, item: Any, borrower: object = None) -> None:
        """Run one item, keeping its result; its failure (or a refused result) cancels the
        others (fail-fast). A drawn run holds a place for `borrower`, given back when it
        ends (to the caller, if it is the last drawn run and the caller's place is lent).
        (One method for both: one coroutine frame for every step of a run.)"""
        awaitable: Any = _UNSET
        try:
            awaitable = self.call(item)
            result = self.results[index] = await awaitable
            if self.accept is not None and not self.accept(result):
                _fail(self.failures, ResultRefused(index, result), self.nursery.cancel_scope)
        except Exception as exc:
            self._failed(index, item, awaitable, exc)
        except trio.Cancelled:
            raise
        except BaseException as exc:
            self._failed(index, item, awaitable, exc)
            raise
        finally:
            if borrower is not None:
                places = self.places
                self.drawn -= 1
                if self.lent and not self.drawn:
                    self.lent = False
                    places.unlend()  # lowered first: the release below wakes no one
                places.limiter.release_on_behalf_of(borrower)

    def _failed(self, index: int, item: Any, awaitable: Any, exc: BaseException) -> None:
        if isinstance(exc, Exception) and not (
            awaitable is _UNSET or inspect.isawaitable(awaitable)
        ):
            explained = _run_not_awaitable(index, self.call, item, awaitable)
            explained.__cause__ = exc
            exc = explained
        _fail(self.failures, exc, self.nursery.cancel_scope)

    def take_free(self) -> int:
        """Start pending items, in order, on the places free now (no scheduler trip); how
        many started."""
        pending = self.pending
        limiter = self.places.limiter
        start_soon, run = self.nursery.start_soon, self.run
        started = 0
        while pending:
            borrower = object()
            try:
                limiter.acquire_on_behalf_of_nowait(borrower)
            except trio.WouldBlock:
                break
            start_soon(run, *pending.popleft(), borrower)
            started += 1
        self.drawn += started
        return started

    async def draw(self, drawing: trio.CancelScope) -> None:
        """Wait for a place of the window for each item not yet started and start its run
        on it, until none is left (the caller's place may take them first) or one has
        failed. Runs in the fan-out's nursery under `drawing`, which the caller cancels once
        nothing is pending."""
        limiter, acquire = self.places.limiter, self.places.acquire
        pending, failures = self.pending, self.failures
        with drawing:
            while pending and not failures:
                borrower = object()
                try:
                    limiter.acquire_on_behalf_of_nowait(borrower)
                except trio.WouldBlock:
                    await acquire(borrower)
                if not pending or failures:
                    limiter.release_on_behalf_of(borrower)
                    return
                index, item = pending.popleft()
                self.nursery.start_soon(self.run, index, item, borrower)
                self.drawn += 1
                if self.on_start is not None:
                    self.on_start(1)


def _fail(failures: list[BaseException], exc: BaseException, scope: trio.CancelScope) -> None:
    if failures:
        add_note(failures[0], "while the other thunks unwound", exc)
    else:
        scope.cancel()
    failures.append(exc)


def _check_thunks(thunks: object) -> list[Callable[[], Awaitable[Any]]]:
    if not hasattr(type(thunks), "__iter__") or isinstance(thunks, (str, bytes)):
        raise ConfigTypeError(
            f"{{thunks}} must be an iterable of callables taking no argument, got "
            f"{type(thunks).__name__}",
            parameter="thunks",
        )
    calls = list(cast(Iterable[Any], thunks))
    for index, thunk in enumerate(calls):
        if not callable(thunk):
            hint = ""
            if inspect.isawaitable(thunk):
                hint = (
                    ": pass the function, not the awaitable it returns "
                    "(`lambda: fetch(x)` or `functools.partial(fetch, x)`, not `fetch(x)`)"
                )
                if inspect.iscoroutine(thunk):
                    thunk.close()  # never awaited: do not warn about it later
            raise ConfigTypeError(
                f"{{thunks}}[{index}] must be a callable taking no argument, got "
                f"{type(thunk).__name__}{hint}",
                parameter="thunks",
            )
    return calls


def _run_not_awaitable(index: int, run: object, item: object, returned: object) -> TypeError:
    if run is operator.call:  # a thunk of `fan_out`
        return _thunk_not_awaitable(index, item, returned)
    return _not_awaitable(run, item, returned)


def _thunk_not_awaitable(index: int, thunk: object, returned: object) -> TypeError:
    name = getattr(thunk, "__qualname__", type(thunk).__name__)
    return ConfigTypeError(
        f"{{thunks}}[{index}] must return an awaitable: {name}() returned "
        f"{type(returned).__name__}; define it with `async def`, or wrap a sync function "
        f"`fn` as `lambda: trio.to_thread.run_sync(fn)`",
        parameter="thunks",
    )
