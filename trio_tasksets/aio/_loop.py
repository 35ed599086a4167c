"""The asyncio loop a bridged env runs on (trio-asyncio's, a stdlib loop in a thread, or an
asyncio host's), and calls into it from trio."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from contextvars import ContextVar
from typing import Any, Literal, TypeVar, TypeVarTuple, Unpack

import trio

from .._core.exceptions import TrioTasksetsError
from ._host import guest_host_loop, host_loop, thread_loop

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


class AsyncioCancelled(TrioTasksetsError, RuntimeError):
    """An asyncio task of the bridge (a pull, a run, a rollout...) was cancelled, but not by trio.

    The asyncio code cancelled itself (or something outside trio cancelled its task). Raised
    instead of asyncio's `CancelledError`, which must not reach trio as a stray BaseException;
    the original `CancelledError` is its `__cause__`. Used by both directions of the bridge.
    """


class TrioAsyncioUnavailable(TrioTasksetsError, ImportError):
    """trio-asyncio cannot be imported on this Python, so an asyncio env cannot run under trio.

    At present trio-asyncio does not support Python 3.14 (python-trio/trio-asyncio#160), and
    trio-tasksets installs it only on older Pythons. The guest-mode direction of the bridge
    (`tt.aio.run_stream`, `tt.aio.run_trio`) does not need it.
    """


def trio_asyncio_module() -> Any:
    """The trio_asyncio module, or `TrioAsyncioUnavailable` saying why not (imported lazily, so
    that this module, and `tt.aio`'s guest mode, import without it)."""
    try:
        import trio_asyncio
        import trio_asyncio._loop as loop_module
    except Exception as exc:  # ImportError, or an AttributeError from an asyncio API 3.14 dropped
        raise TrioAsyncioUnavailable(
            f"trio_tasksets.aio.bridge_env needs trio-asyncio, which cannot be imported on "
            f"Python {sys.version.split()[0]} ({type(exc).__name__}: {exc}). trio-asyncio does "
            f"not support Python 3.14 yet (python-trio/trio-asyncio#160; trio-tasksets installs "
            f"it only on Python < 3.14). The other direction needs no trio-asyncio: run the "
            f"program under asyncio.run and call tt.aio.run_stream / tt.aio.run_trio from it "
            f"(trio guest mode), with asyncio sources and runs."
        ) from exc
    _keep_asyncio_loops(loop_module)
    _rebind_stale_asyncio_names()
    return trio_asyncio


_STALE_NAMES = ("get_running_loop", "_get_running_loop", "current_task")
_rebound = False


def _rebind_stale_asyncio_names() -> None:
    """Point modules imported before trio-asyncio at its `asyncio.get_running_loop` & co.

    trio-asyncio makes asyncio work inside trio by replacing `asyncio.get_running_loop`,
    `asyncio._get_running_loop` and `asyncio.current_task` on import. A module that ran
    ``from asyncio import get_running_loop`` *before* that import keeps the originals, which
    find no loop inside trio-asyncio's: anyio's asyncio backend does (imported at pytest
    start-up by anyio's plugin, or by any earlier httpx use, e.g. in guest mode), so httpx inside
    a bridged env raised ``RuntimeError: no running event loop``. This rebinds, in every loaded
    module, exactly those names still bound to the original functions (C or pure Python); the
    replacements fall back to the originals outside trio, so nothing changes there. Runs once,
    right after trio-asyncio is imported: modules imported later bind the replacements.
    """
    global _rebound
    if _rebound:
        return
    _rebound = True
    import asyncio.events
    import asyncio.tasks

    sources: list[Any] = [asyncio.events, asyncio.tasks]
    with contextlib.suppress(ImportError):  # the C accelerator (CPython)
        import _asyncio

        sources.append(_asyncio)
    rebind: dict[str, tuple[object, list[object]]] = {}
    for name in _STALE_NAMES:
        current = getattr(asyncio, name)
        originals = [getattr(m, n) for m in sources for n in (name, f"_py_{name}") if hasattr(m, n)]
        rebind[name] = (current, [fn for fn in originals if fn is not current])
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict) or any(module is m for m in sources):
            continue
        for name, (current, originals) in rebind.items():
            bound = namespace.get(name)
            if bound is not None and any(bound is fn for fn in originals):
                namespace[name] = current


def _keep_asyncio_loops(loop_module: Any) -> None:
    """Undo one global side effect of importing trio-asyncio, outside trio only.

    On import, trio-asyncio makes `asyncio.new_event_loop()` (hence `asyncio.run`) build its
    own `SyncTrioEventLoop` in every thread that has not set an event loop policy: a trio run
    in disguise, on which trio guest mode (`tt.aio.run_stream`) cannot start, and on which
    trio-asyncio's own `trio_as_aio` fails too. This pins the policy asyncio had before the
    import, as the default of every thread, for code *outside* trio; inside trio, trio-asyncio
    uses its own policy as before (the bridge is unaffected), and a thread that sets a policy
    keeps it. Relies on trio-asyncio 0.16 internals; a no-op if they are not there.
    """
    faked = getattr(loop_module, "_faked_policy", None)
    original = getattr(loop_module, "_original_policy", None)
    if faked is None or original is None:
        return
    holder = type(faked)  # a threading.local subclass: its class attribute is every default
    if getattr(holder, "policy", None) is None:
        holder.policy = original


# --- calling asyncio from trio ------------------------------------------------------------


def _name(fn: object) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


async def _invoke(fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    # The call itself (not only the await) runs inside the asyncio task, so its sync part sees
    # asyncio (sniffio, current_task). A sync `fn` (e.g. a sync score) is fine too.
    result = fn(*args)
    if inspect.isawaitable(result):
        result = await result
    return result


async def call_aio(loop: Any, fn: Callable[[Unpack[Ts]], Any], *args: *Ts) -> Any:
    """From trio: run `fn(*args)` (awaited if awaitable) as an asyncio task on `loop`.

    Returns its result or raises its exception unwrapped. Trio cancellation cancels the asyncio
    task and waits for it to finish, then raises `trio.Cancelled` (or the real error the task
    raised while unwinding). A `CancelledError` trio did not request raises `AsyncioCancelled`.
    """
    try:
        return await loop.run_aio_coroutine(_invoke(fn, args))
    except asyncio.CancelledError as exc:
        # trio-asyncio turns a cancellation *trio* asked for into trio.Cancelled; a
        # CancelledError that still arrives here came from the asyncio side.
        raise AsyncioCancelled(
            f"the asyncio task running {_name(fn)} was cancelled from the asyncio side, not "
            "by trio (did the asyncio code cancel itself?)"
        ) from exc


def add_note(error: BaseException, when: str, extra: BaseException) -> None:
    error.add_note(f"trio_tasksets: {when}, {type(extra).__name__} was also raised: {extra}")


def _leaf_ids(exc: BaseException) -> list[int]:
    if isinstance(exc, BaseExceptionGroup):
        return [i for inner in exc.exceptions for i in _leaf_ids(inner)]
    return [id(exc)]


def _same(exc: BaseException, known: BaseException) -> bool:
    """`exc` is `known`, or a copy of the group `known` that a nursery derived while splitting
    `trio.Cancelled` out of its errors (same type, message and leaf exceptions)."""
    if exc is known:
        return True
    return (
        isinstance(exc, BaseExceptionGroup)
        and type(exc) is type(known)
        and isinstance(known, BaseExceptionGroup)
        and exc.message == known.message
        and _leaf_ids(exc) == _leaf_ids(known)
    )


def unwrap(group: BaseExceptionGroup[BaseException], *known: BaseException | None) -> BaseException:
    """The one exception a group of the bridge's own layers stands for.

    `known` are exceptions raised by user code the layers wrapped (the block's first): they are
    kept whole, and returned as the original objects, even when they are groups themselves (an
    asyncio TaskGroup's) that a nursery re-derived; every other group is a layer and is
    flattened. KeyboardInterrupt wins; then the first known real
    (non-Cancelled) error; then any real error; else a Cancelled (the block's, if it raised
    one). The other real errors are attached to the chosen one as notes.
    """
    keep = [exc for exc in known if exc is not None]
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        original = next((k for k in keep if _same(exc, k)), None)
        if original is not None:
            leaves.append(original)
        elif not isinstance(exc, BaseExceptionGroup):
            leaves.append(exc)
        else:
            for inner in exc.exceptions:
                walk(inner)

    walk(group)
    real = [exc for exc in leaves if not isinstance(exc, trio.Cancelled)]
    interrupts = [exc for exc in real if isinstance(exc, KeyboardInterrupt)]
    if interrupts:
        return interrupts[0]
    if not real:
        return next((exc for exc in keep if any(exc is leaf for leaf in leaves)), leaves[0])
    ordered = [k for k in keep if any(k is r for r in real)] + real
    chosen = ordered[0]
    for other in real:
        if other is not chosen:
            add_note(chosen, "while the asyncio bridge unwound", other)
    return chosen


LoopKind = Literal["trio-asyncio", "thread"]
bridge_loop: ContextVar[Any] = ContextVar("trio_tasksets_bridge_loop", default=None)


@asynccontextmanager
async def open_loop(kind: LoopKind = "trio-asyncio") -> AsyncIterator[Any]:
    """`trio_asyncio.open_loop()`, with the ExceptionGroup layers it adds removed: what the
    block raised comes out itself (python-trio/trio-asyncio#146). Inside trio guest mode (an
    asyncio host, e.g. `tt.aio.run_eval`), the host's own loop instead; with `kind="thread"`,
    a stdlib loop in a thread of its own (`trio_tasksets.aio._host`)."""
    host = guest_host_loop()
    opened: AbstractAsyncContextManager[Any]
    if host is not None:
        opened = host_loop(host)
    elif kind == "thread":
        opened = thread_loop()
    else:
        opened = trio_asyncio_module().open_loop()
    body: BaseException | None = None
    chosen: BaseException | None = None
    try:
        async with opened as loop:
            try:
                yield loop
            except BaseException as exc:
                body = exc
                raise
    except BaseExceptionGroup as group:
        chosen = unwrap(group, body)
    # Raised outside the handler, so no exception of the user gets a new __context__.
    if chosen is not None:
        raise chosen
