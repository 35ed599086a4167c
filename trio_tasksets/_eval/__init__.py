"""The bounded eval: plan slots, run them through the windowed core, keep durable traces.

An `EvalConfig` is valid once built (a bad value is an `EvalConfigError`, a ValueError naming
the parameter); `run_eval` checks what needs the env too before it pulls a task or writes a
file, then:

* static taskset: every slot is planned up front (shuffled, then the first `num_examples`
  tasks, `rollouts_per_example` slots each); the `max_concurrent` window bounds what runs;
* streaming taskset: takes the next `num_examples` tasks of the feed (never one more), plans
  a task's slots as it arrives, and its slots enter the window one by one.

Both go through `run_stream`. Each finished episode is appended to `traces.jsonl` at once.

Rooms: `config` (settings and the checks before any work), `plan` (slots, resume), `run`
(`run_eval`). Where each slot runs is `EvalConfig.backend`, a
`trio_tasksets._env.backend.SlotBackend`; the served and Redis backends live with their
transports (`_serve.slots`, `redis._coordinator`), which this package never imports.
"""

from .config import EvalConfig, EvalConfigError, EvalResult, EvalWarning, latest_run
from .run import run_eval

__all__ = ["EvalConfig", "EvalConfigError", "EvalResult", "EvalWarning", "latest_run", "run_eval"]
