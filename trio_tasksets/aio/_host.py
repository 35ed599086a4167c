"""Native asyncio loops for the asyncio bridge, instead of trio-asyncio's.

`tt.aio.BridgedEnv` runs an asyncio env on an asyncio loop the trio runner drives. By default
that is trio-asyncio's loop inside trio (`open_loop`), which follows trio's clock (a MockClock
drives `asyncio.sleep`) and shares one thread. Two other loops have the same two methods the
bridge calls (`run_aio_coroutine` from trio, `trio_as_future` from asyncio):

* `HostLoop`, under an asyncio host (trio guest mode: `tt.aio.run_eval` / `run_trio` from
  `asyncio.run`): the host's own loop. A trio-asyncio loop cannot work there (the host loop is
  the thread's running loop, so asyncio's C code attaches futures to it: "attached to a
  different loop"), and need not: the env's asyncio code simply runs on the host loop.
* `ThreadLoop`, under `trio.run`, for envs that ask for it (`BridgedEnv.asyncio_loop =
  "thread"`): a stdlib asyncio loop in a thread of its own, so the env's asyncio code runs
  natively, as under `asyncio.run`. trio-asyncio implements asyncio's loop on trio primitives
  (every callback and every socket readiness wait goes through trio's scheduler: for a
  verifiers rollout about 4,000 trio calls and 3-4 ms of CPU more than a native loop,
  `python -m bench.verifiers`); a native loop in a thread costs two thread hops per call. The
  env's asyncio code is then on its own clock (the real one) and in its own thread: it must not
  call trio, nor share objects with trio code, except through the bridge.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, TypeVarTuple, Unpack

import trio

__all__ = ["HostLoop", "ThreadLoop", "guest_host_loop", "host_loop", "thread_loop"]

Ts = TypeVarTuple("Ts")

# The unpatched accessor (trio-asyncio replaces asyncio's own inside trio): C, else Python.
try:
    import _asyncio

    _running_loop: Callable[[], asyncio.AbstractEventLoop | None] = _asyncio._get_running_loop
except ImportError:  # pragma: no cover - CPython always has the accelerator
    _running_loop = asyncio.events._py__get_running_loop  # type: ignore[attr-defined]


def guest_host_loop() -> asyncio.AbstractEventLoop | None:
    """The asyncio loop hosting this trio run in guest mode, or None (a plain `trio.run`).

    Reads the thread's running loop as asyncio's C code sees it: a guest run's ticks run as
    callbacks of the host loop, so it is set; under `trio.run` (trio-asyncio included) it is
    not."""
    loop: asyncio.AbstractEventLoop | None = _running_loop()
    return loop


class _Bridge:
    """An asyncio loop and the trio run it serves: the nursery its trio tasks start in, and
    the token that schedules a callback in trio from any thread."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, nursery: trio.Nursery, token: trio.lowlevel.TrioToken
    ) -> None:
        self.loop = loop
        self._nursery = nursery
        self._token = token

    def _to_trio(self, fn: Callable[[Unpack[Ts]], object], *args: *Ts) -> None:
        """`fn(*args)` soon, in trio (dropped if the run has ended)."""
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(fn, *args)

    def _start(
        self,
        future: asyncio.Future[Any],
        scope: trio.CancelScope,
        run: Callable[[], Awaitable[None]],
    ) -> asyncio.Future[Any]:
        """`trio_as_future`'s end: start `run` as a trio task (it settles `future` in `scope`)
        and cancel `scope` when the future is cancelled; `future`."""

        def cancelled(done: asyncio.Future[Any]) -> None:
            if done.cancelled():
                self._to_trio(scope.cancel)

        future.add_done_callback(cancelled)
        self._to_trio(self._nursery.start_soon, run)
        return future


def _raise_unwound(task: asyncio.Task[Any]) -> None:
    """After a trio cancellation cancelled `task` and it ended: the real error it raised while
    it unwound, if any (else the caller re-raises `trio.Cancelled`)."""
    error = None if task.cancelled() else task.exception()
    if isinstance(error, Exception):
        raise error from None


