"""One resilient Redis connection: reconnect with backoff, stop on request."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, TypeVar

import redis
import trio
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from .entries import Log, redact

T = TypeVar("T")
_BACKOFF_FIRST = 0.1
_BACKOFF_CAP = 3.0


def connect(url: str, read_timeout: float) -> redis.Redis:
    # No client-side retries: a replayed MULTI/EXEC could publish twice. Link retries instead,
    # with a log line and a check before replaying a publish.
    return redis.Redis.from_url(
        url,
        protocol=2,  # the RESP2 reply shapes, the same in every redis-py >= 5
        decode_responses=True,
        retry=Retry(NoBackoff(), 0),
        socket_timeout=read_timeout,
        socket_connect_timeout=5.0,
    )


class Stopped(Exception):
    """The stop event fired while a call was waiting to retry."""


class Link:
    """A redis-py client whose calls run in worker threads and survive outages.

    `call` retries connection and timeout errors forever (capped, jittered exponential backoff,
    one log line per failure naming the URL, one when Redis answers again). Other errors
    (a ResponseError) are raised. Cancellation abandons the thread at once.
    """

    def __init__(self, url: str, *, read_timeout: float, log: Log) -> None:
        self.url = redact(url)
        self.client = connect(url, read_timeout)
        self._log = log

    async def call(
        self,
        what: str,
        fn: Callable[[redis.Redis, int], T],
        *,
        stop: trio.Event | None = None,
        abandon: bool = True,
    ) -> T:
        """`fn(client, attempt)` in a thread, retried while Redis is unreachable.

        `attempt` counts from 1, so `fn` can tell a replay. Raises `Stopped` if `stop` is set
        while waiting to retry. Cancellation abandons the thread at once, unless `abandon` is
        False: then an attempt in progress runs to its end (at most the read timeout) and its
        result is returned, so the caller learns what it did (e.g. the ids it added); a
        cancellation still stops the retries.
        """
        failures = 0
        while True:
            try:
                result = await trio.to_thread.run_sync(
                    fn, self.client, failures + 1, abandon_on_cancel=abandon
                )
            except (RedisConnectionError, RedisTimeoutError) as exc:
                failures += 1
                delay = min(_BACKOFF_CAP, _BACKOFF_FIRST * 2 ** (failures - 1))
                delay *= random.uniform(0.5, 1.0)
                self._log(
                    f"redis at {self.url} unreachable while {what} "
                    f"({type(exc).__name__}: {exc}); retry {failures} in {delay:.1f} s"
                )
                await _wait(delay, stop)
                continue
            except ResponseError:
                self._back(failures, what)  # Redis answered, with an error
                raise
            self._back(failures, what)
            return result

    def _back(self, failures: int, what: str) -> None:
        if failures:
            self._log(
                f"redis at {self.url} reachable again after {failures} failed "
                f"attempt{'s' if failures > 1 else ''} ({what})"
            )

    def close(self) -> None:
        self.client.close()


async def _wait(delay: float, stop: trio.Event | None) -> None:
    if stop is None:
        await trio.sleep(delay)
        return
    with trio.move_on_after(delay):
        await stop.wait()
    if stop.is_set():
        raise Stopped


def first_entry(response: Any) -> tuple[str, dict[str, str] | None] | None:
    """The one entry of an XREADGROUP COUNT 1 reply, or None (a timeout or an empty history)."""
    if not response:
        return None
    entries = response[0][1]
    if not entries:
        return None
    entry_id, fields = entries[0]
    return str(entry_id), fields
