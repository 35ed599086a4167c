"""One resilient Redis connection: reconnect with backoff, stop on request."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from .._core.backoff import Backoff
from .._core.exceptions import ConfigError, TrioTasksetsError
from ._entries import Log, check_url, redact
from ._resp import (
    MAX_REPLY_BYTES,
    Address,
    Connection,
    OddServer,
    RedisError,
    ReplyError,
    Unreachable,
    first_stream,
    run_id,
)

T = TypeVar("T")
# Between attempts through an outage: 0.1 s doubling up to 3 s, each wait in [cap/2, cap].
REDIS_BACKOFF = Backoff(0.1, 3.0, jitter=0.5)
_CONNECT_TIMEOUT = 5.0


def redis_url(url: str, parameter: str = "url") -> str:
    """`url` once `check_url` finds it a Redis URL; else a `ConfigError` naming `parameter`
    and saying what is wrong."""
    try:
        check_url(url)
    except ValueError as exc:
        raise ConfigError(f"{{{parameter}}}: {exc}", parameter=parameter) from None
    return url


class Stopped(TrioTasksetsError):
    """The stop event fired while a call was waiting to retry."""


class Link:
    """A Redis connection (`resp.Connection`) whose calls survive outages.

    `call` retries `Unreachable` forever (capped, jittered exponential backoff, one log line
    per failure naming the URL, one when Redis answers again) on a new connection, and so a
    ``LOADING`` reply (a Redis restarted from its AOF or RDB answers that to every command
    until its data is loaded: it ran nothing). Other errors (a `ReplyError`) are raised. No call is replayed behind the caller's back: `fn` is told
    which attempt it is. Calls may run at once: each holds a connection of its own while it
    runs (kept for the next call after), so there are as many as calls at once. A reply over
    `max_reply_bytes` is `Unreachable` (the connection is closed).
    """

    def __init__(
        self, url: str, *, read_timeout: float, log: Log, max_reply_bytes: int = MAX_REPLY_BYTES
    ) -> None:
        if max_reply_bytes < 1:
            raise ConfigError(
                f"{{max_reply_bytes}} must be >= 1, got {max_reply_bytes!r}",
                parameter="max_reply_bytes",
            )
        self.url = redact(url)
        self._address = Address.parse(url)
        self._read_timeout = read_timeout
        self._max_reply = max_reply_bytes
        self._idle: list[Connection] = []
        self._log = log

    async def call(
        self,
        what: str,
        fn: Callable[[Connection, int], Awaitable[T]],
        *,
        stop: trio.Event | None = None,
        abandon: bool = True,
    ) -> T:
        """`await fn(connection, attempt)`, retried while Redis is unreachable.

        `attempt` counts from 1, so `fn` can tell a replay. Raises `Stopped` if `stop` is set
        while waiting to retry. Cancellation abandons the attempt at once (its connection is
        closed), unless `abandon` is False: then an attempt in progress runs to its end (at
        most the read timeout per round trip) and its result is returned, so the caller learns what
        it did (e.g. the ids it added); a cancellation still stops the retries.
        """
        failures = 0
        while True:
            try:
                with trio.CancelScope(shield=not abandon):
                    connection = await self._connect()
                    try:
                        result = await fn(connection, failures + 1)
                    finally:
                        if not connection.closed:  # reused only if not stale by then
                            self._idle.append(connection)
            except (Unreachable, ReplyError) as exc:
                if isinstance(exc, ReplyError) and not loading(exc):
                    self._back(failures, what)  # Redis answered, with an error
                    raise
                self.close()  # the others are likely broken too
                failures += 1
                delay = REDIS_BACKOFF.delay(failures)
                self._log(
                    f"redis at {self.url} unreachable while {what} ({exc}); retry {failures} "
                    f"in {delay:.1f} s"
                )
                await _wait(delay, stop)
                continue
            self._back(failures, what)
            return result

    async def _connect(self) -> Connection:
        while self._idle:
            connection = self._idle.pop()
            if not connection.stale():
                return connection
            connection.close()
        return await Connection.open(
            self._address,
            connect_timeout=_CONNECT_TIMEOUT,
            read_timeout=self._read_timeout,
            max_reply_bytes=self._max_reply,
        )

    def _back(self, failures: int, what: str) -> None:
        if failures:
            self._log(
                f"redis at {self.url} reachable again after {failures} failed "
                f"attempt{'s' if failures > 1 else ''} ({what})"
            )

    def close(self) -> None:
        """Close the idle connections (the next call opens a new one)."""
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()


async def _wait(delay: float, stop: trio.Event | None) -> None:
    if stop is None:
        await trio.sleep(delay)
        return
    with trio.move_on_after(delay):
        await stop.wait()
    if stop.is_set():
        raise Stopped


def first_entry(reply: Any) -> tuple[str, dict[str, str] | None] | None:
    """The one entry of an XREADGROUP COUNT 1 reply, or None (a timeout or an empty history)."""
    found = first_stream(reply)
    return found[0] if found else None


async def server_run_id(url: str) -> str:
    """The `run_id` of the Redis at `url` (it changes when Redis restarts): one connection, no
    retry, 5 s at most for each step. Raises `resp.RedisError` (`Unreachable`, a
    `ReplyError` such as a refused login, or `OddServer` for an INFO without a run_id)."""
    connection = await Connection.open(
        Address.parse(url), connect_timeout=_CONNECT_TIMEOUT, read_timeout=_CONNECT_TIMEOUT
    )
    try:
        return run_id(await connection.execute("INFO", "server"), connection.address)
    finally:
        connection.close()


def loading(error: BaseException) -> bool:
    """Redis is loading its data after a restart (it refused the command: retry it)."""
    return isinstance(error, ReplyError) and str(error).startswith("LOADING")


_LOGIN_REFUSED = ("NOAUTH", "WRONGPASS", "ERR AUTH", "ERR invalid password", "ERR invalid username")


def login_refused(error: BaseException) -> bool:
    """Redis refused the login: a wrong or missing password (no retry mends that)."""
    return isinstance(error, ReplyError) and str(error).startswith(_LOGIN_REFUSED)


def unusable(flag: str, url: str, error: RedisError) -> tuple[str, str]:
    """What to tell someone whose `flag` URL failed with `error`: the message and the fix
    (a refused login names the URL's password; anything else, reaching Redis)."""
    if isinstance(error, OddServer):
        return (
            f"{flag} {redact(url)}: {error}",
            f"point {flag} at a redis-server (5.0 or later: streams, INFO run_id), not at a "
            f"proxy or a Redis look-alike",
        )
    if login_refused(error):
        return (
            f"{flag} {redact(url)}: Redis refused the login ({error})",
            "give the password in the URL: redis://[user]:password@host[:port][/db] "
            "(%-escape : @ / %)",
        )
    return (
        f"{flag} {redact(url)}: cannot reach Redis ({type(error).__name__}: {error})",
        "start redis-server there, or fix the URL",
    )
