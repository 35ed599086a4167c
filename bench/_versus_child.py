"""One workload of `bench.versus`, in the checkout on ``PYTHONPATH`` (run as a script, so
that the only `trio_tasksets` it can import is that checkout's).

    PYTHONPATH=TREE python bench/_versus_child.py echo|http N [URL WINDOW [cli]]

Only public API both sides have (`run_eval`, `EvalConfig`, `Env`, `EchoClient`,
`OpenAIClient`). Warms up, then prints one JSON line: the CPU (``time.process_time``) and
wall seconds of the timed `run_eval`, its episodes, and the `trio_tasksets` imported.
With ``cli``, the process first settles its heap as that checkout's CLI would before its eval
(`trio_tasksets._cli.heap.settle_heap`, where the checkout has one; nothing otherwise).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import time
from collections.abc import Iterable

import trio

import trio_tasksets as tt


class Many(tt.Taskset[tt.Task, tt.TasksetConfig]):
    size = 1000

    def load(self) -> Iterable[tt.Task]:
        return [tt.Task(f"say {i}", answer="7", key=str(i)) for i in range(self.size)]


async def _eval(ctx: tt.ModelContext, n: int, window: int, out: str, name: str) -> None:
    Many.size = n
    config = tt.EvalConfig(num_examples=n, max_concurrent=window, output_dir=out, run_name=name,
                           dashboard=False)  # fmt: skip
    result = await tt.run_eval(tt.Env(Many()), ctx, config)
    assert result.summary["ok"] == n, result.summary


def settle_as_the_cli() -> bool:
    """What this checkout's `trio-tasksets eval` does to its heap before the eval, if any."""
    try:
        heap = importlib.import_module("trio_tasksets._cli.heap")
    except ImportError:  # a checkout from before it: its CLI left the collector alone
        return False
    return bool(heap.settle_heap(argparse.Namespace(**{heap.OWN_PROCESS: True})))


async def main(kind: str, n: int, url: str, window: int, cli: bool) -> dict[str, float]:
    settled = settle_as_the_cli() if cli else False
    with tempfile.TemporaryDirectory() as out:
        if kind == "echo":
            ctx = tt.ModelContext(tt.EchoClient(), "echo")
            await _eval(ctx, min(n, 1000), window, out, "warm")
            cpu, wall = time.process_time(), time.perf_counter()
            await _eval(ctx, n, window, out, "timed")
            return {"cpu": time.process_time() - cpu, "wall": time.perf_counter() - wall,
                    "settled": settled}  # fmt: skip
        async with tt.OpenAIClient(url, max_retries=0) as client:
            ctx = tt.ModelContext(client, "fake")
            await _eval(ctx, max(window, min(n, 500)), window, out, "warm")
            cpu, wall = time.process_time(), time.perf_counter()
            await _eval(ctx, n, window, out, "timed")
            return {"cpu": time.process_time() - cpu, "wall": time.perf_counter() - wall,
                    "settled": settled}  # fmt: skip


if __name__ == "__main__":
    kind, n = sys.argv[1], int(sys.argv[2])
    url = sys.argv[3] if len(sys.argv) > 3 else ""
    window = int(sys.argv[4]) if len(sys.argv) > 4 else 256
    cli = len(sys.argv) > 5 and sys.argv[5] == "cli"
    figures = trio.run(main, kind, n, url, window, cli)
    print(json.dumps({**figures, "n": n, "module": tt.__file__}), flush=True)
