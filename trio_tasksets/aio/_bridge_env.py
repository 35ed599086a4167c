"""The asyncio bridge, trio-hosted direction: trio programs drive an existing asyncio env.

`bridge_env(aio_env)` turns an *asyncio env* (an object written with asyncio: an asyncio feed,
an asyncio `rollout` or `run_slot`, an asyncio `serving()`) into a `tt.Env` that `tt.run_eval`,
the service pattern and the served path drive. It runs the asyncio code on an asyncio loop that
runs *inside* trio (trio-asyncio's `open_loop`), so asyncio and trio share one thread, one
clock (a MockClock drives `asyncio.sleep` too) and one cancellation tree.

The asyncio env protocol (duck-typed: no base class; `bridge_env` checks it up front, the
signatures included, and points a verifiers v1 Env to `tt.aio.verifiers_env`):

* ``taskset`` (required): a `tt.aio.AsyncioTaskset` (a `tt.Taskset` whose `stream()` is asyncio
  code), any other `tt.Taskset` (static, or with a trio `stream()`), or any object with an
  asyncio ``stream()`` (and optionally ``load()``, ``config``, ``INFINITE``).
* ``async def rollout(task, ctx) -> (messages, completion)`` (optional): one attempt of an
  episode, as `Env.rollout`; ``ctx`` is an `AsyncioModelContext` (``await ctx.chat(messages)``
  from asyncio). The bridge wraps it in `Env.run_slot` (episode record, retries, reward).
* ``async def run_slot(slot, ctx) -> tt.Episode`` (optional; wins over ``rollout``): the whole
  slot. Like `Env.run_slot` it records an episode's own failure on the episode; what it raises
  fails the run (fail-fast), as a machinery error. The bridged env's `rollout_limits` bound
  each call of it as they bound an attempt of `Env.run_slot` (`run_within`): past its
  `rollout_timeout` or `stall_timeout` it is cancelled and the episode records a
  `RolloutTimeoutError` or `StalledError` (retried per `retries`); at its `working_limit` it
  is cancelled and the episode is scored on the last model reply it had received,
  `stop_reason` ``"working_limit"``.
* ``async def score(task, completion) -> float`` (optional, sync or async): the reward.
* ``def serving() -> asyncio async context manager`` (optional): env-level resources, entered
  and exited in one asyncio task that lives as long as the bridged env's `serving()`.
* ``retries: tt.RetryPolicy`` (optional).

Design:

* **The loop.** The bridged env's `serving()` opens the asyncio loop and holds the asyncio
  ``serving()`` in one long-lived asyncio task. The loop is trio-asyncio's (inside trio), or,
  with `BridgedEnv.asyncio_loop = "thread"`, a stdlib loop in a thread of its own; under an
  asyncio host (trio guest mode) it is the host's (`trio_tasksets.aio._host`). `run_slot` (and `rollout`,
  `score`) run their asyncio code on the loop of the `serving()` they run under; without one
  they raise `RuntimeError` (asyncio objects such as an `asyncio.Semaphore` bind to one loop,
  and the env's resources live in `serving()`). An `AsyncioTaskset`'s `channel()` reads on
  the loop of the bridged env's `serving()` it runs under, else the innermost running
  trio-asyncio loop, else (e.g. the main process of an ``--serve`` eval) on a loop of its own
  for the channel's life.
* **Calls.** Every call into asyncio (a pull, a close, a rollout, a score) is one asyncio task,
  awaited from trio. Trio cancellation cancels that task and waits until it has finished
  before `trio.Cancelled` is raised (so the asyncio side sees `CancelledError` and unwinds
  first); a real error raised while it unwinds is raised instead. An asyncio `CancelledError`
  trio did not ask for becomes `AsyncioCancelled`, an ordinary error. Results and errors come
  back unwrapped; the `ExceptionGroup` layers that trio-asyncio's `open_loop` and the bridge's
  own nurseries add are removed, so what the body of `serving()` raised comes out itself.
* **Feeds.** An asyncio `stream()` is pulled one item per receive of the channel (no
  prefetch), with the taskset's system prompt and views applied by the usual path, and closed
  (``aclose()`` as an asyncio task, shielded) exactly once when the channel closes.
* **Python 3.14.** trio-asyncio does not import there (python-trio/trio-asyncio#160) and the
  package does not install it: the bridge raises `TrioAsyncioUnavailable` (an ImportError)
  naming the problem, when it is used (this module imports without it). Guest mode
  (`tt.aio.run_stream`, `tt.aio.run_trio`) does not need trio-asyncio.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, ClassVar, TypeVar, cast

import attrs
import trio

from .._core.exceptions import ConfigTypeError
from .._core.limits import observe_calls, parked
from .._core.tasksets import Taskset, TasksetConfig
from .._core.views import View
from .._env.env import (
    Env,
    Episode,
    EpisodeError,
    EpisodeTask,
    Message,
    OnComplete,
    RetryPolicy,
    Reward,
    RolloutLimits,
    RunSlot,
    Score,
    complete_slot,
    cut_completion,
    new_id,
    partial_messages,
    split_score,
    task_data,
    task_key,
)
from .._env.rollout_limits import RolloutTimeoutError, StalledError, Waits, run_within
from .._models import Completion, ModelContext, Sampling
from ._feeds import as_taskset
from ._loop import LoopKind, bridge_loop, call_aio, open_loop, trio_asyncio_module, unwrap

__all__ = ["AsyncioModelContext", "BridgedEnv", "bridge_env"]

T = TypeVar("T")
TaskT = TypeVar("TaskT")
ConfigT = TypeVar("ConfigT", bound=TasksetConfig)


# --- the model, from asyncio -----------------------------------------------------------------


@attrs.frozen
class AsyncioModelContext:
    """What an asyncio `rollout` / `run_slot` gets instead of `tt.ModelContext`.

    `await ctx.chat(messages)` is asyncio-flavored: it runs the trio model client's call as a
    trio task and resolves with its `tt.Completion` (or raises its error, e.g. a
    `tt.ModelError`); cancelling the awaiting asyncio task cancels the call. `model` and
    `sampling` are the trio context's; `context` is the trio `tt.ModelContext` itself (for trio
    code only: its `chat` cannot be awaited from asyncio).
    """

    context: ModelContext
    loop: Any = attrs.field(repr=False)

    model = View[str]("context", "The trio context's model name.")
    sampling = View[Sampling]("context", "The trio context's sampling.")

    async def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        **sampling_overrides: Any,
    ) -> Completion:
        """Send `messages` to the model (asyncio-flavored), with `tools` and sampling
        overrides as `tt.ModelContext.chat` takes them; see the class docstring."""
        call = self.context.chat
        if tools is not None or sampling_overrides:
            call = functools.partial(call, tools=tools, **sampling_overrides)
        return cast(Completion, await self.loop.trio_as_future(call, messages))


# --- serving(): an asyncio context manager held by one asyncio task ---------------------------


class _Held:
    """The state shared by the trio side of `_hold_serving` and its asyncio holder task."""

    def __init__(self) -> None:
        self.failure: BaseException | None = None  # what the holder raised into the nursery
        self.entered = trio.Event()
        self.release = trio.Event()
        self.done = trio.Event()
        self.value: Any = None
        self.body_error: BaseException | None = None  # handed to the asyncio __aexit__
        self.releasing = False
        self.error: BaseException | None = None  # how the holder ended, once released


async def _hold(loop: Any, factory: Callable[[], Any], held: _Held) -> None:
    """asyncio code: enter `factory()`, report, wait to be released, exit in the same task."""
    async with factory() as value:
        held.value = value
        await loop.trio_as_future(_set, held.entered)  # (the loop may run in another thread)
        await loop.trio_as_future(held.release.wait)
        if held.body_error is not None:
            raise held.body_error  # the asyncio context manager sees what the block raised


async def _set(event: trio.Event) -> None:
    event.set()


async def _run_holder(loop: Any, factory: Callable[[], Any], held: _Held) -> None:
    try:
        await call_aio(loop, _hold, loop, factory, held)
    except Exception as exc:
        if not held.releasing:
            held.failure = exc
            raise  # failed while the block runs (e.g. a background task): cancel the block
        held.error = exc
    finally:
        held.done.set()


@asynccontextmanager
async def _hold_serving(loop: Any, factory: Callable[[], Any]) -> AsyncIterator[Any]:
    """Hold the asyncio context manager `factory()` for the block, entered and exited by one
    asyncio task. An Exception of the block is passed to its `__aexit__` (which may suppress it);
    a cancellation of the block cancels the holder (the manager sees `CancelledError`); the
    holder failing while the block runs cancels the block and is raised itself."""
    held = _Held()
    body: BaseException | None = None
    chosen: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_run_holder, loop, factory, held)
            await held.entered.wait()
            try:
                yield held.value
            except Exception as exc:
                body = held.body_error = exc
            except BaseException as exc:  # Cancelled, KeyboardInterrupt: the holder is cancelled
                body = exc
                raise
            held.releasing = True
            held.release.set()
            await held.done.wait()
            chosen = held.error  # None: exited cleanly (or suppressed the block's error)
    except BaseExceptionGroup as group:
        chosen = unwrap(group, body, held.failure)
    if chosen is not None:
        raise chosen


# --- the bridged env ----------------------------------------------------------------------


# How the bridge calls each part of the asyncio env protocol, and whether it must be async.
_PROTOCOL: dict[str, tuple[tuple[str, ...], bool]] = {
    "rollout": (("task", "ctx"), True),
    "run_slot": (("slot", "ctx"), True),
    "score": (("task", "completion"), False),
    "serving": ((), False),
}


def _is_verifiers(obj: object, module: str, name: str) -> bool:
    """`obj` is an instance of verifiers' `module.name` (checked without importing it)."""
    return any(k.__module__ == module and k.__name__ == name for k in type(obj).__mro__)


