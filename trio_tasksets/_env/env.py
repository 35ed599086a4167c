"""Envs and episodes: one rollout of one task against a model, with whole-episode retries."""

from __future__ import annotations

import contextvars
import inspect
import math
import os
import sys
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Generic, TypeVar

import attrs
import trio

from .._core.adaptive import AdaptiveWindow, Outcome
from .._core.backoff import FIRST, MOST, Backoff
from .._core.datasets import check_record, record_problem
from .._core.exceptions import ConfigError, ConfigTypeError, TrioTasksetsError
from .._core.limits import CallObserver, observe_calls, parked
from .._core.tasksets import Taskset
from .._core.training import current_run
from .._core.window import Window
from .._models import Completion, ModelContext, ModelHTTPError, Tokens, observe_completions
from .._models.pool import sticky
from .boxes import Sandboxes
from .rollout_limits import (
    LimitAttribute,
    RolloutLimits,
    RolloutTimeoutError,
    StalledError,
    Waits,
    given_limits,
    run_within,
)

__all__ = [
    "Env",
    "Episode",
    "EpisodeError",
    "EpisodeTask",
    "RetryPolicy",
    "RolloutLimits",
    "RolloutTimeoutError",
    "RunSlot",
    "StalledError",
    "WindowFeed",
    "chat_messages",
    "current_limits",
    "note_rollout",
    "version_range",
]

TaskT = TypeVar("TaskT")
Message = dict[str, Any]
Score = float | Mapping[str, float]
"""What a reward gives: a number, or named metrics with the reward as their `reward` entry."""
Reward = Callable[[Any, str], Score | Awaitable[Score]]
WeightedRewards = Mapping[str, Reward | tuple[Reward, float]]
"""Several named reward functions, each with a weight (1.0 when not given)."""


def _type_names(names: Iterable[str]) -> tuple[str, ...]:
    if isinstance(names, str):
        return (names,)
    return tuple(names)


