"""Guest-mode direction: asyncio programs call the trio runner.

`await run_stream(source, run, window=...)` and `await run_trio(async_fn, *args)` are awaitable
from asyncio code (`asyncio.run`, a web server, a notebook). They run trio on the *running*
asyncio loop in trio guest mode (`trio.lowlevel.start_guest_run`): no second thread, no
trio-asyncio.

Design:

* **One guest run per thread, shared by all calls.** Trio allows one guest run per host loop
  (one trio run per thread). The first call on a loop starts it lazily; its main task holds a
  nursery that receives *jobs* over an unbounded memory channel. Each call is one job: a trio
  task of its own, with its own cancel scope, running in a copy of the caller's contextvars.
  When the last active call has finished, the channel is closed, the guest run ends, and that
  last caller waits for the end, so `asyncio.run` exits with no pending tasks, threads or
  warnings. A call that arrives while a guest is stopping waits for it, then starts a new one.
* **asyncio inside trio.** Trio code cannot await asyncio awaitables. `call_asyncio` runs an
  asyncio callable as an asyncio task on the host loop and waits, on the trio side, for an
  event its done callback sets. On trio cancellation it cancels the asyncio task, waits
  (shielded) until it has finished, then re-raises `trio.Cancelled`. Results and exceptions
  come back unwrapped. An asyncio `CancelledError` that trio did not ask for (the asyncio
  code cancelled itself, or something else cancelled its task) becomes `AsyncioCancelled`,
  a plain error; it never leaks into trio as a stray BaseException.
* **Cancellation from asyncio.** Cancelling the asyncio task that awaits a call cancels the
  job's trio cancel scope, waits until the job has unwound (runs cancelled, source closed),
  then re-raises the caller's own `CancelledError`. A real error raised while unwinding wins
  over the cancellation (it is never dropped), as on trio.
* **Ctrl-C.** The guest is started with `host_uses_signal_set_wakeup_fd=True`. Under
  `asyncio.run` (main thread), asyncio owns SIGINT: Ctrl-C cancels the main task, so the
  calls unwind as above (runs cancelled, sources closed) and `asyncio.run` raises
  KeyboardInterrupt. Under a host that leaves Python's default SIGINT handler in place (for
  example `loop.run_until_complete`), trio installs its own handler for the life of the guest
  run: Ctrl-C is delivered to the guest, every call unwinds and then raises KeyboardInterrupt
  in its asyncio task, which stops the loop.
* **Cost.** Each pull, run and close that crosses from trio to asyncio is one asyncio task and,
  unless it finishes in its first step, one wake-up of the guest through trio's I/O thread:
  about 36 us per item on a 2-core machine with an asyncio source and an asyncio run that
  awaits `asyncio.sleep(0)` (about 6x the runner under `trio.run` on that no-op workload;
  trio code in guest mode costs about 1.04x), which is noise next to a model call
  (`python -m bench.aio`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import math
import threading
from collections.abc import AsyncIterable, Awaitable, Callable
from typing import Any, TypeVar, TypeVarTuple, Unpack, cast

import outcome
import trio

from .._core.runner import run_stream as _trio_run_stream
from .._env.env import Env
from .._eval import EvalConfig, EvalResult
from .._eval import run_eval as _trio_run_eval
from .._models import ModelContext
from ._adapters import AsyncioRun, AsyncioSource, GuestRunStopped, set_host_loop
from ._loop import AsyncioCancelled

T = TypeVar("T")
R = TypeVar("R")
Ts = TypeVarTuple("Ts")


# --- the shared guest run -----------------------------------------------------------------


class _Stopped:
    """The job's trio task was cancelled by the guest run itself (the run is ending)."""


class _Cancelled:
    """The job's own cancel scope caught the cancellation its caller asked for."""


_STOPPED = _Stopped()
_CANCELLED = _Cancelled()

_JobResult = outcome.Outcome[Any] | _Stopped | _Cancelled


class _Job:
    def __init__(
        self,
        fn: Callable[[], Awaitable[Any]],
        future: asyncio.Future[_JobResult],
        context: contextvars.Context,
    ) -> None:
        self.fn = fn
        self.future = future
        self.context = context
        self.scope = trio.CancelScope()

    def resolve(self, result: _JobResult) -> None:
        if not self.future.done():
            self.future.set_result(result)


async def _run_job(job: _Job) -> None:
    try:
        with job.scope:
            value = await job.fn()
            job.resolve(outcome.Value(value))
    except trio.Cancelled:  # not from our own scope: the guest run is being torn down
        job.resolve(_STOPPED)
        raise
    except Exception as exc:
        job.resolve(outcome.Error(exc))
    except BaseException as exc:  # KeyboardInterrupt, SystemExit: they end the guest run too
        job.resolve(outcome.Error(exc))
        raise
    if job.scope.cancelled_caught:
        job.resolve(_CANCELLED)


