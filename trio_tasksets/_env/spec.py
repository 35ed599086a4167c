"""How an env travels to another process: `EnvSpec` (names and JSON config, never pickle)."""

from __future__ import annotations

import json
import math
from pathlib import PurePath
from typing import Any

import attrs
import orjson

from .. import sandboxes
from .._core.adaptive import AdaptiveBounds, WindowArgumentError, parse_window, window_spec
from .._core.builtin import BUILTIN
from .._core.exceptions import ConfigError, MalformedEntry
from .._core.tasksets import Task, Taskset
from .._models import ModelContext
from .boxes import Sandboxes
from .env import Env, RetryPolicy, answer_match
from .loading import (
    LoadError,
    TravelError,
    import_failure,
    load_object,
    object_spec,
    resolve_target,
)
from .rollout_limits import RolloutLimits

__all__ = [
    "TASK_FIELDS",
    "Declaration",
    "EnvSpec",
    "SandboxSpec",
    "TravelError",
    "config_from_json",
    "config_to_json",
    "rebuild_task",
    "taskset_arg",
]

TASK_FIELDS = frozenset({"prompt", "answer", "info", "system_prompt"})
"""The fields of a `tt.Task`'s `data`: what a task that travels as data may hold, unless its
taskset class rebuilds its tasks (`task_from_data`)."""


