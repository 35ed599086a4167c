"""The env server's ASGI app: `GET /health`, `POST /run` and the WebSocket `/ws`."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import traceback
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import attrs
import orjson
import trio

from ..env import Env, Episode, RunSlot
from ..models import ModelContext
from ..runner import pick_one
from ..tasksets import Taskset
from .policy import Access, Limits, ModelClients, ModelPolicy, Refused, log_refusal
from .wire import (
    WS_MAX_BATCH,
    WS_PATH,
    WireError,
    build_task,
    coalesce,
    decode_json,
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


@attrs.define
class ServerStats:
    """A worker's counters, as ``GET /health`` reports them."""

    running: int = 0  # episodes in progress
    served: int = 0  # episodes answered
    cancelled: int = 0  # episodes cancelled (the client went away, or shutdown)
    failed: int = 0  # requests the env failed outside an episode (500)
    rejected: int = 0  # bad or refused requests (4xx)


def encode_answer(payload: object) -> bytes:
    """`payload` as JSON (orjson; what it refuses, such as non-string keys or integers over
    64 bits, through `json` with ``str()`` keys); `ValueError` if it cannot be JSON at all
    (a lone surrogate, nesting the encoders cannot follow)."""
    try:
        return orjson.dumps(payload, default=str)
    except TypeError:
        pass
    try:
        text = json.dumps(payload, ensure_ascii=False, allow_nan=False, default=str)
        return text.encode()
    except (TypeError, ValueError, RecursionError) as exc:  # UnicodeEncodeError: a ValueError
        raise ValueError(f"{type(exc).__name__}: {exc}") from None


async def _send_json(send: Send, status: int, payload: object, headers: list[Any]) -> None:
    try:
        body = encode_answer(payload)
    except ValueError as exc:
        status = 500
        body = encode_answer({"error": f"the episode cannot be sent as JSON: {exc}"})
    length = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status,
                "headers": [*_JSON, *length, *headers]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})


async def _answer_draining(
    receive: Receive, send: Send, status: int, payload: object, headers: list[Any]
) -> None:
    """Answer a request whose body may be unread, reading (and dropping) what comes until
    ``http.disconnect``. Hypercorn queues a few body chunks for the app and then stops
    reading the socket; when the answer ends it queues ``http.disconnect`` behind them and
    waits for room: an app that stopped reading would wait forever, and so would the
    connection."""

    async def drain() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async with trio.open_nursery() as nursery:
        nursery.start_soon(drain)
        await _send_json(send, status, payload, headers)


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


def _is_json(headers: list[tuple[bytes, bytes]]) -> tuple[bool, str]:
    """Whether the request's Content-Type is application/json (parameters allowed)."""
    for name, value in headers:
        if name == b"content-type":
            text = value.decode("latin-1")
            return text.partition(";")[0].strip().lower() == "application/json", text
    return False, ""