def _single(group: BaseExceptionGroup[BaseException]) -> BaseException:
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        else:
            leaves.append(exc)

    walk(group)
    for exc in leaves:
        if isinstance(exc, KeyboardInterrupt):
            return exc
    return leaves[0] if len(leaves) == 1 else group


class _Guest:
    """One trio guest run on one asyncio loop; jobs arrive over a memory channel."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.send, self.receive = trio.open_memory_channel[_Job](math.inf)
        self.finished: asyncio.Future[outcome.Outcome[None]] = loop.create_future()
        self.active = 0
        self.stopping = False
        self.pending: set[_Job] = set()
        self.token: trio.lowlevel.TrioToken | None = None

    def start(self) -> None:
        # A fresh context: the shared guest must not inherit the first caller's contextvars
        # (each job gets its own caller's context instead).
        contextvars.Context().run(
            trio.lowlevel.start_guest_run,
            self._main,
            run_sync_soon_threadsafe=self.loop.call_soon_threadsafe,
            run_sync_soon_not_threadsafe=self.loop.call_soon,
            done_callback=self._done,
            host_uses_signal_set_wakeup_fd=True,
        )
        self.token = trio.lowlevel.current_trio_token()

    async def _main(self) -> None:
        error: BaseException | None = None
        try:
            async with trio.open_nursery() as nursery:
                async for job in self.receive:
                    # start_soon copies the current context: spawn the job in its caller's.
                    job.context.run(nursery.start_soon, _run_job, job)
        except BaseExceptionGroup as group:
            error = _single(group)  # jobs only raise KeyboardInterrupt & co. into this nursery
        if error is not None:
            raise error

    def _done(self, result: outcome.Outcome[None]) -> None:
        self.stopping = True
        if getattr(_local, "guest", None) is self:
            _local.guest = None
            set_host_loop(None)
        for job in self.pending:
            job.resolve(_STOPPED)  # never started: the guest ended first
        self.pending.clear()
        if not self.finished.done():
            self.finished.set_result(result)

    def submit(self, job: _Job) -> None:
        self.pending.add(job)
        job.future.add_done_callback(lambda _: self.pending.discard(job))
        self._soon(self.send.send_nowait, job)

    def cancel(self, job: _Job) -> None:
        self._soon(job.scope.cancel)

    def _soon(self, fn: Callable[[Unpack[Ts]], object], *args: *Ts) -> None:
        assert self.token is not None
        # RunFinishedError: the guest already ended, and `_done` resolved whatever was pending.
        with contextlib.suppress(trio.RunFinishedError):
            self.token.run_sync_soon(fn, *args)

    def release(self) -> bool:
        """One call is done with the guest; the last one stops it. True: wait for its end."""
        self.active -= 1
        if self.active == 0 and not self.stopping:
            self.stopping = True
            self._soon(self.send.close)
        return self.active == 0


_local = threading.local()  # `.guest`: this thread's guest run (one trio run per thread)


def _acquire_now(loop: asyncio.AbstractEventLoop) -> _Guest | None:
    guest: _Guest | None = getattr(_local, "guest", None)
    if guest is not None and guest.loop is not loop:
        raise RuntimeError(
            "trio_tasksets.aio: a trio guest run from another asyncio loop is still active in "
            "this thread (a loop was stopped before its calls finished); one trio run per thread"
        )
    if guest is None:
        if trio.lowlevel.in_trio_run():
            hint = ""
            if type(loop).__module__.startswith("trio_asyncio"):
                hint = (
                    f" (this asyncio loop is trio-asyncio's {type(loop).__name__}, which runs "
                    "trio itself: start the program with trio.run and use the trio runner, or "
                    "run asyncio on a stdlib loop, e.g. asyncio.Runner(loop_factory="
                    "asyncio.SelectorEventLoop))"
                )
            raise RuntimeError(
                "trio_tasksets.aio: a trio run is already active in this thread (trio.run, "
                f"trio-asyncio or another guest run); call the trio runner directly instead{hint}"
            )
        guest = _Guest(loop)
        guest.start()
        _local.guest = guest
        set_host_loop(loop)
    if guest.stopping:
        return None
    guest.active += 1
    return guest


async def _acquire(loop: asyncio.AbstractEventLoop) -> _Guest:
    while True:
        guest = _acquire_now(loop)
        if guest is not None:
            return guest
        # This thread's guest is stopping: wait for its end, then start a new one.
        await asyncio.shield(cast(_Guest, _local.guest).finished)


async def _wait_uncancellable(future: asyncio.Future[Any]) -> asyncio.CancelledError | None:
    """Wait for `future` whatever happens; return the first CancelledError received meanwhile."""
    cancelled: asyncio.CancelledError | None = None
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError as exc:
            if cancelled is None:
                cancelled = exc
    return cancelled


# --- the public API -----------------------------------------------------------------------


async def run_trio(async_fn: Callable[[Unpack[Ts]], Awaitable[T]], *args: *Ts) -> T:
    """Await, from asyncio, `await async_fn(*args)` run as trio code in the loop's guest run.

    The trio function runs in its own trio task and cancel scope, in a copy of the caller's
    contextvars, on the shared trio guest run of the running asyncio loop (started on first
    use, stopped when the last call finishes). Returns its result; its exception is raised
    unwrapped. Cancelling the awaiting asyncio task cancels the trio task, waits until it has
    unwound, then raises the caller's `CancelledError` (a real error raised while unwinding is
    raised instead). Use `functools.partial` to pass keyword arguments.
    """
    loop = asyncio.get_running_loop()
    guest = await _acquire(loop)
    job = _Job(lambda: async_fn(*args), loop.create_future(), contextvars.copy_context())
    cancelled: asyncio.CancelledError | None = None
    try:
        guest.submit(job)
        while not job.future.done():
            try:
                await asyncio.shield(job.future)
            except asyncio.CancelledError as exc:
                if cancelled is None:
                    cancelled = exc
                    guest.cancel(job)
    finally:
        if not job.future.done():  # left by another exception (e.g. Ctrl-C raised right here)
            guest.cancel(job)
        stopped = job.future.done() and isinstance(job.future.result(), _Stopped)
        if guest.release() or stopped:
            # The last call waits for the guest's end (so the host can close its loop); a call
            # the ending guest stopped needs to know why.
            late = await _wait_uncancellable(guest.finished)
            cancelled = cancelled or late
    result = job.future.result()

    if isinstance(result, _Stopped):
        if cancelled is not None:
            raise cancelled
        ended = guest.finished.result()
        if isinstance(ended, outcome.Error):
            if not isinstance(ended.error, Exception):
                raise ended.error  # KeyboardInterrupt (Ctrl-C delivered to trio), SystemExit
            raise GuestRunStopped(f"the trio guest run ended with {ended.error!r}") from (
                ended.error
            )
        raise GuestRunStopped("the trio guest run ended before this call finished")
    if cancelled is not None:
        if (
            isinstance(result, outcome.Error)
            and isinstance(result.error, Exception)
            and not isinstance(result.error, AsyncioCancelled)
        ):
            raise result.error  # a real failure while unwinding wins, as on trio
        raise cancelled
    if isinstance(result, _Cancelled):  # pragma: no cover - only a cancelled caller gets this
        raise GuestRunStopped("the trio call was cancelled")
    if isinstance(result, outcome.Error):
        raise result.error
    return cast(T, cast(outcome.Value[Any], result).value)


async def run_stream(
    source: AsyncIterable[T],
    run: Callable[[T], Awaitable[R]],
    *,
    window: int | None,
    trio_source: bool | None = None,
    trio_run: bool = False,
) -> list[R]:
    """`trio_tasksets.run_stream`, awaitable from asyncio (trio guest mode on the running loop).

    `source` is an asyncio async iterable and `run` an asyncio coroutine function (by default):
    each pull, each `run(item)` and the source's `aclose()` run as asyncio tasks on the host
    loop. Pass `trio_run=True` for a trio-flavored `run`; `trio_source=True` for a trio-flavored
    source (a `trio.abc.ReceiveChannel` is detected as trio by default). The runner's contract
    holds unchanged: at most `window` runs in flight and a pull only when a slot is
    free, results in submission order, the first failure cancels the rest and is re-raised
    itself, the source is closed exactly once. Cancelling the awaiting asyncio task cancels the
    runs, closes the source, and raises `CancelledError`.
    """
    if trio_source is None:
        trio_source = isinstance(source, trio.abc.ReceiveChannel)
    # Leave a bad source or run unwrapped, so the runner's own check names it.
    src: AsyncIterable[T] = source
    if not trio_source and hasattr(type(source), "__aiter__"):
        src = AsyncioSource(source)
    fn: Callable[[T], Awaitable[R]] = run
    if not trio_run and callable(run):
        fn = AsyncioRun(run)

    async def job() -> list[R]:
        return await _trio_run_stream(src, fn, window=window)

    return await run_trio(job)


async def run_eval(env: Env[Any], ctx: ModelContext, config: EvalConfig) -> EvalResult:
    """Await, from asyncio, `tt.run_eval(env, ctx, config)` run on the loop's trio guest run.

    Everything `tt.run_eval` guarantees holds (bad settings raise `EvalConfigError` before
    any pull or write; traces are durable; errors come back unwrapped). Cancelling the
    awaiting asyncio task cancels the eval, closes the feed and keeps the finished rows.
    `env` is a trio env (`tt.Env`, or `bridge_env(...)` of an asyncio env).
    """
    return await run_trio(_trio_run_eval, env, ctx, config)
