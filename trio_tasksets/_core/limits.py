"""Limits on model calls, on trio's clock: rates (GCRA) and concurrency per endpoint.

* `RateLimiter(per_minute, burst=1)`: a GCRA limiter of units per minute (requests, or
  tokens). `await limiter.acquire(cost)` waits until `cost` more units fit and returns the
  seconds it waited; `limiter.meter(units)` charges (or, negative, refunds) units after the
  fact.
* `TokenLimiter(tokens_per_minute)`: a RateLimiter of tokens whose cost is metered from a
  response's usage, optionally reserving `max_tokens` up front:
  `async with tpm.reserve(max_tokens) as metered: ...; metered.used(usage_tokens)`.
* `ConnectionLimiter(limit)`: at most `limit` calls in flight per key (an endpoint), fixed
  (`int`) or adaptive (`AdaptiveBounds`: one `AdaptiveWindow` per key).
* `EndpointLimits(connections=, rpm=, tpm=)`: the three together, per key, around one call.
* `observe_calls(observer)`: within the block (this task and the tasks it starts), every
  call through an `EndpointLimits` tells `observer.on_wait` what it waited for, every
  `report_outcome` (a model client's attempt: an HTTP status) reaches `observer.on_outcome`,
  and every `rest` (a client's wait before a retry) happens inside `observer.resting`: how
  an episode's row learns its waits, and an adaptive rollout window its 429s (and lends the
  place of a rollout waiting out a Retry-After).
* `report_wait(connection, rate)`: a wait outside `EndpointLimits` (a pool's queue), told
  to the observers as `on_wait`.
* `parked(kind)`: the block is one of the runner's own waits (`"connection"`, `"rpm"`,
  `"tpm"`, `"retry_after"`, `"backoff"`, `"retry"`, `"pace"`: a request-rate limit's
  pacing); the observers hear it begin
  (`on_park`) and end (`on_unpark`), so a working-time clock stops while it lasts (working time is wall time less these waits).
  The limiters here and `rest` wait inside one.

All of them only read `trio.current_time()`, so they are exact on a `MockClock`.
"""

from __future__ import annotations

import contextvars
import math
import re
from collections.abc import AsyncIterator, Hashable, Iterable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import attrs
import trio

from .adaptive import AdaptiveBounds, AdaptiveWindow, Outcome
from .exceptions import ConfigError
from .window import Window

__all__ = [
    "Call",
    "CallObserver",
    "ConnectionLimiter",
    "EndpointLimits",
    "Metered",
    "RateLimiter",
    "Slot",
    "TokenLimiter",
    "current_observers",
    "observe_calls",
    "pace",
    "parked",
    "report_outcome",
    "report_progress",
    "report_stream",
    "report_wait",
    "rest",
    "says_request_rate",
]


