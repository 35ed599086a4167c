"""The served path: an env in its own process(es) behind HTTP, and the client that drives it.

* **Server** (`trio-tasksets serve TASKSET`): an ASGI app on hypercorn's trio worker with
  ``GET /health``, ``POST /run`` (one slot, its episode row back) and the WebSocket ``/ws``
  (many runs multiplexed, answered by id; `_WSSession`). `env.serving()` is held for the
  server's life. ``--workers K`` runs K worker processes that share one listening socket,
  bound once by a supervisor process (see `docs/serve.md`).
* **Cancellation**: on ``/ws`` by a ``{"op": "cancel", "id": ...}`` item (a closed WebSocket
  cancels all its runs); on ``POST /run`` by disconnect: the handler races the episode
  against the ASGI ``receive()`` that returns ``http.disconnect``.
* **Client** (`EnvClient`): `run(slot, ctx) -> Episode` over a few pooled WebSockets (or
  ``POST /run`` with ``transport="http"``), `health()`; a server that cannot be reached or
  answers with an error raises `EnvServerError` naming its URL.
* **Spawning** (`spawn_server`): the eval's ``--serve`` starts the server as a child process on
  127.0.0.1, port 0, with a random bearer token; the child dies with its parent, also when the
  parent is SIGKILLed, through a death pipe: the parent holds the write end of the child's
  stdin, and EOF there stops the child (and a pool's supervisor does the same to its workers).
  Not ``PR_SET_PDEATHSIG``: it fires when the parent *thread* exits, and trio spawns from a
  worker thread that retires when idle, which would stop a healthy child.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import inspect
import ipaddress
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, ClassVar, Protocol, Self
from urllib.parse import urlsplit

import attrs
import orjson
import outcome
import trio

from .env import Env, Episode, RetryPolicy, RunSlot
from .models import ModelClient, ModelContext, OpenAIClient
from .runner import pick_one
from .tasksets import Taskset
from .wire import (
    API_KEY_VAR,
    ClientSpec,
    EnvSpec,
    RunRequestEncoder,
    TravelError,
    WireError,
    build_client,
    build_task,
    describe_client,
    openai_api_key,
    parse_run_request,
    quick_slot,
)

if TYPE_CHECKING:
    import httpcore  # imported where used: it imports anyio, which `import trio_tasksets` should not

__all__ = [
    "TOKEN_VAR",
    "EnvClient",
    "EnvServerError",
    "ServeUsageError",
    "ServerApp",
    "ServerProcess",
    "ServerStats",
    "SlotRunner",
    "TravelError",
    "add_serve_command",
    "check_travel",
    "serve_main",
    "served_runner",
    "spawn_server",
]

TOKEN_VAR = "TT_SERVE_TOKEN"
"""The environment variable a spawned server reads its bearer token from, and the one an
eval with ``--server-url`` reads the remote server's token from."""

MAX_BODY_BYTES = 1 << 20
READY_PREFIX = "serving on "
_JSON = [(b"content-type", b"application/json")]

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class EnvServerError(Exception):
    """The env server could not be reached, went away, or refused a request.

    `url` is the server's; `status` the HTTP status it answered with (None when there was no
    answer: refused, reset, closed mid-request). An eval retries it only when its
    `RetryPolicy.include` names it (``--retry-on EnvServerError``), see `EnvClient.run_slot`.
    """

    def __init__(self, message: str, *, url: str, status: int | None = None) -> None:
        super().__init__(message)
        self.url = url
        self.status = status

    @property
    def retryable(self) -> bool:
        """No answer, or a 5xx: another attempt may succeed. A 4xx will not."""
        return self.status is None or self.status >= 500


# === the server ==============================================================================


class _Disconnected(Exception):
    """The client went away before its request was read: there is no one to answer."""


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, headers: list[tuple[bytes, bytes]]) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers


def _reject(status: int, message: str, *headers: tuple[bytes, bytes]) -> _HTTPError:
    return _HTTPError(status, message, list(headers))


@attrs.define
class ServerStats:
    """A worker's counters, as ``GET /health`` reports them."""

    running: int = 0  # episodes in progress
    served: int = 0  # episodes answered
    cancelled: int = 0  # episodes cancelled (the client went away, or shutdown)
    failed: int = 0  # requests the env failed outside an episode (500)
    rejected: int = 0  # bad requests (4xx)


async def _send_json(send: Send, status: int, payload: object, headers: list[Any]) -> None:
    body = json.dumps(payload, ensure_ascii=False, default=str).encode()
    length = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status,
                "headers": [*_JSON, *length, *headers]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    """Wait for the client to go away (ASGI ``http.disconnect``); then cancel `scope`."""
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