def _check_call(owner: str, name: str, fn: object, params: tuple[str, ...], is_async: bool) -> None:
    """`fn` can be called as the protocol calls it: a `ConfigTypeError` naming the mismatch
    (and ``aio_env``)."""
    if not callable(fn):
        raise ConfigTypeError(f"the asyncio env's {name} must be callable", parameter="aio_env")
    call = f"{name}({', '.join(params)})"
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to check (a builtin): trust it
        return
    try:
        signature.bind(*params)
    except TypeError as exc:
        empty = inspect.Parameter.empty
        bare = signature.replace(
            parameters=[p.replace(annotation=empty) for p in signature.parameters.values()],
            return_annotation=empty,
        )
        raise ConfigTypeError(
            f"{owner}.{name}{bare} cannot be called as {call}, as the asyncio env protocol "
            f"calls it ({exc})",
            parameter="aio_env",
        ) from None
    method = getattr(fn, "__call__", None)  # noqa: B004 - an object with an async __call__
    if is_async and not (inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(method)):
        raise ConfigTypeError(
            f"{owner}.{name} must be a coroutine function (async def {call})",
            parameter="aio_env",
        )


def _check_protocol(aio_env: object) -> None:
    """Refuse, before any run, what does not satisfy the asyncio env protocol (module
    docstring), naming what is missing or mismatched."""
    owner = type(aio_env).__name__
    if isinstance(aio_env, Env):
        raise ConfigTypeError(
            f"{owner} is already a trio env (a tt.Env): run it as it is; "
            f"bridge_env takes an asyncio env",
            parameter="aio_env",
        )
    if _is_verifiers(aio_env, "verifiers.v1.env", "Env"):
        raise ConfigTypeError(
            f"{owner} is a verifiers v1 Env: its run_slot takes verifiers' RunSlot and returns "
            f"verifiers' Episode, not the asyncio env protocol bridge_env drives. Run it with "
            f"tt.aio.verifiers_env(env) (or tt.aio.verifiers_env('taskset-id', **env_config))",
            parameter="aio_env",
        )
    if not hasattr(aio_env, "taskset"):
        raise ConfigTypeError(
            f"an asyncio env needs a `taskset` attribute (and optionally rollout, run_slot, "
            f"score, serving, retries); {owner} has none",
            parameter="aio_env",
        )
    taskset = aio_env.taskset
    if _is_verifiers(taskset, "verifiers.v1.taskset", "Taskset"):
        raise ConfigTypeError(
            f"{owner}.taskset is a verifiers Taskset ({type(taskset).__name__}): run verifiers "
            f"envs with tt.aio.verifiers_env('taskset-id', **env_config)",
            parameter="aio_env",
        )
    if not isinstance(taskset, Taskset):
        for name in ("stream", "load"):
            part = getattr(taskset, name, None)
            if part is not None:
                _check_call(f"{owner}.taskset", name, part, (), False)
    for name, (params, is_async) in _PROTOCOL.items():
        if hasattr(aio_env, name):
            _check_call(owner, name, getattr(aio_env, name), params, is_async)


