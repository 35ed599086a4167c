"""One Redis connection on trio: commands, pipelines and MULTI/EXEC over RESP2.

Commands are packed here and replies parsed by hiredis (Redis's own C parser); the socket is
trio's, so a command costs no thread hop. Why not redis-py (in a worker thread) or coredis:
docs/benchmarks.md, "The Redis client". Replies keep RESP2's shapes, strings decoded as UTF-8
(an invalid byte becomes U+FFFD); an error reply is a `ReplyError`.
"""

from __future__ import annotations

import select
import ssl
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import attrs
import hiredis
import trio

from .._core.exceptions import ConfigError, TrioTasksetsError

Arg = str | bytes | int | float
Command = Sequence[Arg]

_DEFAULT_PORT = 6379
_READ_SIZE = 65536
# Every reply of the last round trip was read, so Redis has read its commands and the socket's
# send buffer (16 KiB by default on Linux) is empty: a send this small cannot block; it skips the
# deadline (a cancel scope around it costs about 15 µs per call). A larger one is under it.
_SMALL_SEND = 16384
_QUERY = frozenset({"db", "ssl_cert_reqs", "ssl_ca_certs"})
_CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}
_MORE = object()  # hiredis: no whole reply buffered yet
MAX_REPLY_BYTES = 64 * 2**20
"""Bytes one reply may take on the wire by default (`Connection.open`'s `max_reply_bytes`)."""


class RedisError(TrioTasksetsError):
    """A Redis call failed."""


class ReplyError(RedisError):
    """Redis answered with an error (`NOGROUP ...`, `WRONGTYPE ...`, `BUSYGROUP ...`)."""


class OddServer(RedisError):
    """The server answered what no Redis answers (a proxy, or a Redis look-alike without
    streams): the message names the server and what it answered."""


class Unreachable(RedisError):
    """Redis could not be reached, or the connection broke or timed out during a call (which
    may or may not have run). The connection is closed; open a new one to go on."""


def _bad_url(message: str) -> ConfigError:
    """A Redis URL that does not parse: a `ConfigError` naming `url`."""
    return ConfigError(message, parameter="url")


@attrs.frozen
class Address:
    """Where a Redis is and how to log in: parsed from a `redis://`, `rediss://` (TLS) or
    `unix://` URL (`Address.parse`)."""

    host: str = "localhost"
    port: int = _DEFAULT_PORT
    path: str | None = None  # a unix socket
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    cert_reqs: ssl.VerifyMode = ssl.CERT_REQUIRED
    ca_certs: str | None = None

    @classmethod
    def parse(cls, url: str) -> Address:
        """The address `url` names; a `ConfigError` naming `url` says what is wrong. Query parameters: `db`,
        and for rediss:// `ssl_cert_reqs` (none, optional, required) and `ssl_ca_certs`."""
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise _bad_url(f"scheme {parts.scheme!r}: use redis://, rediss:// or unix://")
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        unknown = sorted(set(query) - _QUERY)
        if unknown:
            raise _bad_url(f"unknown query parameter {', '.join(unknown)}: known are db, "
                             f"ssl_cert_reqs, ssl_ca_certs")  # fmt: skip
        db_text = query.get("db")
        if parts.scheme != "unix" and parts.path not in ("", "/"):
            db_text = parts.path.lstrip("/")
        try:
            db = int(db_text) if db_text is not None else 0
            port = parts.port
        except ValueError as exc:
            raise _bad_url(f"bad db or port ({exc})") from None
        if db < 0:
            raise _bad_url(f"db must be >= 0, got {db}")
        reqs = query.get("ssl_cert_reqs", "required").lower()
        if reqs not in _CERT_REQS:
            raise _bad_url(f"ssl_cert_reqs must be none, optional or required, got {reqs!r}")
        if parts.scheme == "unix" and not parts.path:
            raise _bad_url("unix:// needs a socket path: unix:///path/to/redis.sock")
        if parts.scheme != "unix" and not parts.hostname:
            raise _bad_url("no host: redis://host[:port][/db]")
        return cls(
            host=parts.hostname or "localhost",
            port=port or _DEFAULT_PORT,
            path=unquote(parts.path) if parts.scheme == "unix" else None,
            db=db,
            username=unquote(parts.username) if parts.username else None,
            password=unquote(parts.password) if parts.password is not None else None,
            tls=parts.scheme == "rediss",
            cert_reqs=_CERT_REQS[reqs],
            ca_certs=query.get("ssl_ca_certs"),
        )

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca_certs)
        if self.cert_reqs != ssl.CERT_REQUIRED:
            context.check_hostname = False
        context.verify_mode = self.cert_reqs
        return context

    def __str__(self) -> str:
        return f"unix://{self.path}" if self.path else f"{self.host}:{self.port}"


