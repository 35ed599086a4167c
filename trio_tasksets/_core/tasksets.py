"""Tasks and tasksets: where tasks come from, static or streaming, read as trio channels."""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import random
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Iterator
from contextlib import AbstractAsyncContextManager
from typing import Any, ClassVar, Generic, Self, TypeVar, get_args, get_origin

import attrs
import trio

from .exceptions import ConfigError, ConfigTypeError

__all__ = ["Task", "Taskset", "TasksetConfig"]


@attrs.define
class TasksetConfig:
    """A taskset's settings; subclass (as an attrs class) to add fields."""

    system_prompt: str | None = None


def _freeze_info(value: dict[str, Any] | None) -> dict[str, Any]:
    return {} if value is None else dict(value)


@attrs.frozen
class Task:
    """One unit of work: a prompt (text or chat messages), an optional answer and metadata.

    `key` identifies the task across runs (resume, de-duplication): the one given, or a stable
    hash of the task's content.
    """

    prompt: str | list[dict[str, Any]]
    answer: str | None = None
    info: dict[str, Any] = attrs.field(factory=dict, converter=_freeze_info)
    system_prompt: str | None = None
    _key: str | None = attrs.field(default=None, kw_only=True, alias="key")

    @property
    def key(self) -> str:
        if self._key is not None:
            return self._key
        content = json.dumps(
            [self.prompt, self.answer, self.info, self.system_prompt],
            sort_keys=True,
            separators=(",", ":"),
            default=str,
        )
        return hashlib.sha256(content.encode()).hexdigest()[:16]

    @property
    def data(self) -> dict[str, Any]:
        """The task's own fields, as a trace row stores them under `task.data`."""
        return {
            "prompt": self.prompt,
            "answer": self.answer,
            "info": self.info,
            "system_prompt": self.system_prompt,
        }

    def with_system_prompt(self, text: str) -> Task:
        """A copy of this task with `text` as its system prompt (the key is kept)."""
        return attrs.evolve(self, system_prompt=text, key=self.key)


TaskT = TypeVar("TaskT")
ConfigT = TypeVar("ConfigT", bound=TasksetConfig)

# A view step: ("head", n) | ("shuffle", seed) | ("map", transform)
_Step = tuple[str, Any]


class Taskset(Generic[TaskT, ConfigT]):
    """Where tasks come from.

    Override `load()` for a static taskset (a finite, re-iterable collection) or `stream()`
    for a feed (tasks arrive over time; the feed may wait forever and may never end). Runners
    read a taskset through `channel()`, which gives both kinds one path. Set `INFINITE = True`
    on a static taskset whose `load()` never ends.

    Views (`head`, `shuffle`, `view`) return a new taskset of the same type and never mutate
    the base; the configured system prompt and the views apply on both paths.
    """

    INFINITE: ClassVar[bool] = False

    def __init__(self, config: ConfigT | None = None) -> None:
        self.config: ConfigT = config if config is not None else self._default_config()
        self._steps: tuple[_Step, ...] = ()

    @classmethod
    def _default_config(cls) -> ConfigT:
        for klass in cls.__mro__:
            for base in getattr(klass, "__orig_bases__", ()):
                origin = get_origin(base)
                if isinstance(origin, type) and issubclass(origin, Taskset):
                    args = get_args(base)
                    if len(args) == 2 and isinstance(args[1], type):
                        return args[1]()  # type: ignore[no-any-return]
        return TasksetConfig()  # type: ignore[return-value]

    # --- the override points ---------------------------------------------------------------

    def load(self) -> Iterable[TaskT]:
        """The static tasks (sync). A pure feed returns `[]`, the default."""
        return []

    async def stream(self) -> AsyncIterator[TaskT]:
        """The tasks as they appear. Override for a feed; the default yields `iter(self)`.

        The base implementation is used for static tasksets, with the system prompt and the
        views already applied; an override yields raw tasks and `channel()` applies them.
        """
        for task in self:
            yield task

    @property
    def streaming(self) -> bool:
        """True exactly when `stream()` is overridden."""
        return type(self).stream is not Taskset.stream

    # --- reading ----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[TaskT]:
        """`load()` with the system prompt and the views applied."""
        tasks: Iterable[TaskT] = self.load()
        prompt = self.config.system_prompt
        if prompt is not None:
            tasks = (self._prompted(task, prompt) for task in tasks)
        for kind, arg in self._steps:
            if kind == "head":
                tasks = itertools.islice(tasks, arg)
            elif kind == "shuffle":
                listed = list(tasks)
                random.Random(arg).shuffle(listed)
                tasks = listed
            else:
                tasks = _mapped(tasks, arg)
        return iter(tasks)

    def channel(self) -> AbstractAsyncContextManager[trio.abc.ReceiveChannel[TaskT]]:
        """The read path: the tasks as a trio ReceiveChannel, pulled only on demand.

        Each receive pulls one task from `stream()` (no prefetch), with the system prompt and
        the views applied on the streaming path too. Leaving the `async with` block closes
        `stream()`, shielded (a closed channel closes it at its next pull).
        """
        return trio.as_safe_channel(guarded_tasks)(self._open_stream)

    def _open_stream(self) -> AsyncIterator[TaskT]:
        # A static taskset's default stream() already applies prompt and views.
        return stream_view(self) if self.streaming else self.stream()

    # --- views ------------------------------------------------------------------------------

    def head(self, n: int) -> Self:
        """The first `n` tasks only (of a stream: the next `n`, and never an (n+1)th pull).
        Raises a `ConfigError` naming `n` unless it is an int >= 0."""
        if isinstance(n, bool) or not isinstance(n, int):
            raise ConfigTypeError(f"head(n): {{n}} must be an int >= 0, got {n!r}", parameter="n")
        if n < 0:
            raise ConfigError(f"head(n): {{n}} must be >= 0, got {n}", parameter="n")
        return self._with(("head", n))

    def shuffle(self, seed: int | None = None) -> Self:
        """The tasks in a reproducible random order (materializes them).

        Refused on an INFINITE or streaming taskset (there is no end to shuffle), unless a
        `head(n)` before it bounds the taskset: a `ConfigError` (a ValueError).
        """
        bounded = any(kind == "head" for kind, _ in self._steps)
        if (self.INFINITE or self.streaming) and not bounded:
            kind = "INFINITE" if self.INFINITE else "streaming"
            raise ConfigError(
                f"cannot shuffle {type(self).__name__}: it is {kind} and has no end; "
                f"bound it first with .head(n).shuffle()",
                parameter="shuffle",
            )
        return self._with(("shuffle", seed))

    def view(self, transform: Callable[[TaskT], TaskT | None]) -> Self:
        """Map each task through `transform`; a task for which it returns None is dropped.
        Raises a `ConfigTypeError` naming `transform` when it is not callable."""
        if not callable(transform):
            raise ConfigTypeError(
                f"view(transform): {{transform}} must be callable, got {transform!r}",
                parameter="transform",
            )
        return self._with(("map", transform))

    def _with(self, step: _Step) -> Self:
        clone = copy.copy(self)
        clone._steps = (*self._steps, step)
        return clone

    @staticmethod
    def _prompted(task: TaskT, text: str) -> TaskT:
        with_prompt = getattr(task, "with_system_prompt", None)
        if with_prompt is None:
            raise ConfigTypeError(
                f"the taskset has {{system_prompt}} set, but its tasks ({type(task).__name__}) "
                f"cannot take one: give them a with_system_prompt(text) method (tt.Task has "
                f"one) or leave system_prompt unset",
                parameter="system_prompt",
            )
        return with_prompt(text)  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        steps = "".join(f".{kind}({'fn' if kind == 'map' else arg!r})" for kind, arg in self._steps)
        return f"{type(self).__name__}({self.config!r}){steps}"