def _check_rate(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{{{name}}} must be a finite number > 0, got {value!r}", parameter=name)
    if value <= 0:
        raise ConfigError(f"{{{name}}} must be > 0, got {value}", parameter=name)
    return float(value)


class RateLimiter:
    """At most `per_minute` units per minute, in bursts of at most `burst` units (GCRA).

    Think of a bucket of `burst` units that drains at `per_minute / 60` units a second: a
    call of `cost` units goes once they fit. With `burst=1` (the default) unit calls are
    spread evenly, one every `60 / per_minute` seconds, never two at once. A cost larger than
    `burst` is let through once the bucket is empty and leaves it in debt, which later calls
    wait out: over any span of `s` seconds at most `max(burst, largest cost) + s * per_minute
    / 60` units start. Callers are served in arrival order: each
    reserves its time when it arrives. A caller cancelled while waiting gives its reservation
    back if no one reserved after it. A `per_minute` that is not a finite number > 0, or a
    `burst` < 1, raises a `ConfigError` naming it.
    """

    def __init__(self, per_minute: float, *, burst: float = 1) -> None:
        self.per_minute = _check_rate(per_minute, "per_minute")
        if isinstance(burst, bool) or not isinstance(burst, int | float) or not burst >= 1:
            raise ConfigError(
                f"{{burst}} must be a number >= 1 (units at once), got {burst!r}",
                parameter="burst",
            )
        self.burst = float(burst)
        self.kind = "rpm"  # what its waits are, to `parked`
        self._per_second = self.per_minute / 60.0
        self._empty_at = -math.inf  # when the bucket is empty, given what was let through
        self.waited = 0.0  # seconds all callers waited, in total
        self.calls = 0

    async def acquire(self, cost: float = 1) -> float:
        """Wait until `cost` more units fit; return the seconds waited (0.0 if none). A
        `cost` that is not a number >= 0 raises a `ConfigError` naming it."""
        if isinstance(cost, bool) or not isinstance(cost, int | float) or not cost >= 0:
            raise ConfigError(f"{{cost}} must be a number >= 0, got {cost!r}", parameter="cost")
        now = trio.current_time()
        # Goes once `cost` more fits in the bucket; a cost above `burst` once it is empty.
        start = max(now, self._empty_at - max(0.0, self.burst - cost) / self._per_second)
        self._empty_at = max(self._empty_at, start) + cost / self._per_second
        reserved = self._empty_at
        try:
            if start > now:
                with parked(self.kind):
                    await trio.sleep_until(start)
            else:
                await trio.sleep_until(start)
        except BaseException:
            if self._empty_at == reserved:  # the newest reservation: give it back exactly
                self._empty_at -= cost / self._per_second
            raise
        waited = trio.current_time() - now
        self.waited += waited
        self.calls += 1
        return waited

    def meter(self, units: float) -> None:
        """Charge `units` more now (a response used more than was acquired), or refund
        `-units` (it used less). A refund never leaves credit beyond an empty bucket."""
        if units >= 0:
            self._empty_at = max(self._empty_at, trio.current_time()) + units / self._per_second
        else:
            self._empty_at += units / self._per_second

    def __repr__(self) -> str:
        return f"{type(self).__name__}(per_minute={self.per_minute:g}, burst={self.burst:g})"


class TokenLimiter(RateLimiter):
    """Tokens per minute, metered from responses' usage (a RateLimiter of tokens).

    `async with tpm.reserve(max_tokens) as metered:` waits until `max_tokens` fit (reserve
    nothing, the default, to wait only while earlier calls' usage is still being paid off);
    call `metered.used(tokens)` with the response's usage to settle the difference. Without
    `used`, the reservation stands as the charge. Reserve `max_tokens` when you know it: with
    nothing reserved, calls that start together are charged only after they finish.
    """

    def __init__(self, tokens_per_minute: float, *, burst: float = 1) -> None:
        _check_rate(tokens_per_minute, "tokens_per_minute")
        super().__init__(tokens_per_minute, burst=burst)
        self.kind = "tpm"

    @asynccontextmanager
    async def reserve(self, max_tokens: int | None = None) -> AsyncIterator[Metered]:
        reserved = 0 if max_tokens is None else max_tokens
        waited = await self.acquire(reserved)
        yield Metered(self, reserved, waited)


@attrs.define
class Metered:
    """One call's reservation on a TokenLimiter: `waited` seconds; settle with `used`."""

    limiter: RateLimiter
    reserved: int
    waited: float
    settled: bool = False

    def used(self, tokens: int) -> None:
        """The call used `tokens` (prompt + completion): charge or refund the difference."""
        if self.settled:
            raise RuntimeError("used() was already called for this reservation")
        self.settled = True
        self.limiter.meter(tokens - self.reserved)


# --- what a 429 says ----------------------------------------------------------------------------

_REMAINING_ZERO = re.compile(r"(?:^|[,;\s])remaining\s*=\s*0(?![\d.])")


SPENT_SHARE = 0.05
"""A 429's rate budget is spent when what remains of it is under this share of its limit
(`says_request_rate`): a token budget refuses a call that needs more than what remains,
which is seldom 0 (the zoo's token buckets answered ``ratelimit-remaining: 7`` of 494)."""


def says_request_rate(headers: Iterable[tuple[str, str]]) -> bool:
    """Whether a 429's headers say a request or token *rate* budget is spent (so the 429 is a
    request-rate limit, `Outcome.REQUEST_RATE`, not a concurrency limit): a header whose
    name has both "ratelimit" and "remaining" with the value 0, or under `SPENT_SHARE` of
    the header named alike with "limit" for "remaining" (OpenAI's and Azure's
    ``x-ratelimit-remaining-requests`` / ``-tokens`` and ``x-ratelimit-limit-...``,
    Anthropic's ``anthropic-ratelimit-requests-remaining`` and ``...-limit``, the IETF
    draft's ``RateLimit-Remaining`` and ``RateLimit-Limit``), or the IETF draft's structured
    ``RateLimit: ...remaining=0``. ``Retry-After`` alone says nothing either way: concurrency
    limits send it too, and a gateway's rate headers on a concurrency 429 show a budget far
    from spent."""
    named = {name.lower(): value.strip() for name, value in headers}
    for lowered, value in named.items():
        if "ratelimit" not in lowered:
            continue
        if "remaining" in lowered:
            try:
                remaining = float(value)
                if remaining <= 0:
                    return True
                limit = float(named.get(lowered.replace("remaining", "limit"), "nan"))
            except ValueError:
                continue
            if limit > 0 and remaining < SPENT_SHARE * limit:
                return True
        elif lowered == "ratelimit" and _REMAINING_ZERO.search(value.lower()):
            return True
    return False


# --- concurrency per endpoint ---------------------------------------------------------------


@attrs.define
class Slot:
    """One call's place in its endpoint's window: `waited` seconds for it. `record` feeds the
    call's outcome to an adaptive window (a fixed window ignores it)."""

    window: Window
    waited: float

    # duplicates: AdaptiveWindow.record's signature, which this forwards to
    def record(
        self,
        outcome: Outcome | int,
        *,
        retry_after: float | None = None,
        latency: float | None = None,
    ) -> None:
        """An `Outcome` or an HTTP status (see `Outcome.from_status`), and the call's
        `latency` in seconds if known (the adaptive window's latency signal)."""
        if isinstance(self.window, AdaptiveWindow):
            self.window.record(outcome, retry_after=retry_after, latency=latency)


def _check_limit(
    limit: int | AdaptiveBounds, name: str, adaptive: dict[str, Any]
) -> int | AdaptiveBounds:
    """`limit` checked (and adaptive bounds with their `adaptive` options): a
    `ConfigError` naming `name` otherwise."""
    if isinstance(limit, tuple):
        try:
            bounds = AdaptiveBounds(*limit)
            AdaptiveWindow(*bounds, **adaptive)  # check the bounds and options now
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"{{{name}}}: adaptive bounds are (min, start, max) with 1 <= min <= start <= "
                f"max, got {limit!r} ({exc})",
                parameter=name,
            ) from None
        return bounds
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ConfigError(
            f"{{{name}}} must be an int >= 1 or AdaptiveBounds(min, start, max), got {limit!r}",
            parameter=name,
        )
    if adaptive:
        raise ConfigError(
            f"adaptive options {sorted(adaptive)} need MIN-START-MAX limits", parameter=name
        )
    return limit