def _at_least_zero(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not value >= 0:
        name = attribute.name
        raise ConfigError(f"{{{name}}} must be >= 0, got {value!r}", parameter=name)


@attrs.frozen
class RetryPolicy:
    """Whole-episode retries, chosen by exception type name.

    An error is retried while attempts remain, when `include` is empty or names the error's
    type (or one of its base classes), and `exclude` names none of them. Between attempts the
    env sleeps a jittered exponential backoff: uniform in [0, min(max_backoff, backoff * 2**k)].
    A negative count or delay raises `ConfigError` naming it.
    """

    max_retries: int = attrs.field(default=0, validator=_at_least_zero)
    include: tuple[str, ...] = attrs.field(default=(), converter=_type_names)
    exclude: tuple[str, ...] = attrs.field(default=(), converter=_type_names)
    backoff: float = attrs.field(default=FIRST, validator=_at_least_zero)
    max_backoff: float = attrs.field(default=MOST, validator=_at_least_zero)

    def should_retry(self, error: BaseException, attempt: int) -> bool:
        """Whether attempt number `attempt` (1-based), which raised `error`, gets another."""
        if attempt > self.max_retries:
            return False
        names = {klass.__name__ for klass in type(error).__mro__}
        if self.exclude and names & set(self.exclude):
            return False
        return not self.include or bool(names & set(self.include))

    def delay(self, attempt: int) -> float:
        """Seconds to wait after attempt number `attempt` failed (the project's `Backoff`)."""
        return Backoff(self.backoff, self.max_backoff).delay(attempt)


class DeadlineExceededError(TrioTasksetsError, TimeoutError):
    """A slot's deadline, carried from the process that asked for it (an eval's `--via`
    entry), passed: the slot was cut there, or not run at all when it came too late. An
    episode error like any other."""


def new_id() -> str:
    """A new id (an episode's, a group's): 128 random bits as 32 hex digits, the shape of a
    uuid4's hex at a fifth of its cost (`uuid.uuid4().hex` builds an int and a UUID object:
    about 1.2 us more per episode)."""
    return os.urandom(16).hex()


@attrs.frozen
class EpisodeTask:
    """The task an episode ran: its `key` and its own fields (`data`, as the row keeps them
    under `task.data`).

    `prompt` and `answer` read `data` (``episode.task.prompt`` is
    ``episode.task.data["prompt"]``): a `tt.Task`'s prompt (a str, or a list of chat
    messages) and answer (a str, or None). A task of another class has the fields its `data`
    (or `attrs.asdict`) gave; either property is None when `data` has no such key.
    """

    key: str
    data: dict[str, Any]

    @property
    def prompt(self) -> str | list[dict[str, Any]] | None:
        """The task's prompt (`data["prompt"]`), None when its data has none."""
        prompt: str | list[dict[str, Any]] | None = self.data.get("prompt")
        return prompt

    @property
    def answer(self) -> Any:
        """The task's answer (`data["answer"]`: a `tt.Task`'s str, or None), None when its
        data has none."""
        return self.data.get("answer")


@attrs.frozen
class EpisodeError:
    """One failed attempt: the exception's type name and message, and `status`, the HTTP
    status the model endpoint answered with when the attempt ended on one (a
    `ModelHTTPError`'s; None otherwise). A row keeps `status` only when it is set; it is what
    tells an adaptive window on another process (an env server's, a worker's) about a 429.
    For an error raised by the user's own code (a reward, a rollout, a tool, a taskset's
    `task_from_data`), `traceback`: the formatted frames of that code, those of this package
    and of trio left out (None for the package's own errors: model, timeout and stall
    errors); a row keeps it only when it is set."""

    type: str
    message: str
    attempt: int = 1
    status: int | None = None
    traceback: str | None = None

    @classmethod
    def of(cls, exc: BaseException, attempt: int) -> EpisodeError:
        """The record of attempt number `attempt`, which raised `exc` (its user traceback,
        when the user's own code raised it)."""
        status = exc.status if isinstance(exc, ModelHTTPError) else None
        return cls(type(exc).__name__, str(exc), attempt, status, user_traceback(exc))

    def to_dict(self) -> dict[str, Any]:
        """The error as a row holds it."""
        found: dict[str, Any] = {
            "type": self.type,
            "message": self.message,
            "attempt": self.attempt,
        }
        if self.status is not None:
            found["status"] = self.status
        if self.traceback is not None:
            found["traceback"] = self.traceback
        return found


_OWN_CODE = tuple(
    os.path.dirname(module.__file__) + os.sep
    for module in (sys.modules[__name__.partition(".")[0]], trio)
    if module.__file__ is not None
)


def user_traceback(error: BaseException) -> str | None:
    """The traceback of `error` in the user's frames, or None when this package (or trio)
    raised it. Frames of this package and of trio are left out; the rest (the user's code and
    the libraries it called) are formatted as Python does, with the error's last line."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames or frames[-1].filename.startswith(_OWN_CODE):
        return None
    kept = traceback.StackSummary.from_list(
        [frame for frame in frames if not frame.filename.startswith(_OWN_CODE)]
    )
    return (
        "Traceback (most recent call last, the user's frames):\n"
        + "".join(kept.format())
        + "".join(traceback.format_exception_only(type(error), error))
    )


@attrs.define
class Episode:
    """The record of one slot: what was asked, what came back, its reward and its errors.

    `ok` is False when every attempt failed; `errors` keeps every failed attempt's error,
    including those of attempts that a later retry made good. `usage` sums the token counts
    of every model reply of every attempt (what the episode cost); `finish_reason` is the
    last reply's. `timing` holds `started` and `finished` (epoch seconds), `duration`
    (seconds, every attempt and backoff included) and, of that duration, `waited_connection`
    and `waited_rate`: the seconds its model calls waited for a connection slot and for the
    rpm/tpm limiters (`trio_tasksets._core.limits.EndpointLimits`; 0.0 without limits; rows written
    before these existed lack them), and `working`: the duration less every wait of the
    runner's own (`limits.parked`: limiters, rests before a retry, retry backoff); with
    streamed replies (``Sampling(stream=True)``), `ttft` and `tpot`: the mean seconds to
    their first token and per output token after it (`stream_timing`).

    Of the attempt the row reports (the last): `turns` counts its model replies, `tool_calls`
    the tool calls those replies asked for, and `stop_reason` names the limit that ended its
    rollout (`"max_turns"`, `"token_limit"`, `"working_limit"`: `Env(working_limit=)`; None
    when the model finished on its own): a tool env (`tt.ToolEnv`) sets them, and any
    rollout loop may (`note_rollout`).

    `metrics` are the episode's named metrics besides its `reward` (what a reward returning
    a mapping gave, each weighted reward function's own value, a verifiers episode's
    per-reward breakdown); empty when there are none.
    """

    id: str
    task: EpisodeTask
    rollout: int
    ok: bool = False
    reward: float = 0.0
    completion: str | None = None
    messages: list[Message] = attrs.Factory(list)
    errors: list[EpisodeError] = attrs.Factory(list)
    attempts: int = 0
    timing: dict[str, float] = attrs.Factory(dict)
    usage: dict[str, int] = attrs.Factory(dict)
    finish_reason: str | None = None
    turns: int = 0
    tool_calls: int = 0
    stop_reason: str | None = None
    metrics: dict[str, float] = attrs.Factory(dict)
    # Training fields (groups, token ids, staleness); a row holds each only when it is set.
    tokens: list[dict[str, Any]] = attrs.Factory(list)  # each model call's `Tokens.to_dict()`
    group: str | None = None  # the id shared by the rollouts of one group (`--group`)
    advantage: float | None = None  # set by `Env.score_group` (e.g. GRPO's)
    policy_version: int | None = None  # the `tt.Staleness` version when the slot started
    stale: bool = False  # finished more than `max_lag` versions behind (withheld)
    worker: str | None = None  # the worker that ran it (`--via`: its consumer name); row: if set
    # each model call's version spans (`Completion.versions`, as dicts); row: `versions`
    # and `policy_versions` (oldest, newest), when a call had any
    versions: list[list[dict[str, Any]]] = attrs.Factory(list)
    group_versions: tuple[str, str] | None = None  # (oldest, newest) over its group's rows
    # Its streamed replies' times: [replies, sum of ttft, replies with a tpot, sum of tpot].
    _streams: list[float] | None = attrs.field(default=None, init=False, eq=False, repr=False)

    def count(self, completion: Completion) -> None:
        """Add one model reply's token usage, keep its finish reason, and its token ids and
        logprobs when the server returned them (one `tokens` entry per model call), and the
        times of a streamed one (`stream_timing`)."""
        usage = self.usage
        for name, value in completion.usage.items():
            usage[name] = usage.get(name, 0) + value
        if completion.finish_reason is not None:
            self.finish_reason = completion.finish_reason
        if completion.tokens is not None:
            self.tokens.append(completion.tokens.to_dict())
        if completion.versions:
            self.versions.append([
                {"version": s.version, "start": s.start, "end": s.end}
                for s in completion.versions
            ])  # fmt: skip
        if completion.ttft is not None:
            streams = self._streams
            if streams is None:
                streams = self._streams = [0, 0.0, 0, 0.0]
            streams[0] += 1
            streams[1] += completion.ttft
            if completion.tpot is not None:
                streams[2] += 1
                streams[3] += completion.tpot

    def stream_timing(self) -> dict[str, float]:
        """The `timing` entries of its streamed replies: ``ttft``, the mean seconds to first
        token, and ``tpot``, the mean seconds per output token after the first (of the
        replies of two tokens or more); {} when no reply was streamed."""
        streams = self._streams
        if streams is None:
            return {}
        timing = {"ttft": streams[1] / streams[0]}
        if streams[2]:
            timing["tpot"] = streams[3] / streams[2]
        return timing

    @property
    def policy_versions(self) -> tuple[str, str] | None:
        """(oldest, newest) of the versions its model calls' tokens carry, or None."""
        return version_range(s["version"] for spans in self.versions for s in spans)

    def to_row(self) -> dict[str, Any]:
        """The trace row: the episode's fields under the same names, JSON-ready."""
        # Written out rather than attrs.asdict: this runs once per row on the eval's hot path.
        row = {
            "id": self.id,
            "task": {"key": self.task.key, "data": self.task.data},
            "rollout": self.rollout,
            "ok": self.ok,
            "reward": self.reward,
            "completion": self.completion,
            "messages": self.messages,
            "errors": [e.to_dict() for e in self.errors],
            "attempts": self.attempts,
            "timing": self.timing,
            "usage": self.usage,
            "finish_reason": self.finish_reason,
            "turns": self.turns,
            "tool_calls": self.tool_calls,
            "stop_reason": self.stop_reason,
            "metrics": self.metrics,
        }
        # The training fields that are set (none for a plain eval's rows), in place: no
        # second dict per row.
        if self.tokens:
            row["tokens"] = self.tokens
        if self.group is not None:
            row["group"] = self.group
            row["advantage"] = self.advantage
        if self.policy_version is not None:
            row["policy_version"] = self.policy_version
            row["stale"] = self.stale
        if self.worker is not None:
            row["worker"] = self.worker
        if self.versions:
            row["versions"] = self.versions
            row["policy_versions"] = list(self.policy_versions or ())
        if self.group_versions is not None:
            row["group_versions"] = list(self.group_versions)
        return row

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Episode:
        """Rebuild an episode from a trace row (the inverse of `to_row`)."""
        return cls(
            id=str(row["id"]),
            task=EpisodeTask(key=str(row["task"]["key"]), data=dict(row["task"]["data"])),
            rollout=int(row["rollout"]),
            ok=bool(row["ok"]),
            reward=float(row["reward"]),
            completion=row.get("completion"),
            messages=list(row.get("messages", [])),
            errors=[EpisodeError(**e) for e in row.get("errors", [])],
            attempts=int(row.get("attempts", 0)),
            timing=dict(row.get("timing", {})),
            usage={str(k): int(v) for k, v in (row.get("usage") or {}).items()},
            finish_reason=None if row.get("finish_reason") is None else str(row["finish_reason"]),
            turns=int(row.get("turns") or 0),
            tool_calls=int(row.get("tool_calls") or 0),
            stop_reason=None if row.get("stop_reason") is None else str(row["stop_reason"]),
            metrics={str(k): float(v) for k, v in (row.get("metrics") or {}).items()},
            tokens=[Tokens.from_dict(t).to_dict() for t in row.get("tokens") or []],
            group=None if row.get("group") is None else str(row["group"]),
            advantage=None if row.get("advantage") is None else float(row["advantage"]),
            policy_version=(
                None if row.get("policy_version") is None else int(row["policy_version"])
            ),
            stale=bool(row.get("stale", False)),
            worker=None if row.get("worker") is None else str(row["worker"]),
            versions=[
                [
                    {"version": str(s["version"]), "start": int(s["start"]), "end": int(s["end"])}
                    for s in spans
                ]
                for spans in row.get("versions") or []
            ],
            group_versions=(
                None
                if not row.get("group_versions")
                else (str(row["group_versions"][0]), str(row["group_versions"][-1]))
            ),
        )

    @classmethod
    def _from_fresh_row(cls, row: object) -> Episode:
        """`from_row` for a row decoded just now and held by nothing else (an env server's
        answer): when every field has the exact JSON type `to_row` gives it and there are no
        errors, the episode takes the row's own `task.data`, `messages`, `errors` and
        `timing` (no copies, so fewer objects per episode); any other row goes through
        `from_row`, which converts or raises as it always does."""
        if type(row) is dict:
            get = row.get
            task, completion, errors = get("task"), get("completion"), get("errors")
            finish, stop = get("finish_reason"), get("stop_reason")
            metrics = get("metrics", {})
            if (
                type(task) is dict
                and type(task.get("key")) is str
                and type(task.get("data")) is dict
                and type(get("id")) is str
                and type(get("rollout")) is int
                and type(get("ok")) is bool
                and type(get("reward")) is float
                and (completion is None or type(completion) is str)
                and type(get("messages")) is list
                and type(errors) is list
                and not errors
                and type(get("attempts")) is int
                and type(get("timing")) is dict
                and type(get("usage")) is dict
                and all(type(v) is int for v in row["usage"].values())
                and (finish is None or type(finish) is str)
                and type(get("turns")) is int
                and type(get("tool_calls")) is int
                and (stop is None or type(stop) is str)
                and type(metrics) is dict
                and all(type(v) is float for v in metrics.values())
                and _TRAINING_KEYS.isdisjoint(row)  # else from_row reads them
            ):
                return cls(row["id"], EpisodeTask(task["key"], task["data"]), row["rollout"],
                           row["ok"], row["reward"], completion, row["messages"], errors,
                           row["attempts"], row["timing"], row["usage"], finish,
                           row["turns"], row["tool_calls"], stop, metrics)  # fmt: skip
        return cls.from_row(row)  # type: ignore[arg-type]  # not a dict: it raises