class HostLoop(_Bridge):
    """The host's asyncio loop, with the trio-asyncio loop methods the bridge calls."""

    async def run_aio_coroutine(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """From trio: run `coro` as an asyncio task on the host loop; its result or error.

        Trio cancellation cancels the task and waits for it to finish, then raises
        `trio.Cancelled`, or the real error the task raised while it unwound. A task cancelled
        from the asyncio side raises `asyncio.CancelledError` (as trio-asyncio does)."""
        # `asyncio.Task(...)`, not `create_task`: an eager task factory would start the
        # coroutine here, inside a trio tick.
        task: asyncio.Task[Any] = asyncio.Task(coro, loop=self.loop)
        done = trio.Event()
        task.add_done_callback(lambda _: self._to_trio(done.set))
        try:
            await done.wait()
        except trio.Cancelled:
            task.cancel()
            with trio.CancelScope(shield=True):
                await done.wait()
            _raise_unwound(task)
            raise
        return task.result()

    def trio_as_future(
        self, fn: Callable[[Unpack[Ts]], Awaitable[Any]], *args: *Ts
    ) -> asyncio.Future[Any]:
        """From asyncio: run `fn(*args)` as a trio task; an asyncio future of its outcome.
        Cancelling the future cancels the trio task."""
        future: asyncio.Future[Any] = self.loop.create_future()
        scope = trio.CancelScope()

        async def run() -> None:
            try:
                with scope:
                    result = await fn(*args)
                    if not future.done():
                        future.set_result(result)
            except Exception as exc:
                if not future.done():
                    future.set_exception(exc)
            finally:
                if not future.done():  # cancelled: by the future's owner, or the run ended
                    future.cancel()

        return self._start(future, scope, run)


@asynccontextmanager
async def host_loop(loop: asyncio.AbstractEventLoop) -> AsyncIterator[HostLoop]:
    """A `HostLoop` on `loop` for the block; the trio tasks it started end with it."""
    async with trio.open_nursery() as nursery:
        yield HostLoop(loop, nursery, trio.lowlevel.current_trio_token())
        nursery.cancel_scope.cancel()


class ThreadLoop(_Bridge):
    """A stdlib asyncio loop running in a thread of its own, with the trio-asyncio loop
    methods the bridge calls. Both methods may be called from their own side only:
    `run_aio_coroutine` from trio, `trio_as_future` from the loop's thread."""

    async def run_aio_coroutine(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """From trio: run `coro` as an asyncio task on the loop's thread (in a copy of the
        calling trio task's contextvars); its result or error, as `HostLoop`'s."""
        done = trio.Event()
        started: list[asyncio.Task[Any]] = []

        def start() -> None:  # on the loop's thread
            task = asyncio.Task(coro, loop=self.loop)
            started.append(task)
            task.add_done_callback(lambda _: self._to_trio(done.set))

        self.loop.call_soon_threadsafe(start)
        try:
            await done.wait()
        except trio.Cancelled:

            def cancel() -> None:  # on the loop's thread, after start() (FIFO)
                started[0].cancel()

            self.loop.call_soon_threadsafe(cancel)
            with trio.CancelScope(shield=True):
                await done.wait()
            _raise_unwound(started[0])
            raise
        return started[0].result()

    def trio_as_future(
        self, fn: Callable[[Unpack[Ts]], Awaitable[Any]], *args: *Ts
    ) -> asyncio.Future[Any]:
        """From the loop's thread: run `fn(*args)` as a trio task; an asyncio future of its
        outcome. Cancelling the future cancels the trio task."""
        future: asyncio.Future[Any] = self.loop.create_future()
        scope = trio.CancelScope()
        loop = self.loop

        def settle(kind: str, value: Any) -> None:  # on the loop's thread
            if future.done():
                return
            if kind == "value":
                future.set_result(value)
            elif kind == "error":
                future.set_exception(value)
            else:
                future.cancel()

        async def run() -> None:  # in trio
            outcome: tuple[str, Any] = ("cancelled", None)
            try:
                with scope:
                    outcome = ("value", await fn(*args))
            except Exception as exc:
                outcome = ("error", exc)
            finally:  # cancelled (by the future's owner, or the block ending) unless set above
                with contextlib.suppress(RuntimeError):  # the loop is closed already
                    loop.call_soon_threadsafe(settle, *outcome)

        return self._start(future, scope, run)


def _native_loop() -> asyncio.AbstractEventLoop:
    # Not asyncio.new_event_loop(): inside trio, trio-asyncio (if imported) makes it build one
    # of its own loops.
    if sys.platform == "win32":  # pragma: no cover
        return asyncio.ProactorEventLoop()
    return asyncio.SelectorEventLoop()


@asynccontextmanager
async def thread_loop() -> AsyncIterator[ThreadLoop]:
    """A `ThreadLoop` for the block: a new stdlib loop, run by a new daemon thread; at the end
    its trio tasks are cancelled, its remaining asyncio tasks cancelled and awaited, its async
    generators and executor shut down, the loop stopped and closed, the thread joined."""
    loop = _native_loop()
    thread = threading.Thread(target=loop.run_forever, name="tt-asyncio-loop", daemon=True)
    thread.start()
    try:
        async with trio.open_nursery() as nursery:
            yield ThreadLoop(loop, nursery, trio.lowlevel.current_trio_token())
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(_stop, loop, thread)


async def _drain(loop: asyncio.AbstractEventLoop) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if t is not asyncio.current_task(loop)]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await loop.shutdown_asyncgens()
    await loop.shutdown_default_executor()


def _stop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    """(In a worker thread.) Drain and stop the loop, join its thread, close it."""
    if loop.is_running():
        asyncio.run_coroutine_threadsafe(_drain(loop), loop).result()
        loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()