class ConnectionLimiter:
    """At most `limit` calls in flight per key, across every task of the process.

    The key names an endpoint (e.g. `(base_url, api_key_var)`): any hashable. `limit` is an
    int (a fixed `Window` per key) or `AdaptiveBounds(min, start, max)` (an `AdaptiveWindow`
    per key, moved by what `Slot.record` reports; keyword `adaptive` options go to it). A
    rollout that makes many calls takes a slot for each call, not one for the rollout.
    """

    def __init__(self, limit: int | AdaptiveBounds, **adaptive: Any) -> None:
        self._spec = _check_limit(limit, "limit", adaptive)
        self._adaptive = adaptive
        self._windows: dict[Hashable, Window] = {}

    @property
    def limit(self) -> int | AdaptiveBounds:
        """What each key's window is: a fixed size, or adaptive bounds."""
        return self._spec

    def window(self, key: Hashable) -> Window:
        """The window of `key` (made on first use)."""
        window = self._windows.get(key)
        if window is None:
            if isinstance(self._spec, AdaptiveBounds):
                window = AdaptiveWindow(*self._spec, **self._adaptive)
            else:
                window = Window(self._spec)
            self._windows[key] = window
        return window

    @property
    def windows(self) -> dict[Hashable, Window]:
        """Every key's window so far (for a dashboard: `size`, `in_flight`, `history`)."""
        return dict(self._windows)

    @asynccontextmanager
    async def slot(self, key: Hashable) -> AsyncIterator[Slot]:
        """Hold one of `key`'s slots for the block (waiting for one first)."""
        window = self.window(key)
        token = object()  # one per call: a task may hold several slots at once
        start = trio.current_time()
        if isinstance(window, AdaptiveWindow):
            with parked("pace"):  # a request-rate limit's pacing, before a place is held
                await window.pace()
        with parked("connection"):
            await window.acquire(token)
        try:
            yield Slot(window, trio.current_time() - start)
        finally:
            window.release(token)