class ServerApp:
    """The ASGI app of one worker: ``GET /health`` and ``POST /run`` over one env.

    Contract: with a `token`, every request without ``Authorization: Bearer <token>`` gets 401
    (health too). A body over `max_body` bytes gets 413, one that is not JSON 400, one that
    does not match the wire format 422 naming the field; an unknown path 404, a wrong method
    405. Each is answered and the server goes on serving. An episode whose client disconnects
    is cancelled (counted in `stats.cancelled`).
    """

    ROUTES: ClassVar[dict[str, str]] = {"/health": "GET", "/run": "POST"}

    def __init__(
        self,
        env: Env[Any],
        *,
        token: str | None = None,
        max_body: int = MAX_BODY_BYTES,
        workers: int = 1,
    ) -> None:
        self.env = env
        self.stats = ServerStats()
        self._token = f"Bearer {token}".encode() if token else None
        self.max_body = self._max_body = max_body
        self._workers = workers
        self.taskset_cls: type[Taskset[Any, Any]] = type(env.taskset)
        self.plain_tasks = getattr(self.taskset_cls, "task_from_data", None) is None
        self._clients: dict[ClientSpec, ModelClient] = {}

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
        elif scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
        elif scope["type"] == "http":
            try:
                await self._route(scope, receive, send)
            except _Disconnected:
                pass
            except _HTTPError as error:
                self.stats.rejected += 1
                await _send_json(send, error.status, {"error": str(error)}, error.headers)
            except Exception as exc:  # the env failed outside an episode: a bug in it
                cause = pick_one(exc) if isinstance(exc, ExceptionGroup) else exc
                traceback.print_exception(cause, file=sys.stderr)
                message = f"the env failed outside an episode: {type(cause).__name__}: {cause}"
                await _send_json(send, 500, {"error": message}, [])

    async def aclose(self) -> None:
        """Close the model clients the server made (shielded)."""
        with trio.CancelScope(shield=True):
            for client in self._clients.values():
                await client.aclose()
            self._clients.clear()

    def health(self) -> dict[str, Any]:
        return {"ok": True, "pid": os.getpid(), "workers": self._workers,
                "taskset": self.taskset_cls.__name__, "websocket": WS_PATH,
                "max_body": self._max_body, **attrs.asdict(self.stats)}  # fmt: skip

    async def _route(self, scope: Message, receive: Receive, send: Send) -> None:
        self._authorize(scope)
        path, method = scope["path"], scope["method"]
        if path not in self.ROUTES:
            raise _reject(404, f"no such path {path!r} (the paths are /health and /run)")
        allowed = self.ROUTES[path]
        if method != allowed:
            raise _reject(
                405, f"{path} takes {allowed}, not {method}", (b"allow", allowed.encode())
            )
        if path == "/health":
            await _send_json(send, 200, self.health(), [])
        else:
            await self._run(scope, receive, send)

    def _authorize(self, scope: Message) -> None:
        if self._token is None:
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self._token):
            reason = "wrong bearer token" if given else "missing Authorization: Bearer token"
            raise _reject(401, reason, (b"www-authenticate", b"Bearer"))

    async def _body(self, scope: Message, receive: Receive) -> bytes:
        limit = self._max_body
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise _reject(413, f"request body of {int(length)} bytes is over the {limit} limit")
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _reject(413, f"request body is over the {limit} byte limit")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _client(self, spec: ClientSpec) -> ModelClient:
        client = self._clients.get(spec)
        if client is None:
            client = self._clients[spec] = build_client(spec)
        return client

    def prepare(self, decoded: object) -> tuple[RunSlot[Any], ModelContext]:
        """The slot and model context of a decoded run request; `WireError` naming the field."""
        request = parse_run_request(decoded, plain_tasks=self.plain_tasks)
        task = build_task(self.taskset_cls, request.key, request.data)
        client = self._client(request.client)
        slot: RunSlot[Any] = RunSlot(task, request.rollout)
        return slot, ModelContext(client, request.model, request.sampling)

    async def _run(self, scope: Message, receive: Receive, send: Send) -> None:
        body = await self._body(scope, receive)
        try:
            decoded = json.loads(body)
        except ValueError as exc:
            raise _reject(400, f"the body is not JSON: {exc}") from None
        try:
            slot, ctx = self.prepare(decoded)
        except WireError as exc:
            raise _reject(422, str(exc)) from None
        episode = await self.episode(slot, ctx, receive)
        if episode is not None:
            await _send_json(send, 200, episode.to_row(), [])

    async def episode(
        self, slot: RunSlot[Any], ctx: ModelContext, receive: Receive | None = None
    ) -> Episode | None:
        """Run the slot (with `receive`: unless the HTTP client disconnects first, then None);
        counted. A cancellation from outside is counted and propagates."""
        episode: Episode | None = None
        stats = self.stats
        stats.running += 1
        try:
            if receive is None:
                episode = await self.env.run_slot(slot, ctx)
            else:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
                    episode = await self.env.run_slot(slot, ctx)
                    nursery.cancel_scope.cancel()
        except Exception:
            stats.failed += 1
            raise
        except BaseException:
            stats.cancelled += 1
            raise
        finally:
            stats.running -= 1
        if episode is None:
            stats.cancelled += 1
        else:
            stats.served += 1
        return episode

    async def _websocket(self, scope: Message, receive: Receive, send: Send) -> None:
        """``/ws``: many runs multiplexed over one WebSocket (see `_WSSession`)."""
        if (await receive())["type"] != "websocket.connect":
            return
        try:
            self._authorize(scope)
            if scope["path"] != WS_PATH:
                raise _reject(404, f"no WebSocket at {scope['path']!r} (it is at {WS_PATH})")
        except _HTTPError as error:  # refused at the handshake, as an HTTP answer
            self.stats.rejected += 1
            body = json.dumps({"error": str(error)}).encode()
            headers = [*_JSON, (b"content-length", str(len(body)).encode()), *error.headers]
            await send({"type": "websocket.http.response.start", "status": error.status,
                        "headers": headers})  # fmt: skip
            await send({"type": "websocket.http.response.body", "body": body})
            return
        await send({"type": "websocket.accept",
                    "headers": [(b"x-tt-pid", str(os.getpid()).encode())]})  # fmt: skip
        await _WSSession(self, send).serve(receive)


WS_PATH = "/ws"
# Items per outgoing message, at most. Small enough that a window's runs go as several
# messages, so the client and the server work at the same time (a pipeline) rather than in
# turns on one message each; large enough to pay a message's fixed cost once per many runs.
WS_MAX_BATCH = 16
_ID_MAX = 128
_ITEM_FIELDS = frozenset({"op", "id", "body"})
_MAX_CONTEXTS = 64  # model contexts a connection keeps parsed (more are parsed each time)


class _Unreadable(Exception):
    """A WebSocket message the server cannot answer item by item: it closes with 1007."""


async def _coalesce(pending: list[Any], limit: int) -> None:
    """Yield to the scheduler while `pending` keeps growing (until it holds `limit`): what the
    tasks that are runnable now add goes into the same message. Bounded: one tick that adds
    nothing ends it, so a busy process still flushes."""
    count = -1
    while count != len(pending) and len(pending) < limit:
        count = len(pending)
        await trio.lowlevel.cancel_shielded_checkpoint()