_TRAINING_KEYS = frozenset(
    {
        "tokens",
        "group",
        "advantage",
        "policy_version",
        "stale",
        "worker",
        "versions",
        "group_versions",
    }
)


def version_range(versions: Iterable[str]) -> tuple[str, str] | None:
    """(oldest, newest) of policy `versions`: by number when every one is an integer, else
    in the order they come (the first seen is the oldest). None for none."""
    seen = list(dict.fromkeys(versions))
    if not seen:
        return None
    if all(v.lstrip("-").isdigit() for v in seen):
        ordered = sorted(seen, key=int)
        return ordered[0], ordered[-1]
    return seen[0], seen[-1]


@attrs.define(eq=False)
class RunSlot(Generic[TaskT]):
    """One rollout of one task, plus its live state while it runs.

    `limits`: the limits its caller asked for (a served request's, a queue entry's; None:
    none): the slot runs under the env's own limits and these, each the tighter
    (`RolloutLimits.within`)."""

    task: TaskT
    rollout: int = 0
    episode: Episode | None = None
    done: bool = False
    started: float | None = None
    limits: RolloutLimits | None = None


OnComplete = Callable[[Episode], Awaitable[None] | None]
"""A slot's completion callback: sync, or async (then awaited shielded from cancellation)."""


async def complete_slot(
    slot: RunSlot[Any], episode: Episode, on_complete: OnComplete | None
) -> Episode:
    """Record `episode` as `slot`'s, then call `on_complete(episode)` once. An awaitable it
    returns runs shielded, so the row is recorded even while the run is being cancelled (a
    sync callback cannot be cancelled). Returns `episode`."""
    slot.episode, slot.done = episode, True
    if on_complete is not None:
        result = on_complete(episode)
        if inspect.isawaitable(result):
            with trio.CancelScope(shield=True):
                await result
    return episode


