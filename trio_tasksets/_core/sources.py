"""Source combinators: `take` (the next n items, then close), `until` (items until a stop) and
`merge` (several sources as one).

Both keep the runner's promises about a source : nothing is pulled that is not
asked for, and every source is closed exactly once, shielded where a close must not be cut
short.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

import trio

from .exceptions import ConfigError, ConfigTypeError
from .runner import SourceIterator, check_source, close_iterator, pick_one

__all__ = ["Merged", "Until", "merge", "take", "until"]

T = TypeVar("T")


def take(source: AsyncIterable[T], n: int) -> AsyncIterator[T]:
    """Yield the next `n` items of `source` (fewer if it ends first), then close it.

    Never requests an (n+1)th item: after the n-th, the next call closes the source, shielded
    from cancellation, and ends (a runner closes it instead when it stops pulling first).
    `n == 0` pulls nothing. Closing the result closes the source, even before the first pull.

    Raises a `ConfigError` naming `n` (`n < 0`, a ValueError; not an int, a
    `ConfigTypeError`, also a TypeError) or `source` (not an async iterable).
    """
    check_source(source)
    if isinstance(n, bool) or not isinstance(n, int):
        raise ConfigTypeError(
            f"{{n}} must be an int >= 0, got {n!r} ({type(n).__name__})", parameter="n"
        )
    if n < 0:
        raise ConfigError(f"{{n}} must be >= 0, got {n}", parameter="n")
    return _Take(source, n)


class _Take(SourceIterator[T]):
    """`take` as an iterator class, not a generator."""

    def __init__(self, source: AsyncIterable[T], n: int) -> None:
        super().__init__(source)
        self._left = n

    async def __anext__(self) -> T:
        if self._left <= 0 or self._closed:
            await self._close_shielded()
            raise StopAsyncIteration
        try:
            item = await self._iterator.__anext__()
        except StopAsyncIteration:
            await self._close_shielded()
            raise
        self._left -= 1  # at 0, the next call closes the source and never asks it again
        return item

    async def _close_shielded(self) -> None:
        # Closing here, mid-iteration, must not be cut short: once marked closed, a later
        # (shielded) aclose() does nothing, so a cancelled close would never be finished.
        if _holds_scope(self._iterator):
            await self.aclose()  # see _holds_scope: cannot be cut short, must not be shielded
            return
        with trio.CancelScope(shield=True):
            await self.aclose()


def until(
    source: AsyncIterable[T], stop: trio.Event | Callable[[], bool] | None = None
) -> Until[T]:
    """The items of `source` until a stop, then the end (and `source` closed).

    What a service needs to stop its feed on its own condition (a signal, a count, a
    deadline) while the runs in flight go on: give the result to `tt.run_stream` or
    `tt.as_completed` as the source. The stop is one of:

    * a `trio.Event`: once set, a pull parked on a quiet feed is cancelled and the stream
      ends at once;
    * a predicate, called before each pull and, when the result is the source of
      `tt.run_stream` or `tt.as_completed` (directly or through `take`), as each run ends:
      once it returns True, the stream ends, a pull parked on a quiet feed cancelled. A
      predicate cannot wake anything: what changes elsewhere (the consumer of
      `as_completed`, another task, the clock) is seen only at those moments, and a parked
      pull waits for the feed's next item meanwhile. There, set an Event instead;
    * `.stop()` on the result (any time, from any task of the run): as a set Event.

    An item whose pull completed before the stop was seen is still handed on, so nothing
    pulled is lost; nothing is pulled after it. When the stream ends (a stop or the source's
    end) it closes `source`, so a plain ``async for`` closes it too. The stream keeps the
    runner's promises about a source: it pulls only when asked, the source's own errors pass
    through unchanged, an outside cancellation is not swallowed, and closing it
    closes `source` exactly once, from the task that iterates it. A bare `tt.merge(...)`
    is refused (a pull cancelled inside its nursery would corrupt the cancel scope stack):
    use ``async with tt.merge(a, b) as merged: tt.until(merged, ...)``.

    Raises a `ConfigTypeError` (a `ConfigError` and a TypeError) naming `source` (not an
    async iterable, or a bare merge) or `stop` (none of the three).
    """
    check_source(source)
    if stop is not None and not (isinstance(stop, trio.Event) or callable(stop)):
        raise ConfigTypeError(
            f"{{stop}} must be a trio.Event, a predicate () -> bool or None, got {stop!r}",
            parameter="stop",
        )
    return Until(source, stop)


class Until(SourceIterator[T]):
    """What `until` returns: an async iterator with `stop()` and `stopped`."""

    def __init__(
        self, source: AsyncIterable[T], stop: trio.Event | Callable[[], bool] | None
    ) -> None:
        super().__init__(source)
        if isinstance(self._iterator, Merged) or _holds_scope(self._iterator):
            raise ConfigTypeError(
                "until({source}): a bare tt.merge(...) keeps a nursery on the iterating task, "
                "so a stop cannot cancel its pull; use `async with tt.merge(...) as merged:` "
                "and pass `merged`",
                parameter="source",
            )
        self._event = stop if isinstance(stop, trio.Event) else None
        self._predicate = None if isinstance(stop, trio.Event) else stop
        self._stopped = False
        self._pull: trio.CancelScope | None = None

    @property
    def stopped(self) -> bool:
        """Whether the stream was told to stop (by `stop()`, the Event or the predicate)."""
        if not self._stopped and (
            (self._event is not None and self._event.is_set())
            or (self._predicate is not None and self._predicate())
        ):
            self._stopped = True
        return self._stopped

    def stop(self) -> None:
        """End the stream: a pull in progress is cancelled, no other one starts."""
        self._stopped = True
        if self._pull is not None:
            self._pull.cancel()

    def _run_ended(self) -> None:
        """A run of the runner this stream feeds has ended: the predicate is looked at again,
        and once it holds, a pull parked on a quiet feed is cancelled."""
        if self._predicate is not None and not self._stopped and self._predicate():
            self.stop()
        super()._run_ended()

    async def __anext__(self) -> T:
        if self._closed:
            raise StopAsyncIteration
        if not self.stopped:
            with trio.CancelScope() as pull:
                self._pull = pull
                try:
                    if self._event is None:
                        return await self._iterator.__anext__()
                    return await self._pull_or_event(self._event)
                except StopAsyncIteration:
                    pass  # the source ended
                finally:
                    self._pull = None
            # Here the source ended or a stop cancelled the pull (an outside cancellation
            # propagates out of the scope).
        # The stream ends: it closes the source itself, as `take` does, so that a plain
        # `async for` closes it too (a runner's own close then finds it closed).
        with trio.CancelScope(shield=True):
            await self.aclose()
        raise StopAsyncIteration

    async def _pull_or_event(self, event: trio.Event) -> T:
        """One pull, cancelled (by `stop()`) if `event` is set first; what the pull raises
        is raised itself, not in an ExceptionGroup."""
        error: BaseException | None = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch, event)
                item = await self._iterator.__anext__()
                nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            error = pick_one(group)
        if error is not None:
            raise error
        return item  # the pull completed first: it is handed on

    async def _watch(self, event: trio.Event) -> None:
        await event.wait()
        self.stop()

    async def aclose(self) -> None:
        """Close `source` (once); shield it if it must not be cut short. Raises the first
        exception its close raised."""
        if not self._closed:
            self._stopped = True
        await super().aclose()


def _holds_scope(iterator: object) -> bool:
    """True for an iterator that keeps a nursery open on the iterating task between pulls (a
    merge iterated bare, or a take of one). Its close exits that nursery, so it must not run
    inside a scope entered after it; and it needs no shield: a nursery's exit waits for its
    tasks whatever the cancellation, and each pump closes its source shielded in its own task.
    """
    if isinstance(iterator, _Take):
        return _holds_scope(iterator._iterator)
    return isinstance(iterator, Merged) and iterator._bare


def merge(*sources: AsyncIterable[T]) -> Merged[T]:
    """Interleave several async sources into one, in arrival order.

    Each source is pumped by its own task, which holds at most one item it has pulled but not
    yet handed on (the only prefetch). The merged stream ends when every source has ended; the
    first source error is raised itself, after the other sources are closed. Every source is
    closed exactly once, shielded, by the task that pulled it.

    Two ways to use the result:

    * ``async with tt.merge(a, b) as merged:`` gives a `trio.abc.ReceiveChannel`, built with
      `trio.as_safe_channel`: the pumps' nursery lives in that block, so the channel is safe
      in any consumer (a timeout around each receive, `take`, a runner).
    * Iterated directly (a runner's source, `async for`, a taskset's `stream()`), the merge is
      an async generator that yields from inside its nursery, so that nursery sits on the
      iterating task between pulls. That is safe exactly when the iterating task enters no
      cancel scope around a pull that it leaves before closing the merge, and closes it
      (`aclose()`, `contextlib.aclosing`) rather than abandoning it: the runner, `take` and a
      taskset's `channel()` do both. A per-pull ``with trio.move_on_after(...)`` around a bare
      ``anext(merged)`` does not (trio reports a corrupted cancel scope stack): use the
      ``async with`` form there. Errors never cancel the nursery from inside while the merge
      sits at its ``yield``: they travel as values and are raised by the merge itself.

    Raises a `ConfigTypeError` (a `ConfigError` and a TypeError) naming `source` for a
    source that is not an async iterable.
    """
    for source in sources:
        check_source(source)
    return Merged(sources)


class Merged(AsyncIterator[T], AbstractAsyncContextManager[trio.abc.ReceiveChannel[T]]):
    """What `merge` returns: an async context manager giving a channel, or an async iterator
    (one or the other, once). Closable before it starts: then it closes the sources itself."""

    def __init__(self, sources: tuple[AsyncIterable[T], ...]) -> None:
        self._sources = sources
        self._generator: AsyncGenerator[T, None] | None = None
        self._channel: AbstractAsyncContextManager[trio.abc.ReceiveChannel[T]] | None = None
        self._bare = False
        self._closed = False

    # --- async with: the structured form --------------------------------------------------

    async def __aenter__(self) -> trio.abc.ReceiveChannel[T]:
        self._claim("async with tt.merge(...)")
        self._channel = trio.as_safe_channel(_merge)(self._sources)
        return await self._channel.__aenter__()

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        assert self._channel is not None
        return await self._channel.__aexit__(*exc_info)

    # --- bare iteration ---------------------------------------------------------------------

    async def __anext__(self) -> T:
        if self._generator is None:
            self._claim("iterating tt.merge(...)")
            self._bare = True
            self._generator = _merge(self._sources)
        return await self._generator.__anext__()

    async def aclose(self) -> None:
        if self._generator is not None:
            await self._generator.aclose()
            return
        if self._channel is not None or self._closed:
            return  # the async with block closes the sources
        self._closed = True
        errors = [await close_iterator(aiter(source), source) for source in self._sources]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def _claim(self, how: str) -> None:
        if self._channel is not None or self._generator is not None or self._closed:
            raise RuntimeError(
                f"{how}: this merge was already used or closed; call tt.merge() once per use"
            )


async def _merge(sources: tuple[AsyncIterable[T], ...]) -> AsyncGenerator[T, None]:
    send, receive = trio.open_memory_channel[tuple[bool, Any]](0)

    async def pump(source: AsyncIterable[T], out: trio.MemorySendChannel[tuple[bool, Any]]) -> None:
        # Errors travel as values: a pump never raises into the nursery, so the nursery is never
        # cancelled from inside while the merged generator is suspended at its yield.
        iterator = aiter(source)
        with out:
            try:
                while True:
                    try:
                        item = await iterator.__anext__()
                    except StopAsyncIteration:
                        return
                    except Exception as exc:
                        await out.send((False, exc))
                        return
                    await out.send((True, item))
            except trio.BrokenResourceError:
                pass
            finally:
                with trio.CancelScope(shield=True):  # a task of its own: a new scope is fine
                    close_error = await close_iterator(iterator, source)
                if close_error is not None:
                    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                        out.send_nowait((False, close_error))

    error: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            with send:
                for source in sources:
                    nursery.start_soon(pump, source, send.clone())
            try:
                async for ok, value in receive:
                    if not ok:
                        error = value
                        break
                    yield value
            finally:
                receive.close()
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The nursery wraps what left its body (GeneratorExit from aclose(), an outside
        # Cancelled): hand it on bare, as a generator must.
        error = pick_one(group)
    if error is not None:
        raise error
