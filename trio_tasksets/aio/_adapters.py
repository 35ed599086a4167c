"""asyncio sources and runs, awaited from the trio guest run on the host loop."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Generic, TypeVar, TypeVarTuple, Unpack

import trio

from .._core.exceptions import TrioTasksetsError
from ._loop import AsyncioCancelled

T = TypeVar("T")
R = TypeVar("R")
Ts = TypeVarTuple("Ts")


class GuestRunStopped(TrioTasksetsError, RuntimeError):
    """The shared trio guest run ended before this call finished (e.g. a TrioInternalError)."""


# --- asyncio awaited from trio --------------------------------------------------------------


async def _invoke(fn: Callable[[Unpack[Ts]], Awaitable[T]], args: tuple[*Ts]) -> T:
    # The call itself (not only the await) runs inside the asyncio task, so even its sync part
    # sees asyncio (sniffio, current_task) and not the trio tick that scheduled it.
    return await fn(*args)


async def call_asyncio(
    fn: Callable[[Unpack[Ts]], Awaitable[T]],
    *args: *Ts,
    context: contextvars.Context | None = None,
) -> T:
    """From a trio task of the guest run: run `await fn(*args)` as an asyncio task on the host.

    Returns its result or raises its exception unwrapped. Trio cancellation cancels the asyncio
    task and waits for it to finish before `trio.Cancelled` is re-raised (a real error raised
    while it unwinds is raised instead). An asyncio cancellation trio did not request raises
    `AsyncioCancelled`. The task runs in `context`, by default a copy of the trio task's.
    """
    loop = _host_loop()  # guest ticks run inside the host loop's callbacks
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()
    waiting = False

    def wake(_: object) -> None:
        if waiting:  # (both sides run on the loop's thread: no wake-up can be lost)
            with contextlib.suppress(trio.RunFinishedError):  # we always wait for the task
                token.run_sync_soon(done.set)

    # `asyncio.Task(...)`, not `loop.create_task`: a task factory (e.g. 3.12's eager one) could
    # start the coroutine right here, inside a trio tick, where it would look like trio code.
    task: asyncio.Task[T] = asyncio.Task(
        _invoke(fn, args),
        loop=loop,
        context=contextvars.copy_context() if context is None else context,
    )
    task.add_done_callback(wake)
    interrupt: BaseException | None = None
    try:
        # A checkpoint first: the guest's next tick is queued on the host loop after the new
        # task's first step, so a task done in one step (a source yielding from memory) is seen
        # done without a round trip through trio's I/O thread (halves the per-item overhead).
        await trio.lowlevel.checkpoint()
        if not task.done():
            waiting = True
            await done.wait()
    except BaseException as exc:  # trio.Cancelled, KeyboardInterrupt: unwind the task first
        interrupt = exc
        task.cancel()
        if not task.done():
            waiting = True
            with trio.CancelScope(shield=True):
                await done.wait()
    # Raise outside the handlers, so no exception of the user gets a new __context__.
    if interrupt is not None:
        error = None if task.cancelled() else task.exception()  # (retrieved: never logged)
        if isinstance(interrupt, trio.Cancelled) and isinstance(error, Exception):
            raise error  # a real failure while unwinding is never dropped
        raise interrupt
    try:
        return task.result()
    except asyncio.CancelledError as exc:
        raise AsyncioCancelled(
            f"the asyncio task running {_name(fn)} was cancelled from the asyncio side, not "
            "by trio (did the asyncio code cancel itself?)"
        ) from exc


def _host_loop() -> asyncio.AbstractEventLoop:
    """The asyncio loop hosting this thread's guest run, from one of its trio tasks.

    Not `asyncio.get_running_loop()`: once trio-asyncio has been imported (by `bridge_env`, or
    by anyone), that answers from trio-asyncio's context variable whenever a trio task is
    running, i.e. None in a guest run's tasks.
    """
    loop: asyncio.AbstractEventLoop | None = getattr(_host, "loop", None)
    return loop if loop is not None else asyncio.get_running_loop()


_host = threading.local()  # `.loop`: the loop hosting this thread's guest run, if any


def set_host_loop(loop: asyncio.AbstractEventLoop | None) -> None:
    """Record (None: forget) the loop hosting this thread's guest run."""
    _host.loop = loop


def _name(fn: object) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


class AsyncioSource(Generic[T]):
    """A trio async iterator over an asyncio async iterable: each pull and the close run as
    asyncio tasks on the host loop. `aclose()` closes it once (the runner calls it once).

    The pulls and the close share one contextvars context, as they would if one asyncio task
    iterated the source: a variable the generator sets before a `yield` is still set after it.
    They never overlap (the runner pulls one at a time and closes after the last pull), so
    sharing the context is safe.
    """

    def __init__(self, source: AsyncIterable[T]) -> None:
        self._source = source
        self._iterator: AsyncIterator[T] | None = None
        self._closed = False
        self._context: contextvars.Context | None = None

    def _shared_context(self) -> contextvars.Context:
        if self._context is None:
            self._context = contextvars.copy_context()
        return self._context

    def __repr__(self) -> str:
        return f"<asyncio source {self._source!r}>"

    def __aiter__(self) -> AsyncioSource[T]:
        if self._iterator is None:
            self._iterator = aiter(self._source)
        return self

    async def __anext__(self) -> T:
        if self._iterator is None:
            self._iterator = aiter(self._source)
        return await call_asyncio(_anext, self._iterator, context=self._shared_context())

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        targets: list[object] = [self._source]
        if self._iterator is not None and self._iterator is not self._source:
            targets.insert(0, self._iterator)
        error: Exception | None = None
        for target in targets:
            aclose = getattr(target, "aclose", None)
            if aclose is None:
                continue
            try:
                await call_asyncio(aclose, context=self._shared_context())
            except Exception as exc:
                if error is None:
                    error = exc
        if error is not None:
            raise error


async def _anext(iterator: AsyncIterator[T]) -> T:
    return await anext(iterator)


class AsyncioRun(Generic[T, R]):
    """A trio run function that runs an asyncio coroutine function as an asyncio task."""

    def __init__(self, run: Callable[[T], Awaitable[R]]) -> None:
        self._run = run

    def __repr__(self) -> str:
        return f"<asyncio run {self._run!r}>"

    async def __call__(self, item: T) -> R:
        return await call_asyncio(self._run, item)
