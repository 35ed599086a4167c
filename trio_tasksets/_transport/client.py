"""An HTTP/1.1 client for trio (h11 and a strict fast path), with a keep-alive pool that
follows its load.

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

Why not httpx: see docs/benchmarks.md (HTTP client). This module, `connection` and
`support` make the transport; nothing else of the package is imported.
"""

from __future__ import annotations

import math
import os
import ssl
from collections import deque
from collections.abc import Mapping, Sequence

import attrs
import h11
import trio

from .._core.exceptions import ConfigError
from .connection import (
    Connection,
    RequestHead,
    ResponseTooLargeSignal,
    SendFailed,
    Sink,
    close_socket,
    open_socket,
    read_response,
    request_head,
    tunnel,
)
from .memory import Handler, answer
from .messages import Request, Response
from .support import (
    CUT_SLOT,
    ConnectError,
    ConnectionClosed,
    HTTPTimeout,
    ProtocolError,
    Proxies,
    RequestCut,
    ResponseTooLarge,
    Route,
    Timeouts,
    decode_body,
    proxies_from_env,
    route_for,
    tls_context,
)

__all__ = ["HTTPClient", "PoolStats"]

USER_AGENT = b"trio-tasksets"
_CACHE = 256  # routes and request heads kept, each
_NO_BODY = frozenset({"GET", "HEAD", "DELETE", "OPTIONS", "TRACE"})


@attrs.frozen
class PoolStats:
    """Connections ``opened`` since the client was created, ``open`` now, how many of
    those are ``idle`` in the pool, and how many pooled ones were found ``stale`` (closed
    by the server) when a request wanted them."""

    opened: int
    open: int
    idle: int
    stale: int


