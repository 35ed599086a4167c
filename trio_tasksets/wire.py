"""The served path's wire format and the env's travel papers: pure functions, no I/O.

Two things cross a process boundary on the served path, both as JSON (never pickle):

* a **run request** (`POST /run`): one slot and its model context,

  ``{"slot": {"task": {"key", "data"}, "rollout"},
     "ctx": {"model", "sampling": {...}, "client": {"type": "echo", ...} | {"type": "openai", ...}}}``

  built by `encode_run_request` and checked field by field by `parse_run_request`, whose
  `WireError` names the offending field (``slot.task.data.prompt``). The model client travels
  as a description, never as a secret: an OpenAI client names the environment variable the
  server reads its API key from (`api_key_var`).
* an **env spec** (`EnvSpec`): how a server process rebuilds the eval's env (the taskset class
  and its config, the Env class, the reward, the retry policy) as command-line arguments.
  `EnvSpec.of(env)` raises `TravelError` for what cannot travel (a lambda reward, a class
  defined inside a function) before anything starts.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import math
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from .env import Env, RetryPolicy, RunSlot, answer_match, task_data, task_key
from .models import EchoClient, ModelClient, ModelContext, OpenAIClient, Sampling
from .tasksets import Task, Taskset

__all__ = [
    "API_KEY_VAR",
    "ClientSpec",
    "EchoSpec",
    "EnvSpec",
    "OpenAISpec",
    "RunRequest",
    "RunRequestEncoder",
    "TravelError",
    "WireError",
    "build_client",
    "build_task",
    "describe_client",
    "encode_run_request",
    "parse_run_request",
    "quick_slot",
]

API_KEY_VAR = "TT_SERVE_API_KEY"
"""Where a spawned server finds the model's API key (the parent puts it in the child's env)."""

FILE_MODULE_PREFIX = "_trio_tasksets_user_"  # how cli.resolve_taskset names file modules


class WireError(ValueError):
    """A request that does not match the wire format; `field` is the dotted path at fault."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class TravelError(ValueError):
    """Something of the env or the model context cannot be rebuilt in a server process."""


# --- model client descriptions --------------------------------------------------------------


@attrs.frozen
class EchoSpec:
    """The offline echo model, rebuilt as `EchoClient(delay)`."""

    delay: float = 0.0


@attrs.frozen
class OpenAISpec:
    """An OpenAI-compatible endpoint; the key is read from `api_key_var` on the server."""

    base_url: str
    timeout: float = 120.0
    max_retries: int = 3
    backoff: float = 0.5
    max_backoff: float = 30.0
    api_key_var: str | None = None


ClientSpec = EchoSpec | OpenAISpec


def openai_api_key(client: OpenAIClient) -> str | None:
    """The API key an `OpenAIClient` sends (it keeps it only in its request headers)."""
    auth = client._headers.get("Authorization", "")
    return auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else None


def describe_client(client: ModelClient, *, api_key_var: str | None = None) -> ClientSpec:
    """The wire description of a model client; `TravelError` for one that cannot travel.

    An `OpenAIClient` with a key is described with `api_key_var` (the server reads the key
    from that variable); the key itself never goes on the wire.
    """
    if isinstance(client, EchoClient):
        return EchoSpec(delay=float(client.delay))
    if isinstance(client, OpenAIClient):
        extra = set(client._headers) - {"Content-Type", "Authorization"}
        if extra:
            raise TravelError(
                f"the OpenAIClient's custom headers ({', '.join(sorted(extra))}) cannot travel "
                f"to an env server; run in-process"
            )
        has_key = openai_api_key(client) is not None
        return OpenAISpec(
            base_url=client.base_url,
            timeout=client.timeout,
            max_retries=client.max_retries,
            backoff=client.backoff,
            max_backoff=client.max_backoff,
            api_key_var=api_key_var if has_key else None,
        )
    raise TravelError(
        f"model client {type(client).__name__} cannot travel to an env server (EchoClient and "
        f"OpenAIClient can); run in-process"
    )


def build_client(spec: ClientSpec, environ: Mapping[str, str] | None = None) -> ModelClient:
    """The model client a description stands for (server side); the key from `environ`."""
    if isinstance(spec, EchoSpec):
        return EchoClient(delay=spec.delay)
    key = None
    if spec.api_key_var is not None:
        key = (os.environ if environ is None else environ).get(spec.api_key_var, "").strip()
        if not key:
            raise WireError(
                "ctx.client.api_key_var",
                f"the server has no environment variable {spec.api_key_var} (set it where the "
                f"server runs)",
            )
    return OpenAIClient(
        spec.base_url,
        key,
        timeout=spec.timeout,
        max_retries=spec.max_retries,
        backoff=spec.backoff,
        max_backoff=spec.max_backoff,
    )