class _WSSession:
    """One WebSocket connection of `ServerApp`: each message is a JSON item or an array of
    items, ``{"op": "run", "id": ID, "body": <a POST /run body>}`` or
    ``{"op": "cancel", "id": ID}``; each run is answered by ``{"id": ID, "status": 200,
    "row": <episode row>}`` or ``{"id": ID, "status": 4xx/500, "error": "..."}``, several
    answers per message (an array). A cancelled run is answered ``{"id": ID, "status": 499,
    "error": "cancelled"}``. A message that is not JSON, or an item without a usable id,
    closes the connection with 1007 (its runs are cancelled); an oversize message 1009
    (hypercorn). Disconnecting cancels the connection's runs."""

    def __init__(self, app: ServerApp, send: Send) -> None:
        self.app = app
        self.send = send
        self.running: dict[int | str, trio.CancelScope] = {}
        self.out: list[bytes] = []
        self.wake = trio.Event()
        self.contexts: dict[bytes, ModelContext] = {}  # by the JSON of a request's `ctx`

    async def serve(self, receive: Receive) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._flush)
            while True:
                message = await receive()
                if message["type"] != "websocket.receive":
                    break
                data = message.get("bytes")
                try:
                    items = self._items(message.get("text") if data is None else data)
                    for item in items:
                        self._handle(item, nursery)
                except _Unreadable as exc:
                    self.app.stats.rejected += 1
                    await self.send({"type": "websocket.close", "code": 1007,
                                     "reason": str(exc)[:120]})  # fmt: skip
                    break
            nursery.cancel_scope.cancel()

    @staticmethod
    def _items(data: str | bytes | None) -> list[Any]:
        try:
            decoded = orjson.loads(data or b"")
        except orjson.JSONDecodeError as exc:
            raise _Unreadable(f"the message is not JSON: {exc}") from None
        return decoded if isinstance(decoded, list) else [decoded]

    def _answer(self, ident: int | str, status: int, **fields: Any) -> None:
        self.out.append(orjson.dumps({"id": ident, "status": status, **fields}, default=str))
        self.wake.set()

    def _handle(self, item: object, nursery: trio.Nursery) -> None:
        ident = item.get("id") if isinstance(item, dict) else None
        if (isinstance(ident, str) and len(ident) <= _ID_MAX) or (
            isinstance(ident, int) and not isinstance(ident, bool)
        ):
            pass
        else:
            raise _Unreadable("every item must be an object with an id (an integer or a string)")
        assert isinstance(item, dict)
        op = item.get("op")
        if op == "cancel":
            scope = self.running.get(ident)
            if scope is not None:
                scope.cancel()
            return
        stats = self.app.stats
        if op != "run":
            stats.rejected += 1
            self._answer(ident, 422, error=f"op: expected 'run' or 'cancel', got {op!r}")
        elif ident in self.running:
            stats.rejected += 1
            self._answer(ident, 409, error=f"id: {ident!r} is already running")
        else:
            if not item.keys() <= _ITEM_FIELDS:
                unknown = sorted(set(item) - _ITEM_FIELDS)
                stats.rejected += 1
                self._answer(ident, 422, error=f"{unknown[0]}: unknown field")
                return
            try:
                slot, ctx = self._prepare(item.get("body"))
            except WireError as exc:
                stats.rejected += 1
                self._answer(ident, 422, error=str(exc))
                return
            scope = self.running[ident] = trio.CancelScope()
            nursery.start_soon(self._run, ident, scope, slot, ctx)

    def _prepare(self, body: object) -> tuple[RunSlot[Any], ModelContext]:
        """`ServerApp.prepare`, with a fast path for a well-formed body whose model context
        this connection has seen before (the same JSON, so the same checks and the same
        `ModelContext`): `quick_slot` checks the slot; anything it does not accept, and a
        new context, go through `ServerApp.prepare`, whose `WireError` names the field."""
        app = self.app
        ctx_key = None
        if type(body) is dict and len(body) == 2:
            ctx_value = body.get("ctx")
            with contextlib.suppress(TypeError):  # orjson: not JSON data (a decoded body is)
                ctx_key = orjson.dumps(ctx_value) if type(ctx_value) is dict else None
            ctx = self.contexts.get(ctx_key) if ctx_key is not None else None
            fast = quick_slot(body.get("slot"), plain_tasks=app.plain_tasks)
            if ctx is not None and fast is not None:
                key, data, rollout = fast
                return RunSlot(build_task(app.taskset_cls, key, data), rollout), ctx
        slot, ctx = app.prepare(body)
        if ctx_key is not None and len(self.contexts) < _MAX_CONTEXTS:
            self.contexts[ctx_key] = ctx
        return slot, ctx

    async def _run(
        self, ident: int | str, scope: trio.CancelScope, slot: RunSlot[Any], ctx: ModelContext
    ) -> None:
        try:
            with scope:
                episode = await self.app.episode(slot, ctx)
        except Exception as exc:  # the env failed outside an episode: a bug in it
            cause = pick_one(exc) if isinstance(exc, ExceptionGroup) else exc
            traceback.print_exception(cause, file=sys.stderr)
            message = f"the env failed outside an episode: {type(cause).__name__}: {cause}"
            self._answer(ident, 500, error=message)
            return
        finally:
            del self.running[ident]
        if scope.cancelled_caught or episode is None:
            self._answer(ident, 499, error="cancelled")
        else:
            self._answer(ident, 200, row=episode.to_row())

    async def _flush(self) -> None:
        while True:
            await self.wake.wait()
            await _coalesce(self.out, WS_MAX_BATCH)
            self.wake = trio.Event()
            items, self.out = self.out[:WS_MAX_BATCH], self.out[WS_MAX_BATCH:]
            if self.out:
                self.wake.set()
            await self.send({"type": "websocket.send", "bytes": b"[" + b",".join(items) + b"]"})


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only (``localhost`` or a loopback address)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: the OS picks one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    return sock


async def _stop_on_signals(stop: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            stop.set()


async def _stop_on_stdin_eof(stop: trio.Event) -> None:
    """The death pipe: the parent holds our stdin's write end; EOF means it is gone."""
    fd = sys.stdin.fileno()
    while True:
        await trio.lowlevel.wait_readable(fd)
        if not os.read(fd, 4096):
            stop.set()
            return


async def _watch(stop: trio.Event, nursery: trio.Nursery, die_with_parent: bool) -> None:
    nursery.start_soon(_stop_on_signals, stop)
    if die_with_parent:
        nursery.start_soon(_stop_on_stdin_eof, stop)


def _announce(url: str) -> None:
    """Tell the parent the URL on stdout (one line); later stdout output goes to stderr."""
    print(f"{READY_PREFIX}{url}", flush=True)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())


async def serve_worker(
    app: ServerApp, fd: int, *, url: str | None, die_with_parent: bool, graceful: float = 3.0
) -> None:
    """Serve `app` on the listening socket `fd` until SIGTERM/SIGINT (or stdin EOF with
    `die_with_parent`), holding `env.serving()` throughout; announce `url` once listening."""
    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    config.bind = [f"fd://{fd}"]
    config.loglevel = "WARNING"
    config.graceful_timeout = graceful
    config.keep_alive_timeout = 120  # longer than the client's keep-alive: it closes first
    config.websocket_max_message_size = app.max_body  # over it: close code 1009
    stop = trio.Event()
    try:
        async with app.env.serving(), trio.open_nursery() as nursery:
            await _watch(stop, nursery, die_with_parent)

            async def run_server(task_status: trio.TaskStatus[Any]) -> None:
                asgi: Any = app
                await serve(asgi, config, shutdown_trigger=stop.wait, task_status=task_status)
                nursery.cancel_scope.cancel()

            await nursery.start(run_server)
            if url is not None:
                _announce(url)
    finally:
        await app.aclose()


# --- K workers: a supervisor process that owns the socket ------------------------------------


async def _stop_process(proc: trio.Process, grace: float) -> None:
    """Close its stdin (the death pipe), SIGTERM, wait `grace` seconds, then SIGKILL."""
    with trio.CancelScope(shield=True):
        if proc.stdin is not None:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await proc.stdin.aclose()
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        with trio.move_on_after(grace):
            await proc.wait()
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