# --- all of it, per endpoint ----------------------------------------------------------------


@attrs.define
class Call:
    """One model call under `EndpointLimits.call`: what it waited for, and its feedback."""

    slot: Slot | None
    metered: Metered | None
    waited_connection: float = 0.0
    waited_rate: float = 0.0

    @property
    def waited(self) -> float:
        """Seconds spent waiting for a connection and for the rate limiters."""
        return self.waited_connection + self.waited_rate

    def record(
        self,
        outcome: Outcome | int,
        *,
        retry_after: float | None = None,
        tokens: int | None = None,
        latency: float | None = None,
    ) -> None:
        """The call's outcome (an `Outcome` or HTTP status) and `latency` (seconds) for an
        adaptive connection window, and the tokens it used (`usage.prompt_tokens +
        usage.completion_tokens`) for tpm."""
        if self.slot is not None:
            self.slot.record(outcome, retry_after=retry_after, latency=latency)
        if tokens is not None and self.metered is not None:
            self.metered.used(tokens)


class EndpointLimits:
    """Connections, requests per minute and tokens per minute, each per endpoint key.

    ``async with limits.call(key, reserve_tokens=max_tokens) as call:`` takes a connection
    slot, then waits for `rpm` and `tpm` (the rate limiters are the last gate before the
    request, so request starts keep the rate exactly); after the response,
    ``call.record(status, retry_after=..., tokens=usage)``. Any of the three may be None (no
    limit). `call.waited_connection` and `call.waited_rate` are the seconds spent waiting.
    A bad limit (`connections` not an int >= 1 nor adaptive bounds, `rpm` or `tpm` not a
    finite number > 0) raises a `ConfigError` naming it.
    """

    def __init__(
        self,
        *,
        connections: int | AdaptiveBounds | None = None,
        rpm: float | None = None,
        tpm: float | None = None,
    ) -> None:
        if connections is not None:
            _check_limit(connections, "connections", {})
        self.connections = ConnectionLimiter(connections) if connections is not None else None
        self._rpm = _check_rate(rpm, "rpm") if rpm is not None else None
        self._tpm = _check_rate(tpm, "tpm") if tpm is not None else None
        self._rates: dict[Hashable, tuple[RateLimiter | None, TokenLimiter | None]] = {}

    @property
    def rpm(self) -> float | None:
        """Requests per minute per key, or None (no limit)."""
        return self._rpm

    @property
    def tpm(self) -> float | None:
        """Tokens per minute per key, or None (no limit)."""
        return self._tpm

    def rate_limiters(self, key: Hashable) -> tuple[RateLimiter | None, TokenLimiter | None]:
        """`key`'s (rpm, tpm) limiters, made on first use (None where unlimited)."""
        found = self._rates.get(key)
        if found is None:
            found = (
                RateLimiter(self._rpm) if self._rpm is not None else None,
                TokenLimiter(self._tpm) if self._tpm is not None else None,
            )
            self._rates[key] = found
        return found

    @asynccontextmanager
    async def call(
        self, key: Hashable, *, reserve_tokens: int | None = None
    ) -> AsyncIterator[Call]:
        rpm, tpm = self.rate_limiters(key)
        async with _maybe_slot(self.connections, key) as slot:
            call = Call(slot, None, waited_connection=slot.waited if slot is not None else 0.0)
            if rpm is not None:
                call.waited_rate += await rpm.acquire(1)
            if tpm is None:
                report_wait(call.waited_connection, call.waited_rate)
                yield call
                return
            async with tpm.reserve(reserve_tokens) as metered:
                call.metered = metered
                call.waited_rate += metered.waited
                report_wait(call.waited_connection, call.waited_rate)
                yield call


