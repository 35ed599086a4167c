"""The eval's served path: one `EnvClient.run` per slot under the eval's window.

`ServedBackend` is the eval's `SlotBackend` for it: ``EvalConfig(backend=ServedBackend(
workers=K))`` (``EvalConfig(serve=True, workers=K)`` is its shorthand) spawns a server for
the eval; ``ServedBackend(server_url=URL, token=T)`` uses a running one.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import attrs
import trio

from .._core.adaptive import AdaptiveWindow
from .._core.exceptions import EvalConfigError
from .._core.window import Window
from .._env.backend import SlotRunner
from .._env.env import Env, Episode, OnComplete, RunSlot
from .._env.spec import EnvSpec, TravelError
from .._models import ModelContext, describe
from .._monitor.dashboard import Progress
from .client import EnvClient
from .errors import EnvServerError
from .spawn import ServerProcess, spawn_server
from .wire import API_KEY_VAR, describe_client

__all__ = ["ServedBackend", "SlotRunner", "check_travel", "served_runner"]


def check_travel(env: Env[Any], ctx: ModelContext, *, spawn: bool) -> None:
    """`TravelError` if the env (when spawning a server for it) or the model context cannot
    go to an env server."""
    if spawn:
        EnvSpec.of(env)
    describe_client(ctx.client, api_key_var=API_KEY_VAR)
    if getattr(ctx.client, "limits", None) is not None:
        raise TravelError(
            "the model client's limits (max connections, rpm, tpm) apply in the process "
            "that makes the model calls, the env server's, and cannot travel to it: drop "
            "them, or run in-process"
        )


def _check_workers(instance: object, attribute: attrs.Attribute[int], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EvalConfigError(
            f"{{workers}} must be an integer >= 1, got {value!r}", parameter="workers"
        )


def _check_server_url(
    instance: object, attribute: attrs.Attribute[str | None], value: object
) -> None:
    if value is None:
        return
    if not isinstance(value, str) or not value.startswith(("http://", "https://")):
        raise EvalConfigError(
            f"{{server_url}} must be an http:// or https:// URL, got {value!r}",
            parameter="server_url",
        )


def _check_token(instance: object, attribute: attrs.Attribute[str | None], value: object) -> None:
    if value is not None and not isinstance(value, str):
        raise EvalConfigError(
            f"{{token}} must be the server's bearer token (a str), got {type(value).__name__}",
            parameter="token",
        )


@attrs.frozen
class ServedBackend:
    """Each slot on an env server: one `EnvClient.run` per slot, the taskset and the rows in
    the eval's process.

    `server_url` None spawns `trio-tasksets serve` as a child for the eval (`workers` server
    processes; it dies with the eval), which may reach the eval's model endpoint only, with
    its key. A `server_url` is a running server, reached with its bearer `token`; it must
    serve the eval's taskset (checked before the first slot). The `EnvClient`'s connections
    are bounded by the eval's window (an adaptive one: by its max).

    Built, it is valid: a bad value raises `EvalConfigError` naming it (``workers`` below 1,
    a `server_url` that is no http(s) URL, ``workers`` other than 1 with a `server_url`).
    """

    server_url: str | None = attrs.field(default=None, validator=_check_server_url)
    workers: int = attrs.field(default=1, validator=_check_workers)
    token: str | None = attrs.field(default=None, repr=False, validator=_check_token)

    def __attrs_post_init__(self) -> None:
        if self.server_url is not None and self.workers != 1:
            raise EvalConfigError(
                "{workers} applies to a server spawned with {serve}, not to {server_url}",
                parameter=("workers", "serve", "server_url"),
            )

    @property
    def remote(self) -> bool:
        return True

    @property
    def spawn(self) -> bool:
        """Whether the eval spawns its own server (no `server_url`)."""
        return self.server_url is None

    @property
    def settings(self) -> dict[str, object]:
        """What config.json records (the token never)."""
        return {"serve": self.spawn, "workers": self.workers, "server_url": self.server_url}

    @property
    def parameter(self) -> str:
        """The setting that chose it: ``serve`` (a spawned server) or ``server_url``."""
        return "serve" if self.spawn else "server_url"

    @property
    def uses_env(self) -> bool:
        """A spawned server runs the eval's env (its spec travels); a running one its own."""
        return self.spawn

    @property
    def uses_client(self) -> bool:
        """The eval's model client is described to the server, which calls the model with it."""
        return True

    def check(self, env: Env[Any], ctx: ModelContext) -> None:
        """Raises `EvalConfigError` naming ``serve`` (or ``server_url``) when the env (for a
        spawned server) or the model client cannot travel to a server."""
        try:
            check_travel(env, ctx, spawn=self.spawn)
        except TravelError as exc:
            name = self.parameter
            raise EvalConfigError(f"{{{name}}}: {exc}", parameter=name) from None

    async def reach(self) -> ServedBackend:
        return self

    def open(
        self, env: Env[Any], ctx: ModelContext, *, window: Window, progress: Progress
    ) -> AbstractAsyncContextManager[SlotRunner]:
        return served_runner(
            env, ctx, workers=self.workers, server_url=self.server_url, window=window,
            token=self.token,
        )  # fmt: skip


