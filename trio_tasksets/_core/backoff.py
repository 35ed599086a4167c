"""`Backoff`: the one wait-before-retry formula of the project (capped, jittered, exponential).

Every retry loop sleeps `Backoff.delay(retry)` before retry number `retry` (1-based): whole
episodes (`RetryPolicy`), model calls (`EndpointCalls`, the loop every HTTP model client
shares, which honours a server's Retry-After first) and Redis calls through an outage
(`redis.link.Link`). The cap for retry k is
``min(max, first * 2**(k-1))``; the wait is uniform in ``[cap * (1 - jitter), cap]``, so
``jitter=1`` is "full jitter" (uniform in [0, cap]: many clients retrying at once spread out
most) and ``jitter=0`` waits the cap exactly.

The defaults are written here once: `FIRST` and `MOST` (a `Backoff()`'s, an episode's
`RetryPolicy`'s and a model client's), and `MODEL_RETRIES` (a model call's retries).
"""

from __future__ import annotations

import random

import attrs

from .exceptions import ConfigError

__all__ = ["FIRST", "MODEL_RETRIES", "MOST", "Backoff"]

FIRST = 0.5
"""Seconds: the default cap of the first retry's wait (it doubles per retry)."""
MOST = 30.0
"""Seconds: the default longest wait, a server's Retry-After included."""
MODEL_RETRIES = 3
"""A model call's default retries after its first attempt (429, 5xx, no connection, timeout)."""


def _seconds(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ConfigError(
            f"{{{attribute.name}}} must be a number of seconds >= 0, got {value!r}",
            parameter=attribute.name,
        )


def _fraction(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ConfigError(
            f"{{{attribute.name}}} must be a fraction in [0, 1], got {value!r}",
            parameter=attribute.name,
        )


@attrs.frozen
class Backoff:
    """Capped exponential backoff with jitter; see the module docstring. A field out of
    range raises `ConfigError` naming it."""

    first: float = attrs.field(default=FIRST, validator=_seconds)
    max: float = attrs.field(default=MOST, validator=_seconds)
    jitter: float = attrs.field(default=1.0, validator=_fraction)

    def cap(self, retry: int) -> float:
        """The longest wait before retry number `retry` (1-based)."""
        # The exponent is capped: 2.0**1024 overflows a float long before `max` applies.
        return min(self.max, self.first * 2.0 ** min(max(retry - 1, 0), 60))

    def delay(self, retry: int, *, retry_after: float | None = None) -> float:
        """Seconds to wait before retry number `retry` (1-based). A server's `retry_after`
        (seconds, e.g. from a 429's Retry-After header) is honoured as given, up to `max`."""
        if retry_after is not None:
            return min(max(retry_after, 0.0), self.max)
        cap = self.cap(retry)
        return random.uniform(cap * (1.0 - self.jitter), cap)