@asynccontextmanager
async def _maybe_slot(
    limiter: ConnectionLimiter | None, key: Hashable
) -> AsyncIterator[Slot | None]:
    if limiter is None:
        yield None
        return
    async with limiter.slot(key) as slot:
        yield slot


# --- who hears about the calls ----------------------------------------------------------------


class CallObserver:
    """Hears about the model calls made under `observe_calls(observer)`. Subclass it and
    override what you need (both do nothing here). Called synchronously, on the calling
    task: keep them quick, and never raise."""

    def on_wait(self, connection: float, rate: float) -> None:
        """A call through `EndpointLimits` waited `connection` seconds for a connection slot
        and `rate` seconds for the rpm/tpm limiters (both may be 0.0)."""

    def on_outcome(self, outcome: Outcome, retry_after: float | None) -> None:
        """One attempt of a model call ended so (`report_outcome`); `retry_after` is the
        response's Retry-After in seconds, if any."""

    def on_call(self, outcome: Outcome, retry_after: float | None, latency: float | None) -> None:
        """`on_outcome`, with the attempt's `latency` in seconds when the client measured it
        (an adaptive window's latency signal). By default: `on_outcome(outcome,
        retry_after)`."""
        self.on_outcome(outcome, retry_after)

    async def pacing(self) -> None:
        """Awaited before each attempt of a model call (`pace`): an observer that paces the
        calls (a request-rate limit's 429s) waits here. Nothing here."""

    @asynccontextmanager
    async def resting(self, outcome: Outcome | None) -> AsyncIterator[None]:
        """The block is a call's wait before its retry (`rest`), after an attempt that ended
        with `outcome` (None: no answer, e.g. a refused connection). Nothing here."""
        yield

    def on_park(self, kind: str) -> None:
        """One of the runner's own waits (`parked(kind)`) begins on this task."""

    def on_unpark(self, kind: str, seconds: float) -> None:
        """That wait ended after `seconds`."""

    def on_progress(self, kind: str) -> None:
        """A model call (`kind` "model") or a tool call ("tool") finished, or tokens of a
        streamed reply arrived ("tokens") (`report_progress`)."""

    def on_stream(self, ttft: float, tpot: float | None) -> None:
        """A streamed model reply finished: `ttft` seconds from its request to its first
        token, `tpot` seconds per output token after the first (None below two tokens)
        (`report_stream`)."""


_NO_PACING = CallObserver.pacing

_observers: contextvars.ContextVar[tuple[CallObserver, ...]] = contextvars.ContextVar(
    "trio_tasksets_call_observers", default=()
)


class observe_calls:  # lower case: it reads as a call in `with observe_calls(...)`
    """``with observe_calls(observer):`` within the block, by this task and the tasks it
    starts, every call's waits, outcomes and rests also go to `observer` (blocks nest: the
    inner and the outer observers hear). A class, not a generator: an episode enters one
    per attempt."""

    __slots__ = ("_observer", "_token")

    def __init__(self, observer: CallObserver) -> None:
        self._observer = observer

    def __enter__(self) -> None:
        self._token = _observers.set((*_observers.get(), self._observer))

    def __exit__(self, *exc_info: object) -> None:
        _observers.reset(self._token)


def current_observers() -> tuple[CallObserver, ...]:
    """The observers of this context's calls: what another task tells of a wait it imposes
    on this one (a policy update holding a call in flight: their `on_park`/`on_unpark`)."""
    return _observers.get()


