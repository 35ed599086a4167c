"""The served path's server: an env in its own process(es) behind HTTP and a WebSocket.

* **Server** (`trio-tasksets serve TASKSET`): an ASGI app on hypercorn's trio worker with
  ``GET /health``, ``POST /run`` (one slot, its episode row back) and the WebSocket ``/ws``
  (many runs multiplexed, answered by id; `_WSSession`). `env.serving()` is held for the
  server's life. ``--workers K`` runs K worker processes that share one listening socket,
  bound once by a supervisor process (see `docs/serve.md`).
* **Cancellation**: on ``/ws`` by a ``{"op": "cancel", "id": ...}`` item (a closed WebSocket
  cancels all its runs); on ``POST /run`` by disconnect: the handler races the episode
  against the ASGI ``receive()`` that returns ``http.disconnect``.
* **Death pipe**: a server started with its stdin on a pipe stops when the pipe reaches EOF,
  so a child spawned by `trio_tasksets.client.spawn_server` dies with its parent, also when
  the parent is SIGKILLed (and a pool's supervisor does the same to its workers). Not
  ``PR_SET_PDEATHSIG``: it fires when the parent *thread* exits, and trio spawns from a
  worker thread that retires when idle, which would stop a healthy child.

The client side (`EnvClient`, `spawn_server`, the eval's served runner) is
`trio_tasksets.client`.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import traceback
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import orjson
import trio

from .env import Env, Episode, RetryPolicy, RunSlot
from .models import ModelClient, ModelContext
from .runner import pick_one
from .tasksets import Taskset
from .wire import (
    ClientSpec,
    EnvSpec,
    WireError,
    build_client,
    build_task,
    parse_run_request,
    quick_slot,
)

if TYPE_CHECKING:
    pass  # imported where used: it imports anyio, which `import trio_tasksets` should not

__all__ = [
    "MAX_BODY_BYTES",
    "TOKEN_VAR",
    "ServeUsageError",
    "ServerApp",
    "ServerStats",
    "add_serve_command",
    "serve_main",
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
        answer = {"id": ident, "status": status, **fields}
        try:
            encoded = orjson.dumps(answer, default=str)
        except TypeError:  # non-str keys, > 64-bit ints, lone surrogates: as POST /run does
            try:
                text = json.dumps(answer, ensure_ascii=False, allow_nan=False, default=str)
                encoded = text.encode()
            except (TypeError, ValueError) as exc:  # this run only, never the connection
                self.app.stats.failed += 1
                error = f"the episode cannot be sent as JSON: {type(exc).__name__}: {exc}"
                encoded = orjson.dumps({"id": ident, "status": 500, "error": error})
        self.out.append(encoded)
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
            except Exception as exc:  # the taskset's task_from_data failed: this run only
                traceback.print_exception(exc, file=sys.stderr)
                stats.failed += 1
                self._answer(ident, 500, error=f"the env failed outside an episode: "
                                               f"{type(exc).__name__}: {exc}")  # fmt: skip
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
