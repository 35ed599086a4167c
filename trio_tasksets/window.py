"""Windows whose size may change while a runner uses them, and the controller that moves one.

* `Window(size)`: pass it as `window=` to `run_stream` / `as_completed` (or acquire from its
  `limiter` yourself). Its size is the `total_tokens` of one `trio.CapacityLimiter`: growing
  wakes a waiting pull at once; shrinking cancels nothing, and nothing more is pulled until
  fewer than `size` are in flight. R1 holds against the current size.
* `AdaptiveWindow(min, start, max)`: a Window that an `AdaptiveController` moves from the
  outcomes you record (success, HTTP 429, 5xx, timeout). A run that must wait out a 429's
  Retry-After lends its place meanwhile (`async with window.rest():`).
* `AdaptiveController`: that controller alone, pure (no clock, no I/O): feed it outcomes with
  the time and the in-flight count, it answers with the new size.
* `parse_window(text, flag=...)`: the CLI form `N` or `MIN-START-MAX`.

Every window keeps a history of its sizes, `[seconds since start, size, reason]`, for a run's
summary (`window_history`).
"""

from __future__ import annotations

import contextvars
import enum
import math
import re
from collections import deque
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import NamedTuple

import attrs
import trio

from ._exceptions import ConfigError

__all__ = [
    "AdaptiveBounds",
    "AdaptiveController",
    "AdaptiveWindow",
    "Change",
    "Outcome",
    "Window",
    "WindowArgumentError",
    "build_window",
    "parse_window",
    "prioritized",
    "window_spec",
]

HISTORY_LIMIT = 10_000  # entries kept (the newest); a long-lived service must not grow forever


def _check_size(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(  # noqa: TRY004 (R2 names one error for a bad window, as the runner)
            f"{name} must be an int >= 1, got {value!r} ({type(value).__name__})"
        )
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def _now() -> float | None:
    """Trio's clock, or None outside a trio run (sizes set before the run starts)."""
    return trio.current_time() if trio.lowlevel.in_trio_run() else None


_prioritized: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "trio_tasksets_prioritized", default=False
)


@contextmanager
def prioritized() -> Iterator[None]:
    """Inside this block (and in the tasks it starts), a `Window.acquire` is served before
    every waiter outside one: how a group's waiting rollout takes a freed place before the
    runner pulls a new task (SPEC 10). Waiters inside such blocks are served first come,
    first served among themselves."""
    token = _prioritized.set(True)
    try:
        yield
    finally:
        _prioritized.reset(token)


