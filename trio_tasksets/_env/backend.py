"""Where an eval's slots run: the `SlotBackend` seam.

An eval plans its slots, windows them and records their rows in its own process; where each
slot *runs* is one object, chosen once before any work:

* `InProcess()` (the default): `env.run_slot` in this process, under `env.serving()`;
* `trio_tasksets._serve.ServedBackend` (``serve=True``, ``workers``, ``server_url``; the CLI's
  ``--serve``, ``--workers``, ``--server-url``): one `EnvClient.run` per slot, on an env
  server spawned as a child or already running;
* `trio_tasksets.redis.ViaBackend` (``via``, ``stream``; ``--via``, ``--stream``): one entry
  of a Redis stream per slot, run by workers anywhere.

Each implementation lives in the room of its transport; the eval imports none of them. Like
anyio, which finds its trio backend by name (``anyio._backends._trio``) only when a run asks
for it, `backend_for` imports a transport's module only when the settings name it, so an eval
in process never loads the served path or hiredis. A backend of one's own (any object with
this protocol) goes in ``EvalConfig(backend=...)``.

With ``group=True`` an eval runs each group (a task's ``-r`` rollouts, run and scored as one unit) in this process
through `run_group`, each rollout one slot of the runner; a runner that is also a
`GroupRunner` (``--via``: one entry per group, run by one worker) runs the whole group where
its slots run instead.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Protocol, runtime_checkable

import attrs

from .._core.exceptions import EvalConfigError
from .._core.window import Window
from .._models import ModelContext
from .._monitor.dashboard import Progress
from .env import Env, Episode, OnComplete, RunSlot
from .groups import Group

__all__ = ["GroupRunner", "InProcess", "SlotBackend", "SlotRunner", "Track", "backend_for"]


class SlotRunner(Protocol):
    """Run one slot to its episode, `on_complete` once (as `Env.run_slot`)."""

    def __call__(
        self,
        slot: RunSlot[Any],
        *,
        on_complete: OnComplete | None = None,
    ) -> Awaitable[Episode]: ...


Track = Callable[[RunSlot[Any], Callable[[], Awaitable[Episode]]], Awaitable[Episode]]
"""`track(slot, wait)`: the eval's bookkeeping around one rollout of a group that runs
elsewhere (the dashboard, the health probe, the adaptive window), returning `await wait()`."""


@runtime_checkable
class GroupRunner(SlotRunner, Protocol):
    """A `SlotRunner` that also runs a whole group where its slots run (``--via``: one
    entry, run by one worker, scored where it ran).

    `run_group(group, track)` returns one episode per slot of `group`, in slot order, each
    with `group` set and scored by the env's `score_group` where they ran; every rollout
    holds a place of the eval's window while the group is out (`fan_out`: ``-c`` counts
    live rollouts), each waiting through `track(slot, wait)`. It tells `group.opened` (the
    eval's open groups) as each rollout starts and when the group ends. A failure of the
    transport (not a failed rollout: that is a row with `ok=False`) is raised.
    """

    def run_group(self, group: Group, track: Track) -> Awaitable[list[Episode]]: ...


@runtime_checkable
class SlotBackend(Protocol):
    """Where an eval's slots run (see the module docstring).

    The eval calls, in this order: `check` (no I/O: `EvalConfigError` for what cannot work,
    before anything is pulled or written), `reach` (may connect; `EvalConfigError` if the
    place cannot be reached, before any file is written; it returns the backend to open,
    e.g. one that knows the server's identity), then `open` once, whose runner runs every
    slot. `remote` is True when the model calls are made in another process: an adaptive
    window then hears their 429s, 5xx and timeouts through the episodes' errors.
    """

    @property
    def remote(self) -> bool: ...

    def check(self, env: Env[Any], ctx: ModelContext) -> None: ...

    async def reach(self) -> SlotBackend: ...

    def open(
        self, env: Env[Any], ctx: ModelContext, *, window: Window, progress: Progress
    ) -> AbstractAsyncContextManager[SlotRunner]: ...


@attrs.frozen
class InProcess:
    """Every slot in this process: `env.run_slot`, under `env.serving()` for the eval."""

    @property
    def remote(self) -> bool:
        return False

    def check(self, env: Env[Any], ctx: ModelContext) -> None:
        pass

    async def reach(self) -> InProcess:
        return self

    def open(
        self, env: Env[Any], ctx: ModelContext, *, window: Window, progress: Progress
    ) -> AbstractAsyncContextManager[SlotRunner]:
        return _in_process(env, ctx)


@asynccontextmanager
async def _in_process(env: Env[Any], ctx: ModelContext) -> AsyncIterator[SlotRunner]:
    async with env.serving():
        yield functools.partial(env.run_slot, ctx=ctx)


# The transports' backends, by the module that holds each (imported when first named).
BACKENDS = {
    "served": ("trio_tasksets._serve.slots", "ServedBackend"),
    "via": ("trio_tasksets.redis._coordinator", "ViaBackend"),
}


def _backend_class(name: str, *, needs: str, parameter: str) -> Any:
    module, attribute = BACKENDS[name]
    try:
        return getattr(importlib.import_module(module), attribute)
    except ImportError as exc:
        raise EvalConfigError(f"{needs} ({exc})", parameter=parameter) from None


def backend_for(
    *,
    serve: bool = False,
    workers: int = 1,
    server_url: str | None = None,
    server_token: str | None = None,
    via: str | None = None,
    stream: str | None = None,
) -> SlotBackend:
    """The one backend that `EvalConfig`'s flat settings name; `EvalConfigError` (naming the
    parameter) when they contradict each other or a value is bad."""
    if via is not None:
        if serve or server_url is not None:
            other = "serve" if serve else "server_url"
            raise EvalConfigError(
                f"{{via}} and {{{other}}}: choose one (workers over Redis, or a server)",
                parameter=("via", other),
            )
        if workers != 1:
            raise EvalConfigError(
                "{workers} applies to a server spawned with {serve}, not to {via}",
                parameter=("workers", "serve", "via"),
            )
        needs = "{via} needs hiredis: pip install 'trio-tasksets[redis]'"
        cls = _backend_class("via", needs=needs, parameter="via")
        return cls(via) if stream is None else cls(via, stream=stream)  # type: ignore[no-any-return]
    if stream is not None:
        raise EvalConfigError(
            "{stream} names the workers' stream: it needs {via}", parameter=("stream", "via")
        )
    if serve or server_url is not None:
        if serve and server_url is not None:
            raise EvalConfigError(
                "{serve} and {server_url}: choose one (spawn a server, or use one)",
                parameter=("serve", "server_url"),
            )
        name = "serve" if serve else "server_url"
        needs = f"{{{name}}}: the served path cannot be imported"
        cls = _backend_class("served", needs=needs, parameter=name)
        return cls(server_url=server_url, workers=workers, token=server_token)  # type: ignore[no-any-return]
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise EvalConfigError(
            f"{{workers}} must be an integer >= 1, got {workers!r}", parameter="workers"
        )
    if workers != 1:
        raise EvalConfigError(
            "{workers} applies to a spawned server: add {serve}", parameter=("workers", "serve")
        )
    return InProcess()