# --- run requests: encode (client side) -----------------------------------------------------


def encode_run_request(
    slot: RunSlot[Any], ctx: ModelContext, *, api_key_var: str | None = None
) -> bytes:
    """The JSON body of `POST /run` for one slot; `TypeError` naming the task if its data
    is not JSON."""
    return RunRequestEncoder(api_key_var).encode(slot, ctx)


_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False)  # json.dumps's, made once


def _dumps(value: object) -> bytes:
    return _ENCODER.encode(value).encode()


class RunRequestEncoder:
    """`encode_run_request` for many slots of the same model context: the context's JSON is
    made once and reused while the context is the same object with the same client
    description and `sampling.extra` (checked on every call; the rest is frozen)."""

    def __init__(self, api_key_var: str | None = None) -> None:
        self.api_key_var = api_key_var
        self._ctx: tuple[ModelContext, ClientSpec, dict[str, Any], bytes] | None = None

    def _ctx_json(self, ctx: ModelContext) -> bytes:
        spec = describe_client(ctx.client, api_key_var=self.api_key_var)
        cached = self._ctx
        if (
            cached is not None
            and cached[0] is ctx
            and cached[1] == spec
            and cached[2] == ctx.sampling.extra
        ):
            return cached[3]
        client = {"type": "echo" if isinstance(spec, EchoSpec) else "openai", **attrs.asdict(spec)}
        value = {"model": ctx.model, "sampling": attrs.asdict(ctx.sampling), "client": client}
        encoded = _dumps(value)
        self._ctx = (ctx, spec, copy.deepcopy(ctx.sampling.extra), encoded)
        return encoded

    def encode(self, slot: RunSlot[Any], ctx: ModelContext) -> bytes:
        """The JSON body of `POST /run` for `slot` under `ctx`."""
        task = slot.task
        try:
            ctx_json = self._ctx_json(ctx)
            data = task_data(task)
            _check_ints(data)
            task_json = _dumps({"task": {"key": task_key(task), "data": data},
                                "rollout": slot.rollout})  # fmt: skip
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"task {task_key(task)!r}: its data or the sampling settings are not JSON, so "
                f"they cannot go to an env server: {exc}"
            ) from exc
        return b'{"slot":%b,"ctx":%b}' % (task_json, ctx_json)


# --- run requests: parse and validate (server side) ------------------------------------------


@attrs.frozen
class RunRequest:
    """A validated run request."""

    key: str
    data: dict[str, Any]
    rollout: int
    model: str
    sampling: Sampling
    client: ClientSpec


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object" if isinstance(value, dict) else type(value).__name__


def _object(value: object, field: str, allowed: set[str] | None = None) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise WireError(field, f"expected an object, got {_kind(value)}")
    if allowed is not None:
        unknown = sorted(set(value) - allowed)
        if unknown:
            raise WireError(f"{field}.{unknown[0]}", "unknown field")
    return value


def _required(obj: dict[str, Any], name: str, field: str) -> Any:
    if name not in obj:
        raise WireError(f"{field}.{name}", "missing")
    return obj[name]


