"""The served path's client transports: pooled HTTP (`POST /run`) and pooled WebSockets."""

from __future__ import annotations

import json
import socket
from typing import Any

import orjson
import outcome
import trio

from .._core.exceptions import TrioTasksetsError
from .._core.runner import pick_one
from .._transport import HTTPClient, ResponseTooLarge, Timeouts
from .wire import WS_MAX_BATCH, coalesce


class HTTPConnections:
    """The HTTP side of an `EnvClient`: the project's transport (`HTTPClient`) to one env
    server, keep-alive connections reused (newest first), at most `limit` open. Requests
    are untimed once connected (a run may take long); connecting times out after
    `connect_timeout`; an answer over `max_answer` bytes (before or after decoding) raises
    `TooLarge`. A cancelled request closes its connection (the server cancels the run).
    Proxies from the environment are not used: neither is by the WebSocket beside it."""

    def __init__(
        self,
        base: str,
        host: str,
        port: int,
        limit: int | None,
        connect_timeout: float,
        max_answer: int,
    ) -> None:
        self.base = base
        self.host, self.port = host, port
        self.max_answer = max_answer
        # Shorter than the server's keep-alive (its --header-timeout, 10 s by default; set
        # from /health when known): an idle connection is dropped here before the server
        # could close it under a request. (`http.is_closed` says whether it is closed.)
        self.http = HTTPClient(
            timeouts=Timeouts(connect=connect_timeout, read=None, write=None),
            max_connections=limit,
            keepalive_expiry=4.0,
            max_response_bytes=max_answer,
            trust_env=False,
        )

    async def request(
        self, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, bytes]:
        """One request (`path` under the server's URL); the status and the whole body.
        Raises `TooLarge`, or the transport's `HTTPError` when no answer came."""
        try:
            response = await self.http.request(method, self.base + path, headers=headers, body=body)
        except ResponseTooLarge:
            raise TooLarge(f"the server sent an answer over {self.max_answer} bytes "
                           f"(the client's max_message_bytes)") from None  # fmt: skip
        return response.status, response.body

    async def aclose(self) -> None:
        await self.http.aclose()


# --- the WebSocket transport -----------------------------------------------------------------


class WSGone(TrioTasksetsError):
    """The WebSocket connection ended; the message says how."""


class TooLarge(TrioTasksetsError):
    """The server sent a message (or an HTTP answer) over the client's size limit."""


_MAX_REFUSAL = 1 << 16  # bytes of a refused handshake's body the client reads


async def handshake(stream: trio.SocketStream, ws: Any) -> Any:
    """Read the server's answer to the upgrade request: wsproto's `AcceptConnection`, or
    `HandshakeRefused` for an HTTP status with its body."""
    from wsproto.events import AcceptConnection, RejectConnection, RejectData

    status, body = 0, b""
    while True:
        data = await stream.receive_some(65536)
        if not data:
            raise WSGone("the server closed the connection during the handshake")
        ws.receive_data(data)
        for event in ws.events():
            if isinstance(event, AcceptConnection):
                return event
            if isinstance(event, RejectConnection):
                status = event.status_code
            elif isinstance(event, RejectData):
                body += event.data
                if event.body_finished or len(body) > _MAX_REFUSAL:
                    raise HandshakeRefused(status, body[:_MAX_REFUSAL])


