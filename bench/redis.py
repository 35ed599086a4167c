"""The distributed feed (issue 6): N worker processes over one Redis stream, against the eval.

    python -m bench.redis [--n 20000] [--workers 1 2 4] [--window 32] [--repeat 2] [--delay S]
                          [--quick]

Starts its own `redis-server` (loopback, free port, no persistence). For each worker count W
and each repeat: an empty stream and group, W `trio-tasksets worker` processes (echo model,
no latency, `-c` window, no dashboard) started and waiting (all W registered in the group),
then the clock starts and this process enqueues the N tasks (pipelined XADDs, while the
workers already consume); the clock stops when the results stream holds N entries. Every
run is checked: N distinct task keys, nothing pending. Reported: tasks/s (best of the
repeats), the scaling ratio against one worker, and the CPU each task cost in the workers and
in redis-server. The in-process reference is `tt.run_eval` on the same N tasks and window,
dashboard off, in this process; the per-task overhead of the Redis path is
1/rate(1 worker) - 1/rate(eval). `--delay S` gives the echo model S seconds of latency (workers
and eval alike), to see the scaling when the model, not the CPU, is the limit.
"""

from __future__ import annotations

import argparse
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from typing import cast

import attrs
import redis
import trio

import trio_tasksets as tt
from trio_tasksets.redis import TASK_FIELD, encode_task

from .common import env_info, markdown_table, redis_server, wait_until

STREAM, GROUP, RESULTS = "bench:tasks", "bench:workers", "bench:results"


class Many(tt.Taskset[tt.Task, tt.TasksetConfig]):
    size = 20_000

    def load(self) -> Iterable[tt.Task]:
        return [tt.Task(f"say {i}", answer=str(i), key=str(i)) for i in range(self.size)]


@attrs.frozen
class Run:
    workers: int
    seconds: float
    enqueue_seconds: float
    worker_cpu: float  # seconds, all worker processes
    redis_cpu: float  # seconds, redis-server


def _redis_cpu(r: redis.Redis) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _consumers(r: redis.Redis) -> int:
    try:
        return len(r.xinfo_consumers(STREAM, GROUP))
    except redis.ResponseError:
        return 0


def one_run(
    url: str, r: redis.Redis, payloads: list[bytes], workers: int, window: int, delay: float
) -> Run:
    """W workers consume len(payloads) tasks; returns the wall time from the first XADD."""
    r.flushall()
    r.xgroup_create(STREAM, GROUP, id="$", mkstream=True)
    cmd = [sys.executable, "-m", "trio_tasksets", "worker", "--no-dashboard",
           "--feed", url, "--stream", STREAM, "--group", GROUP, "--results", RESULTS,
           "-c", str(window), "--echo-delay", str(delay)]  # fmt: skip
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    procs = [
        subprocess.Popen([*cmd, "--consumer", f"w{i}"], stderr=subprocess.DEVNULL)
        for i in range(workers)
    ]
    try:
        wait_until(lambda: _consumers(r) == workers, f"{workers} workers", 30)
        redis_before = _redis_cpu(r)
        start = time.perf_counter()
        for i in range(0, len(payloads), 1000):
            with r.pipeline(transaction=False) as pipe:
                for raw in payloads[i : i + 1000]:
                    pipe.xadd(STREAM, {TASK_FIELD: raw})
                pipe.execute()
        enqueued = time.perf_counter() - start
        wait_until(lambda: r.xlen(RESULTS) >= len(payloads), "every result", 600)
        seconds = time.perf_counter() - start
        redis_cpu = _redis_cpu(r) - redis_before
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        codes = [proc.wait(timeout=60) for proc in procs]
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    worker_cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (
        cpu_after.ru_stime - cpu_before.ru_stime
    )
    entries = cast(list[tuple[str, dict[str, str]]], r.xrange(RESULTS))
    keys = {fields["key"] for _, fields in entries}
    pending = int(r.xpending(STREAM, GROUP)["pending"])
    if codes != [0] * workers or len(keys) != len(payloads) or pending:
        raise RuntimeError(f"bad run: exit codes {codes}, {len(keys)} keys, {pending} pending")
    return Run(workers, seconds, enqueued, worker_cpu, redis_cpu)


async def _eval(n: int, window: int, delay: float) -> float:
    with tempfile.TemporaryDirectory() as out:
        config = tt.EvalConfig(max_concurrent=window, output_dir=out, run_name="bench",
                               dashboard=False)  # fmt: skip
        start = time.perf_counter()
        result = await tt.run_eval(
            tt.Env(Many()), tt.ModelContext(tt.EchoClient(delay), "echo"), config
        )
        elapsed = time.perf_counter() - start
        assert len(result.episodes) == n
        return elapsed


def _report(n: int, window: int, best: dict[int, Run], eval_seconds: float, delay: float) -> None:
    base = n / best[min(best)].seconds
    rows = []
    for workers, run in sorted(best.items()):
        rate = n / run.seconds
        rows.append([
            str(workers), f"{rate:,.0f}", f"{rate / base:.2f}x", f"{run.seconds:.2f}",
            f"{run.enqueue_seconds:.2f}", f"{run.worker_cpu / n * 1e6:.0f}",
            f"{run.redis_cpu / n * 1e6:.0f}",
        ])  # fmt: skip
    headers = ["workers", "tasks/s", "vs 1 worker", "wall s", "enqueue s",
               "worker CPU µs/task", "redis CPU µs/task"]  # fmt: skip
    print(markdown_table(headers, rows))
    eval_rate = n / eval_seconds
    print(f"in-process tt.run_eval (dashboard off, -c {window}, echo delay {delay:g} s): "
          f"{eval_rate:,.0f} tasks/s, "
          f"{eval_seconds / n * 1e6:.0f} µs/task")  # fmt: skip
    if 1 in best:
        overhead = best[1].seconds / n - eval_seconds / n
        print(f"per-task overhead of the Redis path (1 worker vs eval): {overhead * 1e6:.0f} µs")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--delay", type=float, default=0.0, help="echo model latency (s)")
    parser.add_argument("--quick", action="store_true", help="smoke run: n=2000, 1 and 2 workers")
    args = parser.parse_args(argv)
    if args.quick:
        args.n, args.workers, args.repeat = 2000, [1, 2], 1
    Many.size = args.n
    payloads = [encode_task(t) for t in Many()]
    print(" ".join(f"{k}={v}" for k, v in env_info()))
    with redis_server("bench.redis") as (url, r):
        print(f"redis-server {r.info('server')['redis_version']}, n={args.n}, "
              f"-c {args.window}, echo delay {args.delay:g} s, best of {args.repeat}")  # fmt: skip
        best: dict[int, Run] = {}
        for _ in range(args.repeat):
            for workers in args.workers:
                run = one_run(url, r, payloads, workers, args.window, args.delay)
                print(f"  {workers} worker(s): {run.seconds:.2f} s", flush=True)
                if workers not in best or run.seconds < best[workers].seconds:
                    best[workers] = run
    eval_seconds = min(trio.run(_eval, args.n, args.window, args.delay) for _ in range(args.repeat))
    _report(args.n, args.window, best, eval_seconds, args.delay)
    return 0


if __name__ == "__main__":
    sys.exit(main())