class Window:
    """A runner window whose `size` may change while runners use it.

    Pass it wherever `run_stream` / `as_completed` take `window`. It is one
    `trio.CapacityLimiter` (`limiter`) whose `total_tokens` is the size, so it is not a second
    scheduler: a runner takes a token before each pull and a run gives it back when its result
    is delivered. Growing wakes a waiting pull at once; shrinking cancels nothing, and nothing
    more is pulled until fewer than `size` are in flight. Runners that share one window are
    bounded together. `history` lists every size it has had.
    """

    def __init__(self, size: int) -> None:
        self._size = _check_size(size, "size")
        self._lent = 0  # places lent by resting runs (AdaptiveWindow.rest): tokens beyond size
        self._limiter = trio.CapacityLimiter(size)
        self._urgent = 0  # prioritized acquirers waiting (see `prioritized`)
        self._calm = trio.Event()  # set (and replaced) when the last of them is served
        self._epoch: float | None = None
        # (trio time, or None outside a run; size; reason)
        self._history: deque[tuple[float | None, int, str]] = deque(maxlen=HISTORY_LIMIT)
        self._record(size, "start")

    @property
    def size(self) -> int:
        """The most runs (or calls) in flight at once. Set it to resize (reason "set")."""
        return self._size

    @size.setter
    def size(self, size: int) -> None:
        self.resize(size)

    def resize(self, size: int, reason: str = "set") -> None:
        """Set the size now, and record it in `history` with `reason`."""
        self._apply(_check_size(size, "size"), reason)

    async def acquire(self, borrower: object) -> None:
        """Take a token for `borrower` (any hashable, unique among current holders), waiting
        until fewer than `size` are held. Give it back with `release(borrower)`.

        A task under `prioritized()` (a group's rollouts) takes a freed token before any
        other waiter (a runner's next pull), whoever queued first."""
        limiter = self._limiter
        urgent = _prioritized.get()
        if urgent:
            self._urgent += 1
        try:
            while True:
                if not urgent:
                    while self._urgent:  # a group's waiting rollout goes first
                        await self._calm.wait()
                await limiter.acquire_on_behalf_of(borrower)
                # A token handed over (by a release) in the same instant as a shrink, or to
                # this waiter while a prioritized one queued behind it: give it back (to the
                # next in line) and queue again.
                if limiter.borrowed_tokens <= limiter.total_tokens and (urgent or not self._urgent):
                    return
                limiter.release_on_behalf_of(borrower)
        finally:
            if urgent:
                self._urgent -= 1
                if not self._urgent:
                    self._calm.set()
                    self._calm = trio.Event()

    def release(self, borrower: object) -> None:
        self._limiter.release_on_behalf_of(borrower)

    @asynccontextmanager
    async def lend(self, *, take_back: bool = True) -> AsyncIterator[None]:
        """For the holder of a place that must wait for something other than its own work
        (a 429's Retry-After, a runner's pull waiting for an open group's rollouts to
        start): ``async with window.lend(): ...``. Its place is lent meanwhile: one more may
        start (the window holds `size` places that are not lent, plus the lent ones). On
        leaving, the holder waits for a place to free up, in turn with the runners' pulls,
        and takes it back; leaving by an exception gives the place back at once.

        `take_back=False` is for a holder that releases its place right after the block (a
        group's run once all its rollouts are done): the lent place is given back at once,
        and the window is over-full by one until that release, so nothing starts meanwhile.
        """
        self._lent += 1
        self._limiter.total_tokens = self._size + self._lent  # wakes a waiting acquirer
        try:
            yield
        except BaseException:
            self._unlend()
            raise
        if not take_back:
            self._unlend()
            return
        token = object()
        try:
            try:  # a free place: taken without a trip through the scheduler
                self._limiter.acquire_on_behalf_of_nowait(token)
            except trio.WouldBlock:
                await self._limiter.acquire_on_behalf_of(token)
        except BaseException:
            self._unlend()
            raise
        self._unlend()  # lowered first, so that the release below wakes no one
        self._limiter.release_on_behalf_of(token)

    def _unlend(self) -> None:
        # Lowering total_tokens evicts no one: a window over-full after it lets nothing start
        # until enough runs end (Window.acquire).
        self._lent -= 1
        self._limiter.total_tokens = self._size + self._lent

    @property
    def in_flight(self) -> int:
        """Tokens held now: runs in flight, plus a runner's pending pull and, for
        `as_completed`, results not yet received."""
        return self._limiter.borrowed_tokens

    @property
    def resting(self) -> int:
        """Runs in flight that lent their place while resting (`AdaptiveWindow.rest`): the
        limiter's `total_tokens` is `size + resting`. Always 0 for a plain Window."""
        return self._lent

    @property
    def limiter(self) -> trio.CapacityLimiter:
        """The `trio.CapacityLimiter` this window is (runners take their tokens from it).
        Never set its `total_tokens` directly (use `size`), or `history` misses the change."""
        return self._limiter

    @property
    def history(self) -> list[tuple[float, int, str]]:
        """`(seconds since start, size, reason)` for every size the window has had, oldest
        first (at most the newest 10,000). The start is when the window was made or, if that
        was outside a trio run, its first change inside one; changes made before a run count
        as 0.0. JSON-ready as `window_history`."""
        return self.history_since(self._epoch)

    def history_since(self, start: float | None) -> list[tuple[float, int, str]]:
        """`history` with times counted from `start` (a `trio.current_time()`, e.g. when an
        eval began; changes before it, or made outside a run, count as 0.0)."""
        return [
            (0.0 if at is None or start is None else max(0.0, at - start), size, reason)
            for at, size, reason in self._history
        ]

    def _apply(self, size: int, reason: str) -> None:
        if size != self._size:
            self._size = size
            self._limiter.total_tokens = size + self._lent  # growing wakes waiting acquirers
            self._record(size, reason)

    def _record(self, size: int, reason: str) -> None:
        now = _now()
        if now is not None and self._epoch is None:
            self._epoch = now
        self._history.append((now, size, reason))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={self.size}, in_flight={self.in_flight})"


# --- the adaptive controller ----------------------------------------------------------------


