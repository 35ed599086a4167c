"""The training feed's primitives: `first` (over-sampling with a clean cut), `Staleness`
(a policy-version gate for a trainer consuming a feed) and `batches` (a feed run into
trainer batches under a `Staleness`).

`first(n, source, run, window=..., accept=...)` runs `source` windowed, as `as_completed`
does, keeps the first `n` results `accept` takes (in completion order), then leaves the
runner's block: every other run is cancelled and *awaited* (its scoring and cleanup
included) and the source is closed (exactly once) before it returns.

`Staleness(max_lag)` counts policy versions: the trainer calls `advance()` when its policy
changes. A run wrapped by `staleness.run(fn)` records the version current when it starts
(`Episode.policy_version`, through a context variable that `Env.run_slot` reads); once it is
more than `max_lag` versions behind it is cancelled at once (its wrapper returns None), or,
with `withhold=True`, left to finish and marked (`Episode.stale`). `staleness.feed(source)`
pulls the next item only while the batch being built is at most `max_lag` versions ahead
of the trainer: the feed's consumer calls `staleness.handed()` for each batch it hands the
trainer, so a slow trainer pauses the feed instead of piling up rollouts it would train on
stale.

`batches(size, source, run, window=..., staleness=..., accept=...)` is the rollout side of
an async trainer in one block: it runs `source` windowed, keeps the results `accept` takes
and hands them out `size` at a time, the runs going on while the trainer trains (bounded
by the window), under the staleness gate.
"""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Generic, Protocol, TypeVar

import attrs
import trio

from .exceptions import ConfigError, ConfigTypeError
from .runner import SourceIterator, as_completed, check_source, close_iterator
from .window import Window

__all__ = [
    "LiveRun",
    "PolicyUpdates",
    "Staleness",
    "batches",
    "current_run",
    "first",
    "policy_fields",
]

T = TypeVar("T")
R = TypeVar("R")


async def first(
    n: int,
    source: AsyncIterable[T],
    run: Callable[[T], Awaitable[R]],
    *,
    window: int | Window | None,
    accept: Callable[[R], bool | Awaitable[bool]] | None = None,
) -> list[R]:
    """The first `n` results of `run` over `source` (completion order) that `accept` takes
    (every result when `accept` is None), at most `window` runs at once.

    Once the n-th is in, every other run is cancelled and this waits until each has unwound
    (its `finally` blocks and shielded cleanup, e.g. an episode's `on_complete`, included);
    the source is closed exactly once. When it returns, nothing it started still runs.
    Fewer than `n` come back only if the source ends first. `n == 0` pulls nothing. A run's
    failure, or `accept`'s, cancels the rest and is raised itself. `accept` may be sync or
    async.

    Bad arguments raise a `ConfigError` before anything is pulled: naming `n` (`n < 0`; not
    an int, a `ConfigTypeError`, also a TypeError), `accept` (not callable), or `window`,
    `source` and `run` as `as_completed` does.
    """
    if isinstance(n, bool) or not isinstance(n, int):
        raise ConfigTypeError(
            f"{{n}} must be an int >= 0, got {n!r} ({type(n).__name__})", parameter="n"
        )
    if n < 0:
        raise ConfigError(f"{{n}} must be >= 0, got {n}", parameter="n")
    if accept is not None and not callable(accept):
        raise ConfigTypeError(
            f"{{accept}} must be a callable taking a result, or None, got {accept!r}",
            parameter="accept",
        )
    as_completed(source, run, window=window)  # checks source, run and window, starts nothing
    if isinstance(window, int):
        # A tt.Window, so that the rollouts of a group run inside `run` (a fan_out under
        # window.prioritized) take freed places before the next pull.
        window = Window(window)
    results = as_completed(source, run, window=window)
    kept: list[R] = []
    if n == 0:
        with trio.CancelScope(shield=True):
            error = await close_iterator(aiter(source), source)
        if error is not None:
            raise error
        return kept
    async with results as completed:
        async for _index, result in completed:
            if accept is not None:
                verdict = accept(result)
                if inspect.isawaitable(verdict):
                    verdict = await verdict
                if not verdict:
                    continue
            kept.append(result)
            if len(kept) == n:
                break
    return kept


@attrs.define(eq=False)
class LiveRun:
    """One run under a `Staleness`: the version its lag counts from, its cancel scope, and
    whether it fell more than `max_lag` behind (`stale`).

    Without a policy the version is the one current when it started. With one
    (`Staleness(policy=)`) it is the version of the run's oldest token: until its first
    model call is admitted (`tokenless`) it follows the current version, then the governed
    calls tell it theirs (`note`)."""

    version: int
    scope: trio.CancelScope
    stale: bool = False
    tokenless: bool = False

    def note(self, version: int) -> None:
        """A model call of this run makes tokens under `version` (a count of updates)."""
        if self.tokenless or version < self.version:
            self.version = version
        self.tokenless = False


