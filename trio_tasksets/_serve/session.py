"""One WebSocket connection of the env server: many runs multiplexed, answered by id, bounded
per connection (docs/serve.md, docs/security.md)."""

from __future__ import annotations

import contextlib
import math
import sys
import traceback
from collections.abc import Mapping
from typing import Any, Protocol

import orjson
import trio

from .._core.runner import pick_one
from .._core.tasksets import Taskset
from .._env.env import Episode, RunSlot
from .._models import ModelContext
from .asgi import Message, Receive, Send, ServerStats, encode_answer
from .policy import Limits, ModelClients, spell
from .wire import (
    LIMITS,
    TIME_LEFT,
    WS_MAX_BATCH,
    WireError,
    build_task,
    coalesce,
    decode_json,
    quick_slot,
    request_limits,
    time_left,
)

_ID_MAX = 128
_ITEM_FIELDS = frozenset({"op", "id", "body"})
_MAX_CONTEXTS = 64  # model contexts a connection keeps parsed (more are parsed each time)


def deadline_passed() -> str:
    """What a run cancelled at its request's `time_left` is answered with (HTTP 504)."""
    return "the run's time_left passed: the episode was cancelled (its caller's deadline)"


class _Unreadable(Exception):
    """A WebSocket message the server cannot answer item by item: it closes with 1007."""


class _Stalled(Exception):
    """The client has left its answers unread for the idle timeout."""


class SessionHost(Protocol):
    """What a WebSocket session needs of the server (`ServerApp` is one)."""

    clients: ModelClients
    limits: Limits
    stats: ServerStats
    spelling: Mapping[str, str] | None  # how a refusal names the server's settings
    plain_tasks: bool
    taskset_cls: type[Taskset[Any, Any]]

    def refused(self, scope: Message, status: int, message: str) -> None: ...

    def prepare(self, decoded: object) -> tuple[RunSlot[Any], ModelContext]: ...

    async def episode(
        self, slot: RunSlot[Any], ctx: ModelContext, receive: Receive | None = None
    ) -> Episode | None: ...


class WSSession:
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

    def __init__(self, app: SessionHost, scope: Message, send: Send) -> None:
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
        reason = spell(f"answers not read for {idle:g}s ({{idle_timeout}})", self.app.spelling)
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
            self._refuse(ident, 429, spell(f"this connection has {len(self.running)} runs in "
                                           f"flight, the server's limit ({{max_runs}}); wait "
                                           f"for an answer, or open another connection",
                                           self.app.spelling))  # fmt: skip
        else:
            body = item.get("body")
            try:
                left = time_left(body)
                slot, ctx = self._prepare(body)
            except WireError as exc:
                self._refuse(ident, exc.status, str(exc))
                return
            except Exception as exc:  # the taskset's task_from_data failed: this run only
                traceback.print_exception(exc, file=sys.stderr)
                self.app.stats.failed += 1
                self._answer(ident, 500, error=f"the env failed outside an episode: "
                                               f"{type(exc).__name__}: {exc}")  # fmt: skip
                return
            # The caller's deadline travels and is enforced here too: its cancel may never come.
            deadline = math.inf if left is None else trio.current_time() + left
            scope = self.running[ident] = trio.CancelScope(deadline=deadline)
            nursery.start_soon(self._run, ident, scope, slot, ctx)

    def _prepare(self, body: object) -> tuple[RunSlot[Any], ModelContext]:
        """`SessionHost.prepare`, with a fast path for a well-formed body whose model context
        this connection has seen before (the same JSON, so the same checks and the same
        `ModelContext`, until the server evicts a model client): `quick_slot` checks the
        slot; anything it does not accept, and a new context, go through
        `SessionHost.prepare`, whose `WireError` names the field."""
        app = self.app
        clients = app.clients
        if self.generation != clients.generation:  # a model client was evicted: its
            self.contexts.clear()  # contexts are not used again
            self.generation = clients.generation
        ctx_key = None
        if type(body) is dict and len(body) - (TIME_LEFT in body) - (LIMITS in body) == 2:
            ctx_value = body.get("ctx")
            with contextlib.suppress(TypeError):  # orjson: nesting it cannot follow
                ctx_key = orjson.dumps(ctx_value) if type(ctx_value) is dict else None
            ctx = self.contexts.get(ctx_key) if ctx_key is not None else None
            fast = quick_slot(body.get("slot"), plain_tasks=app.plain_tasks)
            if ctx is not None and fast is not None:
                key, data, rollout = fast
                limits = request_limits(body)
                slot = RunSlot(build_task(app.taskset_cls, key, data), rollout, limits=limits)
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
        if scope.cancelled_caught and trio.current_time() >= scope.deadline:
            self._answer(ident, 504, error=deadline_passed())
        elif scope.cancelled_caught or episode is None:
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
