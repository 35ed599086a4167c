"""A bridged env under an asyncio host: asyncio code runs on the host's own loop.

`tt.aio.BridgedEnv` runs an asyncio env on a trio-asyncio loop opened inside trio. That works
under `trio.run`, but not inside trio guest mode (`tt.aio.run_eval` / `run_trio` called from
`asyncio.run`): there the host's asyncio loop is the thread's running loop, so asyncio's C
code attaches futures to it, not to trio-asyncio's loop ("attached to a different loop").
It does not need to: under an asyncio host, the env's asyncio code can simply run on the host
loop, as asyncio tasks, while the trio runner drives it from the guest run.

`host_loop()` opens a `HostLoop`, an object with the two methods of a trio-asyncio loop the
bridge calls (`run_aio_coroutine`, `trio_as_future`), implemented on the host loop; the
bridge's `serving()` uses it instead of trio-asyncio whenever it runs inside a guest run.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, TypeVarTuple, Unpack

import trio

__all__ = ["HostLoop", "guest_host_loop", "host_loop"]

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


class HostLoop:
    """The host's asyncio loop, with the trio-asyncio loop methods the bridge calls."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, nursery: trio.Nursery, token: trio.lowlevel.TrioToken
    ) -> None:
        self.loop = loop
        self._nursery = nursery
        self._token = token

    def _soon(self, fn: Callable[[Unpack[Ts]], object], *args: *Ts) -> None:
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(fn, *args)

    async def run_aio_coroutine(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """From trio: run `coro` as an asyncio task on the host loop; its result or error.

        Trio cancellation cancels the task and waits for it to finish, then raises
        `trio.Cancelled`, or the real error the task raised while it unwound. A task cancelled
        from the asyncio side raises `asyncio.CancelledError` (as trio-asyncio does)."""
        # `asyncio.Task(...)`, not `create_task`: an eager task factory would start the
        # coroutine here, inside a trio tick.
        task: asyncio.Task[Any] = asyncio.Task(coro, loop=self.loop)
        done = trio.Event()
        task.add_done_callback(lambda _: self._soon(done.set))
        try:
            await done.wait()
        except trio.Cancelled:
            task.cancel()
            with trio.CancelScope(shield=True):
                await done.wait()
            error = None if task.cancelled() else task.exception()
            if isinstance(error, Exception):
                raise error from None
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

        def cancelled(done: asyncio.Future[Any]) -> None:
            if done.cancelled():
                self._soon(scope.cancel)

        future.add_done_callback(cancelled)
        self._soon(self._nursery.start_soon, run)
        return future


@asynccontextmanager
async def host_loop(loop: asyncio.AbstractEventLoop) -> AsyncIterator[HostLoop]:
    """A `HostLoop` on `loop` for the block; the trio tasks it started end with it."""
    async with trio.open_nursery() as nursery:
        yield HostLoop(loop, nursery, trio.lowlevel.current_trio_token())
        nursery.cancel_scope.cancel()