class ServerApp:
    """The ASGI app of one worker: ``GET /health``, ``POST /run`` and ``/ws`` over one env.

    Contract: every request passes `access` first (Host, Origin, bearer token: 400/403/401).
    Then an unknown path gets 404, a wrong method 405; ``POST /run`` needs ``Content-Type:
    application/json`` (415), a body within `limits.max_body` bytes (413) that arrives
    within `limits.header_timeout` (408), strict JSON (400), the wire format (422 naming the
    field) and a model client `models` allows (403 naming the flag), all checked before the
    run starts. Each refusal is answered, counted in `stats.rejected` and logged in one line,
    and the server goes on serving. An episode whose client disconnects is cancelled
    (counted in `stats.cancelled`).
    """

    ROUTES: ClassVar[dict[str, str]] = {"/health": "GET", "/run": "POST"}

    def __init__(
        self,
        env: Env[Any],
        *,
        access: Access,
        models: ModelPolicy | None = None,
        limits: Limits | None = None,
        workers: int = 1,
    ) -> None:
        self.env = env
        self.stats = ServerStats()
        self.access = access
        self.limits = limits = Limits() if limits is None else limits
        self.clients = ModelClients(ModelPolicy() if models is None else models,
                                    limits.model_clients)  # fmt: skip
        self.max_body = limits.max_body
        self._workers = workers
        self.taskset_cls: type[Taskset[Any, Any]] = type(env.taskset)
        self.plain_tasks = getattr(self.taskset_cls, "task_from_data", None) is None

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
            except Refused as refused:
                self.refused(scope, refused.status, str(refused))
                error = {"error": str(refused)}
                await _answer_draining(receive, send, refused.status, error, refused.headers)
            except Exception as exc:  # the env failed outside an episode: a bug in it
                cause = pick_one(exc) if isinstance(exc, ExceptionGroup) else exc
                traceback.print_exception(cause, file=sys.stderr)
                message = f"the env failed outside an episode: {type(cause).__name__}: {cause}"
                await _answer_draining(receive, send, 500, {"error": message}, [])

    def refused(self, scope: Message, status: int, message: str) -> None:
        """Count and log one refused request (or WebSocket item)."""
        self.stats.rejected += 1
        log_refusal(scope, status, message)

    async def aclose(self) -> None:
        """Close the model clients the server made (shielded)."""
        await self.clients.aclose()

    def health(self) -> dict[str, Any]:
        limits = self.limits
        return {"ok": True, "pid": os.getpid(), "workers": self._workers,
                "taskset": self.taskset_cls.__name__, "websocket": WS_PATH,
                "max_body": limits.max_body, "max_runs": limits.max_runs,
                "header_timeout": limits.header_timeout, "idle_timeout": limits.idle_timeout,
                **attrs.asdict(self.stats)}  # fmt: skip

    async def _route(self, scope: Message, receive: Receive, send: Send) -> None:
        self.access.check(scope["headers"])
        path, method = scope["path"], scope["method"]
        if path not in self.ROUTES:
            raise Refused(404, f"no such path {path!r} (the paths are /health and /run)")
        allowed = self.ROUTES[path]
        if method != allowed:
            raise Refused(
                405, f"{path} takes {allowed}, not {method}", (b"allow", allowed.encode())
            )
        if path == "/health":
            await _send_json(send, 200, self.health(), [])
        else:
            await self._run(scope, receive, send)

    async def _body(self, scope: Message, receive: Receive) -> bytes:
        limit = self.limits.max_body
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise Refused(413, f"request body of {int(length)} bytes is over the {limit} limit "
                               f"(--max-body-bytes)")  # fmt: skip
        chunks: list[bytes] = []
        size = 0
        timeout = self.limits.header_timeout
        with trio.move_on_after(timeout):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise _Disconnected
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise Refused(413, f"request body is over the {limit} byte limit "
                                       f"(--max-body-bytes)")  # fmt: skip
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
        raise Refused(408, f"the request body did not arrive within {timeout:g}s "
                           f"(--header-timeout)")  # fmt: skip

    def prepare(self, decoded: object) -> tuple[RunSlot[Any], ModelContext]:
        """The slot and model context of a decoded run request: `WireError` naming the field
        (`Forbidden`, 403, for a model client the server does not allow). The context's
        client is counted as in use until `episode` ends."""
        request = parse_run_request(decoded, plain_tasks=self.plain_tasks)
        client = self.clients.get(request.client)
        task = build_task(self.taskset_cls, request.key, request.data)
        self.clients.acquire(client)
        slot: RunSlot[Any] = RunSlot(task, request.rollout)
        return slot, ModelContext(client, request.model, request.sampling)

    async def _run(self, scope: Message, receive: Receive, send: Send) -> None:
        is_json, given = _is_json(scope["headers"])
        if not is_json:
            raise Refused(415, f"POST /run takes Content-Type: application/json, got "
                               f"{given or 'none'!r}")  # fmt: skip
        body = await self._body(scope, receive)
        try:
            decoded = decode_json(body)
        except ValueError as exc:
            raise Refused(400, f"the body is not JSON: {exc}") from None
        try:
            slot, ctx = self.prepare(decoded)
        except WireError as exc:
            raise Refused(exc.status, str(exc)) from None
        episode = await self.episode(slot, ctx, receive)
        if episode is not None:
            await _send_json(send, 200, episode.to_row(), [])

    async def episode(
        self, slot: RunSlot[Any], ctx: ModelContext, receive: Receive | None = None
    ) -> Episode | None:
        """Run a prepared slot (with `receive`: unless the HTTP client disconnects first,
        then None); counted, and its model client released. A cancellation from outside is
        counted and propagates."""
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
            clients = self.clients
            clients.release(ctx.client)
            if clients.retiring:
                await clients.reap()
        if episode is None:
            stats.cancelled += 1
        else:
            stats.served += 1
        return episode

    def _check_handshake(self, scope: Message) -> None:
        self.access.check(scope["headers"])
        if scope["path"] != WS_PATH:
            raise Refused(404, f"no WebSocket at {scope['path']!r} (it is at {WS_PATH})")

    async def _websocket(self, scope: Message, receive: Receive, send: Send) -> None:
        """``/ws``: many runs multiplexed over one WebSocket (see `_WSSession`)."""
        if (await receive())["type"] != "websocket.connect":
            return
        try:
            self._check_handshake(scope)
        except Refused as refused:  # refused at the handshake, as an HTTP answer
            self.refused(scope, refused.status, str(refused))
            body = encode_answer({"error": str(refused)})
            headers = [*_JSON, (b"content-length", str(len(body)).encode()), *refused.headers]
            await send({"type": "websocket.http.response.start", "status": refused.status,
                        "headers": headers})  # fmt: skip
            await send({"type": "websocket.http.response.body", "body": body})
            return
        await send({"type": "websocket.accept",
                    "headers": [(b"x-tt-pid", str(os.getpid()).encode())]})  # fmt: skip
        if await _WSSession(self, scope, send).serve(receive):
            return
        # The server closed it: read (and drop) until the client goes, for a while, so that
        # hypercorn's queue for the app has room for the disconnect (see _answer_draining).
        with trio.move_on_after(self.limits.header_timeout):
            while (await receive())["type"] == "websocket.receive":
                pass