def _str(value: object, field: str, *, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise WireError(field, f"expected a string, got {_kind(value)}")
    return value


def _int(value: object, field: str, *, optional: bool = False, minimum: int | None = None) -> Any:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise WireError(field, f"expected an integer, got {_kind(value)}")
    if minimum is not None and value < minimum:
        raise WireError(field, f"must be >= {minimum}, got {value}")
    return value


def _number(
    value: object, field: str, *, optional: bool = False, minimum: float | None = None
) -> Any:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise WireError(field, f"expected a number, got {_kind(value)}")
    if not math.isfinite(value) or (minimum is not None and value < minimum):
        raise WireError(field, f"must be a finite number >= {minimum}, got {value}")
    return float(value)


def _task_fields(data: dict[str, Any], field: str) -> None:
    """`data` holds `tt.Task` fields of the right types."""
    _object(data, field, {"prompt", "answer", "info", "system_prompt"})
    prompt = _required(data, "prompt", field)
    if isinstance(prompt, list):
        for i, message in enumerate(prompt):
            _object(message, f"{field}.prompt[{i}]")
    else:
        _str(prompt, f"{field}.prompt")
    _str(data.get("answer"), f"{field}.answer", optional=True)
    if data.get("info") is not None:
        _object(data["info"], f"{field}.info")
    _str(data.get("system_prompt"), f"{field}.system_prompt", optional=True)


def _parse_sampling(value: object) -> Sampling:
    field = "ctx.sampling"
    obj = _object(value, field, {"temperature", "max_tokens", "top_p", "seed", "extra"})
    extra = obj.get("extra")
    return Sampling(
        temperature=_number(obj.get("temperature"), f"{field}.temperature", optional=True),
        max_tokens=_int(obj.get("max_tokens"), f"{field}.max_tokens", optional=True),
        top_p=_number(obj.get("top_p"), f"{field}.top_p", optional=True),
        seed=_int(obj.get("seed"), f"{field}.seed", optional=True),
        extra={} if extra is None else _object(extra, f"{field}.extra"),
    )


def _parse_client(value: object) -> ClientSpec:
    field = "ctx.client"
    obj = _object(value, field)
    kind = _str(_required(obj, "type", field), f"{field}.type")
    if kind == "echo":
        _object(obj, field, {"type", "delay"})
        return EchoSpec(_number(obj.get("delay", 0.0), f"{field}.delay", minimum=0.0))
    if kind != "openai":
        raise WireError(f"{field}.type", f"expected 'echo' or 'openai', got {kind!r}")
    names = {"type", "base_url", "timeout", "max_retries", "backoff", "max_backoff", "api_key_var"}
    _object(obj, field, names)
    timeout = _number(obj.get("timeout", 120.0), f"{field}.timeout", minimum=0.0)
    if timeout <= 0:
        raise WireError(f"{field}.timeout", f"must be > 0, got {timeout}")
    return OpenAISpec(
        base_url=_str(_required(obj, "base_url", field), f"{field}.base_url"),
        timeout=timeout,
        max_retries=_int(obj.get("max_retries", 3), f"{field}.max_retries", minimum=0),
        backoff=_number(obj.get("backoff", 0.5), f"{field}.backoff", minimum=0.0),
        max_backoff=_number(obj.get("max_backoff", 30.0), f"{field}.max_backoff", minimum=0.0),
        api_key_var=_str(obj.get("api_key_var"), f"{field}.api_key_var", optional=True),
    )


_SLOT_FIELDS = frozenset({"task", "rollout"})
_TASK_REF_FIELDS = frozenset({"key", "data"})
_TASK_FIELDS = frozenset({"prompt", "answer", "info", "system_prompt"})


def quick_slot(
    value: object, *, plain_tasks: bool = True
) -> tuple[str, dict[str, Any], int] | None:
    """The key, data and rollout of a well-formed ``slot`` field of a decoded run request, or
    None. A fast path for `parse_run_request`'s checks of the slot: it accepts only what they
    accept (exact JSON types, no unknown field), and for anything else (a bad field, or an
    unusual shape) returns None, so that the caller runs `parse_run_request`, which decides
    and names the field."""
    if type(value) is not dict or not value.keys() <= _SLOT_FIELDS:
        return None
    task = value.get("task")
    rollout = value.get("rollout", 0)
    if type(task) is not dict or task.keys() != _TASK_REF_FIELDS:
        return None
    if type(rollout) is not int or rollout < 0:
        return None
    key, data = task["key"], task["data"]
    if type(key) is not str or type(data) is not dict:
        return None
    if plain_tasks:
        if not data.keys() <= _TASK_FIELDS:
            return None
        prompt = data.get("prompt")
        if type(prompt) is list:
            if not all(type(message) is dict for message in prompt):
                return None
        elif type(prompt) is not str:
            return None
        for name in ("answer", "system_prompt"):
            text = data.get(name)
            if text is not None and type(text) is not str:
                return None
        info = data.get("info")
        if info is not None and type(info) is not dict:
            return None
    return key, data, rollout


def parse_run_request(body: object, *, plain_tasks: bool = True) -> RunRequest:
    """Check a decoded `POST /run` body against the wire format; `WireError` names the field.

    With `plain_tasks` (the taskset has no `task_from_data`), `slot.task.data` must hold
    `tt.Task` fields; otherwise it may be any object.
    """
    top = _object(body, "body", {"slot", "ctx"})
    slot = _object(_required(top, "slot", "body"), "slot", {"task", "rollout"})
    task = _object(_required(slot, "task", "slot"), "slot.task", {"key", "data"})
    key = _str(_required(task, "key", "slot.task"), "slot.task.key")
    data = _object(_required(task, "data", "slot.task"), "slot.task.data")
    if plain_tasks:
        _task_fields(data, "slot.task.data")
    rollout = _int(slot.get("rollout", 0), "slot.rollout", minimum=0)
    ctx = _object(_required(top, "ctx", "body"), "ctx", {"model", "sampling", "client"})
    return RunRequest(
        key=key,
        data=data,
        rollout=rollout,
        model=_str(_required(ctx, "model", "ctx"), "ctx.model"),
        sampling=_parse_sampling(ctx.get("sampling", {})),
        client=_parse_client(_required(ctx, "client", "ctx")),
    )


def build_task(taskset_cls: type[Taskset[Any, Any]], key: str, data: dict[str, Any]) -> Any:
    """The task a request stands for: `taskset_cls.task_from_data(data, key)` when the
    taskset class defines it, else `tt.Task(**data, key=key)`; `WireError` if it fails."""
    factory: Callable[[dict[str, Any], str], Any] | None = getattr(
        taskset_cls, "task_from_data", None
    )
    try:
        if factory is not None:
            return factory(data, key)
        return Task(**data, key=key)
    except (TypeError, ValueError, KeyError) as exc:
        raise WireError("slot.task.data", f"cannot build a task from it: {exc}") from exc


# --- the env spec ---------------------------------------------------------------------------


def _module_file(module_name: str) -> str | None:
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    return str(Path(path).resolve()) if isinstance(path, str) else None


def object_spec(obj: Any, what: str) -> str:
    """`module:Name`, or `path/file.py:Name` for an object of a script or a file loaded by
    path (of a `python -m pkg.mod` run: `pkg.mod:Name`); `TravelError` for an object another
    process cannot import by that name."""
    module_name = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(module_name, str) or not isinstance(qualname, str):
        raise TravelError(f"{what} {obj!r} has no importable name; run in-process")
    if "." in qualname or "<" in qualname:
        raise TravelError(
            f"{what} {qualname} is not defined at the top level of a module (a lambda, or a "
            f"definition inside a function or class), so an env server cannot import it; "
            f"define it at module level or run in-process"
        )
    module = sys.modules.get(module_name)
    if module is None or getattr(module, qualname, None) is not obj:
        raise TravelError(f"{what} {module_name}:{qualname} cannot be found by that name")
    main_spec = getattr(module, "__spec__", None) if module_name == "__main__" else None
    if main_spec is not None and main_spec.name:  # `python -m package.module`
        return f"{main_spec.name}:{qualname}"
    if module_name == "__main__" or module_name.startswith(FILE_MODULE_PREFIX):
        path = _module_file(module_name)
        if path is None:
            raise TravelError(f"{what} {qualname} lives in a module with no file; run in-process")
        return f"{path}:{qualname}"
    return f"{module_name}:{qualname}"


def load_object(spec: str) -> Any:
    """The object `object_spec` named, imported in this process (a file module is loaded
    once, under the name `cli.resolve_taskset` gives it)."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ValueError(f"{spec!r}: expected module:Name or path/file.py:Name")
    if where.endswith(".py"):
        path = Path(where).resolve()
        module_name = f"{FILE_MODULE_PREFIX}{path.stem}"
        module = sys.modules.get(module_name)
        if module is None or _module_file(module_name) != str(path):
            module_spec = importlib.util.spec_from_file_location(module_name, path)
            if module_spec is None or module_spec.loader is None:
                raise ValueError(f"{spec!r}: cannot import {path}")
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_name] = module
            module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    try:
        return getattr(module, name)
    except AttributeError:
        raise ValueError(f"{spec!r}: {where} has no {name!r}") from None


_INT_RANGE = (-(2**63), 2**64 - 1)  # what the server's JSON decoder (orjson) keeps exact


def _check_ints(value: object) -> None:
    """Refuse integers a served run would turn into floats (orjson: 64-bit at most)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if not _INT_RANGE[0] <= value <= _INT_RANGE[1]:
            raise ValueError(f"the integer {value} is outside the 64-bit range JSON can carry")
    elif isinstance(value, dict):
        for item in value.values():
            _check_ints(item)
    elif isinstance(value, list | tuple):
        for item in value:
            _check_ints(item)


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


def _reward_spec(env: Env[Any]) -> str | None:
    reward = env._reward
    if reward is answer_match:
        return None
    if getattr(reward, "__self__", None) is env.taskset and getattr(
        reward, "__func__", None
    ) is getattr(type(env.taskset), "reward", None):
        return None  # the taskset's own reward: the server's env finds it the same way
    return object_spec(reward, "the reward")


@attrs.frozen
class EnvSpec:
    """How a server process rebuilds an env: `taskset_cls(config)` wrapped in
    `env_class(taskset, reward=..., retries=...)`."""

    taskset: str
    config: dict[str, Any]
    env_class: str | None = None
    reward: str | None = None
    retries: RetryPolicy = attrs.field(factory=RetryPolicy)

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
        return env