class HTTPClient(trio.abc.AsyncResource):
    """HTTP/1.1 requests over pooled keep-alive connections (see the module docstring).

    ``timeouts``: the default `Timeouts` of a request. ``max_connections``: at most this many
    open (None: as many as requests in flight). ``keepalive_expiry``: seconds an idle
    connection is kept (under the 5 s after which uvicorn, and so vLLM and SGLang, close
    one: a close that races our reuse fails the request). ``max_response_bytes``: a longer
    body, before or after decoding, raises `ResponseTooLarge`. ``ca_bundle``: trust only
    these CA certificates (PEM file or directory); ``ssl_context``: or bring a whole context.
    ``proxy``: an ``http://`` proxy for every request; else, with ``trust_env``, the
    ``*_PROXY`` variables. ``headers``: sent with every request (a request's own win).
    ``handler``: answer every request in memory with ``handler(request)`` (a function, or
    an async one, of a `Request` returning a `Response`) and open no socket: the test seam
    (`trio_tasksets._transport.memory`); the timeouts and the size limit still apply.

    Use ``async with`` or `aclose`: idle connections close at once, busy ones when their
    request ends. A bad option raises `ConfigError` naming it (a proxy setting it cannot
    use: `UnsupportedProxy`, one)."""

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
        handler: Handler | None = None,
    ) -> None:
        if max_connections is not None and max_connections < 1:
            raise ConfigError(
                f"{{max_connections}} must be >= 1 or None, got {max_connections!r}",
                parameter="max_connections",
            )
        if not keepalive_expiry >= 0:
            raise ConfigError(
                f"{{keepalive_expiry}} must be >= 0 seconds, got {keepalive_expiry!r}",
                parameter="keepalive_expiry",
            )
        if max_response_bytes < 1:
            raise ConfigError(
                f"{{max_response_bytes}} must be >= 1, got {max_response_bytes!r}",
                parameter="max_response_bytes",
            )
        if ca_bundle is not None and ssl_context is not None:
            raise ConfigError(
                "pass {ca_bundle} or {ssl_context}, not both",
                parameter=("ca_bundle", "ssl_context"),
            )
        self.timeouts = timeouts if timeouts is not None else Timeouts()
        self.max_connections = max_connections
        self.keepalive_expiry = keepalive_expiry
        self.max_response_bytes = max_response_bytes
        self._ssl = tls_context(ca_bundle) if ca_bundle is not None else ssl_context
        if proxy is not None:
            explicit = proxies_from_env({"all_proxy": proxy})
            self._proxies = Proxies(explicit.http, explicit.https)
        else:
            self._proxies = proxies_from_env() if trust_env else Proxies()
        base = {"user-agent": USER_AGENT, "accept": b"*/*", "accept-encoding": b"gzip, deflate"}
        for name, value in (headers or {}).items():
            base[name.lower()] = value.encode("latin-1")
        self._base_headers = base
        self._handler = handler
        self._routes: dict[str, Route] = {}
        self._heads: dict[tuple[object, ...], RequestHead] = {}
        self._idle: dict[tuple[object, ...], deque[Connection]] = {}
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
        on_body: Sink | None = None,
    ) -> Response:
        """Send one request and read the whole response (any status). Raises an `HTTPError`
        subclass naming ``url`` when there is no usable response, a `ConfigError` (a
        ValueError) naming ``url``, ``method`` or ``headers`` for a URL that is not absolute
        http(s), a bad method or a bad header, ``RuntimeError`` once closed.

        ``on_body``: stream the body. A 2xx response's body is then handed to ``on_body``
        piece by piece as it arrives (server-sent events, a streamed reply) and the
        returned `Response` has an empty body; the request asks for ``identity`` encoding
        (an encoded streamed body raises `ProtocolError`), ``max_response_bytes`` bounds the
        body in all, the read timeout applies between pieces, the total one to the whole.
        What ``on_body`` raises propagates (the connection is closed). A handler's
        (in-memory) answer comes to ``on_body`` whole."""
        if self._closed:
            raise RuntimeError(f"HTTPClient is closed; cannot request {url}")
        await trio.lowlevel.checkpoint_if_cancelled()  # not a byte out if already cancelled
        if on_body is not None:
            pairs = list(headers.items() if isinstance(headers, Mapping) else headers or ())
            headers = [*pairs, ("accept-encoding", "identity")]
        slot = CUT_SLOT.get()
        if slot is not None and slot.cut:
            raise RequestCut(url)
        if self._handler is not None:
            response = await self._answer(self._handler, method, url, headers, body, timeouts)
            if on_body is not None and 200 <= response.status <= 299:
                if response.body:
                    on_body(response.body)
                response = attrs.evolve(response, body=b"")
            return response
        route = self._routes.get(url)
        if route is None:
            route = self._route(url)
        items = tuple(headers.items() if isinstance(headers, Mapping) else headers or ())
        head = self._heads.get((method, route, items))
        if head is None:
            head = self._head(method, route, items)
        if body or method not in _NO_BODY:
            data = b"%scontent-length: %d\r\n\r\n%s" % (head.data, len(body), body)
        else:
            data = head.data + b"\r\n"
        exchange = _Exchange(self, route, url, self.timeouts if timeouts is None else timeouts)
        if slot is None:
            with exchange.scope:
                return await exchange.run(head, data, on_body)
            raise exchange.timed_out()
        slot.scope = exchange.scope
        try:
            with exchange.scope:
                return await exchange.run(head, data, on_body)
        finally:
            slot.scope = None
        if slot.cut:
            raise RequestCut(url)
        raise exchange.timed_out()

    async def _answer(
        self,
        handler: Handler,
        method: str,
        url: str,
        headers: Mapping[str, str] | Sequence[tuple[str, str]] | None,
        body: bytes,
        timeouts: Timeouts | None,
    ) -> Response:
        """The handler's response (`trio_tasksets._transport.memory`), to the request as it
        would have been sent."""
        route_for(url, self._proxies)  # a URL that is not absolute http(s): ConfigError
        fields = {name: value.decode("latin-1") for name, value in self._base_headers.items()}
        for name, value in headers.items() if isinstance(headers, Mapping) else headers or ():
            fields[name.lower()] = value
        request = Request(method, url, list(fields.items()), body)
        limits = self.timeouts if timeouts is None else timeouts
        return await answer(handler, request, limits, max_bytes=self.max_response_bytes)

    def _route(self, url: str) -> Route:
        route = route_for(url, self._proxies)
        if len(self._routes) >= _CACHE:
            self._routes.clear()
        self._routes[url] = route
        return route

    def _head(self, method: str, route: Route, items: tuple[tuple[str, str], ...]) -> RequestHead:
        """The request head, checked once per header set (h11 checks every header of every
        request it sends: about 35 µs a request)."""
        fields = dict(self._base_headers)
        for name, value in items:
            fields[name.lower()] = value.encode("latin-1")
        if route.proxy is not None and route.proxy.authorization and route.scheme == "http":
            fields["proxy-authorization"] = route.proxy.authorization
        head = request_head(method, route, fields)
        if len(self._heads) >= _CACHE:
            self._heads.clear()
        self._heads[(method, route, items)] = head
        return head

    # --- the pool ---------------------------------------------------------------------------

    def _take_idle(self, route: Route) -> Connection | None:
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
        if connection.readable():
            self._stale += 1
            self._discard(connection)
            return None
        return connection

    def _discard(self, connection: Connection) -> None:
        connection.close()
        self._open -= 1
        if self._waiting:
            self._waiting.unpark()

    def _check_in(self, route: Route, connection: Connection) -> None:
        """Back to the pool (the caller knows it can carry another request)."""
        if self._closed:
            self._discard(connection)
            return
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

    async def _connect(self, route: Route, url: str) -> Connection:
        proxy = route.proxy
        host, port = (proxy.host, proxy.port) if proxy is not None else (route.host, route.port)
        try:
            raw = await open_socket(host, port)
        except OSError as exc:
            via = f" through proxy {proxy.shown}" if proxy is not None else ""
            raise ConnectError(f"cannot connect{via}: {exc}", url=url) from exc
        try:
            if route.scheme != "https":
                return Connection(raw, None)
            stream = trio.SocketStream(trio.socket.from_stdlib_socket(raw))
            if proxy is not None:
                await tunnel(stream, route, url)
            context = self._ssl if self._ssl is not None else tls_context()
            tls = trio.SSLStream(stream, context, server_hostname=route.host, https_compatible=True)
            try:
                await tls.do_handshake()
            except trio.BrokenResourceError as exc:
                raise ConnectError(_tls_failure(exc), url=url) from exc
            return Connection(raw, tls)
        except BaseException:
            close_socket(raw)
            raise

    async def aclose(self) -> None:
        """Close the idle connections now and every busy one when its request ends.
        Idempotent; a closed client refuses new requests."""
        self._closed = True
        for idle in self._idle.values():
            while idle:
                self._discard(idle.pop())
        await trio.lowlevel.checkpoint()