_ID_MAX = 128
_ITEM_FIELDS = frozenset({"op", "id", "body"})
_MAX_CONTEXTS = 64  # model contexts a connection keeps parsed (more are parsed each time)


class _Unreadable(Exception):
    """A WebSocket message the server cannot answer item by item: it closes with 1007."""


class _Stalled(Exception):
    """The client has left its answers unread for the idle timeout."""


class _WSSession:
    """One WebSocket connection of `ServerApp`: each message is a JSON item or an array of
    items, ``{"op": "run", "id": ID, "body": <a POST /run body>}`` or
    ``{"op": "cancel", "id": ID}``; each run is answered by ``{"id": ID, "status": 200,
    "row": <episode row>}`` or ``{"id": ID, "status": 4xx/500, "error": "..."}``, several
    answers per message (an array). A cancelled run is answered ``{"id": ID, "status": 499,
    "error": "cancelled"}``. A message that is not JSON, or an item without a usable id,
    closes the connection with 1007 (its runs are cancelled); an oversize message 1009
    (hypercorn). Disconnecting cancels the connection's runs.

    Bounded: a run beyond `Limits.max_runs` in flight is answered 429; while
    `Limits.max_queued` answers wait to be sent, no more of the connection's items are
    handled and no message is read (so hypercorn stops reading the socket, and the client's
    sends block); with nothing in flight, queued or received for `Limits.idle_timeout`
    seconds the connection is closed with 1001. A client that leaves its answers unread
    for `Limits.idle_timeout` seconds is *stalled*: its runs are cancelled, its answers
    dropped, and its messages read and discarded until it goes (the answer being sent
    cannot be taken back from hypercorn, and reading is how its departure is seen)."""

    def __init__(self, app: ServerApp, scope: Message, send: Send) -> None:
        self.app = app
        self.scope = scope
        self.send = send
        self.running: dict[int | str, trio.CancelScope] = {}
        self.out: list[bytes] = []
        self.wake = trio.Event()
        self.room = trio.Event()  # set when `out` is below `max_queued`
        self.sending = False
        self.last = trio.current_time()  # when a message was last received or sent
        self.contexts: dict[bytes, ModelContext] = {}  # by the JSON of a request's `ctx`
        self.generation = app.clients.generation  # of the model clients `contexts` use
        self.max_runs = app.limits.max_runs
        self.max_queued = app.limits.max_queued
        self.closing = False  # the server closes it: nothing more is sent

    async def serve(self, receive: Receive) -> bool:
        """Serve the connection until it ends; True if the client went (a disconnect was
        received), False if the server closed it (1007, idle: 1001)."""
        gone = False  # stays so when the idle watchdog cancels this
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._flush)
            nursery.start_soon(self._close_when_idle, nursery.cancel_scope)
            try:
                gone = await self._receive(receive, nursery)
            except _Stalled:
                await self._stall(receive)
                gone = True
            nursery.cancel_scope.cancel()
        return gone

    async def _receive(self, receive: Receive, nursery: trio.Nursery) -> bool:
        while True:
            if len(self.out) >= self.max_queued:
                await self._wait_for_room()
            message = await receive()
            if message["type"] != "websocket.receive":
                return True
            self.last = trio.current_time()
            data = message.get("bytes")
            try:
                items = self._items(message.get("text") if data is None else data)
                for item in items:
                    if len(self.out) >= self.max_queued:
                        await self._wait_for_room()
                    self._handle(item, nursery)
            except _Unreadable as exc:
                self.app.refused(self.scope, 1007, str(exc))
                await self._close(1007, str(exc)[:120])
                return False

    async def _wait_for_room(self) -> None:
        """Until the queued answers are below `max_queued`; `_Stalled` after idle_timeout."""
        with trio.move_on_after(self.app.limits.idle_timeout):
            while len(self.out) >= self.max_queued:
                self.room = trio.Event()
                await self.room.wait()
            return
        raise _Stalled

    async def _close(self, code: int, reason: str) -> None:
        """Send the close frame (once); no answer is sent after it."""
        if self.closing:
            return
        self.closing = True
        self.out.clear()
        await self.send({"type": "websocket.close", "code": code, "reason": reason})

    async def _stall(self, receive: Receive) -> None:
        """The client leaves its answers unread: cancel its runs, drop its answers, and read
        and discard its messages until it goes. The close frame (1008) goes out if it ever
        reads again (a send hypercorn has begun cannot be taken back)."""
        idle = self.app.limits.idle_timeout
        reason = f"answers not read for {idle:g}s (--idle-timeout)"
        self.app.refused(self.scope, 1008, f"{reason}: its runs are cancelled")
        for scope in self.running.values():
            scope.cancel()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._close, 1008, reason)
            while (await receive())["type"] == "websocket.receive":
                pass
            nursery.cancel_scope.cancel()

    async def _close_when_idle(self, scope: trio.CancelScope) -> None:
        idle = self.app.limits.idle_timeout
        if not math.isfinite(idle):
            return
        while True:
            await trio.sleep_until(self.last + idle)
            if self.running or self.out or self.sending:
                self.last = trio.current_time()  # busy: an answer will come, or a send end
            elif trio.current_time() >= self.last + idle:
                break
        await self._close(1001, f"idle for {idle:g}s")
        scope.cancel()

    @staticmethod
    def _items(data: str | bytes | None) -> list[Any]:
        try:
            decoded = decode_json(data or b"")
        except ValueError as exc:
            raise _Unreadable(f"the message is not JSON: {exc}") from None
        return decoded if isinstance(decoded, list) else [decoded]

    def _answer(self, ident: int | str, status: int, **fields: Any) -> None:
        if self.closing:
            return
        answer = {"id": ident, "status": status, **fields}
        try:
            encoded = encode_answer(answer)
        except ValueError as exc:  # this run only, never the connection
            self.app.stats.failed += 1
            error = f"the episode cannot be sent as JSON: {exc}"
            encoded = orjson.dumps({"id": ident, "status": 500, "error": error})
        self.out.append(encoded)
        self.wake.set()

    def _refuse(self, ident: int | str, status: int, message: str) -> None:
        self.app.refused(self.scope, status, f"item {ident!r}: {message}")
        self._answer(ident, status, error=message)

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
        if op != "run":
            self._refuse(ident, 422, f"op: expected 'run' or 'cancel', got {op!r}")
        elif ident in self.running:
            self._refuse(ident, 409, f"id: {ident!r} is already running")
        elif not item.keys() <= _ITEM_FIELDS:
            unknown = sorted(set(item) - _ITEM_FIELDS)
            self._refuse(ident, 422, f"{unknown[0]}: unknown field")
        elif len(self.running) >= self.max_runs:
            self._refuse(ident, 429, f"this connection has {len(self.running)} runs in flight, "
                                     f"the server's limit (--max-runs-per-connection); wait "
                                     f"for an answer, or open another connection")  # fmt: skip
        else:
            try:
                slot, ctx = self._prepare(item.get("body"))
            except WireError as exc:
                self._refuse(ident, exc.status, str(exc))
                return
            except Exception as exc:  # the taskset's task_from_data failed: this run only
                traceback.print_exception(exc, file=sys.stderr)
                self.app.stats.failed += 1
                self._answer(ident, 500, error=f"the env failed outside an episode: "
                                               f"{type(exc).__name__}: {exc}")  # fmt: skip
                return
            scope = self.running[ident] = trio.CancelScope()
            nursery.start_soon(self._run, ident, scope, slot, ctx)

    def _prepare(self, body: object) -> tuple[RunSlot[Any], ModelContext]:
        """`ServerApp.prepare`, with a fast path for a well-formed body whose model context
        this connection has seen before (the same JSON, so the same checks and the same
        `ModelContext`, until the server evicts a model client): `quick_slot` checks the
        slot; anything it does not accept, and a new context, go through
        `ServerApp.prepare`, whose `WireError` names the field."""
        app = self.app
        clients = app.clients
        if self.generation != clients.generation:  # a model client was evicted: its
            self.contexts.clear()  # contexts are not used again
            self.generation = clients.generation
        ctx_key = None
        if type(body) is dict and len(body) == 2:
            ctx_value = body.get("ctx")
            with contextlib.suppress(TypeError):  # orjson: nesting it cannot follow
                ctx_key = orjson.dumps(ctx_value) if type(ctx_value) is dict else None
            ctx = self.contexts.get(ctx_key) if ctx_key is not None else None
            fast = quick_slot(body.get("slot"), plain_tasks=app.plain_tasks)
            if ctx is not None and fast is not None:
                key, data, rollout = fast
                slot = RunSlot(build_task(app.taskset_cls, key, data), rollout)
                clients.acquire(ctx.client)
                return slot, ctx
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
            if len(self.out) < self.max_queued:
                self.room.set()
            if self.closing or not items:
                continue
            self.sending = True
            await self.send({"type": "websocket.send", "bytes": b"[" + b",".join(items) + b"]"})
            self.sending = False
            self.last = trio.current_time()
