"""The env server's ASGI app: `GET /health`, `POST /run` and the WebSocket `/ws`."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import traceback
from collections.abc import Mapping
from typing import Any, ClassVar

import attrs
import trio

from .._core.health import Health
from .._core.limits import observe_calls
from .._core.runner import ElasticPlaces, pick_one
from .._core.tasksets import Taskset
from .._env.env import Env, Episode, RunSlot
from .._models import ModelContext
from .._monitor.metrics import Metrics
from .asgi import Message, Receive, Send, ServerStats, encode_answer
from .policy import (
    Access,
    Limits,
    ModelClients,
    ModelPolicy,
    RequestRefused,
    log_refusal,
    spell,
)
from .session import WSSession, deadline_passed
from .wire import (
    WS_PATH,
    WireError,
    build_task,
    decode_json,
    parse_run_request,
    time_left,
)

_JSON = [(b"content-type", b"application/json")]
_NOTHING = contextlib.nullcontext()


# === the server ==============================================================================


class _Disconnected(Exception):
    """The client went away before its request was read: there is no one to answer."""


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


class _Body:
    """One HTTP request's ``receive``, noting whether its body has ended (and how much came).

    A request is answered on a connection the client may reuse: an answer sent before the
    body has ended leaves h11 mid-request, and hypercorn then closes the connection without
    saying so; a client that sends its next request on it (httpx does) sees "server
    disconnected". `finish` reads the rest first, or marks the answer ``Connection: close``.
    """

    def __init__(self, scope: Message, receive: Receive, seconds: float) -> None:
        self._receive = receive
        self.deadline = trio.current_time() + seconds  # for the body to arrive
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"0")
        self.declared: int | None = int(length) if length.isdigit() else None
        self.ended = b"transfer-encoding" not in headers and self.declared == 0
        self.read = 0

    async def receive(self) -> Message:
        message = await self._receive()
        if message["type"] == "http.disconnect":
            self.ended = True
        elif message["type"] == "http.request":
            self.read += len(message.get("body", b""))
            self.ended = not message.get("more_body", False)
        return message

    async def finish(self) -> bool:
        """Read and drop the rest of the body, unless it is over `LINGER_BYTES` in all, until
        `deadline` at most: whether the body has ended."""
        if self.declared is not None and self.declared > LINGER_BYTES:
            return self.ended
        with trio.move_on_at(self.deadline):
            while not self.ended and self.read <= LINGER_BYTES:
                await self.receive()
        return self.ended


async def _answer_draining(
    body: _Body, send: Send, status: int, payload: object, headers: list[Any]
) -> None:
    """Answer a request whose body may be unread: its rest read and dropped first (bounded:
    `_Body.finish`), or the answer says ``Connection: close``; then read (and drop) what
    comes until ``http.disconnect``. Hypercorn queues a few body chunks for the app and then
    stops reading the socket; when the answer ends it queues ``http.disconnect`` behind them
    and waits for room: an app that stopped reading would wait forever, and so would the
    connection."""
    if not await body.finish():
        headers = [*headers, (b"connection", b"close")]

    async def drain() -> None:
        while (await body.receive())["type"] != "http.disconnect":
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
    field) and a model client `models` allows (403 naming the setting), all checked before the
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
        spelling: Mapping[str, str] | None = None,
    ) -> None:
        self.env = env
        # How a refusal names the server's own settings (`policy.spell`): their parameter
        # names, unless the server's starter spells them otherwise (the CLI: its flags).
        self.spelling = spelling
        # The runs' fan_outs draw from a window as large as the runs in flight: the eval's
        # -c, which admits the runs, bounds their fan-outs too.
        self.places = ElasticPlaces()
        self.stats = ServerStats()
        self.access = access
        self.limits = limits = Limits() if limits is None else limits
        self.clients = ModelClients(ModelPolicy() if models is None else models,
                                    limits.model_clients, spelling=spelling)  # fmt: skip
        self.max_body = limits.max_body
        self._workers = workers
        self.taskset_cls: type[Taskset[Any, Any]] = type(env.taskset)
        self.plain_tasks = getattr(self.taskset_cls, "task_from_data", None) is None
        # Served metrics: the worker's health (its runs' waits, model calls, in flight) and
        # metrics (each answered episode), when it serves them.
        self.run_health: Health | None = None
        self.metrics: Metrics | None = None

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
        elif scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
        elif scope["type"] == "http":
            body = _Body(scope, receive, self.limits.header_timeout)
            try:
                await self._route(scope, body.receive, send)
            except _Disconnected:
                pass
            except RequestRefused as refused:
                self.refused(scope, refused.status, str(refused))
                error = {"error": str(refused)}
                await _answer_draining(body, send, refused.status, error, refused.headers)
            except Exception as exc:  # the env failed outside an episode: a bug in it
                cause = pick_one(exc) if isinstance(exc, ExceptionGroup) else exc
                traceback.print_exception(cause, file=sys.stderr)
                message = f"the env failed outside an episode: {type(cause).__name__}: {cause}"
                await _answer_draining(body, send, 500, {"error": message}, [])

    def refused(self, scope: Message, status: int, message: str) -> None:
        """Count and log one refused request (or WebSocket item)."""
        self.stats.rejected += 1
        log_refusal(scope, status, message)

    async def aclose(self) -> None:
        """Close the model clients the server made (shielded)."""
        await self.clients.aclose()

    def health(self) -> dict[str, Any]:
        limits = self.limits
        endpoints = self.clients.endpoint_stats()
        found: dict[str, Any] = {
            "ok": True, "pid": os.getpid(), "workers": self._workers,
            "taskset": self.taskset_cls.__name__, "websocket": WS_PATH,
            "max_body": limits.max_body, "max_runs": limits.max_runs,
            "header_timeout": limits.header_timeout, "idle_timeout": limits.idle_timeout,
            **attrs.asdict(self.stats),
        }  # fmt: skip
        if endpoints:  # runs over many endpoints, or engines read: a figure set each
            found["endpoints"] = endpoints
        boxes = self.env.sandboxes
        if boxes is not None:  # what a --server-url eval that asks for a box checks
            found["sandbox"] = getattr(boxes.spec, "text", "the env's own")
            found["sandboxes"] = boxes.admission.stats()
        return found

    async def _route(self, scope: Message, receive: Receive, send: Send) -> None:
        self.access.check(scope["headers"], self.spelling)
        path, method = scope["path"], scope["method"]
        if path not in self.ROUTES:
            raise RequestRefused(404, f"no such path {path!r} (the paths are /health and /run)")
        allowed = self.ROUTES[path]
        if method != allowed:
            raise RequestRefused(
                405, f"{path} takes {allowed}, not {method}", (b"allow", allowed.encode())
            )
        if path == "/health":
            await _send_json(send, 200, self.health(), [])
        else:
            await self._run(scope, receive, send)

    async def _body(self, scope: Message, receive: Receive) -> bytes:
        limit = self.limits.max_body
        timeout = self.limits.header_timeout
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise RequestRefused(413, spell(f"request body of {int(length)} bytes is over the "
                                            f"{limit} limit ({{max_body}})", self.spelling))  # fmt: skip
        chunks: list[bytes] = []
        size = 0
        with trio.move_on_after(timeout):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise _Disconnected
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise RequestRefused(413, spell(f"request body is over the {limit} byte "
                                                    f"limit ({{max_body}})", self.spelling))  # fmt: skip
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
        raise RequestRefused(408, spell(f"the request body did not arrive within {timeout:g}s "
                                        f"({{header_timeout}})", self.spelling))  # fmt: skip

    def prepare(self, decoded: object) -> tuple[RunSlot[Any], ModelContext]:
        """The slot and model context of a decoded run request: `WireError` naming the field
        (`Forbidden`, 403, for a model client the server does not allow). The context's
        client is counted as in use until `episode` ends."""
        request = parse_run_request(decoded, plain_tasks=self.plain_tasks)
        client = self.clients.get(request.client)
        task = build_task(self.taskset_cls, request.key, request.data)
        self.clients.acquire(client)
        slot: RunSlot[Any] = RunSlot(task, request.rollout, limits=request.limits)
        return slot, ModelContext(client, request.model, request.sampling)

    async def _run(self, scope: Message, receive: Receive, send: Send) -> None:
        is_json, given = _is_json(scope["headers"])
        if not is_json:
            raise RequestRefused(415, f"POST /run takes Content-Type: application/json, got "
                               f"{given or 'none'!r}")  # fmt: skip
        body = await self._body(scope, receive)
        try:
            decoded = decode_json(body)
        except ValueError as exc:
            raise RequestRefused(400, f"the body is not JSON: {exc}") from None
        try:
            left = time_left(decoded)
            slot, ctx = self.prepare(decoded)
        except WireError as exc:
            raise RequestRefused(exc.status, str(exc)) from None
        # The caller's deadline travels and is enforced here too: its disconnect may never come.
        with trio.move_on_after(math.inf if left is None else left) as limit:
            episode = await self.episode(slot, ctx, receive)
        if limit.cancelled_caught:
            await _send_json(send, 504, {"error": deadline_passed()}, [])
        elif episode is not None:
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
        health = self.run_health
        if health is not None:
            health.started()
        try:
            with observe_calls(health) if health is not None else _NOTHING:
                if receive is None:
                    async with self.places.run():
                        episode = await self.env.run_slot(slot, ctx)
                else:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
                        async with self.places.run():
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
            if health is not None:
                health.finished()
            clients = self.clients
            clients.release(ctx.client)
            if clients.retiring:
                await clients.reap()
        if episode is None:
            stats.cancelled += 1
        else:
            stats.served += 1
            if self.metrics is not None:
                last = episode.errors[-1].type if episode.errors else None
                self.metrics.record(episode.ok, last, episode.usage)
        return episode

    def _check_handshake(self, scope: Message) -> None:
        self.access.check(scope["headers"], self.spelling)
        if scope["path"] != WS_PATH:
            raise RequestRefused(404, f"no WebSocket at {scope['path']!r} (it is at {WS_PATH})")

    async def _websocket(self, scope: Message, receive: Receive, send: Send) -> None:
        """``/ws``: many runs multiplexed over one WebSocket (see `WSSession`)."""
        if (await receive())["type"] != "websocket.connect":
            return
        try:
            self._check_handshake(scope)
        except RequestRefused as refused:  # refused at the handshake, as an HTTP answer
            self.refused(scope, refused.status, str(refused))
            body = encode_answer({"error": str(refused)})
            headers = [*_JSON, (b"content-length", str(len(body)).encode()), *refused.headers]
            await send({"type": "websocket.http.response.start", "status": refused.status,
                        "headers": headers})  # fmt: skip
            await send({"type": "websocket.http.response.body", "body": body})
            return
        await send({"type": "websocket.accept",
                    "headers": [(b"x-tt-pid", str(os.getpid()).encode())]})  # fmt: skip
        if await WSSession(self, scope, send).serve(receive):
            return
        # The server closed it: read (and drop) until the client goes, for a while, so that
        # hypercorn's queue for the app has room for the disconnect (see _answer_draining).
        with trio.move_on_after(self.limits.header_timeout):
            while (await receive())["type"] == "websocket.receive":
                pass


LINGER_BYTES = 16 << 20
"""How much of a refused request's body the server still reads, and throws away, before it
answers (a 401, 413, ...): a client that is still sending when the answer comes and the
connection closes may lose the answer to the reset (the unread bytes), and see only "server
disconnected"; one whose body has ended keeps its connection. Bounded in bytes (this) and in
time (`Limits.header_timeout`); nothing of it is kept. A body over it is not read, and the
answer closes the connection."""