async def supervise(
    worker_cmd: list[str], sock: socket.socket, workers: int, url: str, die_with_parent: bool
) -> int:
    """Run `workers` worker processes on `sock` until a signal (or stdin EOF, with
    `die_with_parent`); if one dies unasked, stop them all and return 1 (a pool never runs
    degraded). Each worker's stdin is a death pipe from here."""
    fd = sock.fileno()
    procs: list[trio.Process] = []
    failed: list[str] = []
    stop = trio.Event()

    async def reap(proc: trio.Process) -> None:
        code = await proc.wait()
        if not stop.is_set():
            failed.append(f"worker pid {proc.pid} exited with code {code}")
            stop.set()

    try:
        async with trio.open_nursery() as nursery:
            await _watch(stop, nursery, die_with_parent)
            for _ in range(workers):
                proc = await trio.lowlevel.open_process(
                    [*worker_cmd, "--listen-fd", str(fd)],
                    stdin=subprocess.PIPE, stdout=sys.stderr.fileno(), pass_fds=(fd,),
                )  # fmt: skip
                procs.append(proc)
                nursery.start_soon(reap, proc)
            _announce(url)
            await stop.wait()
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as nursery:
                for proc in procs:
                    nursery.start_soon(_stop_process, proc, 5.0)
    for line in failed:
        print(f"trio-tasksets serve: {line}; stopping the pool", file=sys.stderr)
    return 1 if failed else 0


# --- the command line -----------------------------------------------------------------------


class ServeUsageError(ValueError):
    """A bad `trio-tasksets serve` command line (exit 2)."""


def add_serve_command(commands: Any) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to the CLI's subparsers."""
    sv: argparse.ArgumentParser = commands.add_parser(
        "serve",
        help="serve a taskset's env over HTTP (for --server-url or remote use)",
        description="Run a taskset's env behind HTTP: GET /health and POST /run (docs/serve.md).",
    )
    sv.add_argument(
        "taskset", metavar="TASKSET", help="echo, echo-stream, file.py:Class or pkg.mod:Class"
    )
    sv.add_argument(
        "--host",
        default="127.0.0.1",
        help="bind address (default 127.0.0.1; any non-loopback address needs --token-var)",
    )
    sv.add_argument(
        "--port",
        type=int,
        default=8000,
        help=f"port (0: the OS picks one; the '{READY_PREFIX}URL' line on stdout tells it)",
    )
    sv.add_argument("--workers", type=int, default=1, metavar="K", help="worker processes")
    sv.add_argument(
        "--token-var",
        default=None,
        metavar="NAME",
        help="environment variable holding the bearer token every request must carry",
    )
    sv.add_argument(
        "--max-body-bytes",
        type=int,
        default=MAX_BODY_BYTES,
        metavar="N",
        help="larger request bodies get 413 (default 1 MiB)",
    )
    env = sv.add_argument_group("the env (what `--serve` passes on from an eval)")
    env.add_argument(
        "--taskset-config",
        default=None,
        metavar="JSON",
        help="the taskset config's fields as a JSON object",
    )
    env.add_argument("--env-class", default=None, metavar="SPEC", help="an Env subclass")
    env.add_argument("--reward", default=None, metavar="SPEC", help="a reward function")
    env.add_argument("--retries", type=int, default=0, metavar="K")
    env.add_argument("--retry-on", default="", metavar="TYPES")
    env.add_argument("--no-retry-on", default="", metavar="TYPES")
    env.add_argument("--retry-backoff", type=float, default=0.5, metavar="S")
    env.add_argument("--retry-max-backoff", type=float, default=30.0, metavar="S")
    sv.add_argument(
        "--die-with-parent",
        action="store_true",
        help="exit when stdin reaches EOF (the spawning parent's death pipe)",
    )
    sv.add_argument("--listen-fd", type=int, default=None, help=argparse.SUPPRESS)
    return sv


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _env_spec(args: argparse.Namespace) -> EnvSpec:
    config: dict[str, Any] = {}
    if args.taskset_config is not None:
        try:
            config = json.loads(args.taskset_config)
        except ValueError as exc:
            raise ServeUsageError(f"--taskset-config is not JSON: {exc}") from None
        if not isinstance(config, dict):
            raise ServeUsageError("--taskset-config must be a JSON object")
    try:
        retries = RetryPolicy(args.retries, _names(args.retry_on), _names(args.no_retry_on),
                              args.retry_backoff, args.retry_max_backoff)  # fmt: skip
    except ValueError as exc:
        raise ServeUsageError(f"--retries/--retry-backoff: {exc}") from None
    return EnvSpec(args.taskset, config, args.env_class, args.reward, retries)


def _token(args: argparse.Namespace) -> str | None:
    if args.token_var is None:
        if not is_loopback(args.host):
            raise ServeUsageError(
                f"--host {args.host} is not a loopback address: name the environment variable "
                f"holding a bearer token with --token-var NAME (or bind 127.0.0.1)"
            )
        return None
    token = os.environ.get(args.token_var, "").strip()
    if not token:
        raise ServeUsageError(f"--token-var: environment variable {args.token_var} is not set")
    return token


def _check_args(args: argparse.Namespace) -> None:
    if args.workers < 1:
        raise ServeUsageError(f"--workers must be >= 1, got {args.workers}")
    if not 0 <= args.port <= 65535:
        raise ServeUsageError(f"--port must be in 0..65535, got {args.port}")
    if args.max_body_bytes < 1:
        raise ServeUsageError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")


def _worker_cmd(args: argparse.Namespace, spec: EnvSpec) -> list[str]:
    cmd = [sys.executable, "-m", "trio_tasksets", "serve", *spec.argv(),
           "--workers", str(args.workers), "--max-body-bytes", str(args.max_body_bytes),
           "--die-with-parent"]  # fmt: skip
    return [*cmd, "--token-var", args.token_var] if args.token_var else cmd


def serve_main(args: argparse.Namespace) -> int:
    """`trio-tasksets serve`: exit 0 when stopped by a signal, 1 on an error, 2 (raised as
    ServeUsageError or the CLI's UsageError) on a bad command line."""
    from .cli import resolve_taskset

    _check_args(args)
    token = _token(args)
    spec = _env_spec(args)
    taskset_cls = resolve_taskset(args.taskset)
    try:
        env = spec.build(taskset_cls)
    except (TypeError, ValueError, ImportError) as exc:
        raise ServeUsageError(f"cannot build the env: {type(exc).__name__}: {exc}") from exc
    if args.listen_fd is not None:  # a worker of a pool
        app = ServerApp(env, token=token, max_body=args.max_body_bytes, workers=args.workers)
        worker = partial(serve_worker, url=None, die_with_parent=args.die_with_parent)
        trio.run(worker, app, args.listen_fd)
        return 0
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        print(f"trio-tasksets serve: error: cannot listen on {args.host}:{args.port}: {exc}",
              file=sys.stderr)  # fmt: skip
        return 1
    url = _url(args.host, sock.getsockname()[1])
    if args.workers > 1:
        with sock:
            cmd = _worker_cmd(args, spec)
            return trio.run(supervise, cmd, sock, args.workers, url, args.die_with_parent)
    app = ServerApp(env, token=token, max_body=args.max_body_bytes)
    trio.run(
        partial(serve_worker, url=url, die_with_parent=args.die_with_parent), app, sock.detach()
    )
    return 0


