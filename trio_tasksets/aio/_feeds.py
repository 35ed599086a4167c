"""Asyncio feeds as trio tasksets: `AsyncioTaskset` (an asyncio `stream()`), read one item
per receive on the bridge's asyncio loop and closed exactly once."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, ClassVar, TypeVar, cast

import trio

from .._core.exceptions import ConfigTypeError
from .._core.tasksets import Taskset, TasksetConfig, aclose_source, guarded_tasks, stream_view
from ._loop import LoopKind, add_note, bridge_loop, call_aio, open_loop, trio_asyncio_module

__all__ = ["AsyncioTaskset", "as_taskset"]

T = TypeVar("T")
TaskT = TypeVar("TaskT")
ConfigT = TypeVar("ConfigT", bound=TasksetConfig)


async def _close_feed(loop: Any, feed: Any, primary: BaseException | None) -> None:
    """Close an asyncio feed as an asyncio task, shielded. A close error is raised, unless an
    exception is already on its way out: then it is attached to that one as a note."""
    with trio.CancelScope(shield=True):
        try:
            await call_aio(loop, aclose_source, feed)
        except Exception as exc:
            if primary is None:
                raise
            add_note(primary, "while closing the asyncio feed", exc)


async def _asyncio_feed(loop: Any, stream: Callable[[], Any]) -> AsyncGenerator[Any, None]:
    """A trio async generator over an asyncio async iterator: each pull is one asyncio task on
    `loop`, and the feed is closed (as an asyncio task, shielded) exactly once, after the last
    pull has finished, on every exit path."""
    feed = stream()  # an async generator object: none of its code runs yet
    try:
        while True:
            try:
                task = await call_aio(loop, anext, feed)
            except StopAsyncIteration:
                break
            yield task
    except BaseException as exc:  # GeneratorExit (the channel closed), Cancelled, an error
        await _close_feed(loop, feed, exc)
        raise
    await _close_feed(loop, feed, None)


class _TrioView(Taskset[Any, Any]):
    """What `stream_view` reads: the asyncio taskset's views, prompt and a trio stream()."""

    def __init__(self, base: Taskset[Any, Any], loop: Any) -> None:
        self.config = base.config
        self._steps = base._steps
        self._base = base
        self._loop = loop

    def stream(self) -> AsyncIterator[Any]:
        return _asyncio_feed(self._loop, self._base.stream)


class AsyncioTaskset(Taskset[TaskT, ConfigT]):
    """A taskset whose `stream()` is asyncio code (e.g. it awaits an `asyncio.Queue`).

    Everything else is `tt.Taskset`: `load()` (sync), views, the system prompt, `streaming`.
    `channel()` is trio, as always; it pulls `stream()` one task per receive, each pull an
    asyncio task on the innermost running trio-asyncio loop (a bridged env's `serving()` opens
    one), or, with none running, on a loop it opens for the channel's life. Leaving the channel
    closes `stream()` (an asyncio `aclose()`, shielded) after its last pull.

    Each pull runs in its own asyncio task, so a `stream()` must not hold a task-bound construct
    (an `asyncio.timeout()`, a `TaskGroup`) open across a `yield`. Needs trio-asyncio
    (`TrioAsyncioUnavailable` from `channel()` where it cannot import); a static one does not.
    """

    asyncio_loop: ClassVar[LoopKind] = "trio-asyncio"
    """The loop `channel()` opens when no bridged env's `serving()` is running (see
    `BridgedEnv.asyncio_loop`)."""

    def channel(self) -> AbstractAsyncContextManager[trio.abc.ReceiveChannel[TaskT]]:
        """The tasks as a trio channel, pulled from the asyncio `stream()` only on demand."""
        if not self.streaming:
            return super().channel()
        return self._asyncio_channel()

    @asynccontextmanager
    async def _asyncio_channel(self) -> AsyncIterator[trio.abc.ReceiveChannel[TaskT]]:
        loop = bridge_loop.get()
        if loop is None and self.asyncio_loop == "trio-asyncio":
            loop = trio_asyncio_module().current_loop.get()
        if loop is not None:
            async with trio.as_safe_channel(guarded_tasks)(self._bridged(loop)) as tasks:
                yield tasks
            return
        async with (
            open_loop(self.asyncio_loop) as own,
            trio.as_safe_channel(guarded_tasks)(self._bridged(own)) as tasks,
        ):
            yield tasks

    def _bridged(self, loop: Any) -> Callable[[], AsyncIterator[TaskT]]:
        """What opens the asyncio `stream()` on `loop`, views applied, as a trio iterator."""
        return lambda: stream_view(_TrioView(self, loop))


def _feed_view_class() -> Callable[[Any], Taskset[Any, Any]]:
    # Defined in a function on purpose: its qualified name is not importable, so an env with
    # such a taskset is refused by the served path ("run in-process") before any server starts.
    class FeedView(AsyncioTaskset[Any, TasksetConfig]):
        """An asyncio env's taskset that is not a tt.Taskset: an object with an asyncio
        `stream()` (and optionally `load()`, `config`, `INFINITE`)."""

        def __init__(self, feed: Any) -> None:
            config = getattr(feed, "config", None)
            super().__init__(config if isinstance(config, TasksetConfig) else None)
            self._feed = feed
            self.INFINITE = bool(getattr(feed, "INFINITE", False))  # type: ignore[misc]

        @property
        def streaming(self) -> bool:
            return callable(getattr(self._feed, "stream", None))

        def load(self) -> Iterable[Any]:
            load = getattr(self._feed, "load", None)
            return [] if load is None else cast(Iterable[Any], load())

        async def stream(self) -> AsyncIterator[Any]:  # asyncio code
            inner = self._feed.stream()
            try:
                async for task in inner:
                    yield task
            finally:
                await aclose_source(inner)

        def __repr__(self) -> str:
            return f"FeedView({self._feed!r})"

    return FeedView


_FeedView = _feed_view_class()


def as_taskset(obj: object) -> Taskset[Any, Any]:
    if isinstance(obj, Taskset):
        return obj
    if callable(getattr(obj, "stream", None)) or callable(getattr(obj, "load", None)):
        return _FeedView(obj)
    raise ConfigTypeError(
        f"the asyncio env's {{taskset}} must be a tt.Taskset (a tt.aio.AsyncioTaskset for an "
        f"asyncio stream()) or an object with an asyncio stream(), got {type(obj).__name__}",
        parameter="taskset",
    )
