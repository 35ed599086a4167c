"""An HTTP/1.1 client for trio on h11, with a keep-alive pool that follows its load.

`HTTPClient.request` sends one request and returns the whole `Response`. What it keeps of
what httpx users rely on: https verified against the system trust store plus certifi's (or a
``ca_bundle`` of your own); `Timeouts` for connect, write, read and the whole request;
gzip and deflate bodies; chunked responses; ``HTTP_PROXY``/``HTTPS_PROXY``/``ALL_PROXY``/
``NO_PROXY`` from the environment (``http://`` proxies; anything else is refused when the
client is created, naming the variable); ``Retry-After`` parsed (`Response.retry_after`);
a size limit on bodies; every error an `HTTPError` naming the URL.

The pool keeps every connection a request has released, newest first, until it has been idle
``keepalive_expiry`` seconds: under a steady load of N requests in flight it holds about N
connections and opens no more (no churn), whatever N is. ``max_connections`` bounds the
open ones (requests then wait for a free one). Before an idle connection is reused one
``poll`` tells whether the server has closed it; a request whose pooled connection turns
out dead, before any byte of it reached the kernel, is sent once more on a fresh connection.
A request that may have reached the server is never resent: it fails with
`ConnectionClosed` (``request_sent=True``), and the caller's retry policy decides.

Why not httpx: see docs/benchmarks.md (HTTP client). Only this module and `http_support`
make the transport; nothing else of the package is imported.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import select
import socket
import ssl
from collections import deque
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Self

import attrs
import h11
import trio

from .http_support import (
    ConnectError,
    ConnectionClosed,
    DecodingError,
    HTTPError,
    HTTPTimeout,
    ProtocolError,
    Proxies,
    ProxyError,
    ResponseTooLarge,
    Route,
    Timeouts,
    UnsupportedProxy,
    decode_body,
    parse_retry_after,
    proxies_from_env,
    route_for,
    tls_context,
)

__all__ = [
    "ConnectError",
    "ConnectionClosed",
    "DecodingError",
    "HTTPClient",
    "HTTPError",
    "HTTPTimeout",
    "PoolStats",
    "ProtocolError",
    "ProxyError",
    "Response",
    "ResponseTooLarge",
    "Timeouts",
    "UnsupportedProxy",
    "parse_retry_after",
]

USER_AGENT = b"trio-tasksets"
_RECEIVE = 65536
_ROUTE_CACHE = 256


@attrs.frozen
class Response:
    """A whole response. ``headers`` are h11's: lower-case names, raw bytes; ``body`` is
    decoded (no gzip/deflate left)."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    url: str

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (any case), or None."""
        wanted = name.lower().encode("latin-1")
        for key, value in self.headers:
            if key == wanted:
                return value.decode("latin-1")
        return None

    @property
    def retry_after(self) -> float | None:
        """Seconds the server asks to wait (``Retry-After``: seconds or an HTTP date)."""
        return parse_retry_after(self.header("retry-after"))

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body parsed as JSON; ``ValueError`` if it is not."""
        return json.loads(self.body)


@attrs.frozen
class PoolStats:
    """Connections ``opened`` since the client was created, ``open`` now, how many of
    those are ``idle`` in the pool, and how many pooled ones were found ``stale`` (closed
    by the server) when a request wanted them."""

    opened: int
    open: int
    idle: int
    stale: int


class _SendFailed(Exception):
    def __init__(self, cause: BaseException, sent: bool) -> None:
        super().__init__(str(cause) or type(cause).__name__)
        self.sent = sent


if hasattr(select, "poll"):

    def _prober(fd: int) -> Any:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return lambda: bool(poller.poll(0))

else:  # pragma: no cover - Windows

    def _prober(fd: int) -> Any:
        return lambda: bool(select.select([fd], [], [], 0)[0])