class Outcome(enum.Enum):
    """What one call told us about the endpoint's capacity."""

    SUCCESS = "success"
    RATE_LIMITED = "rate_limited"  # HTTP 429: too much concurrency (cut)
    SERVER_ERROR = "server_error"  # HTTP 5xx: pause growth, no cut
    TIMEOUT = "timeout"  # the call timed out: pause growth, no cut

    @classmethod
    def from_status(cls, status: int) -> Outcome | None:
        """The outcome of an HTTP status: 2xx/3xx success, 429 rate limited, 408 timeout, 5xx
        server error; None for any other 4xx (the request's fault, not the endpoint's load)."""
        if status == 429:
            return cls.RATE_LIMITED
        if status == 408:
            return cls.TIMEOUT
        if status >= 500:
            return cls.SERVER_ERROR
        if status < 400:
            return cls.SUCCESS
        return None


@attrs.frozen
class Change:
    """A size the controller decided on, and why ("slow start", "grow", "429" for the
    multiplicative cut, "429 cap" for the cap at the calls the endpoint took)."""

    size: int
    reason: str


@attrs.define
class AdaptiveController:
    """The size of an adaptive window, moved by the outcomes of calls. Pure: no clock, no I/O.

    In the spirit of inspect_ai's adaptive connections:

    * The size grows per *clean round*: a round is `max(size, min_round)` successes; it is
      clean when no 429, 5xx or timeout came in it *and* the calls in flight reached
      `utilization * size` at some point in it (an under-used window proves nothing, so it
      does not grow). Until the first 429 a clean round doubles the size (slow start); after
      it, a clean round adds `max(1, growth * size)`.
    * Every 429 caps the size at `in_flight - 1`, the calls in flight when the endpoint
      refused this one (it took fewer than that), but cuts by no more than the factor in
      one step (`max(in_flight - 1, floor(size * cut))`): reason "429 cap". From a full
      window that is one less per 429, so a window a little over the endpoint's capacity
      comes down to it exactly, one refused call for each place too many.
    * The multiplicative cut, `floor(size * cut)` (reason "429"), comes on the 429 that ends
      slow start (whose last doubling may have overshot by up to half) and after that only
      while 429s persist: when they have kept coming (no gap of `cooldown`
      seconds) for `cooldown` seconds since the first of them, at most once per `cooldown`.
      A growth step that one 429 answers is undone by the cap alone, so probing above the
      capacity costs one refused call per place, not a fifth of the window (with a cut per
      probe, a window probing a capacity of 40 averaged 0.87x of it; with the cap, 1.0x).
    * Growth waits until no 429 has come for `cooldown` seconds (a run waiting out a
      Retry-After still holds its slot unless it rests, `AdaptiveWindow.rest`, so rounds
      may look full while the endpoint is saturated).
    * `Retry-After` is for the caller's retry: it never extends the cooldown (letting it do
      so froze inspect_ai's limit for good, inspect_ai #5137), so cuts go on every
      `cooldown` while 429s do, and growth resumes `cooldown` after the last one.
    * A 5xx or a timeout makes the round unclean (growth pauses); it never cuts.
    * The size never leaves `[min, max]`.
    """

    min: int
    max: int
    size: int
    cut: float = 0.8
    cooldown: float = 15.0
    growth: float = 0.05
    utilization: float = 0.8
    min_round: int = 4
    slow_start: bool = attrs.field(default=True, kw_only=True)
    _successes: int = attrs.field(default=0, init=False)
    _peak: int = attrs.field(default=0, init=False)
    _clean: bool = attrs.field(default=True, init=False)
    _last_cut: float = attrs.field(default=-math.inf, init=False)
    _last_429: float = attrs.field(default=-math.inf, init=False)
    _overload_since: float = attrs.field(default=-math.inf, init=False)  # first of a 429 run

    def __attrs_post_init__(self) -> None:
        _check_bounds(self.min, self.size, self.max)
        if not 0 < self.cut < 1:
            raise ValueError(f"cut must be between 0 and 1 (a factor), got {self.cut}")
        if self.cooldown < 0:
            raise ValueError(f"cooldown must be >= 0 seconds, got {self.cooldown}")
        if not self.growth > 0:
            raise ValueError(f"growth must be > 0 (a fraction of the size), got {self.growth}")
        if not 0 < self.utilization <= 1:
            raise ValueError(f"utilization must be in (0, 1], got {self.utilization}")
        if self.min_round < 1:
            raise ValueError(f"min_round must be >= 1, got {self.min_round}")

    def record(
        self, outcome: Outcome, now: float, in_flight: int, retry_after: float | None = None
    ) -> Change | None:
        """Take one call's outcome at time `now` (seconds, any monotonic clock), with
        `in_flight` calls in flight as it ended (itself included; for a window whose runs
        rest, the ones not resting). Returns the new size if it changed. `retry_after` is
        accepted and, by design, ignored (see the class)."""
        del retry_after
        self._peak = max(self._peak, in_flight)
        if outcome is Outcome.SUCCESS:
            self._successes += 1
            if self._successes >= max(self.size, self.min_round):
                return self._end_round(now)
            return None
        self._clean = False
        if outcome is not Outcome.RATE_LIMITED:
            return None
        first = self.slow_start
        self.slow_start = False
        if now - self._last_429 >= self.cooldown:
            self._overload_since = now  # the first 429 after a quiet cooldown
        self._last_429 = now
        cut = math.floor(self.size * self.cut)
        size, reason = min(self.size, max(in_flight - 1, cut)), "429 cap"
        persists = now - self._overload_since >= self.cooldown
        if (first or persists) and now - self._last_cut >= self.cooldown:
            self._last_cut = now
            size, reason = cut, "429"
        size = max(self.min, size)
        if size < self.size:
            self._new_round()
        return self._set(size, reason)

    def _end_round(self, now: float) -> Change | None:
        grow = (
            self._clean
            and self._peak >= self.utilization * self.size
            and now - self._last_429 >= self.cooldown
        )
        self._new_round()
        if not grow:
            return None
        if self.slow_start:
            return self._set(min(self.max, 2 * self.size), "slow start")
        step = max(1, math.floor(self.growth * self.size))
        return self._set(min(self.max, self.size + step), "grow")

    def _new_round(self) -> None:
        self._successes = 0
        self._peak = 0
        self._clean = True

    def _set(self, size: int, reason: str) -> Change | None:
        if size == self.size:
            return None
        self.size = size
        return Change(size, reason)


