"""HTTP/1.1 on one connection, for `transport.client`: opening it (TCP, a proxy's ``CONNECT``),
sending a request head checked once per header set, and reading a whole response.

Responses are read by h11, except the common kind, which a strict fast path reads itself:
an ``HTTP/1.1`` status 200-599 (not 204 or 304) to a request other than HEAD or CONNECT,
with exactly one all-digit ``Content-Length``, no ``Transfer-Encoding``, and every header
line a token, a colon and a value without control bytes. Anything else, however slight, is
handed whole to h11, which then reads or refuses it. The reason is cost: h11 spends about
100 µs of CPU on such a response (being told of the request included), about half of what
aiohttp spends on a whole call, and the eval's goal leaves no room for it (see
docs/benchmarks.md, HTTP client). tests/test_http_transport.py holds the fast path to h11.
"""

from __future__ import annotations

import functools
import re
import select
import socket
from collections.abc import Callable
from typing import Any

import attrs
import h11
import trio

from .._core.exceptions import ConfigError, TrioTasksetsError
from .support import ConnectError, ProtocolError, ProxyError, Route

__all__ = [
    "Connection",
    "RequestHead",
    "ResponseTooLargeSignal",
    "SendFailed",
    "Sink",
    "open_socket",
    "parse_simple_head",
    "read_response",
    "request_head",
    "tunnel",
]

RECEIVE = 65536
MAX_HEAD = 65536  # bytes of a response head, its blank line included: a longer one is refused
TOKEN = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+")
VALUE = re.compile(rb"[^\x00-\x08\x0a-\x1f\x7f]*")  # no control bytes but HTAB
BLANK_LINE = re.compile(rb"\n\r?\n")  # where h11 ends a head
STATUS = re.compile(rb"HTTP/1\.1 ([2-5][0-9][0-9])(?: [^\x00-\x08\x0a-\x1f\x7f]*)?")


class SendFailed(TrioTasksetsError):
    """Sending failed; ``sent``: some of the request may have reached the kernel."""

    def __init__(self, cause: BaseException, sent: bool) -> None:
        super().__init__(str(cause) or type(cause).__name__)
        self.sent = sent


class ResponseTooLargeSignal(TrioTasksetsError):
    """The body is over the limit (the caller raises its own error naming the URL)."""


if hasattr(select, "poll"):

    def prober(fd: int) -> Callable[[], bool]:
        """A function telling, without blocking, whether ``fd`` is readable."""
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return lambda: bool(poller.poll(0))

else:  # pragma: no cover - Windows

    def prober(fd: int) -> Callable[[], bool]:
        return lambda: bool(select.select([fd], [], [], 0)[0])


class Connection:
    """One connection: a non-blocking socket, TLS over it if https. Plain connections use
    the socket itself with trio's wait_readable/wait_writable (trio's socket wrapper costs a
    scheduler round trip on every send)."""

    __slots__ = ("idle_since", "raw", "readable", "tls")

    def __init__(self, raw: socket.socket, tls: trio.SSLStream[Any] | None) -> None:
        self.raw = raw
        self.tls = tls
        self.idle_since = 0.0
        # Readable while idle means EOF, a reset or bytes nobody asked for: not reusable.
        self.readable = prober(raw.fileno())

    async def send(self, data: bytes, before_wait: Callable[[], None]) -> None:
        """Send all of ``data``; `SendFailed` tells whether any of it reached the kernel.
        ``before_wait`` is called once, before the first wait for the socket (to arm the
        write deadline): a request the kernel takes at once never waits, so it never needs
        one (setting a deadline costs about 2 us in trio's run loop)."""
        if self.tls is not None:
            before_wait()  # TLS may wait anywhere in send_all
            try:
                await self.tls.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise SendFailed(exc, sent=True) from exc  # TLS hides how much went out
            return
        view = memoryview(data)
        sent = 0
        armed = False
        try:
            while True:
                try:
                    sent += self.raw.send(view[sent:])
                except BlockingIOError:
                    if not armed:
                        before_wait()
                        armed = True
                    await trio.lowlevel.wait_writable(self.raw)
                    continue
                if sent >= len(view):
                    return
        except OSError as exc:
            raise SendFailed(exc, sent=sent > 0) from exc

    async def receive(self, wait: bool) -> bytes:
        """The next bytes (b"" at EOF). ``wait``: wait for readability before trying (so the
        first read of a response is always a checkpoint)."""
        if self.tls is not None:
            data = await self.tls.receive_some(RECEIVE)
            return data if isinstance(data, bytes) else bytes(data)
        while True:
            if wait:
                await trio.lowlevel.wait_readable(self.raw)
            try:
                return self.raw.recv(RECEIVE)
            except BlockingIOError:
                wait = True

    def close(self) -> None:
        close_socket(self.raw)  # abrupt: nothing is in flight on a connection we drop