def _tls_failure(exc: BaseException) -> str:
    cause = exc.__cause__
    if isinstance(cause, ssl.SSLCertVerificationError):
        return (
            f"TLS certificate verification failed: {cause.verify_message}; "
            "if the server's certificate comes from a private CA, pass its PEM as ca_bundle"
        )
    return f"TLS handshake failed: {cause or exc}"


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

    def _reading(self) -> None:
        self._enter("read", self.limits.read)

    def timed_out(self) -> HTTPTimeout:
        phase = self.phase
        if self.end != math.inf and trio.current_time() >= self.end:
            phase = "total"
        limits = self.limits
        limit = {"connect": limits.connect, "write": limits.write, "read": limits.read}.get(
            phase, limits.total
        )
        return HTTPTimeout(
            f"{phase} timeout ({limit or 0:g}s)", url=self.url, phase=phase, timeout=limit or 0.0
        )

    async def _connection(self) -> tuple[Connection, bool]:
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

    async def _fresh(self) -> Connection:
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

    async def _send(self, connection: Connection, data: bytes) -> None:
        await connection.send(data, self._writing)

    def _writing(self) -> None:
        self._enter("write", self.limits.write)

    async def run(self, head: RequestHead, data: bytes, sink: Sink | None = None) -> Response:
        client = self.client
        connection, reused = await self._connection()
        try:
            await self._send(connection, data)
        except SendFailed as exc:
            client._discard(connection)
            if exc.sent or not reused:
                raise self._broken(exc) from exc
            # A pooled connection the server had reset: nothing went out; once more, fresh.
            client._stale += 1
            connection = await self._fresh()
            try:
                await self._send(connection, data)
            except SendFailed as again:
                client._discard(connection)
                raise self._broken(again) from again
            except BaseException:
                client._discard(connection)
                raise
        except BaseException:
            client._discard(connection)
            raise
        limit = client.max_response_bytes
        try:
            status, headers, body, reusable = await read_response(
                connection, head, limit, self._reading, sink
            )
        except Exception as exc:
            client._discard(connection)
            error = self._read_error(exc)
            if error is exc:
                raise
            raise error from exc
        except BaseException:
            client._discard(connection)
            raise
        if reusable:
            client._check_in(self.route, connection)
        else:
            client._discard(connection)
        for name, value in headers:
            if name == b"content-encoding":
                body = decode_body(body, value.decode("latin-1"), limit=limit, url=self.url)
                break
        return Response(status, headers, body, self.url)

    def _broken(self, exc: SendFailed) -> ConnectionClosed:
        return ConnectionClosed(
            f"the connection broke while sending the request: {exc}",
            url=self.url,
            request_sent=exc.sent,
        )

    def _read_error(self, exc: Exception) -> Exception:
        url = self.url
        if isinstance(exc, ResponseTooLargeSignal):
            limit = self.client.max_response_bytes
            return ResponseTooLarge(
                f"the response body is over the limit of {limit:,} bytes (max_response_bytes)",
                url=url,
                limit=limit,
            )
        if isinstance(exc, EOFError):
            return ConnectionClosed(str(exc), url=url, request_sent=True)
        if isinstance(exc, OSError | trio.BrokenResourceError):
            reason = f"the connection broke while reading the response: {exc}"
            return ConnectionClosed(reason, url=url, request_sent=True)
        if isinstance(exc, h11.RemoteProtocolError):
            return ProtocolError(f"the response is not valid HTTP/1.1: {exc}", url=url)
        return exc