def _check_rollout(result: object, aio_env: object) -> tuple[list[Message], str]:
    if (
        isinstance(result, tuple)
        and len(result) == 2
        and isinstance(result[0], list)
        and isinstance(result[1], str)
    ):
        return result[0], result[1]
    raise TypeError(
        f"{type(aio_env).__name__}.rollout must return (messages: list, completion: str), got "
        f"{type(result).__name__}"
    )


async def _await(awaitable: Awaitable[T]) -> T:
    return await awaitable


class BridgedEnv(Env[TaskT]):
    """A `tt.Env` over an asyncio env (see the module docstring for the asyncio env protocol).

    Build one with `tt.aio.bridge_env(aio_env)`, or declare a class that other processes can
    import by name (the served path and the CLI rebuild envs that way)::

        class MyEnv(tt.aio.BridgedEnv[tt.Task]):
            aio_env_class = MyAsyncioEnv   # called as aio_env_class(taskset) or ()
            taskset_class = MyFeed         # the taskset class the env is built around

    `MyEnv(taskset, reward=..., retries=...)` then builds ``MyAsyncioEnv(taskset)``, exactly as
    `tt.Env` subclasses are built. `retries=` (else the asyncio env's ``retries``),
    `rollout_limits=` (a `tt.RolloutLimits`, as `tt.Env` takes it) and `reward=` (else the
    asyncio env's ``score``, else as `tt.Env`) apply. A reward that returns an awaitable is
    awaited as asyncio code.

    `serving()` opens the asyncio loop and holds the asyncio env's ``serving()``; `run_slot`
    must run under it (it raises `RuntimeError` otherwise). Raises `TrioAsyncioUnavailable`
    where trio-asyncio cannot import, and a `ConfigTypeError` (a TypeError) naming ``aio_env``
    for an object that does not follow the asyncio env protocol (or ``taskset`` and
    ``aio_env`` when both are given).
    """

    aio_env_class: ClassVar[Callable[..., Any] | None] = None
    taskset_class: ClassVar[type[Taskset[Any, Any]] | None] = None
    asyncio_loop: ClassVar[LoopKind] = "trio-asyncio"
    """The asyncio loop `serving()` runs the env on under `trio.run`: trio-asyncio's, inside
    trio (one thread, trio's clock), or ``"thread"``: a stdlib loop in a thread of its own
    (native asyncio speed; the real clock). Under an asyncio host (guest mode), the host's."""

    def __init__(
        self,
        taskset: Taskset[TaskT, Any] | None = None,
        *,
        aio_env: Any = None,
        reward: Reward | None = None,
        retries: RetryPolicy | None = None,
        rollout_limits: RolloutLimits | None = None,
    ) -> None:
        # Fail here, clearly, where it cannot work (a thread loop does not need it).
        self._trio_asyncio = trio_asyncio_module() if self.asyncio_loop == "trio-asyncio" else None
        if aio_env is None:
            factory = type(self).aio_env_class
            if factory is None:
                raise ConfigTypeError(
                    f"{type(self).__name__}: pass {{aio_env}}=, or set aio_env_class on the "
                    f"class (or use tt.aio.bridge_env(aio_env))",
                    parameter="aio_env",
                )
            aio_env = factory() if taskset is None else factory(taskset)
        elif taskset is not None:
            raise ConfigTypeError(
                "pass either a {taskset} (to build aio_env_class) or {aio_env}, not both",
                parameter=("taskset", "aio_env"),
            )
        _check_protocol(aio_env)
        if retries is None:
            retries = getattr(aio_env, "retries", None)
            if retries is not None and not isinstance(retries, RetryPolicy):
                raise ConfigTypeError(
                    f"the asyncio env's retries must be a tt.RetryPolicy, got {retries!r}",
                    parameter="aio_env",
                )
        self.aio_env: Any = aio_env
        super().__init__(
            as_taskset(aio_env.taskset), reward=reward, retries=retries,
            rollout_limits=rollout_limits,
        )  # fmt: skip
        self._explicit_reward = reward is not None
        self._loops: list[Any] = []  # the loops of the serving() blocks now open, innermost last

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.aio_env!r})"

    # --- the loop ---------------------------------------------------------------------------

    def serving(self) -> AbstractAsyncContextManager[BridgedEnv[TaskT]]:
        """Open the asyncio loop the env runs on and hold the asyncio env's `serving()` (if it
        has one) for the block, in one asyncio task. What the block raises comes out itself
        (unless the asyncio `serving()` suppresses it); a failure of the asyncio `serving()`
        while the block runs cancels the block and is raised itself."""
        return self._serving()

    @asynccontextmanager
    async def _serving(self) -> AsyncIterator[BridgedEnv[TaskT]]:
        factory = getattr(self.aio_env, "serving", None)
        async with open_loop(self.asyncio_loop) as loop:
            self._loops.append(loop)
            outer = bridge_loop.get()
            bridge_loop.set(loop)  # for the channels of asyncio feeds read under this block
            try:
                if factory is None:
                    yield self
                else:
                    async with _hold_serving(loop, factory):
                        yield self
            finally:
                bridge_loop.set(outer)
                self._loops.remove(loop)

    def _loop(self) -> Any:
        current = bridge_loop.get()
        if current is None and self._trio_asyncio is not None:
            current = self._trio_asyncio.current_loop.get()
        if self._loops:
            # Tasks outside the serving() block's task tree (a server's handlers) use its loop.
            return current if any(current is loop for loop in self._loops) else self._loops[-1]
        if current is not None:
            return current
        raise RuntimeError(
            f"{type(self).__name__}: the asyncio env runs on the asyncio loop that "
            f"env.serving() opens; call run_slot inside `async with env.serving():` (tt.run_eval "
            f"and the served path do)"
        )

    async def _aio(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await call_aio(self._loop(), fn, *args)

    # --- the episode ------------------------------------------------------------------------

    async def rollout(self, task: TaskT, ctx: ModelContext) -> tuple[list[Message], str]:
        """The asyncio env's `rollout(task, ctx)` as an asyncio task (with an
        `AsyncioModelContext`), or `Env.rollout` (single-turn chat) if it has none."""
        aio_rollout = getattr(self.aio_env, "rollout", None)
        if aio_rollout is None:
            return await super().rollout(task, ctx)
        loop = self._loop()
        result = await call_aio(loop, aio_rollout, task, AsyncioModelContext(ctx, loop))
        return _check_rollout(result, self.aio_env)

    async def score(self, task: TaskT, completion: str) -> Score:
        """`reward=` if given, else the asyncio env's `score`, else as `Env.score`; asyncio code
        (an awaitable reward) runs on the env's loop. A number, or named metrics with a
        `reward` entry, as `Env.score`."""
        aio_score = getattr(self.aio_env, "score", None)
        if aio_score is not None and not self._explicit_reward:
            value = await self._aio(aio_score, task, completion)
        else:
            value = self._reward(task, completion)
            if inspect.isawaitable(value):
                value = await self._aio(_await, value)
        return value if isinstance(value, Mapping) else float(value)

    # duplicates: Env.run_slot's signature, which this overrides
    async def run_slot(
        self,
        slot: RunSlot[TaskT],
        ctx: ModelContext,
        *,
        on_complete: OnComplete | None = None,
    ) -> Episode:
        """`Env.run_slot` over the bridged `rollout`/`score`, or, if the asyncio env has its own
        `run_slot(slot, ctx)`, that one as an asyncio task (what it raises propagates, as a
        machinery error), under the env's `rollout_limits` (see the module docstring).
        `on_complete(episode)` runs once, shielded, as in `Env.run_slot`.

        Raises `RuntimeError` outside `serving()`, `TypeError` when the asyncio `run_slot`
        returns something other than a `tt.Episode`."""
        loop = self._loop()  # outside serving(): RuntimeError here, not an episode failure
        aio_run_slot = getattr(self.aio_env, "run_slot", None)
        if aio_run_slot is None:
            return await super().run_slot(slot, ctx, on_complete=on_complete)
        if slot.started is None:
            slot.started = time.time()

        async def run() -> Episode:
            episode = await call_aio(loop, aio_run_slot, slot, AsyncioModelContext(ctx, loop))
            if not isinstance(episode, Episode):
                raise TypeError(
                    f"{type(self.aio_env).__name__}.run_slot must return a tt.Episode, got "
                    f"{type(episode).__name__}"
                )
            return episode

        limits = self.rollout_limits.within(slot.limits)
        if limits.bounds_attempt:
            episode = await self._bounded_slot(slot, limits, run)
        else:
            episode = await run()
        return await complete_slot(slot, episode, on_complete)

    async def _bounded_slot(
        self, slot: RunSlot[TaskT], limits: RolloutLimits, run: Callable[[], Awaitable[Episode]]
    ) -> Episode:
        """The asyncio `run_slot` (`run`) under `limits`, one call per attempt: its own
        episode, or one the bridge records (a cut scored, a timeout or a stall as its error),
        with the errors of the attempts before it."""
        task = slot.task
        began = trio.current_time()
        waits = Waits()
        errors: list[EpisodeError] = []
        attempt = 0
        while True:
            attempt += 1
            draft = Episode(
                id=new_id(), task=EpisodeTask(task_key(task), task_data(task)),
                rollout=slot.rollout,
            )  # fmt: skip

            cut = functools.partial(self._scored_cut, draft, task, attempt)
            try:
                episode = await run_within(limits, waits, run, _same, cut, draft.count)
            except (RolloutTimeoutError, StalledError) as exc:
                errors.append(EpisodeError.of(exc, attempt))
                if not self.retries.should_retry(exc, attempt):
                    return _recorded(draft, errors, attempt, slot, began, waits)
                with observe_calls(waits), parked("retry"):
                    await trio.sleep(self.retries.delay(attempt))
                continue
            if episode is draft:  # cut at its working limit: the bridge's own record
                return _recorded(draft, errors + draft.errors, attempt, slot, began, waits)
            if errors:
                episode.errors[:0] = errors
                episode.attempts += len(errors)
            return episode

    async def _scored_cut(
        self, draft: Episode, task: TaskT, attempt: int, replies: list[Completion]
    ) -> Episode:
        """`draft` as the episode of an attempt cut at its working limit: scored on the
        last reply it had received (a failed episode if the reward raises)."""
        draft.stop_reason = "working_limit"
        draft.turns = len(replies)
        draft.tool_calls = sum(len(reply.tool_calls) for reply in replies)
        draft.completion = cut_completion(replies)
        draft.messages = partial_messages(task, replies)
        try:
            draft.reward, draft.metrics = split_score(await self.score(task, draft.completion))
        except Exception as exc:
            draft.errors.append(EpisodeError.of(exc, attempt))
        else:
            draft.ok = True
        return draft


async def _same(episode: Episode) -> Episode:
    return episode


def _recorded(
    episode: Episode,
    errors: list[EpisodeError],
    attempts: int,
    slot: RunSlot[Any],
    began: float,
    waits: Waits,
) -> Episode:
    """`episode`, recorded by the bridge: its errors, attempts and timing, as
    `Env.run_slot` records them."""
    episode.errors = errors
    episode.attempts = attempts
    duration = trio.current_time() - began
    episode.timing = {
        "started": slot.started if slot.started is not None else time.time(),
        "finished": time.time(),
        "duration": duration,
        "waited_connection": waits.connection,
        "waited_rate": waits.rate,
        "working": duration - waits.parked_so_far(),
    }
    return episode


def bridge_env(
    aio_env: Any,
    *,
    reward: Reward | None = None,
    retries: RetryPolicy | None = None,
    rollout_limits: RolloutLimits | None = None,
) -> BridgedEnv[Any]:
    """A `tt.Env` that runs `aio_env`, an asyncio env, under trio (with trio-asyncio).

    `aio_env` follows the asyncio env protocol (module docstring): a `taskset`, and optionally
    `rollout`, `run_slot`, `score`, `serving`, `retries`; `rollout_limits` bound its episodes as
    `tt.Env`'s (its own `run_slot` included). The result is driven like any env:
    `tt.run_eval(env, ctx, config)`, or `async with env.serving(), env.taskset.channel() as
    tasks:` then `env.run_slot(slot, ctx)` per task. Raises a `ConfigTypeError` (a TypeError)
    naming ``aio_env`` for an object that is not an asyncio env, `TrioAsyncioUnavailable`
    where trio-asyncio cannot import (Python 3.14). For the served path, declare a
    `BridgedEnv` subclass at module level instead.
    """
    trio_asyncio_module()
    return BridgedEnv(
        aio_env=aio_env, reward=reward, retries=retries, rollout_limits=rollout_limits
    )