# === the client ==============================================================================


def _transport_reason(exc: Exception) -> str | None:
    """Why a request got no answer, for an httpcore transport error; None for any other."""
    import httpcore

    detail = str(exc) or type(exc).__name__
    if isinstance(exc, httpcore.ConnectError | httpcore.ConnectTimeout):
        return f"connection refused or unreachable ({detail})"
    if isinstance(exc, httpcore.NetworkError | httpcore.RemoteProtocolError):
        return f"the connection was closed or reset mid-request ({detail})"
    other = (httpcore.ProtocolError, httpcore.TimeoutException, httpcore.UnsupportedProtocol)
    return f"{type(exc).__name__}: {detail}" if isinstance(exc, other) else None


class _Connections:
    """Keep-alive HTTP/1.1 connections to one origin: one request per connection at a time,
    an idle one reused (last in, first out), at most `limit` open.

    Not httpcore's `AsyncConnectionPool`: its request-to-connection assignment scans every
    connection on every event (O(connections x requests) per request, encode/httpcore#1035),
    which at a window of 64 made the client cost 3x the server. httpcore still speaks HTTP.
    """

    def __init__(
        self, scheme: str, host: str, port: int, limit: int | None, connect_timeout: float
    ) -> None:
        import httpcore

        self._origin = httpcore.Origin(scheme.encode(), host.encode(), port)
        self.host, self.port = host, port
        self._idle: list[httpcore.AsyncHTTPConnection] = []
        self._limiter = trio.CapacityLimiter(limit) if limit is not None else None
        self._extensions = {"timeout": {"connect": connect_timeout, "read": None,
                                        "write": None, "pool": None}}  # fmt: skip

    async def _take(self) -> httpcore.AsyncHTTPConnection:
        import httpcore

        while self._idle:
            connection = self._idle.pop()
            if not connection.has_expired():
                return connection
            await connection.aclose()
        # The client's keep-alive (60 s) is shorter than the server's (120 s): an idle
        # connection is dropped here before the server could close it under a request.
        return httpcore.AsyncHTTPConnection(self._origin, keepalive_expiry=60.0)

    async def request(
        self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> tuple[int, bytes]:
        """One request on a connection of its own; the status and the whole body."""
        import httpcore

        origin = self._origin
        url = httpcore.URL(scheme=origin.scheme, host=origin.host, port=origin.port, target=target)
        async with self._limiter if self._limiter is not None else contextlib.nullcontext():
            connection = await self._take()
            request = httpcore.Request(
                method, url, headers=headers, content=body, extensions=self._extensions
            )
            try:
                response = await connection.handle_async_request(request)
                try:
                    content = await response.aread()
                finally:
                    await response.aclose()
            except BaseException:
                with trio.CancelScope(shield=True):
                    await connection.aclose()  # a cancelled request leaves it unusable
                raise
            if connection.is_available():
                self._idle.append(connection)
            else:
                await connection.aclose()
            return response.status, content

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        with trio.CancelScope(shield=True):
            for connection in idle:
                await connection.aclose()


# --- the WebSocket transport -----------------------------------------------------------------


class _WSGone(Exception):
    """The WebSocket connection ended; the message says how."""


async def _handshake(stream: trio.SocketStream, ws: Any) -> Any:
    """Read the server's answer to the upgrade request: wsproto's `AcceptConnection`, or
    `_Refused` for an HTTP status with its body."""
    from wsproto.events import AcceptConnection, RejectConnection, RejectData

    status, body = 0, b""
    while True:
        data = await stream.receive_some(65536)
        if not data:
            raise _WSGone("the server closed the connection during the handshake")
        ws.receive_data(data)
        for event in ws.events():
            if isinstance(event, AcceptConnection):
                return event
            if isinstance(event, RejectConnection):
                status = event.status_code
            elif isinstance(event, RejectData):
                body += event.data
                if event.body_finished:
                    raise _Refused(status, body)


class _WSConnection:
    """One WebSocket to ``/ws`` (wsproto over a trio stream), shared by many `run` calls.

    A call queues its item and parks until the answer with its id (`call`). The writer sends
    what is queued as one message (a JSON array; what the runnable tasks add in the same
    scheduler tick goes together, at most `max_bytes`); the reader reschedules each call's
    task with its answer. Both run as one trio system task, so an `EnvClient` needs no
    nursery; `close()` stops it.
    """

    def __init__(self, stream: trio.SocketStream, ws: Any, max_bytes: int, pid: str) -> None:
        self.stream = stream
        self.ws = ws
        self.pid = pid
        self.calls: dict[int, trio.lowlevel.Task] = {}  # the parked task of each call
        self.gone: str | None = None
        self._max_bytes = max_bytes
        self._next = 0
        self._out: list[bytes] = []
        self._wake = trio.Event()
        self._scope = trio.CancelScope()

    @classmethod
    async def open(
        cls, host: str, port: int, target: str, headers: list[tuple[bytes, bytes]],
        max_bytes: int,
    ) -> _WSConnection:  # fmt: skip
        """Connect and do the handshake; `_Refused` for an HTTP answer instead of 101."""
        from wsproto import ConnectionType, WSConnection
        from wsproto.events import Request

        stream = await trio.open_tcp_stream(host, port)
        try:
            stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ws = WSConnection(ConnectionType.CLIENT)
            hostname = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            await stream.send_all(
                ws.send(Request(host=hostname, target=target, extra_headers=headers))
            )
            accepted = await _handshake(stream, ws)
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        pid = dict(accepted.extra_headers).get(b"x-tt-pid", b"").decode()
        return cls(stream, ws, max_bytes, pid)

    def start(self) -> None:
        trio.lowlevel.spawn_system_task(self._serve, name=f"tt-ws-{self.pid}")

    async def call(self, body: bytes) -> Any:
        """Send a run (`body`: a run request's JSON) and wait for its answer: the decoded
        item, or None if the connection ended first (`gone` says why). Cancelling the wait
        tells the server to cancel the run (a ``cancel`` item; a late answer is dropped).

        The calling task parks itself (no `Event` and no call object per run): the reader
        reschedules it with its answer, `_end` with None."""
        if self.gone is not None:
            await trio.lowlevel.checkpoint()
            return None
        self._next += 1
        ident = self._next
        self.calls[ident] = trio.lowlevel.current_task()
        self._queue(b'{"op":"run","id":%d,"body":%b}' % (ident, body))

        def abort(_: object) -> trio.lowlevel.Abort:
            self.cancel(ident)
            return trio.lowlevel.Abort.SUCCEEDED

        return await trio.lowlevel.wait_task_rescheduled(abort)

    def cancel(self, ident: int) -> None:
        """Tell the server to cancel run `ident` (its answer, if any, is dropped)."""
        if self.calls.pop(ident, None) is not None and self.gone is None:
            self._queue(b'{"op":"cancel","id":%d}' % ident)

    def _queue(self, item: bytes) -> None:
        self._out.append(item)
        self._wake.set()

    async def close(self) -> None:
        self._end("the client was closed")
        with trio.CancelScope(shield=True):
            await trio.aclose_forcefully(self.stream)

    def _end(self, reason: str) -> None:
        if self.gone is None:
            self.gone = reason
        self._scope.cancel()
        calls, self.calls = self.calls, {}
        for task in calls.values():
            trio.lowlevel.reschedule(task, outcome.Value(None))

    async def _serve(self) -> None:
        with self._scope:
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._write)
                    await self._read()
            except Exception as exc:  # the connection ended: every waiting call gets why
                cause = pick_one(exc) if isinstance(exc, ExceptionGroup) else exc
                if isinstance(cause, _WSGone):
                    self._end(str(cause))
                else:
                    detail = f"{type(cause).__name__}: {cause}"
                    self._end(f"the connection was closed or reset ({detail})")
        self._end("the connection ended")
        self.stream.socket.close()

    async def _write(self) -> None:
        from wsproto.events import BytesMessage

        while True:
            await self._wake.wait()
            await _coalesce(self._out, WS_MAX_BATCH)
            self._wake = trio.Event()
            items: list[bytes] = []
            size = 2
            while self._out and (
                not items
                or (size + len(self._out[0]) + 1 <= self._max_bytes and len(items) < WS_MAX_BATCH)
            ):
                item = self._out.pop(0) if len(self._out) > 1 else self._out.pop()
                items.append(item)
                size += len(item) + 1
            if self._out:
                self._wake.set()  # the rest goes in the next message
            await self.stream.send_all(self.ws.send(BytesMessage(b"[" + b",".join(items) + b"]")))

    async def _read(self) -> None:
        from wsproto.events import BytesMessage, CloseConnection, Ping, TextMessage

        parts: list[Any] = []
        while True:
            data = await self.stream.receive_some(1 << 16)
            if not data:
                raise _WSGone("the server closed the connection")
            self.ws.receive_data(data)
            for event in self.ws.events():
                if isinstance(event, BytesMessage | TextMessage):
                    parts.append(event.data)
                    if event.message_finished:
                        self._dispatch(parts)
                        parts = []
                elif isinstance(event, Ping):
                    await self.stream.send_all(self.ws.send(event.response()))
                elif isinstance(event, CloseConnection):
                    raise _WSGone(
                        f"the server closed the WebSocket (code {event.code}"
                        + (f": {event.reason})" if event.reason else ")")
                    )

    def _dispatch(self, parts: list[Any]) -> None:
        data = (
            parts[0]
            if len(parts) == 1
            else b"".join(p.encode() if isinstance(p, str) else p for p in parts)
        )
        try:
            answers = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise _WSGone(f"the server sent a message that is not JSON: {exc}") from None
        for answer in answers if isinstance(answers, list) else [answers]:
            ident = answer.get("id") if isinstance(answer, dict) else None
            task = self.calls.pop(ident, None) if type(ident) is int else None
            if task is not None:
                trio.lowlevel.reschedule(task, outcome.Value(answer))


