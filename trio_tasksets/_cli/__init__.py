"""The command line: `trio-tasksets COMMAND` (also `python -m trio_tasksets`).

One module per command (`eval`, `serve`, `worker` with `enqueue`), the options they share
(`options`), and `main` (the parser and the one style of error line).
"""

from .._env.loading import resolve_target, resolve_taskset
from .main import main

__all__ = ["main", "resolve_target", "resolve_taskset"]