def close_socket(raw: socket.socket) -> None:
    trio.lowlevel.notify_closing(raw)
    raw.close()


async def open_socket(host: str, port: int) -> socket.socket:
    """A connected non-blocking TCP socket to ``host:port``, trying its addresses in turn."""
    infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    failures: list[str] = []
    for family, kind, proto, _, address in infos:
        raw = socket.socket(family, kind, proto)
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await trio.socket.from_stdlib_socket(raw).connect(address)
        except OSError as exc:
            close_socket(raw)
            failures.append(f"{address[0]}: {exc.strerror or exc}")
            continue
        except BaseException:
            close_socket(raw)
            raise
        return raw
    raise OSError(f"all attempts to connect to {host}:{port} failed ({'; '.join(failures)})")


async def tunnel(stream: trio.SocketStream, route: Route, url: str) -> None:
    """Ask ``route``'s proxy for a tunnel to its origin (``CONNECT host:port``)."""
    assert route.proxy is not None
    proxy = route.proxy
    authority = f"{route.host}:{route.port}".encode()
    headers = [(b"host", authority)]
    if proxy.authorization:
        headers.append((b"proxy-authorization", proxy.authorization))
    state = h11.Connection(h11.CLIENT)
    try:
        request = h11.Request(method="CONNECT", target=authority, headers=headers)
        await stream.send_all(state.send(request) or b"")
        while True:
            event = state.next_event()
            if event is h11.NEED_DATA:
                state.receive_data(bytes(await stream.receive_some(RECEIVE)))
            elif isinstance(event, h11.Response):
                break
            elif not isinstance(event, h11.InformationalResponse):
                raise ProtocolError(f"proxy {proxy.shown} answered CONNECT with {event!r}", url=url)
    except (trio.BrokenResourceError, h11.RemoteProtocolError) as exc:
        raise ConnectError(f"proxy {proxy.shown} closed the tunnel: {exc}", url=url) from exc
    if not 200 <= event.status_code <= 299:
        required = " (proxy authentication required)" if event.status_code == 407 else ""
        raise ProxyError(
            f"proxy {proxy.shown} refused a tunnel with HTTP {event.status_code}{required}",
            url=url,
            status=event.status_code,
        )


# --- requests ---------------------------------------------------------------------------------


@attrs.frozen
class RequestHead:
    """A checked request line and headers, all but ``Content-Length`` and the blank line."""

    data: bytes
    method: str
    close: bool  # it asks the server to close the connection after the response


def request_head(method: str, route: Route, fields: dict[str, bytes]) -> RequestHead:
    """The head of a request to ``route`` with ``fields`` (lower-case names); a `ConfigError`
    (a ValueError) naming ``method`` or ``headers`` for a method or header that would not be
    a valid (or would be a smuggled) header."""
    if not TOKEN.fullmatch(method.encode("latin-1")):
        raise ConfigError(f"bad HTTP {{method}} {method!r}", parameter="method")
    lines = [b"%s %s HTTP/1.1\r\n" % (method.encode(), route.target)]
    fields = {"host": route.host_header, **fields}  # a Host of the caller's wins, first
    for name, value in fields.items():
        raw = name.encode("latin-1")
        if name in ("content-length", "transfer-encoding"):
            continue  # the transport frames the body
        if not TOKEN.fullmatch(raw) or not VALUE.fullmatch(value):
            raise ConfigError(
                f"bad {{headers}} entry for a request to {route.host}: {name!r}: {value!r}",
                parameter="headers",
            )
        lines.append(b"%s: %s\r\n" % (raw, value))
    close = b"close" in _tokens(fields.get("connection", b""))
    return RequestHead(b"".join(lines), method, close)


def _tokens(value: bytes) -> list[bytes]:
    return [token.strip().lower() for token in value.split(b",")]


# --- responses --------------------------------------------------------------------------------


Headers = list[tuple[bytes, bytes]]