def _finite(reward: float) -> float:
    """The reward, or ValueError (an episode error) for a NaN or an infinity, which would
    poison every mean it enters and cannot be written as JSON."""
    if not math.isfinite(reward):
        raise ValueError(f"the reward is {reward!r}: a reward must be a finite number")
    return reward


def split_score(value: object) -> tuple[float, dict[str, float]]:
    """A reward's result as (reward, named metrics): a number is the reward itself; a
    mapping holds named metrics, its `reward` entry the reward. ValueError (an episode error)
    for a mapping without `reward` or a non-finite value, TypeError for a value that is not a
    number."""
    if type(value) is float:  # the common case first: no ABC check (every episode)
        return _finite(value), {}
    if isinstance(value, Mapping):
        if "reward" not in value:
            raise ValueError(
                f"a reward that returns a mapping must give its reward as the 'reward' entry "
                f"(the others are named metrics), got the keys {sorted(map(str, value))}"
            )
        metrics: dict[str, float] = {}
        for name, number in value.items():
            if isinstance(number, bool) or not isinstance(number, int | float):
                raise TypeError(f"metric {name!r} is {number!r}: a metric must be a number")
            if not math.isfinite(number):
                raise ValueError(f"metric {name!r} is {number!r}: a metric must be finite")
            metrics[str(name)] = float(number)
        return metrics.pop("reward"), metrics
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"a reward must be a number or a mapping of metrics, got {value!r}")
    return _finite(float(value)), {}


