"""What the health probe and the deadline bookkeeping cost (issue 24), side by side.

    python -m bench.deadlines [--n 10000] [--calls 3000] [--repeat 5] [--quick]

Same process, contenders interleaved across repeats, the figure per contender the median of
its CPU seconds (this process's; other load on the machine moves wall time more):

* echo eval (`run_eval`, dashboard off, window 256, the echo model without latency): health
  on (the lag probe every 0.1 s, the `Health` observer of every run's waits, a
  `report_progress` per model reply) against health off (the probe a sleep, the model
  replies' `report_progress` a no-op; the observer is still entered);
* HTTP (`run_eval` over `OpenAIClient` against bench.http's fake server, window 64): the
  client as it was (no deadline read) against today's (each attempt reads
  `trio.current_effective_deadline()`), and today's under a `--time-limit` (a finite
  deadline: each attempt's `Timeouts` is cut to the time left). CPU seconds per call.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import trio

import trio_tasksets as tt
import trio_tasksets._eval.run as eval_run
import trio_tasksets._models.base as models_base
from trio_tasksets._core.health import Health
from trio_tasksets._core.limits import report_progress
from trio_tasksets._models.calls import EndpointCalls
from trio_tasksets._transport import Timeouts

from .common import env_info, markdown_table


class Many(tt.Taskset[tt.Task, tt.TasksetConfig]):
    size = 10_000

    def load(self) -> Iterable[tt.Task]:
        return [tt.Task(f"say {i}", answer="7", key=str(i)) for i in range(self.size)]


class _NoHealth(Health):
    async def probe(self) -> None:
        await trio.sleep_forever()


class _Before(EndpointCalls):
    """`EndpointCalls` before deadlines travelled: every attempt with its own timeouts."""

    async def _post(
        self, body: bytes, headers: Mapping[str, str], on_body: Any = None
    ) -> tuple[int, bytes, float | None, bool]:
        t = self.timeout
        response = await self.http.request(
            "POST", self.url, headers=headers, body=body,
            timeouts=Timeouts(connect=t, read=t, write=t), on_body=on_body,
        )  # fmt: skip
        return response.status, response.body, response.retry_after, False  # not a rate 429


class _Today(tt.OpenAIClient):
    """`OpenAIClient` before deadlines travelled (its calls through `_Before`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        calls = self._calls
        self._calls = _Before(
            calls.http, calls.url, timeout=calls.timeout, max_retries=calls.max_retries,
            limits=calls.limits, limits_key=calls.limits_key,
        )  # fmt: skip


def _quiet(kind: str = "tool") -> None:
    pass


def _health(on: bool) -> None:
    setattr(eval_run, "Health", Health if on else _NoHealth)  # noqa: B010
    setattr(models_base, "report_progress", report_progress if on else _quiet)  # noqa: B010


async def _echo_eval(n: int) -> float:
    Many.size = n
    with tempfile.TemporaryDirectory() as out:
        config = tt.EvalConfig(num_examples=n, max_concurrent=256, output_dir=out,
                               run_name="r", dashboard=False)  # fmt: skip
        start = time.process_time()
        result = await tt.run_eval(tt.Env(Many()), tt.ModelContext(tt.EchoClient(), "echo"),
                                   config)  # fmt: skip
        took = time.process_time() - start
    assert result.summary["ok"] == n
    return took


async def _http_eval(base: str, n: int, client_cls: type[tt.OpenAIClient], limit: bool) -> float:
    Many.size = n
    with tempfile.TemporaryDirectory() as out:
        config = tt.EvalConfig(num_examples=n, max_concurrent=64, output_dir=out, run_name="r",
                               dashboard=False, time_limit=3600.0 if limit else None)  # fmt: skip
        async with client_cls(base, max_retries=0) as client:
            cpu = time.process_time()
            result = await tt.run_eval(tt.Env(Many()), tt.ModelContext(client, "fake"), config)
            cpu = time.process_time() - cpu
    assert result.summary["ok"] == n, result.summary
    return cpu / n


def _interleave(contenders: dict[str, Callable[[], float]], repeat: int) -> dict[str, list[float]]:
    figures: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(repeat):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            figures[name].append(contenders[name]())
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.n, args.calls, args.repeat = 3000, 1000, 3
    print(env_info())

    def echo(on: bool) -> Callable[[], float]:
        def run() -> float:
            _health(on)
            try:
                return trio.run(_echo_eval, args.n)
            finally:
                _health(True)

        return run

    echo_figures = _interleave({"health on": echo(True), "health off": echo(False)}, args.repeat)
    on, off = (statistics.median(echo_figures[k]) for k in ("health on", "health off"))
    rows = [["echo eval, health off", f"{off / args.n * 1e6:.0f} µs CPU/episode", "1.000"],
            ["echo eval, health on", f"{on / args.n * 1e6:.0f} µs CPU/episode",
             f"{on / off:.3f}"]]  # fmt: skip

    server = subprocess.Popen([sys.executable, "-m", "bench.http", "--serve"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert server.stdout is not None
        base = f"http://127.0.0.1:{int(server.stdout.readline())}/v1"
        trio.run(_http_eval, base, 200, tt.OpenAIClient, False)  # warm up

        def http(cls: type[tt.OpenAIClient], limit: bool) -> Callable[[], float]:
            return lambda: trio.run(_http_eval, base, args.calls, cls, limit)

        http_figures = _interleave({
            "OpenAIClient as it was": http(_Today, False),
            "OpenAIClient today": http(tt.OpenAIClient, False),
            "OpenAIClient today, under --time-limit": http(tt.OpenAIClient, True),
        }, args.repeat)  # fmt: skip
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(timeout=10)
    base_cpu = statistics.median(http_figures["OpenAIClient as it was"])
    for name, values in http_figures.items():
        cpu = statistics.median(values)
        rows.append([f"HTTP eval, {name}", f"{cpu * 1e6:.0f} µs CPU/call", f"{cpu / base_cpu:.3f}"])
    print(markdown_table(["contender", "median", "ratio"], rows))


if __name__ == "__main__":
    main()