def parse_simple_head(
    head: bytes, *, chunked: bool = False
) -> tuple[int, Headers, int, bool] | None:
    """(status, headers, content length, keep-alive) of a response head (without its blank
    line) of the simple kind the module docstring describes; None for any other. With
    ``chunked`` (a streamed body: `read_response`'s ``sink``), a head with exactly
    ``Transfer-Encoding: chunked`` and no ``Content-Length`` is simple too, its length -1."""
    lines = head.split(b"\r\n")
    match = STATUS.fullmatch(lines[0])
    if match is None:
        return None
    status = int(match.group(1))
    if status in (204, 304):
        return None
    headers: Headers = []
    length = -1
    keep = True
    is_chunked = False
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not TOKEN.fullmatch(name):
            return None  # also a folded line: it starts with whitespace
        value = value.strip(b" \t")
        if not VALUE.fullmatch(value):
            return None
        name = name.lower()
        if name == b"content-length":
            if length >= 0 or not value.isdigit() or len(value) > 18:
                return None
            length = int(value)
        elif name == b"transfer-encoding":
            if not chunked or value.lower() != b"chunked" or is_chunked:
                return None
            is_chunked = True
        elif name == b"connection" and b"close" in _tokens(value):
            keep = False
        headers.append((name, value))
    if is_chunked:
        return (status, headers, -1, keep) if length < 0 else None
    if length < 0:
        return None
    return status, headers, length, keep


Sink = Callable[[bytes], None]
"""Takes a streamed body's pieces as they arrive (`read_response`'s ``sink``)."""

MAX_CHUNK_LINE = 4096  # bytes of a chunk's size line (extensions included)
HEX = re.compile(rb"[0-9A-Fa-f]{1,15}")


async def read_response(
    connection: Connection,
    head: RequestHead,
    limit: int,
    before_read: Callable[[], None],
    sink: Sink | None = None,
) -> tuple[int, Headers, bytes, bool]:
    """Read the response to ``head``: (status, headers, body, whether the connection can
    carry another request). Calls ``before_read`` before each read (to arm its deadline).
    With a ``sink``, a 2xx body is not kept but handed to ``sink`` piece by piece as it
    arrives (its framing removed; the returned body is then ``b""``), still within
    ``limit`` in all; an exception the sink raises ends the read (the connection is not
    reusable). Only what one read brings is held at a time: the buffers stay bounded.
    A head is at most `MAX_HEAD` bytes (64 KiB, its blank line included) on either path. A
    complete response is returned whatever bytes follow it (those make the connection not
    reusable: it is closed, and the request is never sent again). Raises
    `ResponseTooLargeSignal` for a body over ``limit``, h11's RemoteProtocolError for an
    invalid response (or a head over `MAX_HEAD`), and OSError, trio.BrokenResourceError or `EOFError` (nothing
    or not all of it arrived) when the connection breaks."""
    buffer = bytearray()
    closed = False
    while (blank := BLANK_LINE.search(buffer)) is None:
        if len(buffer) > MAX_HEAD:
            raise h11.RemoteProtocolError(f"the response head is over {MAX_HEAD} bytes")
        before_read()
        data = await connection.receive(wait=not buffer)
        if not data:
            closed = True
            break
        buffer += data
    if blank is not None and blank.end() > MAX_HEAD:  # the head, its blank line included
        raise h11.RemoteProtocolError(f"the response head is over {MAX_HEAD} bytes")
    simple = None
    # The head ends at the first blank line, as h11 finds it; the fast path wants CRLF CRLF.
    end = blank.start() - 1 if blank is not None and blank.group() == b"\n\r\n" else -1
    if end >= 0 and buffer[end] == 13 and head.method not in ("HEAD", "CONNECT"):
        simple = parse_simple_head(bytes(buffer[:end]), chunked=sink is not None)
    if simple is None:
        return await _read_with_h11(connection, head, limit, before_read, buffer, closed, sink)
    status, headers, length, keep = simple
    if length > limit:
        raise ResponseTooLargeSignal
    if sink is not None and 200 <= status <= 299:
        _check_identity(headers)
        del buffer[: end + 4]
        if length < 0:
            done = await _stream_chunked(connection, buffer, limit, before_read, sink)
        else:
            done = await _stream_length(connection, buffer, length, before_read, sink)
        return status, headers, b"", keep and not head.close and done
    need = end + 4 + length
    while len(buffer) < need:
        before_read()
        data = await connection.receive(wait=False)
        if not data:
            raise EOFError("the server closed the connection mid-response")
        buffer += data
    reusable = keep and not head.close and len(buffer) == need  # no bytes nobody asked for
    return status, headers, bytes(buffer[end + 4 : need]), reusable