class _Connection:
    """One keep-alive connection: a non-blocking socket, TLS over it if https, h11's state.
    Plain connections use the socket itself and trio's wait_readable/wait_writable: trio's
    socket wrapper adds a scheduler round trip to every send."""

    __slots__ = ("h11", "idle_since", "raw", "readable", "tls")

    def __init__(self, raw: socket.socket, tls: trio.SSLStream[Any] | None) -> None:
        self.h11 = h11.Connection(h11.CLIENT)
        self.raw = raw
        self.tls = tls
        self.idle_since = 0.0
        self.readable = _prober(raw.fileno())

    async def send(self, data: bytes) -> None:
        """Send all of ``data``; `_SendFailed` tells whether any of it reached the kernel."""
        if self.tls is not None:
            try:
                await self.tls.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise _SendFailed(exc, sent=True) from exc  # TLS hides how much went out
            return
        view = memoryview(data)
        sent = 0
        try:
            while True:
                try:
                    sent += self.raw.send(view[sent:])
                except BlockingIOError:
                    await trio.lowlevel.wait_writable(self.raw)
                    continue
                if sent >= len(view):
                    return
        except OSError as exc:
            raise _SendFailed(exc, sent=sent > 0) from exc

    async def receive(self, wait: bool) -> bytes:
        """The next bytes ("" at EOF). ``wait``: wait for readability before trying (the
        first read of a response: it is a checkpoint then, and a recv saved)."""
        if self.tls is not None:
            data = await self.tls.receive_some(_RECEIVE)
            return data if isinstance(data, bytes) else bytes(data)
        while True:
            if wait:
                await trio.lowlevel.wait_readable(self.raw)
            try:
                return self.raw.recv(_RECEIVE)
            except BlockingIOError:
                wait = True

    def close(self) -> None:
        _close(self.raw)  # abrupt: a pooled connection has nothing in flight to flush


def _close(raw: socket.socket) -> None:
    trio.lowlevel.notify_closing(raw)
    raw.close()


async def _open_socket(host: str, port: int) -> socket.socket:
    """A connected non-blocking TCP socket to ``host:port``, trying its addresses in turn."""
    infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    failures: list[str] = []
    for family, kind, proto, _, address in infos:
        raw = socket.socket(family, kind, proto)
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await trio.socket.from_stdlib_socket(raw).connect(address)
        except OSError as exc:
            _close(raw)
            failures.append(f"{address[0]}: {exc.strerror or exc}")
            continue
        except BaseException:
            _close(raw)
            raise
        return raw
    raise OSError(f"all attempts to connect to {host}:{port} failed ({'; '.join(failures)})")