def weighted_reward(rewards: WeightedRewards) -> Reward:
    """One reward from several named ones (as a verifiers rubric): each `name: fn` or
    `name: (fn, weight)` (weight 1.0 when not given; a fn may be sync or async and return a
    number). The episode's reward is the weighted sum; its metrics are each fn's own,
    unweighted value, under its name. `tt.Env(taskset, reward={...})` builds one.

    Raises a `ConfigError` naming ``reward`` (the `Env`'s parameter that takes the mapping)
    for an empty mapping or a part named ``reward``, and a `ConfigTypeError` for a part that
    is not a function or a weight that is not a number."""
    if not rewards:
        raise ConfigError(
            "{reward}: a mapping of named rewards needs at least one", parameter="reward"
        )
    parts: list[tuple[str, Reward, float]] = []
    for name, spec in rewards.items():
        fn, weight = spec if isinstance(spec, tuple) else (spec, 1.0)
        if not callable(fn):
            raise ConfigTypeError(
                f"{{reward}} {name!r}: expected a function (task, completion), got {fn!r}",
                parameter="reward",
            )
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise ConfigTypeError(
                f"{{reward}} {name!r}: the weight must be a number, got {weight!r}",
                parameter="reward",
            )
        if name == "reward":
            raise ConfigError(
                "{reward}: 'reward' names the weighted sum: name the parts otherwise",
                parameter="reward",
            )
        parts.append((str(name), fn, float(weight)))

    async def weighted(task: Any, completion: str) -> dict[str, float]:
        scores: dict[str, float] = {}
        total = 0.0
        for name, fn, weight in parts:
            value = fn(task, completion)
            if inspect.isawaitable(value):
                value = await value
            score, _ = split_score(value)
            scores[name] = score
            total += weight * score
        return {"reward": total, **scores}

    weighted.rewards = rewards  # type: ignore[attr-defined]  # what it sums (envspec reads it)
    return weighted


def task_key(task: Any) -> str:
    key = getattr(task, "key", None)
    if not isinstance(key, str):
        raise TypeError(f"tasks need a str `key` (tt.Task has one), got {type(task).__name__}")
    return key


def task_data(task: Any) -> dict[str, Any]:
    data = getattr(task, "data", None)
    if isinstance(data, dict):
        return data
    if attrs.has(type(task)):
        return attrs.asdict(task)
    raise TypeError(f"tasks need a dict `data` (tt.Task has one), got {type(task).__name__}")


def chat_messages(task: Any) -> list[Message]:
    """`tt.chat_messages(task)`: the first messages of a task's chat, what every rollout
    starts from (the single-turn default sends exactly these): the system prompt first (when
    the task has one), then the prompt (a str as one user message, a list of messages as
    they are, copied). A multi-turn rollout appends the model's replies and its own turns."""
    messages: list[Message] = []
    system = getattr(task, "system_prompt", None)
    if system:
        messages.append({"role": "system", "content": system})
    prompt = task.prompt
    if isinstance(prompt, str):
        messages.append({"role": "user", "content": prompt})
    else:
        messages.extend(dict(m) for m in prompt)
    return messages


def answer_match(task: Any, completion: str) -> float:
    """1.0 when the task's answer occurs in the completion (case-insensitive), else 0.0."""
    answer = getattr(task, "answer", None)
    if not answer:
        return 0.0
    return 1.0 if str(answer).casefold() in completion.casefold() else 0.0


