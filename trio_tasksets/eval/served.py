"""The eval's served path: one `EnvClient.run` per slot under the eval's window."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, Protocol

import trio

from ..env import Env, Episode, OnComplete, RunSlot
from ..envspec import EnvSpec, TravelError
from ..models import ModelContext, OpenAIClient
from ..serve.client import EnvClient
from ..serve.errors import EnvServerError
from ..serve.spawn import ServerProcess, spawn_server
from ..serve.wire import API_KEY_VAR, TOKEN_VAR, describe_client, openai_api_key
from ..window import AdaptiveWindow, Window

# === the eval's served path ==================================================================


class SlotRunner(Protocol):
    """Run one slot to its episode, `on_complete` once (as `Env.run_slot`)."""

    def __call__(
        self,
        slot: RunSlot[Any],
        *,
        on_complete: OnComplete | None = None,
    ) -> Awaitable[Episode]: ...


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


def _api_key(ctx: ModelContext) -> str | None:
    return openai_api_key(ctx.client) if isinstance(ctx.client, OpenAIClient) else None


def _base_urls(ctx: ModelContext) -> list[str]:
    """The endpoints a spawned server may reach: the eval's model's (each of many), if any."""
    return list(ctx.client.base_urls) if isinstance(ctx.client, OpenAIClient) else []


@asynccontextmanager
async def served_runner(
    env: Env[Any],
    ctx: ModelContext,
    *,
    workers: int,
    server_url: str | None,
    window: int | Window,
) -> AsyncIterator[SlotRunner]:
    """What an eval runs each slot with on the served path: a spawned child (`server_url`
    None) or a running server, through one pooled `EnvClient` (one `run` per slot), whose
    HTTP connections are bounded by the window (an adaptive one: by its max).

    A spawned child may reach the eval's model endpoint only, with the eval's key
    (``--allow-base-url``, ``--api-key-var TT_SERVE_API_KEY``). A remote server's token is
    read from ``$TT_SERVE_TOKEN``; it must allow the model's endpoint itself and hold the
    key in its own ``$TT_SERVE_API_KEY`` (started with ``--api-key-var TT_SERVE_API_KEY``).
    """
    async with contextlib.AsyncExitStack() as stack:
        server: ServerProcess | None = None
        token: str | None
        if server_url is None:
            server = await stack.enter_async_context(
                spawn_server(
                    env, workers=workers, api_key=_api_key(ctx), allow_base_urls=_base_urls(ctx)
                )
            )
            url, token = server.url, server.token
        else:
            url, token = server_url, os.environ.get(TOKEN_VAR)
        client = await stack.enter_async_context(
            EnvClient(url, token=token, api_key_var=API_KEY_VAR, max_connections=_bound(window))
        )
        if server is None:
            await _check_remote(client, env)

        def run(
            slot: RunSlot[Any],
            *,
            on_complete: OnComplete | None = None,
        ) -> Awaitable[Episode]:
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
    """Before the first slot: the server answers (with this token) and serves our taskset."""
    served = (await client.health()).get("taskset")
    ours = type(env.taskset).__name__
    if served != ours:
        raise EnvServerError(
            f"env server {client.url} serves taskset {served}, but this eval's is {ours}",
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
