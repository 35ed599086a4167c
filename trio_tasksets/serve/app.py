"""The env server's ASGI app: `GET /health`, `POST /run` and the WebSocket `/ws`."""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import sys
import traceback
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import attrs
import orjson
import trio

from ..env import Env, Episode, RunSlot
from ..models import ModelClient, ModelContext
from ..runner import pick_one
from ..tasksets import Taskset
from .wire import (
    MAX_BODY_BYTES,
    WS_MAX_BATCH,
    WS_PATH,
    ClientSpec,
    WireError,
    build_client,
    build_task,
    coalesce,
    parse_run_request,
    quick_slot,
)

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


_ID_MAX = 128
_ITEM_FIELDS = frozenset({"op", "id", "body"})
_MAX_CONTEXTS = 64  # model contexts a connection keeps parsed (more are parsed each time)


class _Unreadable(Exception):
    """A WebSocket message the server cannot answer item by item: it closes with 1007."""


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
            await coalesce(self.out, WS_MAX_BATCH)
            self.wake = trio.Event()
            items, self.out = self.out[:WS_MAX_BATCH], self.out[WS_MAX_BATCH:]
            if self.out:
                self.wake.set()
            await self.send({"type": "websocket.send", "bytes": b"[" + b",".join(items) + b"]"})
