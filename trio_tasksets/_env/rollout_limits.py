"""Per-rollout limits: `tt.RolloutLimits`, one validated object, and `run_within`, the one
place an attempt of an episode is run under them.

An env holds its limits whole (`Env.rollout_limits`); `Env`, `tt.ToolEnv` and a bridged asyncio env
read them from there, an env spec and a declaration carry them whole to another process,
and a served request or a queue entry may carry its caller's, which the slot then runs under
as well (`RolloutLimits.within`: each limit the tighter of the two, as a deadline that
travels can only shorten the time left).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar, overload

import attrs
import trio

from .._core.adaptive import Outcome
from .._core.exceptions import ConfigError, TrioTasksetsError
from .._core.limits import CallObserver, observe_calls, report_outcome
from .._models import Completion, observe_completions

__all__ = [
    "LimitAttribute",
    "RolloutLimits",
    "RolloutTimeoutError",
    "StalledError",
    "Waits",
    "given_limits",
    "is_seconds",
    "run_within",
]

T = TypeVar("T")
R = TypeVar("R")
V = TypeVar("V")


class RolloutTimeoutError(TrioTasksetsError, TimeoutError):
    """An attempt of an episode (its rollout and scoring) outlasted the env's
    `rollout_timeout`: an episode error like any other, retried per the env's policy."""


class StalledError(TrioTasksetsError, TimeoutError):
    """An attempt made no progress (no model or tool call finished) for the env's
    `stall_timeout` seconds of working time: cancelled, an episode error retried per the
    env's policy like any other."""


def _to_float(value: object) -> object:
    """An int number of seconds as a float; anything else as given (the validator decides)."""
    return float(value) if type(value) is int else value


def is_seconds(value: object) -> bool:
    """Whether `value` is a number of seconds > 0: a finite int or float (not a bool)."""
    return (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
        and value > 0
    )


