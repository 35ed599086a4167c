"""The client side of the served path: `EnvClient`, spawning a server child, and the eval's
served slot runner.

* `EnvClient`: `run(slot, ctx) -> Episode` over a few pooled WebSockets (or ``POST /run``
  with ``transport="http"``), `health()`; a server that cannot be reached or answers with an
  error raises `EnvServerError` naming its URL. A cancelled `run` sends a ``cancel`` item.
* `spawn_server`: the eval's ``--serve`` starts the server as a child process on 127.0.0.1,
  port 0, with a random bearer token; the child dies with its parent, also when the parent is
  SIGKILLed, through a death pipe (the parent holds the write end of the child's stdin).
* `served_runner`: one `client.run` per slot under the eval's window; the taskset and the
  traces stay in the eval's process.

The server is `trio_tasksets.serve`.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, Protocol, Self
from urllib.parse import urlsplit

import attrs
import orjson
import outcome
import trio

from .env import Env, Episode, RetryPolicy, RunSlot
from .models import ModelContext, OpenAIClient
from .runner import pick_one
from .wire import (
    API_KEY_VAR,
    EnvSpec,
    RunRequestEncoder,
    describe_client,
    openai_api_key,
)

if TYPE_CHECKING:
    import httpcore  # imported where used: it imports anyio, which `import trio_tasksets` should not

from .serve import (
    MAX_BODY_BYTES,
    READY_PREFIX,
    TOKEN_VAR,
    WS_MAX_BATCH,
    WS_PATH,
    _coalesce,
    _stop_process,
)

__all__ = [
    "EnvClient",
    "EnvServerError",
    "ServerProcess",
    "SlotRunner",
    "check_travel",
    "served_runner",
    "spawn_server",
]


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
        self._sending = trio.Lock()  # a pong from the reader and a message from the writer

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
        try:
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
        finally:  # also when the run ends under this system task (cancelled): no socket leaks
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
            data = self.ws.send(BytesMessage(b"[" + b",".join(items) + b"]"))
            async with self._sending:
                await self.stream.send_all(data)

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
                    async with self._sending:  # the writer may be sending: take turns
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
        self.closed = False
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
        if self.closed:
            raise EnvServerError(f"{self.client.url}: the client was closed", url=self.client.url)
        live = [c for c in self.connections if c.gone is None]
        if not live:
            async with self._lock:
                live = [c for c in self.connections if c.gone is None]
                if not live and self.available is not False:
                    live = await self._open()
                    if self.closed:  # aclose() ran while these were opening: theirs too
                        with trio.CancelScope(shield=True):
                            for connection in live:
                                await connection.close()
                        raise EnvServerError(
                            f"{self.client.url}: the client was closed", url=self.client.url
                        )
                    self.connections = live
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
        self.closed = True
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
        token = token.strip() if token else None
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
