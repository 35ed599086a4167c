"""Helpers for deterministic tests of runners and tasksets (the project's own tests use them).

* `Feed`: an async iterator the test feeds item by item; it counts `pulled`, knows when it is
  `closed` (and how often, and whether a pull was still running then), and checks that it is
  pulled and closed from one task.
* `FeedTaskset`: a streaming taskset whose `stream()` reads such a feed.
* `Gate`: holds runs until opened; records how many are running and the peak.
* `ScriptedClient`: a model client that answers from a script (completions, tool calls
  included, or functions of the messages and tools) and records every call in `.calls`;
  `reply(...)` builds a scripted reply, tool calls included.
* `MemoryTaskQueue`: a worker's task queue (`trio_tasksets.worker.TaskQueue`) in memory: `put`
  entries, run the worker loop over it (`trio_tasksets.worker.consume`), read what it
  `answered`, `refused` and still `held`; `reclaim()` hands a crashed worker's entries out
  again. The reference a queue of one's own is tested against (tests/test_queues.py).

Use them on trio's MockClock (pytest-trio's `autojump_clock`), with every wait on a quiet feed
under `trio.fail_after`.
"""

from __future__ import annotations

import copy
import inspect
import json
import math
import random
import zlib
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, Generic, TypeVar

import attrs
import trio

from ._core.exceptions import ConfigError, ConfigTypeError, TrioTasksetsError
from ._core.tasksets import Task, Taskset, TasksetConfig
from ._core.views import View
from ._env.env import task_data, task_key
from ._env.groups import Advantage
from ._models import (
    Completion,
    ModelClientBase,
    ReplyBuilder,
    Sampling,
    Tokens,
    VersionSpan,
    attach_reply,
)
from .worker import Finished, MalformedEntry, TaskEntry

__all__ = [
    "ASSISTANT",
    "EOS",
    "Feed",
    "FeedTaskset",
    "Gate",
    "MemoryTaskQueue",
    "ScriptExhausted",
    "ScriptedCall",
    "ScriptedClient",
    "SimulatedEngine",
    "reply",
]

T = TypeVar("T")
R = TypeVar("R")

_END = object()