class PolicyUpdates(Protocol):
    """What a `Staleness` needs of a policy (`tt.Policy`): how many updates it has had, and
    to hear of each one as it lands."""

    @property
    def updates(self) -> int: ...

    def on_update(self, listener: Callable[[], object]) -> None: ...


_current: contextvars.ContextVar[LiveRun | None] = contextvars.ContextVar(
    "trio_tasksets_live_run", default=None
)


def current_run() -> LiveRun | None:
    """The `LiveRun` of the `Staleness.run` wrapper this task runs under, if any (what
    `Env.run_slot` reads for `policy_version` and `stale`)."""
    return _current.get()


def _check_int(value: object, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigTypeError(
            f"{{{name}}} must be an int >= {minimum}, got {value!r}", parameter=name
        )
    if value < minimum:
        raise ConfigError(f"{{{name}}} must be >= {minimum}, got {value}", parameter=name)
    return value


class Staleness:
    """A policy-version gate between a feed of rollouts and the trainer consuming them.

    - `version` starts at 0; the trainer calls `advance()` each time its policy changes.
    - `run(fn)` wraps a run: it starts at the current version (`Episode.policy_version`);
      when `advance()` leaves it more than `max_lag` versions behind, it is cancelled at once
      and its wrapper returns None, or, with `withhold=True`, it runs on and its episodes are
      marked `stale` (its rows say so). No wrapped run does work more than `max_lag`
      versions stale unless it is withheld and marked.
    - `feed(source)` pulls an item only while `handed - version <= max_lag`, where `handed`
      counts the batches the consumer handed the trainer (`handed()`): the batch being built
      is then trained at most `max_lag` versions after the policy that produced it. A trainer
      waiting for the next batch never blocks the feed (no deadlock).

    - With `policy` (a `tt.Policy`), the versions are the policy's updates: each
      `policy.update(...)` advances the gate (call `advance()` yourself no more), and a
      run's lag counts from its oldest token (the version its first governed model call
      ran under), not from when it started: a run that waited is not stale for it.

    A `max_lag` that is not an int >= 0, a `withhold` that is not a bool, or a `policy`
    that is not a policy, raises a `ConfigError` naming it.
    """

    def __init__(
        self, max_lag: int, *, withhold: bool = False, policy: PolicyUpdates | None = None
    ) -> None:
        self.max_lag = _check_int(max_lag, "max_lag", 0)
        if not isinstance(withhold, bool):
            raise ConfigTypeError(
                f"{{withhold}} must be True or False, got {withhold!r}", parameter="withhold"
            )
        if policy is not None and not callable(getattr(policy, "on_update", None)):
            raise ConfigTypeError(
                f"{{policy}} must be a tt.Policy or None, got {policy!r}", parameter="policy"
            )
        self.withhold = withhold
        self.policy = policy
        self._version = 0 if policy is None else policy.updates
        self._handed = 0
        self._live: set[LiveRun] = set()
        self._changed = trio.Event()
        self.cancelled = 0  # runs cancelled as stale
        self.withheld = 0  # runs marked stale and left to finish
        self.dropped = 0  # results `tt.batches` dropped: stale by the time they were handed
        self.pauses = 0  # pulls of `feed` that waited for the trainer
        if policy is not None:
            policy.on_update(self._advance)

    def __repr__(self) -> str:
        return (
            f"Staleness(max_lag={self.max_lag}, withhold={self.withhold}, "
            f"version={self._version}, handed={self._handed})"
        )

    @property
    def version(self) -> int:
        """The trainer's policy version (how many times `advance()` was called)."""
        return self._version

    @property
    def handed_count(self) -> int:
        """How many batches the consumer reported handed to the trainer."""
        return self._handed

    @property
    def behind(self) -> bool:
        """True while the trainer is behind: the next batch would be more than `max_lag`
        versions ahead of its policy, so `feed` is paused."""
        return self._handed - self._version > self.max_lag

    def advance(self) -> int:
        """The trainer's policy changed: bump the version, cancel (or withhold and mark) the
        runs now more than `max_lag` behind, and wake a paused feed. Returns the version.
        Raises a `ConfigError` naming ``policy`` when the gate follows a policy (its updates
        advance it)."""
        if self.policy is not None:
            raise ConfigError(
                "Staleness.advance(): this gate follows its {policy}, whose updates advance "
                "it; call `await policy.update(...)` instead",
                parameter="policy",
            )
        return self._advance()

    def _advance(self) -> int:
        self._version += 1
        oldest = self._version - self.max_lag
        for live in list(self._live):
            if live.tokenless:
                live.version = self._version  # no token yet: nothing of it is stale
            if live.version < oldest and not live.stale:
                if self.withhold:
                    live.stale = True
                    self.withheld += 1
                else:
                    live.stale = True
                    live.scope.cancel()
                    self.cancelled += 1
        self._wake()
        return self._version

    def handed(self) -> None:
        """The feed's consumer handed the trainer one more batch (it may pause the feed)."""
        self._handed += 1
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def run(self, fn: Callable[[T], Awaitable[R]]) -> Callable[[T], Awaitable[R | None]]:
        """`fn` as a run that records the version it started at and is cancelled (returns
        None) once it falls more than `max_lag` behind, or, with `withhold`, finishes and is
        marked: an `Episode` result (or a list of them, a group) gets `stale = True`.
        Raises a `ConfigTypeError` naming `fn` when it is not callable."""
        if not callable(fn):
            raise ConfigTypeError(
                f"{{fn}} must be an async callable taking one item, got {fn!r}", parameter="fn"
            )

        async def staled(item: T) -> R | None:
            return (await self._run(fn, item))[1]

        return staled

    async def _run(self, fn: Callable[[T], Awaitable[R]], item: T) -> tuple[int, R | None]:
        """(the version the run's lag counts from, its result or None: cancelled as stale)."""
        with trio.CancelScope() as scope:
            live = LiveRun(self._version, scope, tokenless=self.policy is not None)
            self._live.add(live)
            token = _current.set(live)
            try:
                result = await fn(item)
            finally:
                _current.reset(token)
                self._live.discard(live)
            if live.stale:
                _mark(result)
            return live.version, result
        return live.version, None  # cancelled as stale

    async def wait_until_fed(self) -> None:
        """Return once `feed` may pull (at once unless the trainer is behind)."""
        if self.behind:
            self.pauses += 1
        while self.behind:
            await self._changed.wait()

    def feed(self, source: AsyncIterable[T]) -> AsyncIterator[T]:
        """`source`, pausing before each pull while the trainer is `behind`. Closing it
        closes `source` (once, as the runners do)."""
        check_source(source)
        return _Fed(self, source)


def _mark(result: object) -> None:
    """Mark an episode, or each episode of a list (a group), stale."""
    items = result if isinstance(result, list) else [result]
    for item in items:
        if hasattr(item, "stale") and hasattr(item, "policy_version"):
            item.stale = True


class _Fed(SourceIterator[T]):
    """`Staleness.feed` as an iterator class."""

    def __init__(self, staleness: Staleness, source: AsyncIterable[T]) -> None:
        super().__init__(source)
        self._staleness = staleness

    async def __anext__(self) -> T:
        if self._closed:
            raise StopAsyncIteration
        await self._staleness.wait_until_fed()
        return await self._iterator.__anext__()


def batches(
    size: int,
    source: AsyncIterable[T],
    run: Callable[[T], Awaitable[R]],
    *,
    window: int | Window | None,
    staleness: Staleness | None = None,
    accept: Callable[[R], bool | Awaitable[bool]] | None = None,
) -> AbstractAsyncContextManager[AsyncIterator[list[R]]]:
    """Run `run` over `source` (at most `window` runs at once) and hand the results out as
    batches of `size`, for a trainer: the rollout side of an async RL loop in one block.

    Use as ``async with tt.batches(B, groups, run, window=w, staleness=s) as feed: async for
    batch in feed: ...train...; s.advance()``. Typically `source` is `tt.group_feed(...)`
    and `run` runs a group (`tt.run_group`), so a batch is a list of `size` groups' episodes.

    Guarantees:

    - A batch holds `size` results that `accept` took (every result when it is None; sync
      or async), in completion order; every kept result is in exactly one batch. The last
      batch may be shorter: the source ended (an empty one is never handed out).
    - The runs go on while the consumer works on a batch (the next batch builds meanwhile);
      a finished run not yet taken holds its place of the window, so memory and work ahead
      stay bounded by the window (as `as_completed`).
    - With `staleness`: `source` is pulled through `staleness.feed` (paused while the
      trainer is behind), each run through `staleness.run` (a run cancelled as stale is
      dropped, before `accept`), and `staleness.handed()` is called for each batch handed
      out. A result whose run started more than `max_lag` versions before the version
      current when it is taken, or when its batch is handed out, is dropped (counted in
      `staleness.dropped`), or, with `withhold=True`, kept and marked `stale`. So every
      result of a batch was produced at most `max_lag` policy versions before the version
      current when the batch is handed out. The consumer calls `staleness.advance()` as its
      policy changes: one that takes more than `max_lag + 1` batches without advancing
      waits for ever, as the gate promises.
    - Leaving the block (done, `break`, an error, a cancellation) cancels the runs still in
      flight and waits until each has unwound, and closes `source` exactly once; nothing it
      started runs after it. A run's failure, or `accept`'s, cancels the rest and is raised
      itself from the iteration.

    Raises:
        ConfigError: before anything is pulled: naming `size` (not an int >= 1; not an int,
            a `ConfigTypeError`, also a TypeError), `staleness` (not a `tt.Staleness`),
            `accept` (not callable), or `window`, `source` and `run` as `as_completed` does.
    """
    _check_int(size, "size", 1)
    if staleness is not None and not isinstance(staleness, Staleness):
        raise ConfigTypeError(
            f"{{staleness}} must be a tt.Staleness or None, got {staleness!r}",
            parameter="staleness",
        )
    if accept is not None and not callable(accept):
        raise ConfigTypeError(
            f"{{accept}} must be a callable taking a result, or None, got {accept!r}",
            parameter="accept",
        )
    as_completed(source, run, window=window)  # checks source, run and window, starts nothing
    return _batches(size, source, run, window, staleness, accept)


@asynccontextmanager
async def _batches(
    size: int,
    source: AsyncIterable[T],
    run: Callable[[T], Awaitable[R]],
    window: int | Window | None,
    staleness: Staleness | None,
    accept: Callable[[R], bool | Awaitable[bool]] | None,
) -> AsyncIterator[AsyncIterator[list[R]]]:
    if isinstance(window, int):
        window = Window(window)  # (as `first`: a group's waiting rollouts before a new pull)
    tagged: Callable[[T], Awaitable[tuple[int, R | None]]]
    if staleness is None:

        async def tagged(item: T) -> tuple[int, R | None]:
            return 0, await run(item)

    else:
        gate = staleness
        gate.run(run)  # checks `run`
        source = gate.feed(source)

        async def tagged(item: T) -> tuple[int, R | None]:
            return await gate._run(run, item)  # the version its lag counts from

    async with as_completed(source, tagged, window=window) as completed:
        yield _Batches(size, completed, staleness, accept)


class _Batches(Generic[R], AsyncIterator[list[R]]):
    """The batches of `batches`: an iterator class (a consumer's cancelled pull keeps what
    it had received for the next one)."""

    def __init__(
        self,
        size: int,
        completed: trio.abc.ReceiveChannel[tuple[int, tuple[int, R | None]]],
        staleness: Staleness | None,
        accept: Callable[[R], bool | Awaitable[bool]] | None,
    ) -> None:
        self._size = size
        self._completed = completed
        self._staleness = staleness
        self._accept = accept
        self._batch: list[tuple[int, R]] = []  # (the version its run started at, result)
        self._taken: tuple[int, R] | None = None  # received, `accept` not yet done with it
        self._ended = False

    async def __anext__(self) -> list[R]:
        batch = self._batch
        while not self._ended:
            if len(batch) >= self._size:
                self._fresh(batch)
                if len(batch) >= self._size:
                    break
            if self._taken is None:
                try:
                    _index, (started, result) = await self._completed.receive()
                except trio.EndOfChannel:
                    self._ended = True
                    break
                if self._staleness is not None:
                    if result is None:
                        continue  # cancelled as stale
                    if not self._keep(started, result):
                        continue
                kept: Any = result  # (R: None only as a result of `run` itself)
                self._taken = (started, kept)
            if self._accept is not None:
                # A pull cancelled while `accept` runs keeps the result for the next pull.
                verdict = self._accept(self._taken[1])
                if inspect.isawaitable(verdict):
                    verdict = await verdict
                if not verdict:
                    self._taken = None
                    continue
            batch.append(self._taken)
            self._taken = None
        self._fresh(batch)
        if not batch:
            raise StopAsyncIteration
        self._batch = []
        if self._staleness is not None:
            self._staleness.handed()
        return [result for _started, result in batch]

    def _keep(self, started: int, result: object) -> bool:
        """Whether a result started at version `started` may still be handed out (marked
        stale, with `withhold`, when it is too old)."""
        gate = self._staleness
        if gate is None or gate.version - started <= gate.max_lag:
            return True
        if gate.withhold:
            _mark(result)
            return True
        gate.dropped += 1
        return False

    def _fresh(self, batch: list[tuple[int, R]]) -> None:
        """Drop (or mark) the results of `batch` that went stale while it was built."""
        if self._staleness is not None:
            batch[:] = [pair for pair in batch if self._keep(*pair)]


def policy_fields() -> tuple[int | None, bool]:
    """(`policy_version`, `stale`) for an episode finishing in this task: the version its
    `Staleness.run` wrapper started at and whether it is marked stale, or (None, False)."""
    live = _current.get()
    return (None, False) if live is None else (live.version, live.stale)