def _check_bounds(low: int, start: int, high: int) -> None:
    for name, value in (("min", low), ("start", start), ("max", high)):
        _check_size(value, name)
    if not low <= start <= high:
        raise ValueError(f"an adaptive window needs min <= start <= max, got {low}-{start}-{high}")


class AdaptiveWindow(Window):
    """A Window moved by an `AdaptiveController` between `min` and `max`, from `start`.

    Record each call's outcome where the call ends (`success()`, `rate_limited(retry_after)`,
    `server_error()`, `timeout()`, or `record(outcome_or_http_status)`), while its slot is
    still held, so that `in_flight` counts it. The controller's options (`cut`, `cooldown`,
    `growth`, `utilization`, `min_round`) are keyword arguments. Each change is in `history`
    with its reason.
    """

    def __init__(
        self,
        min: int,  # the SPEC names: AdaptiveWindow(min, start, max)
        start: int,
        max: int,
        *,
        cut: float = 0.8,
        cooldown: float = 15.0,
        growth: float = 0.05,
        utilization: float = 0.8,
        min_round: int = 4,
    ) -> None:
        self.controller = AdaptiveController(
            min, max, start, cut, cooldown, growth, utilization, min_round
        )
        self.start = start  # the size it started at (its CLI form is min-start-max)
        super().__init__(start)

    @property
    def min(self) -> int:
        return self.controller.min

    @property
    def max(self) -> int:
        return self.controller.max

    def resize(self, size: int, reason: str = "set") -> None:
        """Set the size by hand (within `[min, max]`); the controller goes on from there."""
        _check_size(size, "size")
        if not self.min <= size <= self.max:
            raise ValueError(f"size must be within [{self.min}, {self.max}], got {size}")
        self.controller.size = size
        self._apply(size, reason)

    def record(self, outcome: Outcome | int, *, retry_after: float | None = None) -> None:
        """Feed one call's outcome (an `Outcome`, or an HTTP status: see
        `Outcome.from_status`; a status that says nothing about capacity is ignored). The
        controller is told the runs in flight that are not resting."""
        if isinstance(outcome, int):
            status = outcome
            found = Outcome.from_status(status)
            if found is None:
                return
            outcome = found
        active = self.in_flight - self._lent
        change = self.controller.record(outcome, trio.current_time(), active, retry_after)
        if change is not None:
            self._apply(change.size, change.reason)

    @asynccontextmanager
    async def rest(self) -> AsyncIterator[None]:
        """For a run that holds a place and must wait (out a 429's Retry-After) before it
        calls again: ``async with window.rest(): await trio.sleep(retry_after)``.

        Its place is lent meanwhile: one more run may start (the window holds `size` runs
        that are not resting, plus the resting ones). On leaving, the run waits for a place
        to free up, in turn with the runners' pulls, and takes it back: a resting run is
        never starved by fresh ones. Lending cannot pile runs up: the 429 that sent the run
        to rest also capped the size at the calls then in flight, less one (see
        `AdaptiveController`). Leaving by an exception gives the place back at once.
        """
        async with self.lend():
            yield

    def success(self) -> None:
        self.record(Outcome.SUCCESS)

    def rate_limited(self, retry_after: float | None = None) -> None:
        """An HTTP 429. `retry_after` (seconds) delays the caller's retry, never the cooldown."""
        self.record(Outcome.RATE_LIMITED, retry_after=retry_after)

    def server_error(self) -> None:
        self.record(Outcome.SERVER_ERROR)

    def timeout(self) -> None:
        self.record(Outcome.TIMEOUT)

    def __repr__(self) -> str:
        return (
            f"AdaptiveWindow(min={self.min}, size={self.size}, max={self.max}, "
            f"in_flight={self.in_flight})"
        )