def _check_identity(headers: Headers) -> None:
    """A streamed body comes as sent (the client asks for ``identity``): an encoded one is
    refused (h11's RemoteProtocolError), not handed on undecoded."""
    for name, value in headers:
        if name == b"content-encoding" and value.strip().lower() not in (b"", b"identity"):
            raise h11.RemoteProtocolError(
                f"a streamed body came with Content-Encoding {value.decode('latin-1')!r}, "
                "though the client asked for identity"
            )


async def _stream_length(
    connection: Connection,
    buffer: bytearray,
    length: int,
    before_read: Callable[[], None],
    sink: Sink,
) -> bool:
    """Hand a body of ``length`` bytes to ``sink`` as it arrives, from what ``buffer`` holds
    on; whether nothing followed it."""
    left = length
    data = bytes(buffer)
    drained = False
    while True:
        piece = data[:left]
        extra = len(data) > left  # bytes after the body: the connection is not reusable
        if piece:
            left -= len(piece)
            sink(piece)
        if left <= 0:
            return not extra
        before_read()
        data = await connection.receive(wait=drained)
        if not data:
            raise EOFError("the server closed the connection mid-response")
        drained = _drained(data)


def _drained(data: bytes) -> bool:
    """Whether a read that brought `data` took all the socket had (less than it asked
    for): a stream's next read then waits for readability first rather than trying a
    read that would fail (a reply streamed token by token brings one token a read, and a
    failed read costs a system call and an exception)."""
    return len(data) < RECEIVE


async def _stream_chunked(
    connection: Connection,
    buffer: bytearray,
    limit: int,
    before_read: Callable[[], None],
    sink: Sink,
) -> bool:
    """Hand a chunked body (RFC 9112 7.1) to ``sink`` as it arrives, from what ``buffer``
    holds on: what each read brings, its chunks' data joined in one call before the next
    wait (a server streaming a token a chunk sends hundreds of small ones), the chunk
    sizes, extensions and trailers dropped. Whether nothing followed the body. Bytes that
    are not chunked framing raise h11's RemoteProtocolError (as the h11 path would)."""
    pos = 0
    total = 0
    pending: list[bytes] = []
    bulk = True  # whether `_whole_chunks` may find chunks in what the last read brought
    drained = False  # whether the last read took all there was (see `_drained`)

    def flush() -> None:
        if pending:
            data = pending[0] if len(pending) == 1 else b"".join(pending)
            pending.clear()
            sink(data)

    async def more() -> None:
        nonlocal pos, bulk, drained
        flush()
        if pos:
            del buffer[:pos]
            pos = 0
        before_read()
        data = await connection.receive(wait=drained)
        if not data:
            raise EOFError("the server closed the connection mid-response")
        drained = _drained(data)
        buffer.extend(data)
        bulk = True

    while True:
        if bulk:
            bulk = False
            datas, used = _whole_chunks(bytes(buffer[pos:]))
            if used:
                total += sum(map(len, datas))
                if total > limit:
                    raise ResponseTooLargeSignal
                pending.extend(datas)
                pos += used
                bulk = True  # the next chunk may be one it leaves to the loop below
        while (eol := buffer.find(b"\r\n", pos)) < 0:
            if len(buffer) - pos > MAX_CHUNK_LINE:
                raise h11.RemoteProtocolError("a chunk size line is too long")
            await more()
        size_text = bytes(buffer[pos:eol]).split(b";", 1)[0].strip(b" \t")
        if not HEX.fullmatch(size_text):
            raise h11.RemoteProtocolError(f"bad chunk size line {bytes(buffer[pos:eol])[:40]!r}")
        size = int(size_text, 16)
        pos = eol + 2
        if size == 0:  # the last chunk: trailers (dropped) up to a blank line
            flush()
            while True:
                while (eol := buffer.find(b"\r\n", pos)) < 0:
                    if len(buffer) - pos > MAX_HEAD:
                        raise h11.RemoteProtocolError("the trailers are too long")
                    await more()
                if eol == pos:
                    return eol + 2 == len(buffer)
                pos = eol + 2
        total += size
        if total > limit:
            raise ResponseTooLargeSignal
        while size:
            if pos >= len(buffer):
                await more()
            take = min(size, len(buffer) - pos)
            pending.append(bytes(buffer[pos : pos + take]))
            pos += take
            size -= take
        while len(buffer) - pos < 2:
            await more()
        if buffer[pos : pos + 2] != b"\r\n":
            raise h11.RemoteProtocolError("a chunk's data is not followed by CRLF")
        pos += 2