class Env(Generic[TaskT]):
    """A taskset plus how to run and score one episode of it.

    The default episode is single-turn chat: the task's messages (system prompt first) go to
    the model once. Override `rollout` for multi-turn or tool-using episodes, and `serving`
    for resources that live as long as a service (a sandbox pool, a browser).

    The reward: `reward=` if given, else the taskset's own `reward(task, completion)` method if
    it has one, else `answer_match`. A reward may be sync or async, and return a number or
    named metrics with a `reward` entry; `reward={name: fn or (fn, weight)}` sums several.

    The taskset may be left out (`tt.Env(reward=...)`): a service whose tasks come from its
    own channel calls `run_slot(tt.RunSlot(task), ctx)` with them (`env.taskset` is then an
    empty `tt.Taskset`).

    `rollout_limits` (a `tt.RolloutLimits`) bounds each attempt of an episode: its wall time
    (`rollout_timeout`: a `RolloutTimeoutError`), its working time (`working_limit`: the
    attempt is cut and scored, `stop_reason: "working_limit"`), its time without progress
    (`stall_timeout`: a `StalledError`); see `tt.RolloutLimits`. Give it whole
    (`rollout_limits=`) or as the keyword arguments `rollout_timeout`, `working_limit` and
    `stall_timeout` (not both: `ConfigError`). Each limit is also an attribute
    (`env.rollout_timeout = 30` bounds a subclass that does not pass it on), and
    `rollout_limits` is one too. While any task of the rollout is parked in the runner's
    own waits (`limits.parked`: connection, rpm and tpm limiters, Retry-After rests, retry
    backoff), the working and stall clocks stop. A slot's caller may tighten the limits
    for its slot (`RunSlot.limits`), never loosen them.

    `sandbox` (a factory: `tt.sandboxes.local()`, `tt.sandboxes.bwrap()`, ...) gives each
    attempt of a rollout a box of its own (`sandbox_scope="group"`: each group one, shared
    by its rollouts), made on first use of `tt.current_sandbox()` (the tools', a reward's)
    and destroyed when the attempt (the group) ends, however it ends; `max_sandboxes` (an
    int, ``(min, start, max)`` bounds, a `tt.Window`; default adaptive, ``1-CORES-256``)
    admits at most that many alive at once (see `trio_tasksets._env.boxes`).

    Raises `ConfigError` for limits that are given twice or out of range, naming them, a
    `ConfigTypeError` naming ``retries`` for one that is not a `RetryPolicy`, a `ConfigError`
    naming ``reward`` for a mapping of named rewards that cannot be summed, and naming
    ``sandbox``, ``sandbox_scope`` or ``max_sandboxes`` for a bad one (or the last two
    without a sandbox).
    """

    rollout_limits: RolloutLimits = RolloutLimits()  # also here: a subclass may skip __init__
    sandboxes: Sandboxes | None = None  # `sandbox=`: a box per rollout (`_env.boxes`)
    rollout_timeout: LimitAttribute[float | None] = LimitAttribute()
    working_limit: LimitAttribute[float | None] = LimitAttribute()
    stall_timeout: LimitAttribute[float | None] = LimitAttribute()

    def __init__(
        self,
        taskset: Taskset[TaskT, Any] | None = None,
        *,
        reward: Reward | WeightedRewards | None = None,
        retries: RetryPolicy | None = None,
        rollout_limits: RolloutLimits | None = None,
        rollout_timeout: float | None = None,
        working_limit: float | None = None,
        stall_timeout: float | None = None,
        sandbox: Any = None,
        sandbox_scope: str = "rollout",
        max_sandboxes: Any = None,
    ) -> None:
        # No taskset: a service whose tasks come from its own channel (an empty one stands in).
        self.taskset: Taskset[TaskT, Any] = taskset if taskset is not None else Taskset()
        if retries is not None and not isinstance(retries, RetryPolicy):
            raise ConfigTypeError(
                f"Env({{retries}}={retries!r}): give a tt.RetryPolicy, e.g. "
                f"{{retries}}=tt.RetryPolicy(max_retries=N)",
                parameter="retries",
            )
        self.retries = retries if retries is not None else RetryPolicy()
        self.rollout_limits = given_limits(
            rollout_limits, rollout_timeout=rollout_timeout, working_limit=working_limit,
            stall_timeout=stall_timeout,
        )  # fmt: skip
        taskset_reward = getattr(self.taskset, "reward", None)
        if isinstance(reward, Mapping):
            reward = weighted_reward(reward)
        if isinstance(taskset_reward, Mapping):  # a taskset's `reward = {name: fn, ...}`
            taskset_reward = weighted_reward(taskset_reward)
        self._reward: Reward = reward or taskset_reward or answer_match
        if sandbox is not None:
            self.sandboxes = Sandboxes.of(sandbox, scope=sandbox_scope, max_sandboxes=max_sandboxes)
        elif max_sandboxes is not None or sandbox_scope != "rollout":
            raise ConfigError(
                "{sandbox_scope} and {max_sandboxes} need a {sandbox}: give "
                "sandbox=tt.sandboxes.local() (or another backend)",
                parameter=("sandbox", "sandbox_scope", "max_sandboxes"),
            )

    def serving(self) -> AbstractAsyncContextManager[Env[TaskT]]:
        """Env-level resources for the life of a service or an eval (default: none)."""
        return _nothing(self)

    async def rollout(self, task: TaskT, ctx: ModelContext) -> tuple[list[Message], str]:
        """Run one attempt of an episode; return the full message list and the completion."""
        messages = chat_messages(task)
        reply = await ctx.chat(messages)
        return [*messages, reply.message], reply.content

    async def score(self, task: TaskT, completion: str) -> Score:
        """The reward of a completion: a number, or named metrics with a `reward` entry."""
        value = self._reward(task, completion)
        if type(value) is float:  # the common case first: no ABC checks (every episode)
            return value
        if inspect.isawaitable(value):
            value = await value
        return value if isinstance(value, Mapping) else float(value)

    async def score_group(self, task: TaskT, episodes: list[Episode]) -> None:
        """Score a group (`--group`: a task's `-r` rollouts), once all are done and ok: set
        each episode's `reward` and `advantage` as you like. Defining it takes full control:
        without one of your own (this one does nothing), `run_group` sets GRPO's advantage
        as the group says (`Group.advantage`: reward minus the group mean by default; see
        `tt.group_advantages`, which yours may call after changing rewards). Raising fails
        the group (every row `ok=False` with the cause)."""

    async def run_slot(
        self,
        slot: RunSlot[TaskT],
        ctx: ModelContext,
        *,
        on_complete: OnComplete | None = None,
    ) -> Episode:
        """Run one slot to its episode, retrying the whole episode per `self.retries`.

        Never raises for the episode's own failure: it is recorded on the episode (`ok=False`,
        `errors`). Cancellation propagates (an unfinished episode is not recorded).
        `on_complete(episode)` runs once, after the last attempt, shielded from cancellation.
        """
        task = slot.task
        episode = Episode(
            id=new_id(),
            task=EpisodeTask(key=task_key(task), data=task_data(task)),
            rollout=slot.rollout,
        )
        live = current_run()  # a tt.Staleness wrapper's run: the policy version
        if live is not None:
            episode.policy_version = live.version
        slot.episode = episode
        slot.started = time.time()
        began = trio.current_time()
        waits = Waits()
        own = self.rollout_limits
        limits = own if slot.limits is None else own.within(slot.limits)
        bounded = limits.bounds_attempt
        unreadable = record_problem(task) is not None  # a data file's unreadable record
        boxes = self.sandboxes
        attempt = 0
        while True:
            attempt += 1
            stats = _Rollout(episode, limits)
            token = _rollout.set(stats)
            try:
                if unreadable:  # its row fails at once: no model call, no retry
                    check_record(task)
                # sticky: with many endpoints, an attempt's calls stay on one (its prefix cache)
                if boxes is not None:  # a box for the attempt (or its group's): `_env.boxes`
                    async with boxes.attempt():
                        messages, completion, (reward, metrics) = await self._attempt(
                            task, ctx, stats, waits, bounded
                        )
                elif not bounded:  # inline: this runs once per attempt of every episode
                    with observe_completions(stats), observe_calls(waits), sticky(episode.id):
                        messages, completion = await self.rollout(task, ctx)
                        reward, metrics = split_score(await self.score(task, completion))
                else:
                    with sticky(episode.id):
                        messages, completion, (reward, metrics) = await self._bounded(
                            task, ctx, stats, waits
                        )
            except Exception as exc:
                episode.errors.append(EpisodeError.of(exc, attempt))
                if unreadable or not self.retries.should_retry(exc, attempt):
                    break
                with observe_calls(waits), parked("retry"):
                    await trio.sleep(self.retries.delay(attempt))
            else:
                episode.ok = True
                episode.reward = reward
                episode.metrics = metrics
                episode.completion = completion
                episode.messages = messages
                break
            finally:
                _rollout.reset(token)
        episode.turns, episode.tool_calls = stats.turns, stats.tool_calls
        episode.stop_reason = stats.stop_reason
        episode.attempts = attempt
        episode.timing = {
            "started": slot.started,
            "finished": time.time(),
            "duration": trio.current_time() - began,
            "waited_connection": waits.connection,
            "waited_rate": waits.rate,
        }
        episode.timing["working"] = episode.timing["duration"] - waits.parked_so_far()
        if episode._streams is not None:
            episode.timing.update(episode.stream_timing())
        if live is not None:
            episode.stale = live.stale  # withheld: finished more than max_lag behind
            episode.policy_version = live.version  # with a policy: its oldest token's
        return await complete_slot(slot, episode, on_complete)

    async def _attempt(
        self, task: TaskT, ctx: ModelContext, stats: _Rollout, waits: Waits, bounded: bool
    ) -> tuple[list[Message], str, tuple[float, dict[str, float]]]:
        """One attempt, as `run_slot` runs it inline (an env with sandboxes, inside the
        attempt's box scope)."""
        with sticky(stats.episode.id):
            if bounded:
                return await self._bounded(task, ctx, stats, waits)
            with observe_completions(stats), observe_calls(waits):
                messages, completion = await self.rollout(task, ctx)
                return messages, completion, split_score(await self.score(task, completion))

    async def _bounded(
        self, task: TaskT, ctx: ModelContext, stats: _Rollout, waits: Waits
    ) -> tuple[list[Message], str, tuple[float, dict[str, float]]]:
        """One attempt, the rollout and its score, under the attempt's limits (`run_within`):
        cut at its working limit, then scored on the replies it had, its `stop_reason`
        "working_limit"."""

        async def rollout() -> tuple[list[Message], str]:
            return await self.rollout(task, ctx)

        async def finish(
            result: tuple[list[Message], str],
        ) -> tuple[list[Message], str, tuple[float, dict[str, float]]]:
            messages, completion = result
            return messages, completion, split_score(await self.score(task, completion))

        async def cut(
            replies: list[Completion],
        ) -> tuple[list[Message], str, tuple[float, dict[str, float]]]:
            stats.stop_reason = "working_limit"
            return await finish((partial_messages(task, replies), cut_completion(replies)))

        return await run_within(stats.limits, waits, rollout, finish, cut, stats.count)