def _seconds(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not is_seconds(value):
        raise ConfigError(
            f"{{{attribute.name}}} must be a number of seconds > 0, or None, got {value!r}",
            parameter=attribute.name,
        )


def _count(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"{{{attribute.name}}} must be an int >= 1, or None, got {value!r}",
            parameter=attribute.name,
        )


def _tighter(a: Any, b: Any) -> Any:
    return b if a is None else a if b is None else min(a, b)


@attrs.frozen
class RolloutLimits:
    """What bounds each attempt of an episode; every field None (the default) bounds nothing.

    - `rollout_timeout` (seconds): the attempt, its rollout and its scoring, in wall time;
      one that outlasts it is cancelled and becomes a `RolloutTimeoutError`, retried per
      the env's `retries` like any episode error.
    - `working_limit` (seconds): the attempt's *working* time, its wall time less the time
      it was parked in the runner's own waits (connection, rpm and tpm limiters,
      Retry-After rests, retry backoff). An attempt that reaches it is cut and ends
      normally: scored on the last model reply it had received (``""`` if none), with
      `stop_reason` ``"working_limit"``.
    - `stall_timeout` (seconds): an attempt in which no model or tool call finished for
      that many seconds of working time is cancelled as a `StalledError`.
    - `max_turns`, `token_limit` (counts): the model calls of a tool-calling loop and the
      tokens its replies used in all (`tt.ToolEnv`'s; a rollout loop of your own may read
      them); the loop ends normally at either, its `stop_reason` naming it.
    - `tool_timeout` (seconds): each tool call of a tool-calling loop; one that outlasts it
      answers the model with an error text.

    Built valid or not at all: a bad value raises `ConfigError` naming its field.
    """

    rollout_timeout: float | None = attrs.field(
        default=None, converter=_to_float, validator=_seconds
    )
    working_limit: float | None = attrs.field(default=None, converter=_to_float, validator=_seconds)
    stall_timeout: float | None = attrs.field(default=None, converter=_to_float, validator=_seconds)
    max_turns: int | None = attrs.field(default=None, validator=_count)
    token_limit: int | None = attrs.field(default=None, validator=_count)
    tool_timeout: float | None = attrs.field(default=None, converter=_to_float, validator=_seconds)

    @property
    def bounds_attempt(self) -> bool:
        """Whether `run_within` has anything to watch: a rollout timeout, a working limit or
        a stall timeout."""
        return (
            self.rollout_timeout is not None
            or self.working_limit is not None
            or self.stall_timeout is not None
        )

    def within(self, other: RolloutLimits | None) -> RolloutLimits:
        """These limits under `other` too (a caller's): each the tighter of the two, a limit
        either leaves None taken from the other. `other` None: these, unchanged."""
        if other is None or other == self:
            return self
        return RolloutLimits(**{
            name: _tighter(getattr(self, name), getattr(other, name)) for name in _NAMES
        })  # fmt: skip

    def updated(self, other: RolloutLimits) -> RolloutLimits:
        """These limits with every limit `other` sets in place of this one's own."""
        given = {name: value for name in _NAMES if (value := getattr(other, name)) is not None}
        return attrs.evolve(self, **given) if given else self

    def to_json(self) -> dict[str, float | int]:
        """The limits that are set, as one JSON object (`from_json` reads it back equal)."""
        return {name: value for name in _NAMES if (value := getattr(self, name)) is not None}

    @classmethod
    def from_json(cls, value: object) -> RolloutLimits:
        """The limits `to_json` wrote. Raises `ConfigError` naming ``limits`` for a value that
        is not an object of limit names, or naming the limit whose value is bad."""
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(
                f"{{limits}} must be an object of limits, got {value!r}", parameter="limits"
            )
        unknown = sorted(set(value) - set(_NAMES))
        if unknown:
            raise ConfigError(
                f"{{limits}} has no limit named {unknown[0]!r} (the limits: {', '.join(_NAMES)})",
                parameter="limits",
            )
        return cls(**value)


_NAMES = tuple(field.name for field in attrs.fields(RolloutLimits))


def given_limits(limits: object, **fields: Any) -> RolloutLimits:
    """The limits an env is given: `limits` whole (its `rollout_limits=`), else built from the
    keyword `fields` (each None: not set). Raises `ConfigError` when both are given, when
    `limits` is not a `RolloutLimits`, or naming the field whose value is bad."""
    if limits is None:
        return RolloutLimits(**fields)
    if not isinstance(limits, RolloutLimits):
        raise ConfigError(
            f"{{rollout_limits}} must be a tt.RolloutLimits, got {type(limits).__name__}",
            parameter="rollout_limits",
        )
    given = sorted(name for name, value in fields.items() if value is not None)
    if given:
        raise ConfigError(
            f"{{rollout_limits}} and {', '.join(given)} are both given: give each limit "
            f"once, in rollout_limits or as a keyword argument",
            parameter="rollout_limits",
        )
    return limits


class LimitAttribute(Generic[V]):
    """One limit of an object's `rollout_limits`, read and set as an attribute of its own
    (`env.rollout_timeout = 30` sets `env.rollout_limits` to a copy with that limit; a bad
    value raises `ConfigError` naming it)."""

    name: str

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, instance: None, owner: type) -> LimitAttribute[V]: ...

    @overload
    def __get__(self, instance: object, owner: type) -> V: ...

    def __get__(self, instance: object, owner: type) -> Any:
        if instance is None:
            return self
        return getattr(instance.rollout_limits, self.name)  # type: ignore[attr-defined]

    def __set__(self, instance: Any, value: V) -> None:
        instance.rollout_limits = attrs.evolve(instance.rollout_limits, **{self.name: value})


# --- enforcing them: the one place an attempt runs under its limits --------------------------