class HTTPClient:
    """HTTP/1.1 requests over pooled keep-alive connections (see the module docstring).

    ``timeouts``: the default `Timeouts` of a request. ``max_connections``: at most this many
    open (None: as many as requests in flight). ``keepalive_expiry``: seconds an idle
    connection is kept (under the 5 s after which uvicorn, and so vLLM and SGLang, close
    one: a connection the server closes while we reuse it fails the request). ``max_response_bytes``: a longer body, before or after decoding,
    raises `ResponseTooLarge`. ``ca_bundle``: trust only these CA certificates (PEM file or
    directory); ``ssl_context``: or bring a whole context. ``proxy``: an ``http://`` proxy
    for every request; else, with ``trust_env``, the ``*_PROXY`` variables. ``headers``:
    sent with every request (a request's own headers win).

    Use ``async with`` or `aclose`: idle connections close at once, busy ones when their
    request ends."""

    def __init__(
        self,
        *,
        timeouts: Timeouts | None = None,
        max_connections: int | None = None,
        keepalive_expiry: float = 4.0,
        max_response_bytes: int = 64 * 2**20,
        ca_bundle: str | os.PathLike[str] | None = None,
        ssl_context: ssl.SSLContext | None = None,
        proxy: str | None = None,
        trust_env: bool = True,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        if max_connections is not None and max_connections < 1:
            raise ValueError(f"max_connections must be >= 1 or None, got {max_connections!r}")
        if not keepalive_expiry >= 0:
            raise ValueError(f"keepalive_expiry must be >= 0 seconds, got {keepalive_expiry!r}")
        if max_response_bytes < 1:
            raise ValueError(f"max_response_bytes must be >= 1, got {max_response_bytes!r}")
        if ca_bundle is not None and ssl_context is not None:
            raise ValueError("pass ca_bundle or ssl_context, not both")
        self.timeouts = timeouts if timeouts is not None else Timeouts()
        self.max_connections = max_connections
        self.keepalive_expiry = keepalive_expiry
        self.max_response_bytes = max_response_bytes
        self._ssl = ssl_context if ssl_context is not None else None
        self._ca_bundle = ca_bundle
        if ca_bundle is not None:
            self._ssl = tls_context(ca_bundle)  # fail now on a bad path
        if proxy is not None:
            explicit = proxies_from_env({"all_proxy": proxy})
            self._proxies = Proxies(explicit.http, explicit.https)
        else:
            self._proxies = proxies_from_env() if trust_env else Proxies()
        base = {"user-agent": USER_AGENT, "accept": b"*/*", "accept-encoding": b"gzip, deflate"}
        for name, value in (headers or {}).items():
            base[name.lower()] = value.encode("latin-1")
        self._base_headers = base
        self._routes: dict[str, Route] = {}
        self._heads: dict[tuple[object, ...], _Head] = {}
        self._idle: dict[tuple[object, ...], deque[_Connection]] = {}
        self._open = 0
        self._opened = 0
        self._stale = 0
        self._waiting = trio.lowlevel.ParkingLot()
        self._closed = False

    def __repr__(self) -> str:
        return f"HTTPClient(max_connections={self.max_connections}, open={self._open})"

    @property
    def is_closed(self) -> bool:
        return self._closed

    @property
    def stats(self) -> PoolStats:
        idle = sum(len(q) for q in self._idle.values())
        return PoolStats(opened=self._opened, open=self._open, idle=idle, stale=self._stale)

    async def request(
        self,
        method: str,
        url: str,
        *,
        headers: Mapping[str, str] | Sequence[tuple[str, str]] | None = None,
        body: bytes = b"",
        timeouts: Timeouts | None = None,
    ) -> Response:
        """Send one request and read the whole response (any status). Raises an `HTTPError`
        subclass naming ``url`` when there is no usable response, ``ValueError`` for a URL
        that is not absolute http(s), ``RuntimeError`` once closed."""
        if self._closed:
            raise RuntimeError(f"HTTPClient is closed; cannot request {url}")
        route = self._routes.get(url)
        if route is None:
            route = self._route(url)
        limits = self.timeouts if timeouts is None else timeouts
        exchange = _Exchange(self, route, url, limits)
        with exchange.scope:
            return await exchange.run(self._outgoing(method, route, headers, body))
        raise exchange.timed_out()

    def _route(self, url: str) -> Route:
        route = route_for(url, self._proxies)
        if len(self._routes) >= _ROUTE_CACHE:
            self._routes.clear()
        self._routes[url] = route
        return route

    def _outgoing(
        self,
        method: str,
        route: Route,
        headers: Mapping[str, str] | Sequence[tuple[str, str]] | None,
        body: bytes,
    ) -> _Outgoing:
        items = tuple(headers.items() if isinstance(headers, Mapping) else headers or ())
        key = (method, route, items)
        head = self._heads.get(key)
        if head is None:
            head = self._heads[key] = self._head(method, route, items)
            if len(self._heads) > _ROUTE_CACHE:
                self._heads.clear()
        framed = body or method not in _NO_BODY
        length = b"content-length: %d\r\n\r\n" % len(body) if framed else b"\r\n"
        return _Outgoing(head, length, body, method)

    def _head(self, method: str, route: Route, items: tuple[tuple[str, str], ...]) -> _Head:
        """The request line and headers but Content-Length, checked once per header set
        (h11 would check them on every request; see the module docstring)."""
        fields = dict(self._base_headers)
        for name, value in items:
            fields[name.lower()] = value.encode("latin-1")
        if route.proxy is not None and route.proxy.authorization and route.scheme == "http":
            fields["proxy-authorization"] = route.proxy.authorization
        fields.pop("content-length", None)
        fields.pop("transfer-encoding", None)
        if not _TOKEN.fullmatch(method.encode("latin-1")):
            raise ValueError(f"bad HTTP method {method!r}")
        lines = [b"%s %s HTTP/1.1\r\n" % (method.encode(), route.target)]
        lines.append(b"host: %s\r\n" % route.host_header)
        for field, data in fields.items():
            raw = field.encode("latin-1")
            if field == "host" or not _TOKEN.fullmatch(raw) or not _VALUE.fullmatch(data):
                raise ValueError(f"bad header for a request to {route.host}: {field!r}: {data!r}")
            lines.append(b"%s: %s\r\n" % (raw, data))
        close = fields.get("connection", b"").lower() == b"close"
        return _Head(b"".join(lines), _announcement(method, close))

    # --- the pool ---------------------------------------------------------------------------

    def _take_idle(self, route: Route) -> _Connection | None:
        """The newest idle connection to ``route``, or None. One the server has closed is
        closed here and None returned: the request then goes on a fresh connection."""
        idle = self._idle.get(route.key)
        if not idle:
            return None
        connection = idle.pop()
        if trio.current_time() - connection.idle_since > self.keepalive_expiry:
            self._discard(connection)  # the newest is expired: so are all the others
            while idle:
                self._discard(idle.pop())
            return None
        if connection.readable():  # EOF, a reset, or bytes nobody asked for
            self._stale += 1
            self._discard(connection)
            return None
        return connection

    def _discard(self, connection: _Connection) -> None:
        connection.close()
        self._open -= 1
        if self._waiting:
            self._waiting.unpark()

    def _check_in(self, route: Route, connection: _Connection) -> None:
        """Back to the pool if it can carry another request, else closed."""
        state = connection.h11
        if self._closed or state.our_state is not h11.DONE or state.their_state is not h11.DONE:
            self._discard(connection)
            return
        state.start_next_cycle()
        now = trio.current_time()
        connection.idle_since = now
        idle = self._idle.get(route.key)
        if idle is None:
            idle = self._idle[route.key] = deque()
        while idle and now - idle[0].idle_since > self.keepalive_expiry:
            self._discard(idle.popleft())
        idle.append(connection)
        if self._waiting:
            self._waiting.unpark()

    def _room(self) -> bool:
        """Whether another connection may open under ``max_connections``, closing an idle
        one (of another origin: the caller found none of its own) to make room."""
        limit = self.max_connections
        if limit is None or self._open < limit:
            return True
        for idle in self._idle.values():
            if idle:
                self._discard(idle.popleft())
                return True
        return False

    async def _connect(self, route: Route, url: str) -> _Connection:
        proxy = route.proxy
        host, port = (proxy.host, proxy.port) if proxy is not None else (route.host, route.port)
        try:
            raw = await _open_socket(host, port)
        except OSError as exc:
            via = f" through proxy {proxy.shown}" if proxy is not None else ""
            raise ConnectError(f"cannot connect{via}: {exc}", url=url) from exc
        try:
            if route.scheme != "https":
                return _Connection(raw, None)
            stream = trio.SocketStream(trio.socket.from_stdlib_socket(raw))
            if proxy is not None:
                await _tunnel(stream, route, url)
            context = self._ssl if self._ssl is not None else tls_context()
            tls = trio.SSLStream(stream, context, server_hostname=route.host, https_compatible=True)
            try:
                await tls.do_handshake()
            except trio.BrokenResourceError as exc:
                raise ConnectError(_tls_failure(url, exc), url=url) from exc
            return _Connection(raw, tls)
        except BaseException:
            _close(raw)
            raise

    async def aclose(self) -> None:
        """Close the idle connections now and every busy one when its request ends.
        Idempotent; a closed client refuses new requests."""
        self._closed = True
        for idle in self._idle.values():
            while idle:
                self._discard(idle.pop())
        await trio.lowlevel.checkpoint()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


@attrs.frozen
class _Head:
    """A checked request head, and the event that tells h11 such a request went out."""

    data: bytes
    announce: h11.Request


@attrs.frozen
class _Outgoing:
    head: _Head
    length: bytes
    body: bytes
    method: str


_NO_BODY = frozenset({"GET", "HEAD", "DELETE", "OPTIONS", "TRACE"})
_TOKEN = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+")
_VALUE = re.compile(rb"[^\x00-\x08\x0a-\x1f\x7f]*")  # no control bytes but HTAB


@functools.cache
def _announcement(method: str, close: bool) -> h11.Request:
    """A request event with ``method`` and no body. h11 parses the response to our request;
    what it must know of the request (its method, whether it asked to close) is in this."""
    headers = [(b"host", b"-")] + ([(b"connection", b"close")] if close else [])
    return h11.Request(method=method, target=b"/", headers=headers)


_END = h11.EndOfMessage()


def _tls_failure(url: str, exc: BaseException) -> str:
    cause = exc.__cause__
    if isinstance(cause, ssl.SSLCertVerificationError):
        return (
            f"TLS certificate verification failed: {cause.verify_message}; "
            "if the server's certificate comes from a private CA, pass its PEM as ca_bundle"
        )
    return f"TLS handshake failed: {cause or exc}"


async def _tunnel(stream: trio.SocketStream, route: Route, url: str) -> None:
    """Ask the proxy for a tunnel to ``route``'s origin (``CONNECT host:port``)."""
    assert route.proxy is not None
    proxy = route.proxy
    authority = f"{route.host}:{route.port}".encode()
    headers = [(b"host", authority)]
    if proxy.authorization:
        headers.append((b"proxy-authorization", proxy.authorization))
    state = h11.Connection(h11.CLIENT)
    try:
        await stream.send_all(
            state.send(h11.Request(method="CONNECT", target=authority, headers=headers)) or b""
        )
        while True:
            event = state.next_event()
            if event is h11.NEED_DATA:
                state.receive_data(await stream.receive_some(_RECEIVE))
                continue
            if isinstance(event, h11.Response):
                break
            if not isinstance(event, h11.InformationalResponse):
                raise ProtocolError(f"proxy {proxy.shown} answered CONNECT with {event!r}", url=url)
    except (trio.BrokenResourceError, h11.RemoteProtocolError) as exc:
        raise ConnectError(f"proxy {proxy.shown} closed the tunnel: {exc}", url=url) from exc
    if not 200 <= event.status_code <= 299:
        raise ProxyError(
            f"proxy {proxy.shown} refused a tunnel with HTTP {event.status_code}"
            + (" (proxy authentication required)" if event.status_code == 407 else ""),
            url=url,
            status=event.status_code,
        )


class _Exchange:
    """One request: its deadlines (one cancel scope, moved as the phase changes) and its
    way through the pool."""

    __slots__ = ("client", "end", "limits", "phase", "route", "scope", "url")

    def __init__(self, client: HTTPClient, route: Route, url: str, limits: Timeouts) -> None:
        self.client = client
        self.route = route
        self.url = url
        self.limits = limits
        self.end = trio.current_time() + limits.total if limits.total is not None else math.inf
        self.scope = trio.CancelScope(deadline=self.end)
        self.phase = "pool"

    def _enter(self, phase: str, limit: float | None) -> None:
        self.phase = phase
        if limit is None:
            self.scope.deadline = self.end
        else:
            self.scope.deadline = min(self.end, trio.current_time() + limit)

    def timed_out(self) -> HTTPTimeout:
        limits = self.limits
        phase = self.phase
        if self.end != math.inf and trio.current_time() >= self.end:
            phase = "total"
        limit = {
            "connect": limits.connect,
            "write": limits.write,
            "read": limits.read,
        }.get(phase, limits.total)
        return HTTPTimeout(
            f"{phase} timeout ({limit or 0:g}s)",
            url=self.url,
            phase=phase,
            timeout=limit or 0.0,
        )

    async def _connection(self) -> tuple[_Connection, bool]:
        """A pooled connection (and True), else a fresh one (and False), waiting for one
        under ``max_connections``."""
        client = self.client
        while True:
            connection = client._take_idle(self.route)
            if connection is not None:
                return connection, True
            if client._room():
                return await self._fresh(), False
            await client._waiting.park()

    async def _fresh(self) -> _Connection:
        client = self.client
        client._open += 1
        try:
            self._enter("connect", self.limits.connect)
            connection = await client._connect(self.route, self.url)
        except BaseException:
            client._open -= 1
            if client._waiting:
                client._waiting.unpark()
            raise
        client._opened += 1
        return connection

    async def run(self, outgoing: _Outgoing) -> Response:
        client = self.client
        connection, reused = await self._connection()
        try:
            await self._send(connection, outgoing)
        except _SendFailed as exc:
            client._discard(connection)
            if exc.sent or not reused:
                raise self._broken(exc) from exc
            # A pooled connection the server had reset: nothing went out, so once more on a
            # fresh one.
            client._stale += 1
            connection = await self._fresh()
            try:
                await self._send(connection, outgoing)
            except _SendFailed as again:
                client._discard(connection)
                raise self._broken(again) from again
            except BaseException:
                client._discard(connection)
                raise
        except BaseException:
            client._discard(connection)
            raise
        try:
            status, headers, body = await self._receive(connection)
        except BaseException:
            client._discard(connection)
            raise
        client._check_in(self.route, connection)
        for name, value in headers:
            if name == b"content-encoding":
                limit = client.max_response_bytes
                body = decode_body(body, value.decode("latin-1"), limit=limit, url=self.url)
                break
        return Response(status, headers, body, self.url)

    def _broken(self, exc: _SendFailed) -> ConnectionClosed:
        return ConnectionClosed(
            f"the connection broke while sending the request: {exc}",
            url=self.url,
            request_sent=exc.sent,
        )

    async def _send(self, connection: _Connection, outgoing: _Outgoing) -> None:
        state = connection.h11
        state.send(outgoing.head.announce)
        state.send(_END)
        self._enter("write", self.limits.write)
        await connection.send(b"".join((outgoing.head.data, outgoing.length, outgoing.body)))

    async def _receive(
        self, connection: _Connection
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        state = connection.h11
        limit = self.client.max_response_bytes
        read = self.limits.read
        got_bytes = False
        status = 0
        headers: list[tuple[bytes, bytes]] = []
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                event = state.next_event()
            except h11.RemoteProtocolError as exc:
                if not got_bytes:
                    raise ConnectionClosed(
                        "the server closed the connection without answering",
                        url=self.url,
                        request_sent=True,
                    ) from exc
                raise ProtocolError(
                    f"the response is not valid HTTP/1.1: {exc}", url=self.url
                ) from exc
            if event is h11.NEED_DATA:
                self._enter("read", read)
                try:
                    data = await connection.receive(wait=not got_bytes)
                except (OSError, trio.BrokenResourceError) as exc:
                    raise ConnectionClosed(
                        f"the connection broke while reading the response: {exc}",
                        url=self.url,
                        request_sent=True,
                    ) from exc
                got_bytes = got_bytes or bool(data)
                state.receive_data(data)
            elif type(event) is h11.Data:
                size += len(event.data)
                if size > limit:
                    raise self._too_large(limit)
                chunks.append(event.data)
            elif type(event) is h11.Response:
                status = event.status_code
                headers = list(event.headers)
                for name, value in headers:
                    if name == b"content-length" and int(value) > limit:
                        raise self._too_large(limit)
            elif type(event) is h11.EndOfMessage:
                break
            elif type(event) is h11.ConnectionClosed:  # pragma: no cover - h11 raises instead
                raise ConnectionClosed(
                    "the server closed the connection mid-response",
                    url=self.url,
                    request_sent=True,
                )
        return status, headers, b"".join(chunks)

    def _too_large(self, limit: int) -> ResponseTooLarge:
        return ResponseTooLarge(
            f"the response body is over the limit of {limit:,} bytes (max_response_bytes)",
            url=self.url,
            limit=limit,
        )