_HEXDIGITS = b"0123456789abcdefABCDEF"


def _whole_chunks(region: bytes) -> tuple[list[bytes], int]:
    """The data of the whole chunks at the start of `region` (which starts at a chunk's
    size line) and the bytes they take, found in bulk: split at every CRLF, the parts are
    size, data, size, data, ... as long as no data holds a CRLF of its own, and each size
    (hex digits alone: no extension) must match its data's length. It stops before the
    first chunk that does not (or the last chunk, size 0), which the exact loop reads:
    ([], 0) when that is the first."""
    parts = region.split(b"\r\n")
    pairs = (len(parts) - 1) // 2  # the sizes whose data's CRLF has come
    if not pairs:
        return [], 0
    sizes, datas = parts[0 : 2 * pairs : 2], parts[1 : 2 * pairs : 2]
    if not all(sizes) or b"".join(sizes).translate(None, _HEXDIGITS) or max(map(len, sizes)) > 15:
        return [], 0  # an extension or bad bytes: the loop reads (or refuses) them
    declared = [int(size, 16) for size in sizes]
    lengths = list(map(len, datas))
    whole = pairs
    if declared != lengths:
        whole = next(k for k, (a, b) in enumerate(zip(declared, lengths, strict=True)) if a != b)
    if 0 in declared[:whole]:
        whole = declared.index(0)
    used = sum(lengths[:whole]) + sum(map(len, sizes[:whole])) + 4 * whole
    return datas[:whole], used


@functools.cache
def _announcement(method: str, close: bool) -> h11.Request:
    """What h11 must know of our request to read its response: the method, and whether it
    asked to close. (The request itself was sent as checked bytes.)"""
    headers = [(b"host", b"-")] + ([(b"connection", b"close")] if close else [])
    return h11.Request(method=method, target=b"/", headers=headers)


async def _read_with_h11(
    connection: Connection,
    head: RequestHead,
    limit: int,
    before_read: Callable[[], None],
    buffer: bytearray,
    eof: bool,
    sink: Sink | None = None,
) -> tuple[int, Headers, bytes, bool]:
    """`read_response` by h11, from what is in ``buffer`` (and EOF, if ``eof``) on (a 2xx
    body to ``sink``, if given, as `read_response` says)."""
    state = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
    state.send(_announcement(head.method, head.close))
    state.send(h11.EndOfMessage())
    if buffer:
        state.receive_data(bytes(buffer))
    if eof:
        state.receive_data(b"")
    got_bytes = bool(buffer)
    status = 0
    streaming = False
    headers: Headers = []
    chunks: list[bytes] = []
    size = 0
    while True:
        try:
            event = state.next_event()
        except h11.RemoteProtocolError:
            if eof:
                raise EOFError(
                    "the server closed the connection mid-response"
                    if got_bytes
                    else "the server closed the connection without answering"
                ) from None
            raise
        if event is h11.NEED_DATA:
            before_read()
            data = await connection.receive(wait=not got_bytes)
            got_bytes = got_bytes or bool(data)
            eof = not data
            state.receive_data(data)
        elif type(event) is h11.Data:
            size += len(event.data)
            if size > limit:
                raise ResponseTooLargeSignal
            if streaming:
                sink(bytes(event.data))  # type: ignore[misc]
            else:
                chunks.append(event.data)
        elif type(event) is h11.Response:
            status = event.status_code
            headers = list(event.headers)
            streaming = sink is not None and 200 <= status <= 299
            if streaming:
                _check_identity(headers)
            for name, value in headers:
                if name == b"content-length" and int(value) > limit:
                    raise ResponseTooLargeSignal
        elif type(event) is h11.EndOfMessage:
            break
        elif type(event) is h11.ConnectionClosed:  # pragma: no cover - h11 raises instead
            raise EOFError("the server closed the connection mid-response")
    # A complete response is returned whatever follows it; bytes after it (junk h11 would
    # refuse, or the start of an answer nobody asked for) make the connection not reusable.
    left, closed = state.trailing_data
    reusable = (
        state.our_state is h11.DONE and state.their_state is h11.DONE and not left and not closed
    )
    return status, headers, b"".join(chunks), reusable