def pack(command: Command) -> bytes:
    """`command` in RESP (an array of bulk strings)."""
    out = [b"*%d\r\n" % len(command)]
    for arg in command:
        if isinstance(arg, str):
            data = arg.encode()
        elif isinstance(arg, bytes):
            data = arg
        elif isinstance(arg, int):
            data = b"%d" % arg
        else:
            data = repr(float(arg)).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


class Connection:
    """One connection to Redis, used by one task at a time.

    A call that fails in transit (a broken socket, not sent and answered within
    `read_timeout`, a cancellation) raises (`Unreachable`, or the cancellation) and leaves the
    connection closed: its replies can no longer be matched to its commands. So does a
    server that sends more replies than it was sent commands (a misbehaving server or
    proxy: every later reply would be off by one), and one whose reply takes more than
    `max_reply_bytes` (within one read of 64 KiB) before it is whole.
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        address: Address,
        read_timeout: float,
        max_reply_bytes: int = MAX_REPLY_BYTES,
    ) -> None:
        if max_reply_bytes < 1:
            raise ConfigError(
                f"{{max_reply_bytes}} must be >= 1, got {max_reply_bytes!r}",
                parameter="max_reply_bytes",
            )
        self._stream = stream
        self._socket = _socket_of(stream)
        self._address = address
        self._read_timeout = read_timeout
        self._max_reply = max_reply_bytes
        self._reader = hiredis.Reader(
            encoding="utf-8", errors="replace", replyError=ReplyError, notEnoughData=_MORE
        )
        self.closed = False

    @classmethod
    async def open(
        cls,
        address: Address,
        *,
        connect_timeout: float = 5.0,
        read_timeout: float = 10.0,
        max_reply_bytes: int = MAX_REPLY_BYTES,
    ) -> Connection:
        """Connect, log in (AUTH) and select the db. `Unreachable` if Redis cannot be reached
        within `connect_timeout`; `ReplyError` if it refuses the login."""
        if max_reply_bytes < 1:
            raise ConfigError(
                f"{{max_reply_bytes}} must be >= 1, got {max_reply_bytes!r}",
                parameter="max_reply_bytes",
            )
        stream: trio.abc.Stream | None = None
        try:
            with trio.fail_after(connect_timeout):
                if address.path is not None:
                    stream = await trio.open_unix_socket(address.path)
                else:
                    stream = await trio.open_tcp_stream(address.host, address.port)
                if address.tls:
                    stream = trio.SSLStream(
                        stream, address.ssl_context(), server_hostname=address.host
                    )
                    await stream.do_handshake()
        except BaseException as exc:
            if stream is not None:
                _socket_of(stream).close()  # a TLS handshake that failed or timed out
            if isinstance(exc, trio.TooSlowError):
                raise Unreachable(
                    f"no connection to {address} within {connect_timeout:g} s"
                ) from None
            if isinstance(exc, (OSError, trio.BrokenResourceError)):
                raise Unreachable(f"cannot connect to {address}: {_reason(exc)}") from None
            raise
        connection = cls(stream, address, read_timeout, max_reply_bytes)
        hello: list[Command] = []
        if address.password is not None:
            login = [address.username] if address.username else []
            hello.append(["AUTH", *login, address.password])
        if address.db:
            hello.append(["SELECT", address.db])
        if hello:
            try:
                await connection.pipeline(hello)
            except BaseException:
                connection.close()
                raise
        return connection

    async def execute(self, *command: Arg) -> Any:
        """Run one command; its reply, or `ReplyError`."""
        [reply] = await self.pipeline([command])
        return reply

    async def pipeline(
        self, commands: Sequence[Command], *, transaction: bool = False, raise_errors: bool = True
    ) -> list[Any]:
        """Send `commands` at once and read their replies (one round trip).

        `transaction`: wrapped in MULTI/EXEC, so they run together; the replies are EXEC's.
        `raise_errors`: raise the first error reply (after reading them all); else error
        replies are returned in place, as `ReplyError` instances.
        """
        if transaction:
            commands = [("MULTI",), *commands, ("EXEC",)]
        replies = await self._roundtrip(b"".join(pack(c) for c in commands), len(commands))
        if transaction:
            executed = replies[-1]
            for reply in replies[:-1]:  # MULTI's OK, then each QUEUED
                if isinstance(reply, ReplyError):
                    raise reply  # refused while queueing: EXEC discarded them all
            if not isinstance(executed, list):
                raise executed if isinstance(executed, ReplyError) else ReplyError("EXEC aborted")
            replies = executed
        if raise_errors:
            for reply in replies:
                if isinstance(reply, ReplyError):
                    raise reply
        return list(replies)

    async def _roundtrip(self, data: bytes, count: int) -> list[Any]:
        if self.closed:
            raise Unreachable(f"connection to {self._address} is closed")
        done = False
        try:
            try:
                replies: list[Any] = []
                small = len(data) <= _SMALL_SEND
                if small:
                    await self._stream.send_all(data)
                with trio.move_on_after(self._read_timeout) as waited:
                    if not small:
                        await self._stream.send_all(data)
                    pending = 0  # bytes received since the last whole reply
                    while len(replies) < count:
                        reply = self._reader.gets()
                        if reply is _MORE:
                            if pending > self._max_reply:
                                raise Unreachable(
                                    f"{self._address} sent a reply over {self._max_reply:,} "
                                    f"bytes (max_reply_bytes)"
                                )
                            chunk = await self._stream.receive_some(_READ_SIZE)
                            if not chunk:
                                raise Unreachable(f"{self._address} closed the connection")
                            self._reader.feed(bytes(chunk))
                            pending += len(chunk)
                        else:
                            replies.append(reply)
                            pending = 0
                    if self._reader.has_data():
                        raise Unreachable(
                            f"{self._address} sent more replies than it was sent commands "
                            f"(a misbehaving server or proxy); the connection is closed"
                        )
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise Unreachable(f"connection to {self._address} failed: {_reason(exc)}") from None
            except hiredis.ProtocolError as exc:
                raise Unreachable(f"{self._address} broke the protocol: {exc}") from None
            if waited.cancelled_caught:
                raise Unreachable(f"no reply from {self._address} within {self._read_timeout:g} s")
            done = True
            return replies
        finally:
            if not done:
                self.close()

    @property
    def address(self) -> Address:
        return self._address

    def stale(self) -> bool:
        """Whether the idle connection can no longer be used: closed, or Redis hung up (its
        `timeout` setting, a restart) or sent something unasked. A reused connection is checked
        first, so an idle hang-up costs a new connection, not a failed call."""
        if self.closed or self._reader.has_data():
            return True
        try:
            return _readable(self._socket.fileno())
        except (OSError, ValueError):
            return True

    def close(self) -> None:
        """Close the socket now (no goodbye: Redis needs none)."""
        if not self.closed:
            self.closed = True
            self._socket.close()


def _readable(fd: int) -> bool:
    if hasattr(select, "poll"):  # select() cannot take a descriptor above 1023
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(0))
    readable, _, _ = select.select([fd], [], [], 0)
    return bool(readable)


def _socket_of(stream: trio.abc.Stream) -> trio.socket.SocketType:
    """The socket under `stream` (under TLS, the transport's)."""
    while not isinstance(stream, trio.SocketStream):
        assert isinstance(stream, trio.SSLStream), stream
        stream = stream.transport_stream
    return stream.socket


def _reason(exc: BaseException) -> str:
    """What went wrong underneath: TLS's own error, or the first of trio's connect attempts."""
    cause = exc.__cause__
    if isinstance(exc, trio.BrokenResourceError) and cause is not None:
        exc = cause
    elif isinstance(cause, BaseExceptionGroup) and cause.exceptions:
        exc = cause.exceptions[0]
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _shown(reply: Any) -> str:
    text = repr(reply)
    return text if len(text) <= 120 else text[:117] + "..."


def fields(flat: Sequence[Any] | None) -> dict[str, Any] | None:
    """A flat `[name, value, name, value, ...]` reply as a dict (None stays None: an entry
    deleted from its stream)."""
    if flat is None:
        return None
    return dict(zip(flat[::2], flat[1::2], strict=True))


def entries(reply: Sequence[Any] | None) -> list[tuple[str, dict[str, Any] | None]]:
    """The entries of an XRANGE reply, or of one stream of an XREAD/XREADGROUP reply:
    `(id, fields)`, fields None for an entry deleted meanwhile. `OddServer` for a reply of
    another shape."""
    if reply is not None and not isinstance(reply, list):
        raise OddServer(f"the server answered a stream read with {_shown(reply)}")
    try:
        return [(str(entry_id), fields(flat)) for entry_id, flat in reply or ()]
    except (TypeError, ValueError) as exc:
        raise OddServer(f"the server answered a stream read with {_shown(reply)}") from exc


def first_stream(reply: Sequence[Any] | None) -> list[tuple[str, dict[str, Any] | None]]:
    """The entries of the first (only) stream of an XREAD/XREADGROUP reply (None: none came);
    `OddServer` for a reply of another shape."""
    if not reply:
        return []
    if not isinstance(reply, list) or not isinstance(reply[0], list) or len(reply[0]) != 2:
        raise OddServer(f"the server answered a stream read with {_shown(reply)}")
    return entries(reply[0][1])


def run_id(reply: Any, server: object) -> str:
    """The `run_id` of an ``INFO server`` reply from `server`; `OddServer` naming it and
    what it answered if there is none."""
    found = info(reply).get("run_id") if isinstance(reply, str) else None
    if not found:
        raise OddServer(
            f"{server} answered INFO server with {_shown(reply)}, which has no run_id: it is "
            f"not a Redis server (a proxy, or a Redis look-alike?)"
        )
    return found


def info(text: str) -> dict[str, str]:
    """An INFO reply as a dict of its `name:value` lines."""
    pairs = (line.partition(":") for line in text.splitlines() if line and line[0] != "#")
    return {name: value for name, _, value in pairs}