class _Refused(Exception):
    """The server answered the WebSocket handshake with an HTTP status instead of 101."""

    def __init__(self, status: int, body: bytes) -> None:
        try:
            detail = json.loads(body).get("error")
        except (ValueError, AttributeError):
            detail = body[:200].decode(errors="replace")
        super().__init__(detail)
        self.status = status


class _WSPool:
    """The WebSocket connections of an `EnvClient`: opened on first use, one per server
    worker unless `size` is given (the kernel deals connections to the workers that accept
    them, so up to 4 per worker are tried to reach distinct workers, by the pid each worker
    names at the handshake). A run goes on the connection with the fewest runs in flight. A
    connection that ends is dropped; the next run opens new ones."""

    def __init__(self, client: EnvClient, size: int | None) -> None:
        self.client = client
        self.size = size
        self.connections: list[_WSConnection] = []
        self.available: bool | None = None  # None: not asked yet; False: use HTTP
        self.max_bytes = MAX_BODY_BYTES
        self._lock = trio.Lock()

    def live(self) -> _WSConnection | None:
        """The open connection with the fewest runs in flight; None if none is open."""
        best: _WSConnection | None = None
        for connection in self.connections:
            if connection.gone is None and (
                best is None or len(connection.calls) < len(best.calls)
            ):
                best = connection
        return best

    async def pick(self) -> _WSConnection | None:
        """A live connection (opened if needed), or None when the server has no ``/ws``."""
        live = [c for c in self.connections if c.gone is None]
        if not live:
            async with self._lock:
                live = [c for c in self.connections if c.gone is None]
                if not live and self.available is not False:
                    live = self.connections = await self._open()
        if not live:
            return None
        return min(live, key=lambda c: len(c.calls))

    async def _open(self) -> list[_WSConnection]:
        client = self.client
        health = await client.health()
        target = health.get("websocket")
        if not isinstance(target, str):
            self.available = False  # a server without /ws: HTTP only
            return []
        self.available = True
        self.max_bytes = int(health.get("max_body", MAX_BODY_BYTES))
        workers = int(health.get("workers", 1))
        size = self.size or workers
        wanted = min(size, workers)
        host, port = client._connections.host, client._connections.port
        connections: list[_WSConnection] = []
        seen: set[str] = set()
        try:
            for _ in range(size if self.size else 4 * workers):
                connection = await _WSConnection.open(
                    host, port, client._prefix + target, client._ws_headers, self.max_bytes
                )
                if connection.pid in seen and len(seen) < wanted:
                    await connection.close()  # a worker we have: try for another
                    continue
                seen.add(connection.pid)
                connections.append(connection)
                connection.start()
                if len(connections) >= size:
                    break
        except BaseException:
            with trio.CancelScope(shield=True):
                for connection in connections:
                    await connection.close()
            raise
        return connections

    async def aclose(self) -> None:
        connections, self.connections = self.connections, []
        for connection in connections:
            await connection.close()