class _Rollout:
    """What one attempt's rollout did: its model replies (`turns`), the tool calls they
    asked for, and the limit that stopped it (`note_rollout`); and the limits it runs
    under (`current_limits`)."""

    __slots__ = ("episode", "limits", "stop_reason", "tool_calls", "turns")

    def __init__(self, episode: Episode, limits: RolloutLimits) -> None:
        self.episode = episode  # not a bound `episode.count`: one object fewer per attempt
        self.limits = limits
        self.turns = 0
        self.tool_calls = 0
        self.stop_reason: str | None = None

    def count(self, completion: Completion) -> None:
        self.episode.count(completion)
        self.turns += 1
        self.tool_calls += len(completion.tool_calls)

    __call__ = count  # the completions' observer itself: no bound method per attempt


_rollout: contextvars.ContextVar[_Rollout | None] = contextvars.ContextVar(
    "trio_tasksets_rollout", default=None
)


def note_rollout(
    *, stop_reason: str | None = None, turns: int | None = None, tool_calls: int | None = None
) -> None:
    """Tell the episode being run how its rollout went, for its row: `stop_reason`, the
    limit that ended it (None: the model finished); `turns` and `tool_calls`, to replace the
    counts of the replies seen (every `ModelContext.chat` of the attempt, sub-runs' included)
    by the loop's own. Outside `Env.run_slot` it does nothing."""
    stats = _rollout.get()
    if stats is None:
        return
    stats.stop_reason = stop_reason
    if turns is not None:
        stats.turns = turns
    if tool_calls is not None:
        stats.tool_calls = tool_calls