class WSConnection:
    """One WebSocket to ``/ws`` (wsproto over a trio stream), shared by many `run` calls.

    A call queues its item and parks until the answer with its id (`call`). The writer sends
    what is queued as one message (a JSON array; what the runnable tasks add in the same
    scheduler tick goes together, at most `max_bytes`); the reader reschedules each call's
    task with its answer. Both run as one trio system task, so an `EnvClient` needs no
    nursery; `close()` stops it. A message from the server over `max_message` bytes ends
    the connection. `outstanding` counts the runs the server may still hold (a cancelled one
    until its answer comes): the caller keeps it under the server's `limit`.
    """

    def __init__(
        self,
        stream: trio.SocketStream,
        ws: Any,
        max_bytes: int,
        pid: str,
        *,
        max_message: int,
        limit: int | None = None,
    ) -> None:
        self.stream = stream
        self.ws = ws
        self.pid = pid
        self.calls: dict[int, trio.lowlevel.Task] = {}  # the parked task of each call
        self.cancelled: set[int] = set()  # runs cancelled here, not yet answered
        self.limit = limit
        self.idle_since = trio.current_time()  # when `outstanding` last fell to 0
        self.gone: str | None = None
        self._max_bytes = max_bytes
        self._max_message = max_message
        self._next = 0
        self._out: list[bytes] = []
        self._wake = trio.Event()
        self._scope = trio.CancelScope()
        self._sending = trio.Lock()  # a pong from the reader and a message from the writer

    @property
    def outstanding(self) -> int:
        """Runs sent (or queued) whose answer has not come."""
        return len(self.calls) + len(self.cancelled)

    def has_room(self) -> bool:
        return self.limit is None or len(self.calls) + len(self.cancelled) < self.limit

    @classmethod
    async def open(
        cls, host: str, port: int, target: str, headers: list[tuple[bytes, bytes]],
        max_bytes: int, *, max_message: int, limit: int | None = None,
    ) -> WSConnection:  # fmt: skip
        """Connect and do the handshake; `HandshakeRefused` for an HTTP answer instead of 101."""
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
            accepted = await handshake(stream, ws)
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        pid = dict(accepted.extra_headers).get(b"x-tt-pid", b"").decode(errors="replace")
        return cls(stream, ws, max_bytes, pid, max_message=max_message, limit=limit)

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
            self.cancelled.add(ident)  # the server holds it until it answers (499)
            self._queue(b'{"op":"cancel","id":%d}' % ident)

    def _queue(self, item: bytes) -> None:
        self._out.append(item)
        self._wake.set()

    def retire(self, reason: str) -> None:
        """End the connection now (its system task closes the socket)."""
        self._end(reason)

    async def close(self) -> None:
        self._end("the client was closed")
        with trio.CancelScope(shield=True):
            await trio.aclose_forcefully(self.stream)

    def _end(self, reason: str) -> None:
        if self.gone is None:
            self.gone = reason
        self._scope.cancel()
        calls, self.calls = self.calls, {}
        self.cancelled.clear()
        for task in calls.values():
            trio.lowlevel.reschedule(task, outcome.Value(None))

    async def _serve(self) -> None:
        try:
            try:
                with self._scope:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(self._write)
                        await self._read()
            # Outside the scope, which takes its own Cancelled out of the nursery's group: a
            # reader that fails as `_end` cancels the writer leaves a group of Cancelled and
            # that failure, which an `except Exception` inside the scope would let escape
            # this system task (a TrioInternalError).
            except Exception as exc:  # the connection ended: every waiting call gets why
                cause = pick_one(exc) if isinstance(exc, ExceptionGroup) else exc
                if isinstance(cause, WSGone):
                    self._end(str(cause))
                else:
                    detail = f"{type(cause).__name__}: {cause}"
                    self._end(f"the connection was closed or reset ({detail})")
            self._end("the connection ended")
        finally:  # also when the run ends under this system task (cancelled): no socket leaks
            self.stream.socket.close()

    async def _write(self) -> None:
        from wsproto.events import BytesMessage

        while True:
            await self._wake.wait()
            await coalesce(self._out, WS_MAX_BATCH)
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
            data = self.ws.send(BytesMessage(b"[" + b",".join(items) + b"]"))
            async with self._sending:
                await self.stream.send_all(data)

    async def _read(self) -> None:
        from wsproto.events import BytesMessage, CloseConnection, Ping, TextMessage

        parts: list[Any] = []
        size = 0
        limit = self._max_message
        while True:
            data = await self.stream.receive_some(1 << 16)
            if not data:
                raise WSGone("the server closed the connection")
            self.ws.receive_data(data)
            for event in self.ws.events():
                if isinstance(event, BytesMessage | TextMessage):
                    parts.append(event.data)
                    size += len(event.data)
                    if size > limit:
                        raise WSGone(f"the server sent a message over {limit} bytes (the "
                                     f"client's max_message_bytes)")  # fmt: skip
                    if event.message_finished:
                        self._dispatch(parts)
                        parts = []
                        size = 0
                elif isinstance(event, Ping):
                    async with self._sending:  # the writer may be sending: take turns
                        await self.stream.send_all(self.ws.send(event.response()))
                elif isinstance(event, CloseConnection):
                    raise WSGone(
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
            raise WSGone(f"the server sent a message that is not JSON: {exc}") from None
        calls = self.calls
        for answer in answers if isinstance(answers, list) else [answers]:
            ident = answer.get("id") if isinstance(answer, dict) else None
            if type(ident) is not int:
                continue
            task = calls.pop(ident, None)
            if task is not None:
                trio.lowlevel.reschedule(task, outcome.Value(answer))
            elif self.cancelled:
                self.cancelled.discard(ident)
        if not calls and not self.cancelled:
            self.idle_since = trio.current_time()


class HandshakeRefused(TrioTasksetsError):
    """The server answered the WebSocket handshake with an HTTP status instead of 101."""

    def __init__(self, status: int, body: bytes) -> None:
        try:
            detail = json.loads(body).get("error")
        except (ValueError, AttributeError):
            detail = body[:200].decode(errors="replace")
        super().__init__(detail)
        self.status = status