class _Signal:
    """A 'something changed' broadcast: wait until a predicate holds."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def fire(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def until(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self._event.wait()


class _Queue(Generic[T]):
    """An unbounded queue of items, an end marker and errors, fed synchronously by the test."""

    def __init__(self) -> None:
        self._send, self._receive = trio.open_memory_channel[object](math.inf)

    def put(self, *items: T) -> None:
        for item in items:
            self._send.send_nowait(item)

    def end(self) -> None:
        """After the items already put, the feed ends (StopAsyncIteration)."""
        self._send.send_nowait(_END)

    def fail(self, error: BaseException) -> None:
        """After the items already put, the feed raises `error`."""
        self._send.send_nowait(error)

    async def get(self) -> tuple[bool, T]:
        """(True, item), or (False, _) at the end; raises a fed error."""
        value = await self._receive.receive()
        if value is _END:
            return False, None  # type: ignore[return-value]
        if isinstance(value, BaseException):
            raise value
        return True, value  # type: ignore[return-value]


class Feed(_Queue[T]):
    """An async iterator fed by the test: `put(*items)`, `end()`, `fail(exc)`.

    A pull with nothing queued parks until the test puts something (a quiet feed). Records:
    `pulled` (items handed out), `closed`, `close_calls`, `closed_while_pulling` (an `aclose()`
    that arrived while a pull was running elsewhere) and `foreign_close` (closed from a task
    other than the one that pulled).
    """

    def __init__(self, *items: T) -> None:
        super().__init__()
        self.pulled = 0
        self.closed = False
        self.close_calls = 0
        self.closed_while_pulling = False
        self.foreign_close = False
        self.waiting = False
        self._puller: trio.lowlevel.Task | None = None
        self.put(*items)

    def __aiter__(self) -> Feed[T]:
        return self

    async def __anext__(self) -> T:
        if self.closed:
            raise RuntimeError("Feed pulled after it was closed")
        self._puller = trio.lowlevel.current_task()
        self.waiting = True
        try:
            more, item = await self.get()
        finally:
            self.waiting = False
        if not more:
            raise StopAsyncIteration
        self.pulled += 1
        return item

    async def aclose(self) -> None:
        self.close_calls += 1
        if self.waiting:
            self.closed_while_pulling = True
        if self._puller is not None and self._puller is not trio.lowlevel.current_task():
            self.foreign_close = True
        self.closed = True
        await trio.lowlevel.checkpoint()


@attrs.define
class _FeedState:
    queue: _Queue[Task] = attrs.Factory(_Queue)
    pulled: int = 0
    closed: bool = False


class FeedTaskset(Taskset[Task, TasksetConfig]):
    """A streaming taskset fed by the test: `put(*tasks)` (a str becomes a Task whose prompt
    and answer are that str), `end()`, `fail(exc)`; it counts `pulled` and knows `closed`.
    Views of it (`head`, `view`) share the feed and the counts.
    """

    def __init__(self, config: TasksetConfig | None = None) -> None:
        super().__init__(config)
        self._state = _FeedState()

    pulled = View[int]("_state", "Tasks pulled so far, by any view of this feed.")
    closed = View[bool]("_state", "Whether a view of this feed closed it.")

    def put(self, *tasks: Task | str) -> None:
        self._state.queue.put(*(Task(t, answer=t) if isinstance(t, str) else t for t in tasks))

    def end(self) -> None:
        self._state.queue.end()

    def fail(self, error: BaseException) -> None:
        self._state.queue.fail(error)

    async def stream(self) -> AsyncGenerator[Task, None]:
        state = self._state
        try:
            while True:
                more, task = await state.queue.get()
                if not more:
                    return
                state.pulled += 1
                yield task
        finally:
            state.closed = True


class Gate:
    """Holds runs until `open()`; records `running`, `peak`, `started` and `finished`.

    `gate.run` is a run function that returns its item once the gate is open; `gate.wrap(fn)`
    holds `fn` the same way. `await gate.wait_running(n)` waits until n runs are held.
    A gate made with `opened=True` holds nothing and only counts.
    """

    def __init__(self, *, opened: bool = False) -> None:
        self._open = trio.Event()
        if opened:
            self._open.set()
        self._changed = _Signal()
        self.running = 0
        self.peak = 0
        self.started = 0
        self.finished = 0
        self.cancelled = 0

    def open(self) -> None:
        self._open.set()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    @asynccontextmanager
    async def held(self) -> AsyncGenerator[None, None]:
        """Count a run as running, wait for the gate, then let the body run."""
        self.running += 1
        self.started += 1
        self.peak = max(self.peak, self.running)
        self._changed.fire()
        try:
            await self._open.wait()
            yield
            self.finished += 1
        except trio.Cancelled:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1
            self._changed.fire()

    async def run(self, item: T) -> T:
        async with self.held():
            return item

    def wrap(self, fn: Callable[[T], Awaitable[R]]) -> Callable[[T], Awaitable[R]]:
        async def run(item: T) -> R:
            async with self.held():
                return await fn(item)

        return run

    async def wait_running(self, n: int) -> None:
        await self._changed.until(lambda: self.running >= n)

    async def wait_started(self, n: int) -> None:
        await self._changed.until(lambda: self.started >= n)


# --- a scripted model ---------------------------------------------------------------------


def reply(
    content: str | None = "",
    *,
    tool_calls: Sequence[tuple[str, dict[str, Any] | str]] = (),
    usage: dict[str, int] | None = None,
    finish_reason: str | None = None,
    **message_fields: Any,
) -> Completion:
    """A model reply as an OpenAI-compatible server would send it: `content`, and one tool
    call per ``(name, arguments)`` in `tool_calls` (arguments as a dict, or as the raw text
    the model wrote, e.g. invalid JSON), with ids ``call_0``, ``call_1``, ... Extra keyword
    arguments become fields of the message (``reasoning_content=...``). `finish_reason`
    defaults to ``"tool_calls"`` when there are calls, else ``"stop"``."""
    message: dict[str, Any] = {"role": "assistant", "content": content, **message_fields}
    if tool_calls:
        message["tool_calls"] = [
            {
                "id": f"call_{i}",
                "type": "function",
                "function": {
                    "name": name,
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                },
            }
            for i, (name, arguments) in enumerate(tool_calls)
        ]
    return Completion(
        content=content or "",
        usage=dict(usage or {}),
        finish_reason=finish_reason or ("tool_calls" if tool_calls else "stop"),
        message=message,
    )


@attrs.frozen
class ScriptedCall:
    """One call a `ScriptedClient` answered: the messages (a deep copy, as they were then),
    the model, the sampling and the tools it was given."""

    messages: list[dict[str, Any]]
    model: str
    sampling: Sampling
    tools: list[dict[str, Any]] | None


class ScriptExhausted(TrioTasksetsError, RuntimeError):
    """A `ScriptedClient` was called more often than its script has replies."""


Answer = Completion | str | dict[str, Any]
ScriptStep = Answer | Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], Any]


class ScriptedClient(ModelClientBase):
    """A `ModelClient` that answers from a script, for tests (tool calls included).

    `replies` is either a sequence, answered in call order (one step per call, across every
    rollout using the client), or one function answering every call. A step is a
    `Completion` (see `reply` for one with tool calls), a str (a reply with that text), a
    dict (the assistant message as a server would send it), or a function of
    ``(messages, tools)``, sync or async, returning one of those (it may sleep, or raise to
    play a failing model). Every call is recorded in `calls` (a `ScriptedCall`), before it is
    answered. A call past the end of the script raises `ScriptExhausted`, and a step that
    gives none of those a `ConfigTypeError` naming ``replies``. Each call checkpoints, and
    waits `delay` seconds first (`trio.sleep`: a MockClock controls it); a `delay` below 0
    raises a `ConfigError` naming it.
    """

    def __init__(self, replies: Sequence[ScriptStep] | ScriptStep, *, delay: float = 0.0) -> None:
        if not delay >= 0:
            raise ConfigError(f"{{delay}} must be >= 0, got {delay!r}", parameter="delay")
        if callable(replies) or isinstance(replies, Completion | str | dict):
            self._steps: list[ScriptStep] | None = None
            self._every: ScriptStep | None = replies
        else:
            self._steps = list(replies)
            self._every = None
        self.delay = delay
        self.calls: list[ScriptedCall] = []

    def __repr__(self) -> str:
        size = "a function" if self._steps is None else f"{len(self._steps)} replies"
        return f"ScriptedClient({size}, calls={len(self.calls)})"

    # duplicates: ModelClient.chat's signature (with tools), which every client implements
    async def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        model: str,
        sampling: Sampling,
        tools: list[dict[str, Any]] | None = None,
    ) -> Completion:
        """The script's next reply (recorded in `calls`); raises `ScriptExhausted` for a
        call past the end of a sequence script."""
        index = len(self.calls)
        self.calls.append(ScriptedCall(copy.deepcopy(messages), model, sampling, tools))
        if self.delay > 0:
            await trio.sleep(self.delay)
        await trio.lowlevel.checkpoint()
        if self._steps is None:
            step = self._every
        elif index < len(self._steps):
            step = self._steps[index]
        else:
            raise ScriptExhausted(
                f"ScriptedClient: the script has {len(self._steps)} replies, and call "
                f"{index + 1} was made (messages: {messages[-1:]!r})"
            )
        answer: Any = step
        if callable(step):
            answer = step(messages, tools)
            if inspect.isawaitable(answer):
                answer = await answer
        return _completion(answer)


def _completion(answer: object) -> Completion:
    if isinstance(answer, Completion):
        return answer
    if isinstance(answer, str):
        return reply(answer)
    if isinstance(answer, dict):
        message = {"role": "assistant", **answer}
        content = message.get("content")
        return Completion(
            content=content if isinstance(content, str) else "",
            finish_reason="tool_calls" if message.get("tool_calls") else "stop",
            message=message,
        )
    raise ConfigTypeError(
        f"ScriptedClient: a script step of {{replies}} gave {type(answer).__name__}; give a "
        f"Completion (testing.reply(...)), a str or an assistant message dict",
        parameter="replies",
    )


class MemoryTaskQueue:
    """A `TaskQueue` in memory (see `trio_tasksets.worker` for the guarantees it gives).

    `put(task, ...)` adds an entry (any task: its key and data travel, as through Redis);
    `answered` lists each published `Finished` in publish order, `refused` each entry
    acknowledged without running (with the reason), `held` the entries claimed and not yet
    acknowledged, and `peak` the most held at once. A worker that is cancelled or crashes
    leaves its entries in `held`; `reclaim()` (what another worker does once they are idle)
    puts them back first in line. `publish` of an entry no longer held (reclaimed and
    answered elsewhere) records nothing and counts it in `duplicates`.
    """

    def __init__(self, consumer: str = "memory", *, keep_alive_every: float = math.inf) -> None:
        self._consumer = consumer
        self._keep_alive_every = keep_alive_every
        self.ready: deque[TaskEntry] = deque()
        self.held: dict[str, TaskEntry] = {}
        self.answered: list[Finished] = []
        self.refused: list[tuple[TaskEntry, str]] = []
        self.peak = 0
        self.kept_alive = 0
        self.duplicates = 0
        self.closed = False
        self._ids = 0
        self._stop = trio.Event()
        self._changed = trio.Event()

    # duplicates: the TaskQueue protocol's read-only properties, as every class's plain getters
    @property
    def consumer(self) -> str:
        return self._consumer

    @property
    def keep_alive_every(self) -> float:
        return self._keep_alive_every

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def describe(self) -> str:
        return f"memory queue {self._consumer} ({len(self.ready)} ready)"

    # duplicates: keyword settings with defaults: the shape of every such signature
    def put(
        self,
        task: Any,
        *,
        rollout: int = 0,
        rollouts: int = 1,
        group: str | None = None,
        declared: str | None = None,
        deadline: float | None = None,
        advantage: Advantage = "mean",
    ) -> TaskEntry:
        """Add an entry for `task` (`group`: one entry of `rollouts` rollouts run as a
        group, its advantages as `advantage` says); return it."""
        self._ids += 1
        entry = TaskEntry(
            None, f"m-{self._ids}", task_key(task), task_data(task), rollout=rollout,
            rollouts=rollouts, group=group, declared=declared, deadline=deadline,
            advantage=advantage,
        )  # fmt: skip
        self.ready.append(entry)
        self._wake()
        return entry

    def reclaim(self) -> list[TaskEntry]:
        """Every held entry back at the front of the line (a dead worker's, reclaimed)."""
        taken = list(self.held.values())
        self.held.clear()
        self.ready.extendleft(reversed(taken))
        self._wake()
        return taken

    def restart(self, consumer: str | None = None) -> None:
        """Ready for another worker (named `consumer`, default: the same) after `stop()`:
        new claims may start."""
        if consumer is not None:
            self._consumer = consumer
        self._stop = trio.Event()
        self.closed = False

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def claims(
        self, build: Callable[[TaskEntry], T], *, room: Callable[[], int]
    ) -> AsyncIterator[T]:
        claimed: deque[TaskEntry] = deque()
        while True:
            if claimed:  # ours now, even after stop(): run them
                entry = claimed.popleft()
                try:
                    item = build(entry)
                except MalformedEntry as exc:
                    del self.held[entry.id]
                    self.refused.append((entry, str(exc)))
                    continue
                yield item
                continue
            if self.stopping:
                return
            if not self.ready:
                stop, changed = self._stop, self._changed
                async with trio.open_nursery() as nursery:

                    async def until(event: trio.Event) -> None:
                        await event.wait()
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(until, stop)
                    nursery.start_soon(until, changed)
                continue
            await trio.lowlevel.checkpoint()
            for _ in range(min(max(1, room()), len(self.ready))):
                entry = self.ready.popleft()
                self.held[entry.id] = entry
                claimed.append(entry)
            self.peak = max(self.peak, len(self.held))

    async def publish(self, batch: Sequence[Finished]) -> None:
        await trio.lowlevel.checkpoint()
        for finished in batch:
            if self.held.pop(finished.entry.id, None) is None:
                self.duplicates += 1
            else:
                self.answered.append(finished)

    async def keep_alive(self, held: Sequence[TaskEntry]) -> None:
        await trio.lowlevel.checkpoint()
        self.kept_alive += 1

    def stop(self) -> None:
        self._stop.set()

    async def close(self) -> None:
        await trio.lowlevel.checkpoint()
        self.closed = True


# --- a simulated inference engine ------------------------------------------------------------

ASSISTANT = 1
"""The simulated engine's token that opens the assistant's turn: the last token of a prompt."""
EOS = 2
"""The simulated engine's end-of-sequence token (a reply that ends on it stops)."""


def _word_id(word: str, vocab: int) -> int:
    return zlib.crc32(word.encode()) % (vocab - 3) + 3


@attrs.define(eq=False)
class _Generation:
    aborted: bool = False


class SimulatedEngine(ModelClientBase):
    """An inference engine in memory, on trio's clock (a `MockClock` runs it in
    milliseconds): a model client (`chat`, and `complete_ids`, a token-id prompt continued)
    and an engine a `tt.Policy` updates (`pause`, `resume`, `set_version`: a
    `tt.EngineControl`).

    - A prompt is its messages' words as token ids, then `ASSISTANT`. The reply is a
      function of the prompt alone: its length is drawn from a lognormal of mean
      `mean_tokens` and shape `sigma` (seeded by `seed` and the prompt; at most
      `longest`), each token a function of the prompt, its position and the token before,
      the last one `EOS` (``finish_reason`` ``"stop"``; ``"length"`` when the request's
      ``max_tokens`` comes first). So a reply cut anywhere and continued from the prompt
      plus its tokens (`complete_ids`) equals the uncut one, token for token.
    - Time: `prefill_time` before the first token, then `decode_time` per token, for each
      of up to `max_running` requests at once (the rest queue; None: no bound).
    - `pause("keep")` freezes the requests in place until `resume()`; `pause("abort")` ends
      them (their replies end with ``finish_reason`` ``"abort"`` and the tokens made);
      `pause("wait")` returns once none is running. New requests wait while paused.
    - Each reply carries the engine's own `versions` (the version set by `set_version` when
      each token was made), its token ids and logprobs (`tokens`), and `ttft`; as tokens are
      made they go to the partial reply a `tt.Policy` hands the call, as a streamed reply's
      would, so a call cut by an ``abort`` update keeps them.
    - Figures: `requests`, `generated` (tokens made), `aborted` (requests ended by a pause).

    A bad setting raises a `ConfigError` naming it."""

    def __init__(
        self,
        *,
        decode_time: float = 0.01,
        prefill_time: float = 0.0,
        mean_tokens: float = 256.0,
        sigma: float = 1.0,
        longest: int = 8192,
        max_running: int | None = None,
        vocab: int = 32000,
        seed: int = 0,
        version: str | int = 0,
    ) -> None:
        for name, value in (("decode_time", decode_time), ("prefill_time", prefill_time),
                            ("sigma", sigma)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ConfigError(
                    f"{{{name}}} must be a number >= 0, got {value!r}", parameter=name
                )
        if (
            isinstance(mean_tokens, bool)
            or not isinstance(mean_tokens, int | float)
            or not mean_tokens >= 1
        ):
            raise ConfigError(
                f"{{mean_tokens}} must be a number >= 1, got {mean_tokens!r}",
                parameter="mean_tokens",
            )
        for name, count in (("longest", longest), ("vocab", vocab)):
            if isinstance(count, bool) or not isinstance(count, int) or count < 4:
                raise ConfigError(f"{{{name}}} must be an int >= 4, got {count!r}", parameter=name)
        if max_running is not None and (
            isinstance(max_running, bool) or not isinstance(max_running, int) or max_running < 1
        ):
            raise ConfigError(
                f"{{max_running}} must be an int >= 1 or None, got {max_running!r}",
                parameter="max_running",
            )
        self.decode_time = float(decode_time)
        self.prefill_time = float(prefill_time)
        self.mean_tokens = float(mean_tokens)
        self.sigma = float(sigma)
        self.longest = longest
        self.vocab = vocab
        self.seed = seed
        self.version = str(version)
        self.paused: str | None = None
        self._resumed = trio.Event()
        self._resumed.set()
        self._changed = trio.Event()
        self._running: set[_Generation] = set()
        self._drained = trio.Event()
        self._drained.set()
        self._slots = None if max_running is None else trio.Semaphore(max_running)
        self.requests = 0
        self.generated = 0
        self.aborted = 0

    def __repr__(self) -> str:
        return (
            f"SimulatedEngine(mean_tokens={self.mean_tokens:g}, decode_time={self.decode_time:g}, "
            f"version={self.version!r}, paused={self.paused!r})"
        )

    # --- the engine's control (tt.EngineControl) ------------------------------------------

    async def pause(self, mode: str) -> None:
        """Pause generation: ``"keep"``, ``"abort"`` or ``"wait"`` (as the class says).
        Raises a `ConfigError` naming ``mode`` for another."""
        if mode not in ("keep", "abort", "wait"):
            raise ConfigError(
                f"{{mode}} must be keep, abort or wait, got {mode!r}", parameter="mode"
            )
        if mode == "wait":
            while self._running:
                await self._drained.wait()
        self.paused = mode
        self._resumed = trio.Event()
        if mode == "abort":
            for generation in self._running:
                generation.aborted = True
        self._wake()
        await trio.lowlevel.checkpoint()

    async def resume(self) -> None:
        """Resume generation."""
        self.paused = None
        self._resumed.set()
        self._wake()
        await trio.lowlevel.checkpoint()

    async def set_version(self, version: str) -> None:
        """The tokens made from now on carry `version`."""
        self.version = str(version)
        await trio.lowlevel.checkpoint()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # --- the model ----------------------------------------------------------------------------

    def encode(self, messages: list[dict[str, Any]]) -> list[int]:
        """The prompt of `messages` as token ids (their words, then `ASSISTANT`)."""
        ids = [
            _word_id(word, self.vocab)
            for message in messages
            for word in str(message.get("content") or "").split()
        ]
        return [*ids, ASSISTANT]

    def length(self, prompt_ids: Sequence[int]) -> int:
        """The number of tokens of the (whole) reply to `prompt_ids`, `EOS` included."""
        key = zlib.crc32(repr((self.seed, list(prompt_ids))).encode())
        draw = random.Random(key).lognormvariate(
            math.log(self.mean_tokens) - self.sigma**2 / 2, self.sigma
        )
        return max(1, min(self.longest, round(draw)))

    def _token(self, key: int, position: int, previous: int) -> int:
        return (key * 1_000_003 + position * 7919 + previous * 31) % (self.vocab - 3) + 3

    def reply_ids(self, prompt_ids: Sequence[int]) -> list[int]:
        """The whole reply to `prompt_ids` (greedy, unchanged weights), `EOS` last."""
        key = zlib.crc32(repr(list(prompt_ids)).encode())
        ids: list[int] = []
        previous = prompt_ids[-1] if prompt_ids else 0
        for position in range(self.length(prompt_ids) - 1):
            previous = self._token(key, position, previous)
            ids.append(previous)
        return [*ids, EOS]

    # duplicates: ModelClient.chat's signature (with tools), which every client implements
    async def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        model: str,
        sampling: Sampling,
        tools: list[dict[str, Any]] | None = None,
    ) -> Completion:
        """Generate the reply to `messages`, as the class says."""
        prompt = self.encode(messages)
        return await self._generate(prompt, prompt, [], sampling)

    async def complete_ids(
        self, prompt_ids: list[int], *, model: str, sampling: Sampling
    ) -> Completion:
        """Continue `prompt_ids`: a prompt (up to its last `ASSISTANT`) and the reply's
        tokens so far; the reply goes on from there as the uncut one would."""
        split = (
            len(prompt_ids) - 1 - prompt_ids[::-1].index(ASSISTANT)
            if ASSISTANT in prompt_ids
            else len(prompt_ids) - 1
        )
        prompt = prompt_ids[: split + 1]
        return await self._generate(prompt_ids, prompt, prompt_ids[split + 1 :], sampling)

    async def _generate(
        self, given: list[int], prompt: list[int], done: list[int], sampling: Sampling
    ) -> Completion:
        whole = self.reply_ids(prompt)
        rest = whole[len(done) :]
        finish = "stop"
        if sampling.max_tokens is not None and sampling.max_tokens < len(rest):
            rest, finish = rest[: sampling.max_tokens], "length"
        self.requests += 1
        began = trio.current_time()
        slot = self._slots
        if slot is not None:
            await slot.acquire()
        generation = _Generation()
        self._running.add(generation)
        self._drained = trio.Event()
        builder = ReplyBuilder(began)  # its tokens as a stream brings them
        attach_reply(builder)
        builder.feed({"prompt_token_ids": list(given)})
        spans: list[list[Any]] = []  # [version, start, end]
        made = 0
        ttft: float | None = None

        def emit(n: int, version: str) -> None:
            nonlocal made
            if n <= 0:
                return
            if spans and spans[-1][0] == version and spans[-1][2] == made:
                spans[-1][2] += n
            else:
                spans.append([version, made, made + n])
            new = rest[made : made + n]
            builder.feed({
                "choices": [{
                    "delta": {"content": "".join(f"t{t} " for t in new)},
                    "token_ids": new,
                    "logprobs": {"content": [{"logprob": _logprob(t)} for t in new]},
                }]
            })  # fmt: skip
            made += n
            self.generated += n

        segment, version = math.inf, self.version  # the tokens being made now: since, under
        try:
            if self.prefill_time:
                await trio.sleep(self.prefill_time)
            while made < len(rest) and not generation.aborted:
                if self.paused is not None:
                    await self._resumed.wait()
                    continue
                segment, version = trio.current_time(), self.version
                changed = self._changed
                left = (len(rest) - made) * self.decode_time
                with trio.move_on_after(left):
                    await changed.wait()
                steps = len(rest) - made
                if self.decode_time:
                    steps = min(
                        steps, int((trio.current_time() - segment) / self.decode_time + 1e-9)
                    )
                if ttft is None and steps:
                    ttft = segment + self.decode_time - began
                emit(steps, version)
                segment = math.inf
        finally:
            if segment != math.inf and self.decode_time:  # cut mid-way: what it made
                emit(
                    min(
                        len(rest) - made,
                        int((trio.current_time() - segment) / self.decode_time + 1e-9),
                    ),
                    version,
                )
            self._running.discard(generation)
            if not self._running:
                self._drained.set()
            if slot is not None:
                slot.release()
        if generation.aborted and made < len(rest):
            self.aborted += 1
            finish = "abort"
        ids = rest[:made]
        return Completion(
            content="".join(f"t{t} " for t in ids),
            usage={"prompt_tokens": len(given), "completion_tokens": len(ids)},
            finish_reason=finish,
            tokens=Tokens(list(given), list(ids), [_logprob(t) for t in ids]),
            ttft=ttft,
            versions=[VersionSpan(v, s, e) for v, s, e in spans],
        )


def _logprob(token: int) -> float:
    return -((token % 97) + 1) / 100