def _mapped(tasks: Iterable[TaskT], transform: Callable[[TaskT], TaskT | None]) -> Iterator[TaskT]:
    for task in tasks:
        out = transform(task)
        if out is not None:
            yield out


async def aclose_source(source: AsyncIterator[Any]) -> None:
    """`source.aclose()` when it has one (a plain async iterator may not)."""
    aclose = getattr(source, "aclose", None)
    if aclose is not None:
        await aclose()


async def guarded_tasks(
    open_source: Callable[[], AsyncIterator[TaskT]],
) -> AsyncGenerator[TaskT, None]:
    """The tasks of `open_source()`, for a `trio.as_safe_channel` (`Taskset.channel`, and an
    asyncio taskset's bridged channel): the source is closed on every exit, shielded."""
    # Only the channel's own background task iterates this generator, and it enters no scope
    # between pulls, so `guard` may stay open across the yield. It is entered before the
    # source is opened and shielded only for the close: the source's cleanup is shielded
    # without a scope entered after any scope the source holds (a merge's nursery).
    with trio.CancelScope() as guard:
        source = open_source()
        try:
            async for task in source:
                yield task
        finally:
            guard.shield = True
            await aclose_source(source)


async def stream_view(taskset: Taskset[TaskT, Any]) -> AsyncGenerator[TaskT, None]:
    """`taskset.stream()` with the system prompt and the views applied, pulled on demand.

    A head view stops *before* requesting an (n+1)th task; a shuffle after a head buffers the
    n tasks it bounds. `stream()` is closed on every exit (shielded by `guarded_tasks`).
    """
    source = taskset.stream()
    steps = taskset._steps
    shuffle_at = next((i for i, (kind, _) in enumerate(steps) if kind == "shuffle"), None)
    before = steps if shuffle_at is None else steps[:shuffle_at]
    applied = _apply_steps(source, taskset.config.system_prompt, before)
    try:
        if shuffle_at is None:
            async for task in applied:
                yield task
            return
        tasks = [t async for t in applied]
        random.Random(steps[shuffle_at][1]).shuffle(tasks)
        for task in _apply_sync(tasks, steps[shuffle_at + 1 :]):
            yield task
    finally:
        try:
            await aclose_source(applied)
        finally:
            await aclose_source(source)


async def _apply_steps(
    source: AsyncIterator[TaskT], prompt: str | None, steps: tuple[_Step, ...]
) -> AsyncGenerator[TaskT, None]:
    """Pull raw tasks from `source`, apply prompt, maps and heads; never over-pull a head."""
    heads = [[arg] for kind, arg in steps if kind == "head"]  # mutable remaining counts
    if any(h[0] == 0 for h in heads):
        return
    while True:
        try:
            task = await source.__anext__()
        except StopAsyncIteration:
            return
        if prompt is not None:
            task = Taskset._prompted(task, prompt)
        keep: TaskT | None = task
        head_i = 0
        for kind, arg in steps:
            if keep is None:
                break
            if kind == "map":
                keep = arg(keep)
            elif kind == "head":
                heads[head_i][0] -= 1
                head_i += 1
        if keep is not None:
            yield keep
        # A head used up (counted only for tasks that reached it) ends the stream.
        if any(h[0] == 0 for h in heads):
            return


def _apply_sync(tasks: Iterable[TaskT], steps: tuple[_Step, ...]) -> Iterator[TaskT]:
    out: Iterable[TaskT] = tasks
    for kind, arg in steps:
        if kind == "head":
            out = itertools.islice(out, arg)
        elif kind == "map":
            out = _mapped(out, arg)
        else:
            listed = list(out)
            random.Random(arg).shuffle(listed)
            out = listed
    return iter(out)
