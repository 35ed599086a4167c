"""Windows whose size may change while a runner uses them.

* `Window(size)`: pass it as `window=` to `run_stream` / `as_completed` (or acquire from its
  `limiter` yourself). Its size is the `total_tokens` of one `trio.CapacityLimiter`: growing
  wakes a waiting pull at once; shrinking cancels nothing, and nothing more is pulled until
  fewer than `size` are in flight: the window's bound holds against the current size.
* `prioritized()`: a run that takes its place ahead of waiting pulls (a group's rollout).
* `take_place`: a free place without a trip through the scheduler, else wait for one.

Every window keeps a history of its sizes, `[seconds since start, size, reason]`, for a run's
summary (`window_history`). The adaptive window and its controller are in `adaptive`.
"""

from __future__ import annotations

import contextvars
from collections import deque
from contextlib import AbstractAsyncContextManager

import trio

from .exceptions import ConfigError

__all__ = ["HISTORY_LIMIT", "Window", "check_size", "prioritized", "take_place"]

HISTORY_LIMIT = 10_000  # entries kept (the newest); a long-lived service must not grow forever


def check_size(value: object, name: str) -> int:
    """`value` as a window size: an int >= 1, else a `ConfigError` naming `name` (a
    ValueError for a non-int too: one error for every bad window, as the runner's)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            f"{{{name}}} must be an int >= 1, got {value!r} ({type(value).__name__})",
            parameter=name,
        )
    if value < 1:
        raise ConfigError(f"{{{name}}} must be >= 1, got {value}", parameter=name)
    return value


def _now() -> float | None:
    """Trio's clock, or None outside a trio run (sizes set before the run starts)."""
    return trio.current_time() if trio.lowlevel.in_trio_run() else None


_prioritized: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "trio_tasksets_prioritized", default=False
)


class prioritized:  # (lower case: used as a function, ``with prioritized():``)
    """Inside this block (and in the tasks it starts), a `Window.acquire` is served before
    every waiter outside one: how a group's waiting rollout takes a freed place before the
    runner pulls a new task. Waiters inside such blocks are served first come,
    first served among themselves. (A class, not a generator: it is entered once per
    group.)"""

    __slots__ = ("_token",)

    def __enter__(self) -> None:
        self._token = _prioritized.set(True)

    def __exit__(self, *exc_info: object) -> None:
        _prioritized.reset(self._token)


async def take_place(limiter: trio.CapacityLimiter, borrower: object) -> None:
    """`limiter.acquire_on_behalf_of(borrower)`, but a free token is taken without a trip
    through the scheduler (no checkpoint: the caller goes on in the same step)."""
    try:
        limiter.acquire_on_behalf_of_nowait(borrower)
    except trio.WouldBlock:
        await limiter.acquire_on_behalf_of(borrower)


class _Lending:
    """`Window.lend()`'s block (a class, not a generator: a group gate's pull enters one each
    time it waits, and a generator's context manager costs as much again)."""

    __slots__ = ("_take_back", "_window")

    def __init__(self, window: Window, take_back: bool) -> None:
        self._window = window
        self._take_back = take_back

    async def __aenter__(self) -> None:
        self._window._lend()

    async def __aexit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        window = self._window
        if exc_type is not None or not self._take_back:
            window._unlend()  # leaving by an exception gives the place back at once
            return
        limiter = window._limiter
        token = object()
        try:
            await take_place(limiter, token)
        except BaseException:
            window._unlend()
            raise
        window._unlend()  # lowered first, so that the release below wakes no one
        limiter.release_on_behalf_of(token)


class Window:
    """A runner window whose `size` may change while runners use it.

    Pass it wherever `run_stream` / `as_completed` take `window`. It is one
    `trio.CapacityLimiter` (`limiter`) whose `total_tokens` is the size, so it is not a second
    scheduler: a runner takes a token before each pull and a run gives it back when its result
    is delivered. Growing wakes a waiting pull at once; shrinking cancels nothing, and nothing
    more is pulled until fewer than `size` are in flight. Runners that share one window are
    bounded together. `history` lists every size it has had. A `size` that is not an int
    >= 1 raises a `ConfigError` naming it (here and in `resize`).
    """

    def __init__(self, size: int) -> None:
        self._size = check_size(size, "size")
        self._lent = 0  # places lent by resting runs (AdaptiveWindow.rest): tokens beyond size
        self._limiter = trio.CapacityLimiter(size)
        self._urgent = 0  # prioritized acquirers waiting (see `prioritized`)
        # set when the last of them is served, made only when an acquirer waits for that
        self._calm: trio.Event | None = None
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
        self._apply(check_size(size, "size"), reason)

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
                        if self._calm is None:
                            self._calm = trio.Event()
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
                if not self._urgent and self._calm is not None:
                    self._calm.set()
                    self._calm = None

    def release(self, borrower: object) -> None:
        self._limiter.release_on_behalf_of(borrower)

    def lend(self, *, take_back: bool = True) -> AbstractAsyncContextManager[None]:
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
        return _Lending(self, take_back)

    def _lend(self) -> None:
        # (also a fan_out caller's, while its last thunks run: `tt.fan_out`)
        self._lent += 1
        self._limiter.total_tokens = self._size + self._lent  # wakes a waiting acquirer

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
        """Places lent now: by runs resting (`AdaptiveWindow.rest`), by holders waiting in
        `lend()` (a group gate's pull), and by `fan_out` callers waiting on their last
        thunks. The limiter's `total_tokens` is `size + resting`."""
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
