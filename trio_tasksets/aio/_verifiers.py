"""verifiers v1 envs under the trio runner: `tt.aio.verifiers_env(target, **env_config)`.

A verifiers v1 env (PyPI `verifiers` >= 0.4: a `vf.Taskset` plus a harness and a runtime, an
asyncio `serving()` and an asyncio `run_slot`) becomes a `tt.Env` that `tt.run_eval`,
`run_stream` with `env.run_slot` and `--serve` drive. It runs on the asyncio bridge
(`tt.aio.BridgedEnv`) with a native asyncio loop: under `trio.run`, a stdlib loop in a thread of
its own (`asyncio_loop = "thread"`: verifiers runs as under vf-eval, without trio-asyncio's
per-callback cost); under an asyncio host (`tt.aio.run_eval`), the host's loop. verifiers'
`serving()` is held in one asyncio task for the env's `serving()`; each slot is one asyncio
task running verifiers' own `Env.run_slot`.

* **target**: a taskset id (the import name `vf-eval` takes; verifiers loads the module and
  the `Taskset` subclass it exports in `__all__`), or a verifiers `Env` instance.
* **env_config**: verifiers' own env config keys (``agent={"harness": ..., "runtime": ...}``,
  ``taskset={...}``, ``retries``, ``timeout``...), deep-merged over
  ``{"taskset": {"id": target}}`` and validated by verifiers (`resolve_env_config`), as
  `vf-eval` resolves them. vf-eval's defaults apply: the taskset's own harness, else `bash`,
  and the remote `prime` runtime; offline runs name a local one
  (``agent={"runtime": {"type": "subprocess"}}``).

What crosses over: the tt `ModelContext`'s model name, its `OpenAIClient`'s base URL, timeout
and API key, and its sampling (temperature, top_p, max_tokens, seed, extra) become verifiers'
`ModelContext`; verifiers' harness then calls the model itself (through verifiers'
interception server), so the tt client's retries do not apply and the offline `EchoClient`
cannot serve it. An episode becomes a tt row: verifiers' episode id, the task's key and data,
`ok` (verifiers' episode `ok`), `reward` and `completion` (the last trace's reward and last
reply), `messages` (the last trace's), `errors` (the episode's, then each trace's), `usage`
(verifiers' token usage of every model call) and `metrics` (the last trace's per-reward
breakdown: each `@vf.reward`'s unweighted score and each `@vf.metric`, by name).

A verifiers taskset that defines ``async def stream(self)`` (the shape of verifiers PR #2582)
is a streaming tt taskset: the eval needs `-n`, pulls exactly `n` tasks and closes the feed.

Travel (``--serve``): the env is described by its taskset id and env config (plain
JSON on `VerifiersConfig`), so a server process rebuilds it by name; an `Env` instance travels
as its resolved config, the way verifiers' own env server rebuilds envs.

This module imports without verifiers; using it without says which extra to install.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import json
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import attrs

from .._core.exceptions import ConfigError, ConfigTypeError, TrioTasksetsError
from .._core.tasksets import TasksetConfig
from .._env.env import Episode, EpisodeError, EpisodeTask, RetryPolicy, Reward, RunSlot
from .._env.rollout_limits import RolloutLimits
from .._models import ModelContext, Sampling, describe
from ._bridge_env import AsyncioModelContext, BridgedEnv
from ._feeds import AsyncioTaskset

__all__ = [
    "EXTRA",
    "VerifiersConfig",
    "VerifiersEnv",
    "VerifiersTask",
    "VerifiersTaskset",
    "VerifiersUnavailable",
    "VerifiersUsageError",
    "env_from_cli",
    "verifiers_env",
]

EXTRA = "pip install 'trio-tasksets[verifiers]'"
"""How to install what this module needs."""

NO_KEY_VAR = "TT_VERIFIERS_NO_API_KEY"
"""The API-key variable verifiers is told to read for a client without a key (never set:
verifiers then sends its placeholder key, ``EMPTY``)."""

KEY_VAR_PREFIX = "TT_VERIFIERS_API_KEY_"
"""Where a client's API key is handed to verifiers, which reads keys from the environment
(verifiers' subprocess runtime strips every variable whose name holds ``API_KEY``)."""


class VerifiersUnavailable(TrioTasksetsError, ImportError):
    """`verifiers` (v1, >= 0.4) is not installed; the message names the extra to install."""


class VerifiersUsageError(ConfigError):
    """A bad verifiers env setting (its `env_args`, `retries`...): the CLI's usage error."""


def _vf() -> Any:
    """`verifiers.v1`, imported on first use (importing trio_tasksets never needs it)."""
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise VerifiersUnavailable(
            f"tt.aio.verifiers_env runs verifiers v1 envs and needs the `verifiers` package "
            f"(>= 0.4), which cannot be imported ({type(exc).__name__}: {exc}); install it "
            f"with {EXTRA}"
        ) from exc
    return vf


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`over` deep-merged onto `base` (dicts merge key by key; anything else replaces)."""
    merged = dict(base)
    for key, value in over.items():
        old = merged.get(key)
        if isinstance(old, Mapping) and isinstance(value, Mapping):
            merged[key] = _merge(old, value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _class_spec(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _load_class(spec: str) -> Any:
    module, _, name = spec.partition(":")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


# --- tasks ------------------------------------------------------------------------------------


@attrs.frozen(eq=False)
class VerifiersTask:
    """A verifiers task as a tt task: `key` is verifiers' task key, `data` its task data as
    JSON (`TaskData` fields that differ from their defaults). `vf_task` is the verifiers task
    itself, or None for a task rebuilt from `(key, data)` by an env server (the env rebuilds
    the verifiers task from `data` with its taskset's task type)."""

    vf_task: Any = attrs.field(repr=False)
    key: str
    data: dict[str, Any]

    @classmethod
    def of(cls, vf_task: Any) -> VerifiersTask:
        data = vf_task.data.model_dump(mode="json", exclude_defaults=True)
        return cls(vf_task, str(vf_task.key), data)

    @property
    def prompt(self) -> Any:
        return self.data.get("prompt")

    @property
    def system_prompt(self) -> str | None:
        return self.data.get("system_prompt")

    def with_system_prompt(self, text: str) -> VerifiersTask:
        """The task with `text` as its system prompt (as verifiers' `with_system_prompt`)."""
        if self.vf_task is None:
            data = {**self.data, "system_prompt": text}
            return VerifiersTask(None, self.key, data)
        return VerifiersTask.of(self.vf_task.with_system_prompt(text))


# --- the taskset --------------------------------------------------------------------------------


@attrs.define
class VerifiersConfig(TasksetConfig):
    """What rebuilds a verifiers env anywhere (plain JSON): the taskset id (`target`), the
    env config keys (`env_config`), and the verifiers `Env` class when it is not the one the
    config names itself (`env_class`, ``module:Class``; an `Env` instance's class)."""

    target: str = ""
    env_config: dict[str, Any] = attrs.Factory(dict)
    env_class: str | None = None


def _build_env(config: VerifiersConfig) -> Any:
    """The verifiers env `config` describes (verifiers validates the env config)."""
    vf = _vf()
    if not config.target:
        raise ConfigError(
            "VerifiersConfig.{target} is empty: name the verifiers taskset id "
            "(tt.aio.verifiers_env('my-taskset', ...), or the TASKSET vf:my-taskset)",
            parameter="target",
        )
    raw = _merge({"taskset": {"id": config.target}}, config.env_config)
    with _current_folder_for(config.target):
        resolved = vf.resolve_env_config(raw)
        if config.env_class is None:
            return vf.load_environment(resolved)
        return _load_class(config.env_class)(resolved)


def _module_of(target: str) -> str:
    """The module verifiers imports for a taskset id (`owner/my-tasks@1` -> `my_tasks`)."""
    return target.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()


@contextlib.contextmanager
def _current_folder_for(target: str) -> Iterator[None]:
    """While a taskset id is imported: the current folder first on `sys.path` when it holds
    the id's module (`my_tasks.py` or `my_tasks/`) and is not on the path already, so that a
    local verifiers taskset loads without `PYTHONPATH=.`, as a `file.py:Class` taskset's
    folder is on the path while it loads."""
    module = _module_of(target)
    here = Path.cwd()
    local = (here / f"{module}.py").is_file() or (here / module / "__init__.py").is_file()
    on_path = {str(Path(p or ".").resolve()) for p in sys.path}
    if not local or str(here) in on_path or not module.isidentifier():
        yield
        return
    folder = str(here)
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        if folder in sys.path:
            sys.path.remove(folder)


def _streams(vf_taskset: Any) -> bool:
    """Whether a verifiers taskset defines its own ``async def stream(self)``."""
    vf = _vf()
    impl = getattr(type(vf_taskset), "stream", None)
    if impl is None or impl is getattr(vf.Taskset, "stream", None):
        return False
    if not inspect.isasyncgenfunction(impl):
        raise ConfigTypeError(
            f"{type(vf_taskset).__name__}.{{stream}} must be an async generator "
            f"(`async def stream(self)` that yields tasks), got {impl!r}",
            parameter="stream",
        )
    return True


class VerifiersTaskset(AsyncioTaskset[VerifiersTask, VerifiersConfig]):
    """The tasks of a verifiers env's taskset, as tt tasks (`VerifiersTask`).

    Static: `load()` iterates the verifiers taskset (its `idx`, system prompt and views
    applied by verifiers). Streaming, when the verifiers taskset defines ``async def
    stream(self)``: `stream()` pulls it as asyncio code, one task per receive, and closes it
    when the channel closes. `INFINITE` is verifiers' ``not taskset.bounded``.

    Built from a `VerifiersConfig` (which builds the verifiers env), or around a verifiers
    env with `vf_env=`.
    """

    asyncio_loop = "thread"  # as VerifiersEnv's

    def __init__(self, config: VerifiersConfig | None = None, *, vf_env: Any = None) -> None:
        super().__init__(config)
        self.vf_env: Any = _build_env(self.config) if vf_env is None else vf_env
        vf_taskset = self.vf_env.taskset
        self._streams = _streams(vf_taskset)
        self.INFINITE = not bool(getattr(vf_taskset, "bounded", True))  # type: ignore[misc]

    @property
    def streaming(self) -> bool:
        return self._streams

    @property
    def taskset_id(self) -> str:
        """`vf:ID`: how runs name this taskset (their default run name holds the ID)."""
        return f"vf:{self.config.target}"

    def load(self) -> Iterator[VerifiersTask]:
        if self._streams:
            return iter(())
        return (VerifiersTask.of(task) for task in self.vf_env.taskset)

    async def stream(self) -> AsyncIterator[VerifiersTask]:
        """Streaming: the verifiers taskset's own `stream()` (asyncio code). Static: the
        tasks of `load()` with the views applied (no awaits: runs under trio or asyncio)."""
        if not self._streams:
            for task in self:
                yield task
            return
        feed = self.vf_env.taskset.stream()
        try:
            async for vf_task in feed:
                yield VerifiersTask.of(vf_task)
        finally:
            await feed.aclose()

    @classmethod
    def task_from_data(cls, data: dict[str, Any], key: str) -> VerifiersTask:
        """A task an env server received (`VerifiersEnv.run_slot` rebuilds the verifiers
        task from `data` with its own taskset's task type)."""
        if not isinstance(data, dict):
            raise ConfigTypeError(
                f"a verifiers task's {{data}} must be an object, got {data!r}", parameter="data"
            )
        return VerifiersTask(None, key, data)

    def __repr__(self) -> str:
        return f"VerifiersTaskset({self.config.target!r})"


# --- the model context ----------------------------------------------------------------------------

_key_vars: dict[str, str] = {}
_key_vars_lock = threading.Lock()  # envs' loops run in threads of their own


def _api_key_var(key: str | None) -> str:
    """The environment variable verifiers reads the client's API key from: one of ours per
    distinct key (set here, in this process only), or `NO_KEY_VAR` for a client without one."""
    if key is None:
        return NO_KEY_VAR
    with _key_vars_lock:
        var = _key_vars.get(key)
        if var is None:
            var = _key_vars[key] = f"{KEY_VAR_PREFIX}{len(_key_vars) + 1}"
        os.environ[var] = key
    return var


def vf_model_context(ctx: ModelContext) -> Any:
    """verifiers' `ModelContext` for a tt one: the model name, the `OpenAIClient`'s endpoint,
    timeout and API key, and the sampling. `TypeError` for another client (verifiers' harness
    calls the model itself, over HTTP)."""
    vf = _vf()
    client = describe(ctx.client)
    travel = client.travel or {}
    if travel.get("type") != "openai" or not client.endpoints:
        raise ConfigTypeError(
            f"a verifiers env calls the model itself over HTTP, so its model context's "
            f"{{client}} needs an OpenAI-compatible endpoint (a tt.OpenAIClient with its "
            f"base_url), not {type(ctx.client).__name__}",
            parameter="client",
        )
    sampling: Sampling = ctx.sampling
    values = sampling.named_settings()
    values.update(sampling.extra)
    timeout = float(travel["timeout"])
    endpoint = vf.EvalClientConfig(
        base_url=client.endpoints[0],
        api_key_var=_api_key_var(client.api_key),
        timeout={"connect": min(30.0, timeout), "read": timeout},
    )
    return vf.ModelContext(
        model=ctx.model, client=endpoint, sampling=vf.SamplingConfig.model_validate(values)
    )


# --- episodes -------------------------------------------------------------------------------------


def _errors(vf_episode: Any) -> list[EpisodeError]:
    errors = list(vf_episode.errors)
    for trace in vf_episode.traces:
        errors.extend(trace.errors)
    return [EpisodeError(str(e.type), str(e.message)) for e in errors]


def _reply(trace: Any) -> str | None:
    """The trace's last reply (verifiers' `last_reply`), or None when the model never replied."""
    if trace is None or not (trace.assistant_messages or trace.root_reply is not None):
        return None
    return str(trace.last_reply)


def _usage(vf_episode: Any) -> dict[str, int]:
    """verifiers' usage of the episode (every trace's model calls) as a tt row's: the
    server's `prompt_tokens` (verifiers keeps cache reads apart: they are added back, and
    kept as `cached_input_tokens` too), `completion_tokens`, and `reasoning_tokens` when
    the server reported them; {} when it reported none."""
    usage = vf_episode.usage
    if usage is None:
        return {}
    cached = usage.cached_input_tokens
    counts = {
        "prompt_tokens": int(usage.prompt_tokens) + int(cached or 0),
        "completion_tokens": int(usage.completion_tokens),
    }
    if cached is not None:
        counts["cached_input_tokens"] = int(cached)
    if usage.reasoning_tokens is not None:
        counts["reasoning_tokens"] = int(usage.reasoning_tokens)
    return counts


def _metrics(trace: Any) -> dict[str, float]:
    """The trace's per-reward breakdown as named metrics: each `@vf.reward`'s own score
    (unweighted; the row's reward is their weighted sum) and each `@vf.metric`, under their
    names; a reward or metric that did not run (None) is left out."""
    if trace is None:
        return {}
    found: dict[str, float] = {}
    for name, reward in trace.rewards.items():
        if reward is not None:
            found[str(name)] = float(reward.score)
    for name, value in trace.metrics.items():
        if value is not None:
            found[str(name)] = float(value)
    return found


def to_episode(vf_episode: Any, task: VerifiersTask, rollout: int, began: float) -> Episode:
    """The tt row of a verifiers episode (see the module docstring)."""
    traces = vf_episode.traces
    last = traces[-1] if traces else None
    finished = time.time()
    return Episode(
        id=str(vf_episode.id),
        task=EpisodeTask(key=task.key, data=task.data),
        rollout=rollout,
        ok=bool(vf_episode.ok),
        reward=float(last.reward) if last is not None else 0.0,
        completion=_reply(last),
        messages=(
            [m.model_dump(mode="json", exclude_none=True) for m in last.messages]
            if last is not None
            else []
        ),
        errors=_errors(vf_episode),
        attempts=1,
        timing={"started": began, "finished": finished, "duration": finished - began},
        usage=_usage(vf_episode),
        metrics=_metrics(last),
    )


# --- the env --------------------------------------------------------------------------------------


class _VerifiersAsyncioEnv:
    """The asyncio env the bridge drives: verifiers' `serving()` and `run_slot`."""

    def __init__(self, taskset: VerifiersTaskset) -> None:
        self.taskset = taskset
        self.vf_env = taskset.vf_env
        self._ctx: tuple[ModelContext, Any] | None = None

    def serving(self) -> AbstractAsyncContextManager[Any]:
        return self.vf_env.serving()  # type: ignore[no-any-return]

    def _vf_task(self, task: VerifiersTask) -> Any:
        if task.vf_task is not None:
            return task.vf_task
        vf_taskset = self.vf_env.taskset
        task_cls = type(vf_taskset).task_type()
        return task_cls(task_cls.data_type().model_validate(task.data), vf_taskset.config.task)

    def _context(self, ctx: ModelContext) -> Any:
        cached = self._ctx
        if cached is not None and cached[0] is ctx:
            return cached[1]
        vf_ctx = vf_model_context(ctx)
        self._ctx = (ctx, vf_ctx)
        return vf_ctx

    async def run_slot(self, slot: RunSlot[VerifiersTask], ctx: AsyncioModelContext) -> Episode:
        from verifiers.v1.env import RunSlot as VfRunSlot

        began = slot.started if slot.started is not None else time.time()
        vf_ctx = self._context(ctx.context)
        vf_slot = VfRunSlot(self._vf_task(slot.task))
        vf_episode = await self.vf_env.run_slot(vf_slot, vf_ctx)
        return to_episode(vf_episode, slot.task, slot.rollout, began)


class VerifiersEnv(BridgedEnv[VerifiersTask]):
    """A verifiers v1 env as a `tt.Env`; build one with `tt.aio.verifiers_env`.

    ``VerifiersEnv(VerifiersTaskset(VerifiersConfig(target=..., env_config=...)))`` is what a
    server process builds from the env's spec. verifiers scores and retries its own episodes
    (its env config's ``retries``): a tt `reward=` or a non-default `retries=` is refused;
    `rollout_limits=` bounds its episodes as `tt.Env`'s do.
    """

    aio_env_class = _VerifiersAsyncioEnv
    taskset_class = VerifiersTaskset
    asyncio_loop = "thread"  # verifiers runs on a native asyncio loop, as under vf-eval
    taskset: VerifiersTaskset

    def __init__(
        self,
        taskset: VerifiersTaskset | None = None,
        *,
        aio_env: Any = None,
        reward: Reward | None = None,
        retries: RetryPolicy | None = None,
        rollout_limits: RolloutLimits | None = None,
    ) -> None:
        if reward is not None:
            raise ConfigTypeError(
                "a verifiers env scores its episodes itself (its tasks' @vf.reward methods): "
                "drop {reward}",
                parameter="reward",
            )
        if retries is not None and retries != RetryPolicy():
            raise VerifiersUsageError(
                f"a verifiers env retries its episodes itself: set verifiers' retries in the env "
                f"config (verifiers_env(..., retries={{'max_retries': {retries.max_retries}}}), "
                f'{{env_args}} \'{{"retries": {{"max_retries": {retries.max_retries}}}}}\') '
                f"instead of {{retries}}",
                parameter=("retries", "env_args"),
            )
        if taskset is not None and not isinstance(taskset, VerifiersTaskset):
            raise ConfigTypeError(
                f"VerifiersEnv runs a VerifiersTaskset (build one with tt.aio.verifiers_env), "
                f"got {type(taskset).__name__}",
                parameter="taskset",
            )
        super().__init__(taskset, aio_env=aio_env, rollout_limits=rollout_limits)

    @property
    def vf_env(self) -> Any:
        """The verifiers env this env runs."""
        return self.aio_env.vf_env

    def __repr__(self) -> str:
        return f"VerifiersEnv({self.aio_env.vf_env!r})"


def verifiers_env(target: Any, /, **env_config: Any) -> VerifiersEnv:
    """A `tt.Env` that runs a verifiers v1 env under the trio runner (module docstring).

    `target` is a taskset id (``env_config`` are verifiers' env config keys, deep-merged over
    ``{"taskset": {"id": target}}``) or a verifiers `Env` instance (then no `env_config`).
    Raises `VerifiersUnavailable` without verifiers, `TypeError` for another target, and
    verifiers' own errors (a pydantic `ValidationError`, `ModuleNotFoundError` for an unknown
    taskset id) for a bad config, before anything runs.
    """
    vf = _vf()
    if isinstance(target, vf.Env):
        if env_config:
            raise ConfigTypeError(
                f"verifiers_env(env, ...): an Env instance carries its own config; pass a "
                f"taskset id to configure one (got {sorted(env_config)})",
                parameter="env_config",
            )
        config = VerifiersConfig(
            target=str(target.config.taskset.id),
            env_config=target.config.model_dump(mode="json", exclude_unset=True),
            env_class=None
            if type(target) is vf.environment_class(target.config.taskset.id, target.config.id)
            else _class_spec(type(target)),
        )
        return VerifiersEnv(VerifiersTaskset(config, vf_env=target))
    if not isinstance(target, str) or not target:
        raise ConfigTypeError(
            f"verifiers_env(target): {{target}} is a verifiers taskset id (a str) or a "
            f"verifiers v1 Env instance, got {target!r}",
            parameter="target",
        )
    config = VerifiersConfig(target=target, env_config=json.loads(json.dumps(env_config)))
    return VerifiersEnv(VerifiersTaskset(config))


def env_from_cli(spec: str, env_args: str | None) -> VerifiersConfig:
    """The `VerifiersConfig` of a TASKSET ``vf:ID`` and its `env_args` (JSON text, or None);
    `VerifiersUsageError` (a ValueError) names the parameter at fault."""
    target = spec.removeprefix("vf:")
    if not target:
        raise VerifiersUsageError(
            "TASKSET vf:ID needs the verifiers taskset id after vf:", parameter="spec"
        )
    env_config: Any = {}
    if env_args is not None:
        try:
            env_config = json.loads(env_args)
        except ValueError as exc:
            raise VerifiersUsageError(
                f"{{env_args}} is not JSON: {exc}", parameter="env_args"
            ) from None
        if not isinstance(env_config, dict):
            raise VerifiersUsageError(
                f"{{env_args}} must be a JSON object of verifiers env config keys, e.g. "
                f'\'{{"agent": {{"runtime": {{"type": "subprocess"}}}}}}\', got {env_args!r}',
                parameter="env_args",
            )
    _vf()
    return VerifiersConfig(target=target, env_config=env_config)
