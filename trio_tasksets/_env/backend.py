"""Where an eval's slots run: the `SlotBackend` seam.

An eval plans its slots, windows them and records their rows in its own process; where each
slot *runs* is one object, ``EvalConfig.backend``:

* `InProcess()` (the default): `env.run_slot` in this process, under `env.serving()`;
* `trio_tasksets._serve.ServedBackend(workers=K)` (``EvalConfig(serve=True, workers=K)`` is
  its shorthand), or ``ServedBackend(server_url=URL, token=T)``: one `EnvClient.run` per
  slot, on an env server spawned as a child or already running;
* `trio_tasksets.redis.ViaBackend(url, stream=S)`: one entry of a Redis stream per slot, run
  by workers anywhere.

Each implementation lives in the room of its transport; the eval imports none of them. Like
anyio, which finds its trio backend by name (``anyio._backends._trio``) only when a run asks
for it, `served_backend` imports the served path only when ``serve=True`` names it. A
backend of one's own (any object with the `SlotBackend` protocol) goes in
``EvalConfig(backend=...)``; the built-in ones also describe themselves
(`DescribedBackend`): what config.json records of them, and what goes where their slots run.

With ``group=True`` an eval runs each group (a task's rollouts) in this process through
`run_group`, each rollout one slot of the runner; a runner that is also a `GroupRunner`
(``ViaBackend``: one entry per group, run by one worker) runs the whole group where its
slots run instead.
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

__all__ = [
    "DescribedBackend",
    "GroupRunner",
    "InProcess",
    "SlotBackend",
    "SlotRunner",
    "Track",
    "served_backend",
]


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
    """A `SlotRunner` that also runs a whole group where its slots run (`ViaBackend`: one
    entry, run by one worker).

    `run_group(group, track)` returns one episode per slot of `group`, in slot order, each
    with `group` set and scored by the env's `score_group` where they ran; every rollout
    holds a place of the eval's window while the group is out (`fan_out`: the window counts
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


@runtime_checkable
class DescribedBackend(SlotBackend, Protocol):
    """A `SlotBackend` that says what it is (the built-in ones do): what an eval records of
    it and what the command line asks of it, instead of its own arguments.

    * `settings`: how config.json records where the slots ran (e.g. ``{"serve": True,
      "workers": 4, "server_url": None}``): the keys of the settings that name it;
    * `parameter`: the setting that chose it (``serve``, ``server_url``, ``via``), which a
      message about it names; None in process;
    * `uses_env`: the slots run with the eval's own env (here, or a copy sent where they
      run): its reward and per-rollout limits apply. False where the place has its own (a
      running server's, the workers');
    * `uses_client`: the model calls are made with the eval's own model client (here, or
      described to where they run). False where the place calls the model with its own
      endpoint and key (the workers).
    """

    @property
    def settings(self) -> dict[str, object]: ...

    @property
    def parameter(self) -> str | None: ...

    @property
    def uses_env(self) -> bool: ...

    @property
    def uses_client(self) -> bool: ...


@attrs.frozen
class InProcess:
    """Every slot in this process: `env.run_slot`, under `env.serving()` for the eval."""

    @property
    def remote(self) -> bool:
        return False

    @property
    def settings(self) -> dict[str, object]:
        return {}

    @property
    def parameter(self) -> None:
        return None

    @property
    def uses_env(self) -> bool:
        return True

    @property
    def uses_client(self) -> bool:
        return True

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


# The served path's backend, by the module that holds it (imported when first named).
SERVED = ("trio_tasksets._serve.slots", "ServedBackend")


def served_backend(*, workers: int = 1) -> SlotBackend:
    """The backend ``EvalConfig(serve=True, workers=K)`` names: `ServedBackend(workers=K)`,
    a server spawned as the eval's child, found by name here (the one place that does).

    Raises:
        EvalConfigError: naming ``serve`` if the served path cannot be imported, or
            ``workers`` (as `ServedBackend` does) for a bad number of workers.
    """
    module, attribute = SERVED
    try:
        cls = getattr(importlib.import_module(module), attribute)
    except ImportError as exc:
        raise EvalConfigError(
            f"{{serve}}: the served path cannot be imported ({exc})", parameter="serve"
        ) from None
    backend: SlotBackend = cls(workers=workers)
    return backend