class EnvClient:
    """A client of an env server: `await client.run(slot, ctx) -> Episode`.

    `transport="websocket"` (the default) multiplexes the runs over a few long-lived
    WebSockets to ``/ws`` (`connections` of them; None: one per server worker), many runs per
    message; a server without ``/ws``, an ``https://`` URL, or a request over the server's
    size limit uses ``POST /run`` instead. `transport="http"`: one ``POST /run`` per run on
    keep-alive connections, at most `max_connections` open (None: no bound; an eval sizes
    it to its window). `health()` is always HTTP. Runs are untimed (an episode may take
    long); connecting times out after `connect_timeout`. Every failure to get an answer
    raises `EnvServerError` naming `url`. `api_key_var` is the variable an OpenAI model's
    description tells the server to read its key from. Use `async with` or `aclose()`.
    """

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        api_key_var: str | None = None,
        max_connections: int | None = None,
        connect_timeout: float = 10.0,
        transport: str = "websocket",
        connections: int | None = None,
    ) -> None:
        if transport not in ("websocket", "http"):
            raise ValueError(f"transport must be 'websocket' or 'http', got {transport!r}")
        if connections is not None and connections < 1:
            raise ValueError(f"connections must be >= 1, got {connections}")
        self.url = url.rstrip("/")
        self.transport = transport
        self._connect_timeout = connect_timeout
        self.api_key_var = api_key_var
        self._encoder = RunRequestEncoder(api_key_var)
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"env server URL must be http://host:port or https://..., got {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        self._prefix = parts.path
        self._connections = _Connections(
            parts.scheme, parts.hostname, port, max_connections, connect_timeout
        )
        self._headers = [(b"host", parts.netloc.encode())]
        self._ws_headers: list[tuple[bytes, bytes]] = []
        if token:
            self._headers.append((b"authorization", f"Bearer {token}".encode()))
            self._ws_headers.append((b"authorization", f"Bearer {token}".encode()))
        self._ws = _WSPool(self, connections)
        if transport == "http" or parts.scheme != "http":
            self._ws.available = False

    def __repr__(self) -> str:
        return f"EnvClient({self.url!r})"

    async def _request(self, method: str, path: str, body: bytes = b"") -> Any:
        headers = [*self._headers, (b"content-length", str(len(body)).encode())]
        if body:
            headers.append((b"content-type", b"application/json"))
        target = (self._prefix + path).encode()
        try:
            status, content = await self._connections.request(
                method.encode(), target, headers, body
            )
        except Exception as exc:
            reason = _transport_reason(exc)
            if reason is None:
                raise
            raise EnvServerError(f"env server {self.url} is gone: {reason}", url=self.url) from exc
        try:
            payload = json.loads(content)
        except ValueError:
            payload = None
        if status != 200:
            if isinstance(payload, dict):
                detail = payload.get("error")
            else:
                detail = content[:200].decode(errors="replace")
            raise EnvServerError(
                f"env server {self.url} answered {method} {path} with HTTP {status}: {detail}",
                url=self.url,
                status=status,
            )
        if payload is None:
            raise EnvServerError(
                f"env server {self.url} answered {path} with a body that is not JSON",
                url=self.url,
                status=status,
            )
        return payload

    async def health(self) -> dict[str, Any]:
        """The server's ``GET /health``: ``{"ok": true, "pid", "running", "served", ...}``."""
        payload = await self._request("GET", "/health")
        if not isinstance(payload, dict):
            raise EnvServerError(f"env server {self.url}: /health is not an object", url=self.url)
        return payload

    async def run(self, slot: RunSlot[Any], ctx: ModelContext) -> Episode:
        """Run one slot on the server and return its episode. Cancelling this call cancels
        the episode on the server: a ``cancel`` message on a WebSocket, or closing the
        connection of a ``POST /run``."""
        body = self._encoder.encode(slot, ctx)
        connection = None
        if self._ws.available is not False:
            connection = self._ws.live() or await self._ws_connection()
        if connection is None or len(body) + 64 > self._ws.max_bytes:
            # Over the server's message limit a run would close its WebSocket (1009) and
            # fail the others on it: send it alone, as POST /run (which answers 413).
            row = await self._request("POST", "/run", body)
        else:
            row = await self._ws_run(connection, body)
        try:
            return Episode._from_fresh_row(row)
        except (KeyError, TypeError, ValueError) as exc:
            raise EnvServerError(
                f"env server {self.url} answered /run with a row that is not an episode: {exc}",
                url=self.url,
            ) from exc

    async def _ws_connection(self) -> _WSConnection | None:
        try:
            with trio.fail_after(self._connect_timeout):
                return await self._ws.pick()
        except trio.TooSlowError:
            reason = f"the WebSocket handshake took over {self._connect_timeout:g}s"
        except _Refused as exc:
            raise EnvServerError(
                f"env server {self.url} refused the WebSocket with HTTP {exc.status}: {exc}",
                url=self.url,
                status=exc.status,
            ) from exc
        except (OSError, _WSGone) as exc:
            reason = f"connection refused or unreachable ({exc})"
        raise EnvServerError(f"env server {self.url} is gone: {reason}", url=self.url)

    async def _ws_run(self, connection: _WSConnection, body: bytes) -> Any:
        answer = await connection.call(body)
        if answer is None:
            raise EnvServerError(f"env server {self.url} is gone: {connection.gone}", url=self.url)
        status = answer.get("status")
        if status != 200 or not isinstance(answer.get("row"), dict):
            raise EnvServerError(
                f"env server {self.url} answered a run on {WS_PATH} with status {status}: "
                f"{answer.get('error')}",
                url=self.url,
                status=status if isinstance(status, int) else None,
            )
        return answer["row"]

    async def run_slot(
        self,
        slot: RunSlot[Any],
        ctx: ModelContext,
        *,
        on_complete: Callable[[Episode], Awaitable[None] | None] | None = None,
        retries: RetryPolicy | None = None,
    ) -> Episode:
        """`Env.run_slot` through the server: one `run` per slot (more only on a retry), the
        slot's live state set, and `on_complete(episode)` run once, shielded.

        A retryable `EnvServerError` (no answer, or 5xx) is retried per `retries` only when
        its `include` names it (or a base class): an empty `include` means "any episode
        error" to the env, not "a server that went away".
        """
        slot.started = time.time()
        attempt = 0
        while True:
            attempt += 1
            try:
                episode = await self.run(slot, ctx)
                break
            except EnvServerError as exc:
                if not _retry_server_error(retries, exc, attempt):
                    raise
                await trio.sleep(retries.delay(attempt) if retries is not None else 0)
        slot.episode = episode
        slot.done = True
        if on_complete is not None:
            result = on_complete(episode)  # a sync callback cannot be cancelled: no scope needed
            if result is not None and inspect.isawaitable(result):
                with trio.CancelScope(shield=True):
                    await result
        return episode

    async def aclose(self) -> None:
        """Close the WebSockets (runs still waiting on them fail) and the idle HTTP
        connections (one in use closes when its request ends)."""
        await self._ws.aclose()
        await self._connections.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


def _retry_server_error(policy: RetryPolicy | None, exc: EnvServerError, attempt: int) -> bool:
    if policy is None or not exc.retryable:
        return False
    named = {klass.__name__ for klass in type(exc).__mro__} & set(policy.include)
    return bool(named) and policy.should_retry(exc, attempt)