def _api_key(ctx: ModelContext) -> str | None:
    return describe(ctx.client).api_key


def _base_urls(ctx: ModelContext) -> list[str]:
    """The endpoints a spawned server may reach: the eval's model's (each of many), if any."""
    return list(describe(ctx.client).endpoints)


@asynccontextmanager
async def served_runner(
    env: Env[Any],
    ctx: ModelContext,
    *,
    workers: int,
    server_url: str | None,
    window: int | Window,
    token: str | None = None,
) -> AsyncIterator[SlotRunner]:
    """What an eval runs each slot with on the served path: a spawned child (`server_url`
    None) or a running server, through one pooled `EnvClient` (one `run` per slot), whose
    HTTP connections are bounded by the window (an adaptive one: by its max).

    A spawned child may reach the eval's model endpoint only, with the eval's key
    (``--allow-base-url``, ``--api-key-var TT_SERVE_API_KEY``). A running server is reached
    with its bearer `token` (a field of the backend: the CLI reads it from ``$TT_SERVE_TOKEN``
    or ``--token-var``, this module never reads the environment); it must allow the model's
    endpoint itself and hold the key in its own ``$TT_SERVE_API_KEY`` (started with
    ``--api-key-var TT_SERVE_API_KEY``).
    """
    async with contextlib.AsyncExitStack() as stack:
        server: ServerProcess | None = None
        if server_url is None:
            server = await stack.enter_async_context(
                spawn_server(
                    env, workers=workers, api_key=_api_key(ctx), allow_base_urls=_base_urls(ctx)
                )
            )
            url, token = server.url, server.token
        else:
            url = server_url
        client = await stack.enter_async_context(
            EnvClient(url, token=token, api_key_var=API_KEY_VAR, max_connections=_bound(window))
        )
        if server is None:
            await _check_remote(client, env)

        limits = env.rollout_limits if env.rollout_limits.to_json() else None

        def run(
            slot: RunSlot[Any],
            *,
            on_complete: OnComplete | None = None,
        ) -> Awaitable[Episode]:
            if slot.limits is None:
                slot.limits = limits  # the eval's own, carried whole to the server
            return client.run_slot(slot, ctx, on_complete=on_complete, retries=env.retries)

        try:
            yield run
        except BaseException as exc:
            errors = _server_errors(exc)
            if server is not None and errors:
                await _tell_exit(errors, server)
            raise


def _bound(window: int | Window) -> int | None:
    """The most runs a window may ever let through at once (None: a Window may grow)."""
    if isinstance(window, AdaptiveWindow):
        return window.max
    return None if isinstance(window, Window) else window


async def _check_remote(client: EnvClient, env: Env[Any]) -> None:
    """Before the first slot: the server answers (with this token), serves our taskset, and
    makes the sandbox this eval asks for (`--sandbox`: never run without the box)."""
    health = await client.health()
    served = health.get("taskset")
    ours = type(env.taskset).__name__
    if served != ours:
        raise EnvServerError(
            f"env server {client.url} serves taskset {served}, but this eval's is {ours}",
            url=client.url,
        )
    asked = getattr(env.sandboxes.spec, "text", None) if env.sandboxes is not None else None
    if asked is not None and health.get("sandbox") != asked:
        has = health.get("sandbox") or "no sandbox"
        raise EnvServerError(
            f"this eval asks for --sandbox {asked}, but env server {client.url} runs with "
            f"{has}: start the server with --sandbox {asked}",
            url=client.url,
        )


def _server_errors(exc: BaseException) -> list[EnvServerError]:
    """The `EnvServerError`s in `exc` (itself, or the leaves of a group)."""
    if isinstance(exc, EnvServerError):
        return [exc]
    if isinstance(exc, BaseExceptionGroup):
        return [e for leaf in exc.exceptions for e in _server_errors(leaf)]
    return []


async def _tell_exit(errors: list[EnvServerError], server: ServerProcess) -> None:
    """Add how the child ended (if it did: give it a moment to be reaped) to each message."""
    with trio.CancelScope(shield=True), trio.move_on_after(1.0):
        await server.process.wait()
    if server.process.returncode is not None:
        for error in errors:
            error.args = (f"{error}; {server.describe_exit()}",)
