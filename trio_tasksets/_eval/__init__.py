"""The bounded eval: plan slots, run them through the windowed core, keep durable traces.

`run_eval` checks everything it can before it pulls a task or writes a file (a bad value is an
`EvalConfigError`, a ValueError naming the command-line flag), then:

* static taskset: every slot is planned up front (shuffled, then the first `-n` tasks, `-r`
  slots each); `-c` bounds what runs;
* streaming taskset: takes the next `-n` tasks of the feed (never an (n+1)th), plans a task's
  `-r` slots as it arrives, and its slots enter the `-c` window one by one.

Both go through `run_stream`. Each finished episode is appended to `traces.jsonl` at once.

Rooms: `config` (settings and the checks before any work), `plan` (slots, resume), `run`
(`run_eval`). Where each slot runs is a `trio_tasksets._env.backend.SlotBackend`, chosen once
(`EvalConfig.slot_backend()`); the served and Redis backends live with their transports
(`serve.slots`, `redis.coordinator`), which this package never imports.
"""

from .config import EvalConfig, EvalConfigError, EvalResult, EvalWarning, latest_run
from .run import run_eval

__all__ = ["EvalConfig", "EvalConfigError", "EvalResult", "EvalWarning", "latest_run", "run_eval"]
