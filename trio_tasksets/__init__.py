"""trio_tasksets: streaming tasksets and a windowed runner on Trio.

The flat public API (SPEC): the runner (`run_stream`, `as_completed`, `take`, `merge`,
`fan_out`),
tasksets (`Task`, `TasksetConfig`, `Taskset`), envs and models (`Env`, `RunSlot`, `Episode`,
`RetryPolicy`, `Sampling`, `ModelContext`, `Completion`, `ToolCall`, `EchoClient`,
`OpenAIClient`), agents (`tool`, `Tool`, `ToolEnv`, `fan_out`), the served path's
`EnvClient` and the eval
(`EvalConfig`, `run_eval`, `EvalResult`). Every exception the library defines is a
`TrioTasksetsError` (the tree: `trio_tasksets._exceptions`); a bad setting is a `ConfigError`.
Submodules: `testing` (helpers for deterministic tests, `ScriptedClient`), `tools`
(`tools.shell`) and `aio` (the asyncio bridge).
"""

from . import aio, testing, tools
from ._exceptions import ConfigError, TrioTasksetsError
from .agents import ToolEnv
from .env import (
    Env,
    Episode,
    EpisodeError,
    EpisodeTask,
    RetryPolicy,
    RolloutTimeoutError,
    RunSlot,
    StalledError,
)
from .eval import EvalConfig, EvalConfigError, EvalResult, run_eval
from .eval.report import report
from .models import (
    Completion,
    EchoClient,
    ModelClient,
    ModelConnectionError,
    ModelContext,
    ModelError,
    ModelHTTPError,
    ModelResponseError,
    ModelTimeoutError,
    OpenAIClient,
    Sampling,
    ToolCall,
)
from .runner import as_completed, fan_out, run_stream
from .serve import EnvClient
from .sources import merge, take
from .tasksets import Task, Taskset, TasksetConfig
from .tools import Tool, tool
from .version import __version__
from .window import AdaptiveWindow, Window

__all__ = [
    "AdaptiveWindow",
    "Completion",
    "ConfigError",
    "EchoClient",
    "Env",
    "EnvClient",
    "Episode",
    "EpisodeError",
    "EpisodeTask",
    "EvalConfig",
    "EvalConfigError",
    "EvalResult",
    "ModelClient",
    "ModelConnectionError",
    "ModelContext",
    "ModelError",
    "ModelHTTPError",
    "ModelResponseError",
    "ModelTimeoutError",
    "OpenAIClient",
    "RetryPolicy",
    "RolloutTimeoutError",
    "RunSlot",
    "Sampling",
    "StalledError",
    "Task",
    "Taskset",
    "TasksetConfig",
    "Tool",
    "ToolCall",
    "ToolEnv",
    "TrioTasksetsError",
    "Window",
    "__version__",
    "aio",
    "as_completed",
    "fan_out",
    "merge",
    "report",
    "run_eval",
    "run_stream",
    "take",
    "testing",
    "tool",
    "tools",
]
