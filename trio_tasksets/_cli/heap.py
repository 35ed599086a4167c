"""The CLI's long-lived processes set their garbage collector once their set-up is done.

`trio-tasksets eval`, `worker` and `serve` each build their objects (the imports, the
parser, the env, the taskset's plan, the model client) and then run for minutes to days.
Those objects live as long as the process; left in the collector's oldest generation, every
full collection walks them again (tens of thousands of objects), and an eval makes many
full collections as its kept episodes grow the heap. `settle_heap` runs one collection and
then `gc.freeze()`: the survivors move to the permanent generation, which the collector no
longer scans (what Instagram-style deployments do at start-up; CPython's `gc.freeze`
documentation). Nothing else changes: collections still run on the usual thresholds, over
the objects made afterwards. Measured in docs/benchmarks.md ("Against the round's base").

Only the process the CLI itself started does this (`main()` called with no `argv`, as the
console script and ``python -m trio_tasksets`` do); `main([...])` called from a program or a
test, and the library (`tt.run_eval`), never change a process's collector settings.
"""

from __future__ import annotations

import gc

__all__ = ["OWN_PROCESS", "settle_heap"]

OWN_PROCESS = "tt_own_process"  # the `args` attribute `main` sets: this process is the CLI's


def settle_heap(own_process: bool) -> bool:
    """Collect once and freeze the survivors (`gc.freeze`) when this is the CLI's own
    process (`own_process`: what `main` set as ``args.tt_own_process``) and its collector is
    enabled; True when it did."""
    if not own_process or not gc.isenabled():
        return False
    gc.collect()
    gc.freeze()
    return True