def current_limits(env: Env[Any]) -> RolloutLimits:
    """The limits the attempt being run runs under: the env's own, tightened by its slot's
    (`RunSlot.limits`); outside `Env.run_slot`, `env.rollout_limits`. A rollout loop reads its turn,
    token and tool-time limits here (`tt.ToolEnv` does)."""
    stats = _rollout.get()
    return env.rollout_limits if stats is None else stats.limits


def partial_messages(task: Any, replies: list[Completion]) -> list[Message]:
    """The messages of a rollout cut at its working limit: the task's chat messages (when
    it has a prompt) and the model replies it had received."""
    try:
        messages = chat_messages(task)
    except AttributeError:
        messages = []
    return [*messages, *({"role": "assistant", "content": r.content} for r in replies)]


def cut_completion(replies: list[Completion]) -> str:
    """The completion a rollout cut at its working limit is scored on: its last model
    reply's text (``""`` if it had none)."""
    return replies[-1].content if replies else ""


class WindowFeed(CallObserver):
    """Feeds an adaptive rollout window (a runner's `AdaptiveWindow`) from its runs.

    Around each run, `with observe_calls(feed):` hands it the 429s, 5xx and timeouts of the
    model calls the run makes, as they come (a cut must not wait for the episode's retries
    to end), with each call's latency (the window's latency signal), paces each call while
    a request-rate limit answers 429 (`AdaptiveWindow.pace`), and a run whose call waits
    out a 429 before its retry (`limits.rest`) lends its place meanwhile
    (`AdaptiveWindow.rest`); then, while the run still holds its slot,
    `feed.ended(episode)` adds one success for an episode that ended ok. Where the model
    calls are made in another process (an env server, a worker), pass `remote=True`:
    `ended` then reads the episode's errors instead (a 429 or 5xx `ModelHTTPError`, a model
    or rollout timeout, by the errors' `status` and type). A window that is not adaptive is
    left alone.
    """

    def __init__(self, window: Window | None, *, remote: bool = False) -> None:
        self.window = window if isinstance(window, AdaptiveWindow) else None
        self.remote = remote

    def on_outcome(self, outcome: Outcome, retry_after: float | None) -> None:
        self.on_call(outcome, retry_after, None)

    def on_call(self, outcome: Outcome, retry_after: float | None, latency: float | None) -> None:
        # A call's success is its latency only (the episode's end counts the success); a
        # 429 or 5xx is recorded as it comes, with its latency (when the call started).
        if self.window is None:
            return
        if outcome is not Outcome.SUCCESS:
            self.window.record(outcome, retry_after=retry_after, latency=latency)
        elif latency is not None:
            self.window.observe_latency(latency)

    async def pacing(self) -> None:
        if self.window is not None:
            await self.window.pace()

    @asynccontextmanager
    async def resting(self, outcome: Outcome | None) -> AsyncIterator[None]:
        # Only after a 429: its cap (and `rest` at `min`) keeps lending from piling runs up;
        # a 5xx cuts nothing.
        if self.window is None or outcome is not Outcome.RATE_LIMITED:
            yield
            return
        async with self.window.rest():
            yield

    def ended(self, episode: Episode) -> None:
        window = self.window
        if window is None:
            return
        if self.remote:
            for error in episode.errors:
                outcome = error_outcome(error)
                if outcome is not None:
                    window.record(outcome)
        if episode.ok:
            window.success()


_TIMEOUT_ERRORS = frozenset({"ModelTimeoutError", "RolloutTimeoutError"})


def error_outcome(error: EpisodeError) -> Outcome | None:
    """What an episode error says about the endpoint's load: its `status` (429 rate
    limited, 5xx server error), a model or rollout timeout; None otherwise."""
    if error.type in _TIMEOUT_ERRORS:
        return Outcome.TIMEOUT
    return None if error.status is None else Outcome.from_status(error.status)


@asynccontextmanager
async def _nothing(env: Env[Any]) -> AsyncIterator[Env[Any]]:
    yield env