def report_progress(kind: str = "tool") -> None:
    """Tell the observers of this context that a call finished: what a `--stall-timeout`
    watches, and the run's count of model calls. `ModelContext.chat` reports each reply
    (`kind="model"`); a tool runner calls this as each tool call returns; a streamed reply
    as its tokens arrive (`kind="tokens"`, at most twice a second)."""
    for observer in _observers.get():
        observer.on_progress(kind)


def report_stream(ttft: float, tpot: float | None) -> None:
    """Tell the observers of this context how a streamed reply went (`CallObserver.on_stream`);
    `ModelContext.chat` reports each streamed reply."""
    for observer in _observers.get():
        observer.on_stream(ttft, tpot)


def report_outcome(
    outcome: Outcome | int, *, retry_after: float | None = None, latency: float | None = None
) -> None:
    """Tell the observers of this context how one attempt of a model call ended: an
    `Outcome`, or an HTTP status (see `Outcome.from_status`; a status that says nothing
    about the endpoint's load, such as a 400, is not passed on), and its `latency` in
    seconds if measured. Model clients call it once per attempt (`OpenAIClient` does)."""
    observers = _observers.get()
    if not observers:
        return
    if isinstance(outcome, int):
        found = Outcome.from_status(outcome)
        if found is None:
            return
        outcome = found
    for observer in observers:
        observer.on_call(outcome, retry_after, latency)


async def pace() -> None:
    """Wait, before an attempt of a model call, for every observer that paces the calls of
    this context (`CallObserver.pacing`). Model clients call it before each attempt
    (`OpenAIClient` does); without an observer that overrides `pacing` it returns at
    once, without a checkpoint (and without a `parked("pace")` wait)."""
    observers = _observers.get()
    for observer in observers:  # only an observer that overrides `pacing` can make us wait
        if type(observer).pacing is not _NO_PACING:
            break
    else:
        return  # no wait, so no `parked("pace")` either (every call of an eval's run)
    with parked("pace"):
        for observer in observers:
            await observer.pacing()


async def rest(seconds: float, *, outcome: Outcome | None = None, kind: str = "backoff") -> None:
    """Wait `seconds` before retrying a model call whose attempt ended with `outcome` (a 429,
    a 5xx, a timeout), inside every observer's `resting` block: a model client's sleep
    between attempts (`OpenAIClient` rests so). The whole of it, taking back a lent window
    place included, is `parked(kind)`: `"retry_after"` (the server said how long) or
    `"backoff"`. Without observers, `trio.sleep`."""
    observers = _observers.get()
    if not observers:
        await trio.sleep(seconds)
        return
    with parked(kind):
        async with AsyncExitStack() as stack:
            for observer in observers:
                await stack.enter_async_context(observer.resting(outcome))
            await trio.sleep(seconds)


class parked:  # lower case: it reads as a call in `with parked("rpm"):`
    """``with parked(kind):`` the block is one of the runner's own waits (a limiter's, a
    rest before a retry, an episode's retry backoff): every observer of `observe_calls`
    hears `on_park(kind)` as it begins and `on_unpark(kind, seconds)` as it ends, however
    it ends. A wait in progress is known as such, so a working-time clock
    (`Env(working_limit=)`) stops at its start, not after it."""

    __slots__ = ("_kind", "_observers", "_start")

    def __init__(self, kind: str) -> None:
        self._kind = kind

    def __enter__(self) -> None:
        self._observers = observers = _observers.get()
        if observers:
            self._start = trio.current_time()
            for observer in observers:
                observer.on_park(self._kind)

    def __exit__(self, *exc_info: object) -> None:
        observers = self._observers
        if observers:
            seconds = trio.current_time() - self._start
            for observer in observers:
                observer.on_unpark(self._kind, seconds)


def report_wait(connection: float, rate: float = 0.0) -> None:
    """Tell the observers of this context that a model call waited `connection` seconds for
    a place at an endpoint and `rate` seconds for rate limiters (`CallObserver.on_wait`):
    what `EndpointLimits.call` reports, and a pool of endpoints for its queue."""
    for observer in _observers.get():
        observer.on_wait(connection, rate)