@attrs.define
class Waits(CallObserver):
    """What one episode waited for, in seconds: its model calls' connection slots and rate
    limiters (`on_wait`), and every wait of the runner's own (`parked`: the union of those
    intervals, a wait in progress included). `working(limit, stall)` gives two cancel
    scopes: one `limit` seconds of working time away, one `stall` seconds of working time
    after the last progress (`on_progress`); their deadlines move as waits begin and end."""

    connection: float = 0.0
    rate: float = 0.0
    parked: float = 0.0
    depth: int = 0  # waits in progress (several tasks of one rollout may wait at once)
    since: float = 0.0  # when the current parked interval began
    scope: trio.CancelScope | None = None
    work_began: float = 0.0
    parked_before: float = 0.0  # `parked` when the working scope began
    limit: float = math.inf
    stall_scope: trio.CancelScope | None = None
    stall: float = math.inf
    progress_at: float = 0.0  # when a call last finished (or the attempt began)
    parked_at_progress: float = 0.0  # `parked_so_far()` then

    def on_wait(self, connection: float, rate: float) -> None:
        self.connection += connection
        self.rate += rate

    def on_park(self, kind: str) -> None:
        self.depth += 1
        if self.depth == 1:
            self.since = trio.current_time()
            if self.scope is not None:
                self.scope.deadline = math.inf  # the working clock stops
                self.stall_scope.deadline = math.inf  # type: ignore[union-attr]

    def on_unpark(self, kind: str, seconds: float) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.parked += trio.current_time() - self.since
            if self.scope is not None:
                self.scope.deadline = self._working_deadline()
                self.stall_scope.deadline = self._stall_deadline()  # type: ignore[union-attr]

    def on_progress(self, kind: str = "model") -> None:
        if self.stall_scope is None:  # no stall timeout: nothing to move (every model reply)
            return
        self.progress_at, self.parked_at_progress = trio.current_time(), self.parked_so_far()
        if not self.depth:
            self.stall_scope.deadline = self._stall_deadline()

    def parked_so_far(self) -> float:
        if not self.depth:
            return self.parked
        return self.parked + (trio.current_time() - self.since)

    def _working_deadline(self) -> float:
        return self.work_began + self.limit + (self.parked - self.parked_before)

    def _stall_deadline(self) -> float:
        return self.progress_at + self.stall + (self.parked - self.parked_at_progress)

    @contextmanager
    def working(
        self, limit: float | None, stall: float | None
    ) -> Iterator[tuple[trio.CancelScope, trio.CancelScope]]:
        now = trio.current_time()
        self.work_began, self.parked_before = now, self.parked
        self.limit = math.inf if limit is None else limit
        self.stall = math.inf if stall is None else stall
        self.progress_at, self.parked_at_progress = now, self.parked_so_far()
        parked = bool(self.depth)
        work = trio.CancelScope(deadline=math.inf if parked else self._working_deadline())
        stalled = trio.CancelScope(deadline=math.inf if parked else self._stall_deadline())
        self.scope, self.stall_scope = work, stalled
        try:
            with work, stalled:
                yield work, stalled
        finally:
            self.scope = self.stall_scope = None


async def run_within(
    limits: RolloutLimits,
    waits: Waits,
    rollout: Callable[[], Awaitable[T]],
    finish: Callable[[T], Awaitable[R]],
    cut: Callable[[list[Completion]], Awaitable[R]],
    record: Callable[[Completion], None],
) -> R:
    """One attempt of an episode under `limits`: `rollout()` within the working limit and
    the stall watchdog, then `finish(result)`, or, when the working limit cut the rollout,
    `cut(replies)` (the model replies it had received), all of it within the rollout
    timeout. Every model reply is passed to `record`; the attempt's model calls report their
    waits to `waits`.

    Raises `StalledError` (no progress for `stall_timeout`) and `RolloutTimeoutError` (the
    attempt outlasted `rollout_timeout`; an adaptive window is told of a timeout), and what
    `rollout` and `finish` raise."""
    seconds, limit, stall = limits.rollout_timeout, limits.working_limit, limits.stall_timeout
    replies: list[Completion] = []

    def observe(completion: Completion) -> None:
        record(completion)
        replies.append(completion)

    with trio.move_on_after(math.inf if seconds is None else seconds):
        with observe_completions(observe), observe_calls(waits):
            with waits.working(limit, stall) as (work, stalled):
                result = await rollout()
            if stalled.cancelled_caught:
                raise StalledError(
                    f"no model or tool call finished for {stall:g}s of working time "
                    f"(stall_timeout; cancelled)"
                )
            if work.cancelled_caught:
                return await cut(replies)
            return await finish(result)  # scored outside the working scope: never cut
    assert seconds is not None
    report_outcome(Outcome.TIMEOUT)  # an adaptive rollout window pauses its growth
    raise RolloutTimeoutError(
        f"the rollout took longer than its rollout_timeout of {seconds:g}s (cancelled)"
    )