# === spawning a server child =================================================================


@attrs.define(eq=False)
class ServerProcess:
    """A server child started by `spawn_server`: its `url`, `token` and process."""

    url: str
    token: str
    process: trio.Process
    _stderr: IO[bytes]

    @property
    def pid(self) -> int:
        return self.process.pid

    def stderr_tail(self, limit: int = 4000) -> str:
        """The last `limit` bytes the child wrote to stderr."""
        self._stderr.flush()
        size = self._stderr.seek(0, os.SEEK_END)
        self._stderr.seek(max(0, size - limit))
        return self._stderr.read().decode(errors="replace").strip()

    def describe_exit(self) -> str:
        """A line on how the child ended (or that it runs), with its stderr tail."""
        code = self.process.returncode
        state = "is still running" if code is None else f"exited with code {code}"
        tail = self.stderr_tail()
        return f"the env server child (pid {self.pid}) {state}" + (
            f"; its stderr ends:\n{tail}" if tail else ""
        )


def _child_env(token: str, api_key: str | None) -> dict[str, str]:
    environ = dict(os.environ)
    environ[TOKEN_VAR] = token
    if api_key is not None:
        environ[API_KEY_VAR] = api_key
    # The child imports the same modules: give it this process's import path.
    paths = [os.getcwd() if p == "" else p for p in sys.path]
    environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return environ


async def _read_ready_line(proc: trio.Process) -> str | None:
    """The URL the child announces on stdout; None if its stdout ends first."""
    assert proc.stdout is not None
    buffer = b""
    while b"\n" not in buffer:
        chunk = await proc.stdout.receive_some(4096)
        if not chunk:
            return None
        buffer += chunk
    line = buffer.split(b"\n", 1)[0].decode(errors="replace").strip()
    return line.removeprefix(READY_PREFIX) if line.startswith(READY_PREFIX) else None


async def _wait_healthy(server: ServerProcess) -> None:
    """Poll ``/health`` until it answers ok; EnvServerError if the child exits first."""
    async with EnvClient(server.url, token=server.token, connect_timeout=2.0) as client:
        while True:
            if server.process.returncode is not None:
                raise EnvServerError(
                    f"env server {server.url} died while starting: {server.describe_exit()}",
                    url=server.url,
                )
            with contextlib.suppress(EnvServerError):
                if (await client.health()).get("ok") is True:
                    return
            await trio.sleep(0.05)


async def _start(server: ServerProcess, startup_timeout: float) -> None:
    with trio.move_on_after(startup_timeout) as scope:
        url = await _read_ready_line(server.process)
        if url is None:
            await server.process.wait()
            raise EnvServerError(
                f"the env server failed to start: {server.describe_exit()}", url="(not started)"
            )
        server.url = url
        await _wait_healthy(server)
    if scope.cancelled_caught:
        raise EnvServerError(
            f"the env server did not become healthy within {startup_timeout:g}s: "
            f"{server.describe_exit()}",
            url=server.url or "(not started)",
        )


@asynccontextmanager
async def spawn_server(
    env: Env[Any],
    *,
    workers: int = 1,
    api_key: str | None = None,
    startup_timeout: float = 60.0,
    grace: float = 5.0,
) -> AsyncIterator[ServerProcess]:
    """Start `trio-tasksets serve` for `env` as a child process on 127.0.0.1 (a free port, a
    random bearer token) and yield it once ``/health`` answers; stop it on exit (stdin
    closed, SIGTERM, SIGKILL after `grace` seconds).

    The child rebuilds the env from `EnvSpec.of(env)` (`TravelError` first if it cannot); it
    dies with this process even on SIGKILL (the death pipe on its stdin), and so do its
    workers. `api_key` is put in the child's environment as ``TT_SERVE_API_KEY``. A child that
    dies or stalls while starting raises `EnvServerError` with its stderr tail.
    """
    spec = EnvSpec.of(env)
    token = secrets.token_urlsafe(32)
    cmd = [sys.executable, "-m", "trio_tasksets", "serve", *spec.argv(), "--host", "127.0.0.1",
           "--port", "0", "--workers", str(workers), "--token-var", TOKEN_VAR,
           "--die-with-parent"]  # fmt: skip
    with tempfile.TemporaryFile() as stderr:
        proc = await trio.lowlevel.open_process(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
            env=_child_env(token, api_key), start_new_session=True,
        )  # fmt: skip
        server = ServerProcess("", token, proc, stderr)
        try:
            await _start(server, startup_timeout)
            yield server
        finally:
            await _stop_process(proc, grace)


# === the eval's served path ==================================================================


class SlotRunner(Protocol):
    """Run one slot to its episode, `on_complete` once (as `Env.run_slot`)."""

    def __call__(
        self,
        slot: RunSlot[Any],
        *,
        on_complete: Callable[[Episode], Awaitable[None] | None] | None = None,
    ) -> Awaitable[Episode]: ...


def check_travel(env: Env[Any], ctx: ModelContext, *, spawn: bool) -> None:
    """`TravelError` if the env (when spawning a server for it) or the model context cannot
    go to an env server."""
    if spawn:
        EnvSpec.of(env)
    describe_client(ctx.client, api_key_var=API_KEY_VAR)


def _api_key(ctx: ModelContext) -> str | None:
    return openai_api_key(ctx.client) if isinstance(ctx.client, OpenAIClient) else None


@asynccontextmanager
async def served_runner(
    env: Env[Any], ctx: ModelContext, *, workers: int, server_url: str | None, window: int
) -> AsyncIterator[SlotRunner]:
    """What an eval runs each slot with on the served path: a spawned child (`server_url`
    None) or a running server, through one pooled `EnvClient` (one `run` per slot).

    A remote server's token is read from ``$TT_SERVE_TOKEN``; it reads the model's API key
    from its own ``$TT_SERVE_API_KEY``.
    """
    async with contextlib.AsyncExitStack() as stack:
        server: ServerProcess | None = None
        token: str | None
        if server_url is None:
            server = await stack.enter_async_context(
                spawn_server(env, workers=workers, api_key=_api_key(ctx))
            )
            url, token = server.url, server.token
        else:
            url, token = server_url, os.environ.get(TOKEN_VAR)
        client = await stack.enter_async_context(
            EnvClient(url, token=token, api_key_var=API_KEY_VAR, max_connections=window)
        )
        if server is None:
            await _check_remote(client, env)

        def run(
            slot: RunSlot[Any],
            *,
            on_complete: Callable[[Episode], Awaitable[None] | None] | None = None,
        ) -> Awaitable[Episode]:
            return client.run_slot(slot, ctx, on_complete=on_complete, retries=env.retries)

        try:
            yield run
        except BaseException as exc:
            errors = _server_errors(exc)
            if server is not None and errors:
                await _tell_exit(errors, server)
            raise


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
