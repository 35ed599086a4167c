"""trio_tasksets: streaming tasksets and a windowed runner on Trio.

The flat public API (every name the docs use): the runner (`run_stream`,
`as_completed`, `take`, `until`, `merge`, `fan_out`), tasksets (`Task`, `TasksetConfig`,
`Taskset`, the built-in `EchoTaskset` and `EchoStreamTaskset`; the loaders `JsonlTaskset`,
`CsvTaskset`, `HFTaskset`), envs and models (`Env`, `RunSlot`, `Episode`, `RetryPolicy`,
`Sampling`, `ModelContext`, `Completion`, `ToolCall`, `EchoClient`, `OpenAIClient` and its
`HTTPClient` (`Request`, `Response`), the model errors, `chat_messages`; for a client of
another provider `ModelClientBase`, `ClientDescription`, `EndpointCalls`), agents (`tool`,
`Tool`, `ToolEnv`, `fan_out`), windows and limits on model calls (`Window`, `AdaptiveWindow`, `AdaptiveBounds`,
`EndpointLimits`, `RateLimiter`; for a model client of your own `report_outcome`, `rest`,
`observe_calls`; for a tool runner `parked`, `report_progress`; `sticky` to keep calls on one
endpoint), groups for training (`Group`, `group_feed`, `run_group`, `group_advantages`,
`GroupFailedError`, `first`, `Staleness`, `batches`; policy updates while rollouts run:
`Policy`, `EngineControl`, `VLLMControl`, `VersionSpan`), the served path (`EnvClient`, `EnvServerError`, `spawn_server`) and the
eval (`EvalConfig`, `run_eval`, `EvalResult`, `report`, `rescore`; where its slots run:
`SlotBackend`, `InProcess`, `ServedBackend`, and `trio_tasksets.redis.ViaBackend`). Every
exception the library defines is a `TrioTasksetsError` (the tree: `trio_tasksets._core.exceptions`).
Bad input (a setting, an argument) raises a `ConfigError`, a ValueError whose `parameter`
names what was wrong as the library spells it (``window``, ``num_examples``; the command line
shows the flag instead); an argument of the wrong kind (a `run` that is not callable) is also
a TypeError. Each public function says in its docstring what it raises.

Public submodules: `aio` (the asyncio bridge), `testing` (helpers for deterministic tests,
`ScriptedClient`), `tools` (`tools.shell`), `sandboxes` (`Sandbox` backends: `sandboxes.local`, `sandboxes.bwrap`,
`sandboxes.docker`), `trio_tasksets.worker` (the worker's queue seam and
loop) and `trio_tasksets.redis` (the Redis feed), the last two imported by name. The `__all__` of each is its public API, pinned by `tests/test_exports.py`; every
other module is private (`trio_tasksets._core.window`, `trio_tasksets.aio._guest`, ...: a leading
underscore, free to change in any release), as in trio and httpx.
"""

from . import aio, sandboxes, testing, tools
from ._core.adaptive import AdaptiveBounds, AdaptiveWindow, build_window, parse_window
from ._core.builtin import EchoStreamConfig, EchoStreamTaskset, EchoTaskset
from ._core.datasets import (
    CsvConfig,
    CsvTaskset,
    DatasetError,
    HFConfig,
    HFTaskset,
    JsonlConfig,
    JsonlTaskset,
)
from ._core.exceptions import ConfigError, ConfigTypeError, EmptyEvalError, TrioTasksetsError
from ._core.limits import (
    CallObserver,
    EndpointLimits,
    RateLimiter,
    observe_calls,
    parked,
    report_outcome,
    report_progress,
    rest,
)
from ._core.runner import as_completed, fan_out, run_stream
from ._core.sources import merge, take, until
from ._core.tasksets import Task, Taskset, TasksetConfig
from ._core.training import Staleness, batches, first
from ._core.version import __version__
from ._core.window import Window
from ._env.agents import ToolEnv
from ._env.backend import InProcess, SlotBackend
from ._env.env import (
    Env,
    Episode,
    EpisodeError,
    EpisodeTask,
    RetryPolicy,
    RolloutLimits,
    RolloutTimeoutError,
    RunSlot,
    StalledError,
    chat_messages,
)
from ._env.groups import Group, GroupFailedError, group_advantages, group_feed, run_group
from ._eval import EvalConfig, EvalConfigError, EvalResult, run_eval
from ._eval.rescore import rescore
from ._models import (
    ClientDescription,
    Completion,
    EchoClient,
    EndpointCalls,
    EngineControl,
    ModelClient,
    ModelClientBase,
    ModelConnectionError,
    ModelContext,
    ModelError,
    ModelHTTPError,
    ModelResponseError,
    ModelTimeoutError,
    OpenAIClient,
    Policy,
    Sampling,
    Tokens,
    ToolCall,
    VersionSpan,
    VLLMControl,
    api_key_from_env,
)
from ._models.pool import sticky
from ._report import report
from ._serve import EnvClient, EnvServerError, ServedBackend, spawn_server
from ._transport import HTTPClient, Request, Response, Timeouts
from .sandboxes import ExecResult, Sandbox, current_sandbox
from .tools import Tool, tool

__all__ = [
    "AdaptiveBounds",
    "AdaptiveWindow",
    "CallObserver",
    "ClientDescription",
    "Completion",
    "ConfigError",
    "ConfigTypeError",
    "CsvConfig",
    "CsvTaskset",
    "DatasetError",
    "EchoClient",
    "EchoStreamConfig",
    "EchoStreamTaskset",
    "EchoTaskset",
    "EmptyEvalError",
    "EndpointCalls",
    "EndpointLimits",
    "EngineControl",
    "Env",
    "EnvClient",
    "EnvServerError",
    "Episode",
    "EpisodeError",
    "EpisodeTask",
    "EvalConfig",
    "EvalConfigError",
    "EvalResult",
    "ExecResult",
    "Group",
    "GroupFailedError",
    "HFConfig",
    "HFTaskset",
    "HTTPClient",
    "InProcess",
    "JsonlConfig",
    "JsonlTaskset",
    "ModelClient",
    "ModelClientBase",
    "ModelConnectionError",
    "ModelContext",
    "ModelError",
    "ModelHTTPError",
    "ModelResponseError",
    "ModelTimeoutError",
    "OpenAIClient",
    "Policy",
    "RateLimiter",
    "Request",
    "Response",
    "RetryPolicy",
    "RolloutLimits",
    "RolloutTimeoutError",
    "RunSlot",
    "Sampling",
    "Sandbox",
    "ServedBackend",
    "SlotBackend",
    "Staleness",
    "StalledError",
    "Task",
    "Taskset",
    "TasksetConfig",
    "Timeouts",
    "Tokens",
    "Tool",
    "ToolCall",
    "ToolEnv",
    "TrioTasksetsError",
    "VLLMControl",
    "VersionSpan",
    "Window",
    "__version__",
    "aio",
    "api_key_from_env",
    "as_completed",
    "batches",
    "build_window",
    "chat_messages",
    "current_sandbox",
    "fan_out",
    "first",
    "group_advantages",
    "group_feed",
    "merge",
    "observe_calls",
    "parked",
    "parse_window",
    "report",
    "report_outcome",
    "report_progress",
    "rescore",
    "rest",
    "run_eval",
    "run_group",
    "run_stream",
    "sandboxes",
    "spawn_server",
    "sticky",
    "take",
    "testing",
    "tool",
    "tools",
    "until",
]
