"""trio_tasksets: streaming tasksets and a windowed runner on Trio."""

from . import testing
from .runner import as_completed, merge, run_stream, take
from .tasksets import Task, Taskset, TasksetConfig

__all__ = [
    "Task",
    "Taskset",
    "TasksetConfig",
    "as_completed",
    "merge",
    "run_stream",
    "take",
    "testing",
]