def _json_native(value: object) -> bool:
    if value is None or isinstance(value, str | bool | int):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list | tuple):
        return all(_json_native(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_native(v) for k, v in value.items())
    return False


def config_to_json(taskset: Taskset[Any, Any]) -> dict[str, Any]:
    """The taskset's config as JSON fields; `TravelError` if it cannot be rebuilt from them."""
    config = taskset.config
    name = type(taskset).__name__
    if type(config) is not type(type(taskset)._default_config()):
        raise TravelError(
            f"taskset {name}'s config is a {type(config).__name__}, not the config class the "
            f"taskset declares, so an env server cannot rebuild it"
        )
    if not attrs.has(type(config)):
        raise TravelError(f"taskset {name}'s config is not an attrs class")
    fields = attrs.asdict(config, recurse=False)
    for field, value in fields.items():
        if not _json_native(value):
            raise TravelError(
                f"taskset {name}'s config field {field!r} ({type(value).__name__}) is not "
                f"plain JSON data, so it cannot travel to an env server"
            )
    return json.loads(json.dumps(fields))  # type: ignore[no-any-return]


def config_from_json(taskset_cls: type[Taskset[Any, Any]], fields: dict[str, Any]) -> Any:
    """The taskset's declared config class built from `config_to_json`'s fields (an array
    goes back into a tuple where the field's default is a tuple)."""
    default = taskset_cls._default_config()
    config_cls = type(default)
    values = dict(fields)
    for field in attrs.fields(config_cls):
        if isinstance(values.get(field.name), list) and isinstance(
            getattr(default, field.name), tuple
        ):
            values[field.name] = tuple(values[field.name])
    return config_cls(**values)


def rebuild_task(
    taskset_cls: type[Taskset[Any, Any]],
    key: str,
    data: dict[str, Any],
    *,
    task_cls: type[Task] = Task,
    **extra: Any,
) -> Any:
    """The task that `key` and `data` (a task's `data`) stand for in another process: the
    one decoder of a task that travels (a served request's, a queue entry's, a row's).

    `taskset_cls.task_from_data(data, key)` when the taskset class defines it, else
    `task_cls(**data, key=key, **extra)` (`tt.Task`, or a subclass with fields of its own
    given as `extra`). Raises `ConfigError` naming ``data`` saying why when `data` is not a
    `tt.Task`'s (no prompt, or fields beyond `TASK_FIELDS`), and what `task_from_data`
    raises."""
    factory: Any = getattr(taskset_cls, "task_from_data", None)
    if factory is not None:
        return factory(data, key)
    if "prompt" not in data:
        raise ConfigError("its task has no prompt", parameter="data")
    unknown = sorted(set(data) - TASK_FIELDS)
    if unknown:
        raise ConfigError(f"unknown task fields {unknown}", parameter="data")
    return task_cls(**data, key=key, **extra)


def _reward_spec(env: Env[Any]) -> str | None:
    reward = env._reward
    if reward is answer_match:
        return None
    if getattr(reward, "__self__", None) is env.taskset and getattr(
        reward, "__func__", None
    ) is getattr(type(env.taskset), "reward", None):
        return None  # the taskset's own reward: the server's env finds it the same way
    own = getattr(env.taskset, "reward", None)
    if own is not None and getattr(reward, "rewards", None) is own:
        return None  # the taskset's own weighted rewards (`reward = {...}`): the same
    return object_spec(reward, "the reward")


_BACKENDS = ("local", "bwrap")


@attrs.frozen
class SandboxSpec:
    """A sandbox backend by name, as `--sandbox` gives it and as it travels (an env spec, a
    Redis declaration): ``local``, ``bwrap``, ``docker:IMAGE``, or ``pkg.mod:factory`` /
    ``file.py:factory`` (a factory of your own: called with no argument, it makes one box).
    `text` is that form; `factory()` the factory it names."""

    text: str

    @classmethod
    def parse(cls, text: str, *, parameter: str = "sandbox") -> SandboxSpec:
        """`text` checked: one of the forms above. Raises `ConfigError` naming `parameter`
        otherwise (a factory by import path is loaded by `factory()`, when the env is
        built)."""
        value = text.strip() if isinstance(text, str) else ""
        kind, colon, rest = value.partition(":")
        if (
            value in _BACKENDS
            or (kind == "docker" and rest.strip())
            or (colon and kind not in ("docker", "") and rest.strip())
        ):
            return cls(value)
        raise ConfigError(
            f"{{{parameter}}} must be local, bwrap, docker:IMAGE or pkg.mod:factory (a "
            f"factory of your own), got {text!r}",
            parameter=parameter,
        )

    def factory(self) -> Any:
        """The sandbox factory the spec names (`tt.sandboxes.parse`: `local()`, `bwrap()`,
        `docker(IMAGE)`, or the factory ``pkg.mod:factory`` names). Raises `ConfigError`
        naming ``sandbox`` when it cannot be made or loaded."""
        return sandboxes.parse(self.text)


def _max_sandboxes(value: object) -> int | AdaptiveBounds | None:
    """A `max_sandboxes` as it travels (``N`` or ``MIN-START-MAX`` text, or None)."""
    if value is None:
        return None
    try:
        return parse_window(str(value), parameter="max_sandboxes")
    except WindowArgumentError as exc:
        raise TravelError(f"not an env spec ({exc})") from None


@attrs.frozen
class EnvSpec:
    """How another process rebuilds an env: `taskset_cls(config)` wrapped in
    `env_class(taskset, reward=..., retries=...)`, with every limit `limits` sets in place of
    the env's own (a limit left None keeps the env's).

    It travels as data (`to_json` / `from_json`: a spawned server gets it whole, never
    re-encoded as command-line flags), and `build` is the one way an env is made from one,
    for the command line's options as for a spawned server."""

    taskset: str
    config: dict[str, Any]
    env_class: str | None = None
    reward: str | None = None
    retries: RetryPolicy = attrs.field(factory=RetryPolicy)
    limits: RolloutLimits = attrs.field(factory=RolloutLimits)
    sandbox: SandboxSpec | None = None
    max_sandboxes: int | AdaptiveBounds | None = None

    @classmethod
    def of(cls, env: Env[Any]) -> EnvSpec:
        """The spec of `env`; `TravelError` when a piece of it cannot travel."""
        taskset = env.taskset
        env_cls = type(env)
        return cls(
            taskset=object_spec(type(taskset), "the taskset class"),
            config=config_to_json(taskset),
            env_class=None if env_cls is Env else object_spec(env_cls, "the Env class"),
            reward=_reward_spec(env),
            retries=env.retries,
            limits=env.rollout_limits,
            **_sandbox_fields(env.sandboxes),
        )

    def to_json(self) -> str:
        """The spec as one JSON object (`from_json` reads it back equal)."""
        r = self.retries
        return json.dumps({
            "taskset": self.taskset, "config": self.config, "env_class": self.env_class,
            "reward": self.reward, "limits": self.limits.to_json(),
            "sandbox": None if self.sandbox is None else self.sandbox.text,
            "max_sandboxes": (
                None if self.max_sandboxes is None else window_spec(self.max_sandboxes)
            ),
            "retries": {"max_retries": r.max_retries, "include": list(r.include),
                        "exclude": list(r.exclude), "backoff": r.backoff,
                        "max_backoff": r.max_backoff},
        })  # fmt: skip

    @classmethod
    def from_json(cls, text: str) -> EnvSpec:
        """The spec `to_json` wrote; `TravelError` for anything else."""
        try:
            data = json.loads(text)
            retries = RetryPolicy(**data.pop("retries"))
            limits = RolloutLimits.from_json(data.pop("limits"))
            sandbox = data.pop("sandbox", None)
            boxes = _max_sandboxes(data.pop("max_sandboxes", None))
            spec = cls(
                **data, retries=retries, limits=limits, max_sandboxes=boxes,
                sandbox=None if sandbox is None else SandboxSpec.parse(sandbox),
            )  # fmt: skip
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise TravelError(f"not an env spec ({type(exc).__name__}: {exc})") from None
        if not isinstance(spec.taskset, str) or not isinstance(spec.config, dict):
            raise TravelError("not an env spec (taskset must be a string, config an object)")
        return spec

    def build(
        self,
        taskset: Taskset[Any, Any] | type[Taskset[Any, Any]] | None = None,
        *,
        target_env: type[Env[Any]] | None = None,
    ) -> Env[Any]:
        """The env, in this process: `taskset` (a taskset built already; a taskset class,
        built from `self.config`; default: the class `self.taskset` names) wrapped in the env class (`env_class`, else `target_env`,
        the Env subclass TASKSET named, else `tt.Env`) with the reward, retries and limits.
        A part that cannot be loaded or built raises `ConfigError` naming it (``taskset``,
        ``config``, ``env_class``, ``reward``)."""
        if taskset is None or isinstance(taskset, type):
            if taskset is None:
                taskset_cls, found = resolve_target(self.taskset)
                target_env = target_env or found
            else:
                taskset_cls = taskset
            try:
                taskset = taskset_cls(config_from_json(taskset_cls, self.config))
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{{config}}: {exc}", parameter="config") from exc
        env_cls: Any = target_env or Env
        if self.env_class is not None:
            if target_env is not None:
                raise ConfigError(
                    f"TASKSET {self.taskset} names an Env class already; {{env_class}} "
                    f"{self.env_class} would replace it",
                    parameter="env_class",
                    fix="drop {env_class}, or name the taskset class as TASKSET",
                )
            env_cls = _load(self.env_class, "env_class")
            if not (isinstance(env_cls, type) and issubclass(env_cls, Env)):
                raise ConfigError(
                    f"{{env_class}} {self.env_class}: not a subclass of tt.Env",
                    parameter="env_class",
                )
        kwargs: dict[str, Any] = {"retries": self.retries}
        if self.reward is not None:
            kwargs["reward"] = _load(self.reward, "reward")
        try:
            env: Env[Any] = env_cls(taskset, **kwargs)
        except Exception as exc:
            raise ConfigError(
                f"{env_cls.__name__}(taskset, ...) failed: {type(exc).__name__}: {exc}",
                parameter="env_class",
            ) from exc
        env.rollout_limits = env.rollout_limits.updated(self.limits)
        self._give_sandboxes(env)
        return env

    def _give_sandboxes(self, env: Env[Any]) -> None:
        """`sandbox` and `max_sandboxes` in place of the env's own (its scope kept)."""
        own = env.sandboxes
        if self.sandbox is None and self.max_sandboxes is None:
            return
        if self.sandbox is not None:
            factory, spec = self.sandbox.factory(), self.sandbox
        elif own is not None:
            factory, spec = own.factory, own.spec
        else:
            raise ConfigError(
                "{max_sandboxes} admits sandboxes, but the env makes none",
                parameter="max_sandboxes",
                fix="add {sandbox} (local, bwrap, docker:IMAGE or pkg.mod:factory)",
            )
        limit: Any = self.max_sandboxes
        if limit is None and own is not None:
            limit = own.admission.window
        scope = own.scope if own is not None else "rollout"
        env.sandboxes = Sandboxes.of(factory, scope=scope, max_sandboxes=limit, spec=spec)


def _sandbox_text(own: Sandboxes | None) -> str | None:
    return own.spec.text if own is not None and isinstance(own.spec, SandboxSpec) else None


def _sandbox_fields(own: Sandboxes | None) -> dict[str, Any]:
    """What of an env's sandboxes travels: the `--sandbox` spec they came from, with their
    admission window's spec (an env whose own class makes its sandboxes rebuilds them
    itself: nothing travels)."""
    if own is None or not isinstance(own.spec, SandboxSpec):
        return {}
    window = own.admission.window
    return {"sandbox": own.spec, "max_sandboxes": parse_window(window_spec(window))}


def _load(spec: str, parameter: str) -> Any:
    """The object `spec` names; `ConfigError` naming `parameter` if it cannot be loaded."""
    try:
        return load_object(spec)
    except LoadError as exc:
        raise ConfigError(f"{{{parameter}}} {spec}: {exc}", parameter=parameter) from exc
    except Exception as exc:
        where = spec.rpartition(":")[0]
        message = f"{{{parameter}}} {spec}: {import_failure(exc, where)}"
        raise ConfigError(message, parameter=parameter) from exc


# --- what a producer meant its entries for (a worker refuses another env's) ---------------


def _name(cls: type) -> str:
    """`object_spec`'s name for a class, else `module:qualname` (compared, never imported)."""
    try:
        return object_spec(cls, "the class")
    except TravelError:
        return f"{cls.__module__}:{cls.__qualname__}"


def taskset_arg(name: str) -> str:
    """How a TASKSET argument names the class `name`: its built-in id if it has one."""
    for builtin_id, cls in BUILTIN.items():
        if name in (object_spec(cls, "the class"), f"{cls.__module__}:{cls.__qualname__}"):
            return builtin_id
    return name


def _same_class(a: str, b: str) -> bool:
    """The same class: the same name, or the same file name and class in two checkouts."""
    if a == b:
        return True
    (where_a, _, name_a), (where_b, _, name_b) = a.rpartition(":"), b.rpartition(":")
    files = where_a.endswith(".py") and where_b.endswith(".py")
    return files and name_a == name_b and PurePath(where_a).name == PurePath(where_b).name


@attrs.frozen
class Declaration:
    """What a producer meant its entries for: the taskset class (as `object_spec` names it),
    its config (JSON fields, without `system_prompt`, which each task carries), and from an
    eval the env class, the model and the sampling. A field left None is not declared (and
    not checked). A worker refuses an entry whose declaration `differs` from its own.

    `limits`: the producer's env's limits, when it sets any; never a reason to refuse, a
    worker runs the entry under them and its own, each the tighter (`RunSlot.limits`).

    `sandbox`: the producer's `--sandbox` (its text form), when it gave one: the worker
    makes the box where it runs, so a worker with another sandbox, or none, refuses the
    entry (an eval that asked for a box is never run without one)."""

    taskset: str
    config: dict[str, Any] | None = None
    env_class: str | None = None
    model: str | None = None
    sampling: dict[str, Any] | None = None
    limits: RolloutLimits | None = None
    sandbox: str | None = None

    @classmethod
    def of_taskset(cls, taskset: Taskset[Any, Any]) -> Declaration:
        try:
            config: dict[str, Any] | None = config_to_json(taskset)
        except TravelError:
            config = None  # not plain JSON: not declared, not checked
        if config is not None:
            config.pop("system_prompt", None)
        return cls(_name(type(taskset)), config)

    @classmethod
    def of(cls, env: Env[Any], ctx: ModelContext | None = None) -> Declaration:
        """The declaration of `env` (and of the model in `ctx`, if given)."""
        base = cls.of_taskset(env.taskset)
        sampling = None if ctx is None else orjson.loads(orjson.dumps(attrs.asdict(ctx.sampling)))
        return attrs.evolve(
            base,
            env_class=_name(type(env)),
            model=None if ctx is None else ctx.model,
            sampling=sampling,
            limits=env.rollout_limits if env.rollout_limits.to_json() else None,
            sandbox=_sandbox_text(env.sandboxes),
        )

    def to_json(self) -> str:
        fields = {k: v for k, v in attrs.asdict(self, recurse=False).items() if v is not None}
        if self.limits is not None:
            fields["limits"] = self.limits.to_json()
        return orjson.dumps(fields, option=orjson.OPT_SORT_KEYS).decode()

    @classmethod
    def from_json(cls, raw: str) -> Declaration:
        """The declaration an entry carries; MalformedEntry if it is not one."""
        try:
            value = orjson.loads(raw)
            limits = value.pop("limits", None)  # (not a dict: AttributeError)
            if limits is not None:
                value["limits"] = RolloutLimits.from_json(limits)
            return cls(**value)
        except (orjson.JSONDecodeError, TypeError, AttributeError, ConfigError) as exc:
            raise MalformedEntry(f"'env' is not a declaration ({exc})") from None

    def differs(self, own: Declaration) -> str | None:
        """Why an entry declared so cannot run on a worker whose env is `own` (what differs,
        and what to start the worker with), or None."""
        if not _same_class(self.taskset, own.taskset):
            return (
                f"declared for taskset {self.taskset}, but this worker runs {own.taskset}: "
                f"start the worker with taskset {taskset_arg(self.taskset)}"
            )
        if None not in (self.config, own.config) and self.config != own.config:
            args = orjson.dumps(self.config).decode()
            return (
                f"declared with taskset config {args}, but this worker's is "
                f"{orjson.dumps(own.config).decode()}: start the worker with taskset config "
                f"{args}"
            )
        mine, theirs = self.env_class, own.env_class
        if mine is not None and theirs is not None and not _same_class(mine, theirs):
            return (
                f"declared for env class {mine}, but this worker runs {theirs}: start the "
                f"worker with env class {mine}"
            )
        if None not in (self.model, own.model) and self.model != own.model:
            return (
                f"declared for model {self.model!r}, but this worker runs {own.model!r}: give "
                f"the eval and the worker the same model"
            )
        if self.sandbox is not None and self.sandbox != own.sandbox:
            has = "no sandbox" if own.sandbox is None else f"--sandbox {own.sandbox}"
            return (
                f"declared with --sandbox {self.sandbox}, but this worker has {has}: start "
                f"the worker with --sandbox {self.sandbox}"
            )
        if None not in (self.sampling, own.sampling) and self.sampling != own.sampling:
            return (
                f"declared with sampling {self.sampling}, but this worker samples with "
                f"{own.sampling}: give the eval and the worker the same sampling"
            )
        return None