# --- the CLI form ---------------------------------------------------------------------------


class AdaptiveBounds(NamedTuple):
    """`MIN-START-MAX` of an adaptive window: `AdaptiveWindow(*bounds)`."""

    min: int
    start: int
    max: int


class WindowArgumentError(ConfigError):
    """A bad window: a `N|MIN-START-MAX` that does not parse, or a size or bounds that
    `build_window` refuses (a `ConfigError`, so a ValueError; the command line's argparse
    types turn it into their usage error, see `trio_tasksets.cli.options`)."""


_FORM = re.compile(r"\s*(\d+)\s*(?:-\s*(\d+)\s*-\s*(\d+)\s*)?")


def parse_window(text: str, *, flag: str = "-c/--max-concurrent") -> int | AdaptiveBounds:
    """Parse `N` (a fixed window) or `MIN-START-MAX` (adaptive). Raises WindowArgumentError,
    naming `flag`, for anything else."""
    match = _FORM.fullmatch(text)
    if match is None:
        raise WindowArgumentError(
            f"{flag}: expected N or MIN-START-MAX (e.g. 64, or 1-8-512 to adapt), got {text!r}"
        )
    low, start, high = match.groups()
    if start is None:
        size = int(low)
        if size < 1:
            raise WindowArgumentError(f"{flag}: N must be >= 1, got {text!r}")
        return size
    bounds = AdaptiveBounds(int(low), int(start), int(high))
    if not 1 <= bounds.min <= bounds.start <= bounds.max:
        raise WindowArgumentError(
            f"{flag}: MIN-START-MAX needs 1 <= MIN <= START <= MAX, got {text!r}"
        )
    return bounds


def build_window(
    spec: int | AdaptiveBounds | tuple[int, int, int] | Window, *, parameter: str = "window"
) -> Window:
    """The one window constructor: a `Window` given is used as is; `N` makes `Window(N)`;
    `(min, start, max)` (an `AdaptiveBounds`, as `parse_window` reads ``MIN-START-MAX``) makes
    `AdaptiveWindow(min, start, max)`. Anything else raises `WindowArgumentError` naming
    `parameter` (the setting the window came from, e.g. ``max_concurrent``)."""
    if isinstance(spec, Window):
        return spec
    if isinstance(spec, tuple):
        try:
            return AdaptiveWindow(*spec)
        except (TypeError, ValueError) as exc:
            raise WindowArgumentError(
                f"{{{parameter}}}: adaptive bounds are (min, start, max) with 1 <= min <= "
                f"start <= max, got {spec!r} ({exc})",
                parameter=parameter,
            ) from None
    if isinstance(spec, bool) or not isinstance(spec, int) or spec < 1:
        raise WindowArgumentError(
            f"{{{parameter}}} must be an integer >= 1, (min, start, max) bounds or a "
            f"tt.Window, got {spec!r}",
            parameter=parameter,
        )
    return Window(spec)


def window_spec(window: int | AdaptiveBounds | Window) -> str:
    """The CLI form of a window: `N`, or `MIN-START-MAX` (an `AdaptiveWindow`: its bounds
    and the size it started at; a `Window`: its size now)."""
    if isinstance(window, AdaptiveWindow):
        return f"{window.min}-{window.start}-{window.max}"
    if isinstance(window, Window):
        return str(window.size)
    if isinstance(window, tuple):
        return "-".join(str(part) for part in window)
    return str(window)
