"""How an env travels to another process: `EnvSpec` (names and JSON config, never pickle)."""

from __future__ import annotations

import json
import math
from typing import Any

import attrs

from .env import Env, RetryPolicy, answer_match
from .loading import TravelError, load_object, object_spec
from .tasksets import Task, Taskset

__all__ = ["EnvSpec", "TravelError", "config_from_json", "config_to_json", "rebuild_task"]


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


def rebuild_task(taskset_cls: type[Taskset[Any, Any]], key: str, data: dict[str, Any]) -> Any:
    """The task that `key` and `data` (a task's `data`) stand for in another process:
    `taskset_cls.task_from_data(data, key)` when the taskset class defines it, else
    `tt.Task(**data, key=key)`. Raises what they raise (TypeError, ValueError, ...)."""
    factory: Any = getattr(taskset_cls, "task_from_data", None)
    if factory is not None:
        return factory(data, key)
    return Task(**data, key=key)


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


@attrs.frozen
class EnvSpec:
    """How a server process rebuilds an env: `taskset_cls(config)` wrapped in
    `env_class(taskset, reward=..., retries=...)`, with its `rollout_timeout` set."""

    taskset: str
    config: dict[str, Any]
    env_class: str | None = None
    reward: str | None = None
    retries: RetryPolicy = attrs.field(factory=RetryPolicy)
    rollout_timeout: float | None = None

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
            rollout_timeout=env.rollout_timeout,
        )

    def argv(self) -> list[str]:
        """The `trio-tasksets serve` arguments that rebuild this env."""
        r = self.retries
        args = [self.taskset, "--taskset-config", json.dumps(self.config)]
        if self.env_class is not None:
            args += ["--env-class", self.env_class]
        if self.reward is not None:
            args += ["--reward", self.reward]
        args += ["--retries", str(r.max_retries), "--retry-on", ",".join(r.include),
                 "--no-retry-on", ",".join(r.exclude), "--retry-backoff", repr(r.backoff),
                 "--retry-max-backoff", repr(r.max_backoff)]  # fmt: skip
        if self.rollout_timeout is not None:
            args += ["--rollout-timeout", repr(self.rollout_timeout)]
        return args

    def build(self, taskset_cls: type[Taskset[Any, Any]]) -> Env[Any]:
        """The env, in this process (`taskset_cls` is `self.taskset`, already resolved)."""
        taskset = taskset_cls(config_from_json(taskset_cls, self.config))
        env_cls = Env if self.env_class is None else load_object(self.env_class)
        if not (isinstance(env_cls, type) and issubclass(env_cls, Env)):
            raise TypeError(f"--env-class {self.env_class}: not an Env subclass")
        kwargs: dict[str, Any] = {"retries": self.retries}
        if self.reward is not None:
            kwargs["reward"] = load_object(self.reward)
        env: Env[Any] = env_cls(taskset, **kwargs)
        if self.rollout_timeout is not None:
            env.rollout_timeout = self.rollout_timeout
        return env
