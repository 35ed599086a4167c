"""`eval --via` (issue 12): the eval as a coordinator over worker processes, against in-process.

    python -m bench.via [--n 3000] [--delay 0.05] [--window 64] [--repeat 3] [--quick]

Starts its own `redis-server` (loopback, free port, no persistence). The model is the echo
model with `--delay` seconds of latency (50 ms by default), in this process for the in-process
eval and in the workers for `--via`. Contenders, each `tt.run_eval` in this process on the same
N tasks with `-c --window` (64), dashboard off, clock around the `run_eval` call:

* `in-process`: the eval runs every slot itself;
* `via, 1 worker -c 64`: the eval enqueues, one worker process runs (its window as large as the
  eval's, so the eval's `-c` is the limit, as in process);
* `via, 1 worker -c 32` and `via, 2 workers -c 32`: the same eval over workers with the
  worker's default window, so one worker is the limit and two fill the eval's 64.

Workers are started (and registered in the group) before the clock starts, and stopped with
SIGTERM after (each must exit 0). The contenders alternate within each repeat; reported: the
best and the median rollouts/s, the ratios the goals name (`via, 1 worker -c 64` against
in-process: >= 0.9; 2 workers against 1, both `-c 32`: >= 1.8), and the CPU per slot in this
process (the eval or the coordinator) and in the workers (from when they start consuming).

The workers run this module (`python -m bench.via --worker ...`): `run_worker` with the
benchmark's own env, as `trio-tasksets worker bench.via:Many` does.
"""

from __future__ import annotations

import argparse
import functools
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable

import attrs
import redis
import trio

import trio_tasksets as tt
from trio_tasksets.redis import ViaBackend
from trio_tasksets.redis._worker import WorkerConfig, run_worker

from .common import env_info, goal_line, markdown_table, redis_server, wait_until

STREAM, GROUP, RESULTS = "bench:via", "bench:workers", "bench:results"


class Many(tt.Taskset[tt.Task, tt.TasksetConfig]):
    size = 3000

    def load(self) -> Iterable[tt.Task]:
        return [tt.Task(f"say {i}", answer=str(i), key=str(i)) for i in range(self.size)]


@attrs.frozen
class Contender:
    name: str
    workers: int  # 0: in process
    worker_window: int = 0


@attrs.define
class Timing:
    seconds: list[float] = attrs.Factory(list)
    cpu: list[float] = attrs.Factory(list)  # this process
    worker_cpu: list[float] = attrs.Factory(list)  # the worker processes


def _consumers(r: redis.Redis) -> int:
    try:
        return len(r.xinfo_consumers(STREAM, GROUP))
    except redis.ResponseError:
        return 0


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def one_run(
    url: str, r: redis.Redis, contender: Contender, n: int, window: int, delay: float
) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds of this process, CPU seconds of the workers) of one eval."""
    r.flushall()
    r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    cmd = [sys.executable, "-m", "bench.via", "--worker", url, "--delay", str(delay)]
    procs = [
        subprocess.Popen(
            [*cmd, "--window", str(contender.worker_window), "--consumer", f"w{i}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for i in range(contender.workers)
    ]
    try:
        wait_until(lambda: _consumers(r) == contender.workers, f"{contender.workers} workers", 60)
        with tempfile.TemporaryDirectory() as out:
            config = tt.EvalConfig(
                max_concurrent=window, output_dir=out, run_name="bench", dashboard=False,
                backend=ViaBackend(url, stream=STREAM) if contender.workers else tt.InProcess(),
            )  # fmt: skip
            env = tt.Env(Many())
            ctx = tt.ModelContext(tt.EchoClient(delay), "echo")
            cpu = _cpu(resource.RUSAGE_SELF)
            start = time.perf_counter()
            result = trio.run(tt.run_eval, env, ctx, config)
            seconds = time.perf_counter() - start
            cpu = _cpu(resource.RUSAGE_SELF) - cpu
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        reports = [proc.communicate(timeout=60)[0] for proc in procs]
        codes = [proc.returncode for proc in procs]
    # Each worker's CPU from the moment it started consuming: its start-up is not a slot's.
    worker_cpu = sum(float(out.split()[-1]) for out in reports if out.strip())
    ok = sum(e.ok for e in result.episodes)
    if codes != [0] * contender.workers or len(result.episodes) != n or ok != n:
        raise RuntimeError(f"bad run: exit codes {codes}, {len(result.episodes)} rows, {ok} ok")
    return seconds, cpu, worker_cpu


def _worker(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.via --worker")
    parser.add_argument("url")
    parser.add_argument("--window", type=int, required=True)
    parser.add_argument("--consumer", required=True)
    parser.add_argument("--delay", type=float, required=True)
    args = parser.parse_args(argv)
    config = WorkerConfig(args.url, STREAM, GROUP, RESULTS, consumer=args.consumer,
                          max_concurrent=args.window, dashboard=False)  # fmt: skip
    ctx = tt.ModelContext(tt.EchoClient(args.delay), "echo")
    cpu = _cpu(resource.RUSAGE_SELF)  # from here on: the worker's own work, not its start-up
    trio.run(functools.partial(run_worker, config, ctx, env=tt.Env(Many()), log=lambda _: None))
    print(f"cpu {_cpu(resource.RUSAGE_SELF) - cpu}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return _worker(argv[1:])
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--delay", type=float, default=0.05, help="echo model latency (s)")
    parser.add_argument("--window", type=int, default=64, help="the eval's -c")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smoke run: n=1500, 1 repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.n, args.repeat = 1500, 1
    Many.size = args.n
    half = max(args.window // 2, 1)
    contenders = [
        Contender("in-process", 0),
        Contender(f"via, 1 worker -c {args.window}", 1, args.window),
        Contender(f"via, 1 worker -c {half}", 1, half),
        Contender(f"via, 2 workers -c {half}", 2, half),
    ]
    timings = {c.name: Timing() for c in contenders}
    print(" ".join(f"{k}={v}" for k, v in env_info()))
    with redis_server("bench.via") as (url, r):
        print(f"redis-server {r.info('server')['redis_version']}, n={args.n}, eval "
              f"-c {args.window}, echo delay {args.delay:g} s, {args.repeat} repeats")  # fmt: skip
        for _ in range(args.repeat):
            for contender in contenders:
                seconds, cpu, worker_cpu = one_run(
                    url, r, contender, args.n, args.window, args.delay
                )
                timing = timings[contender.name]
                timing.seconds.append(seconds)
                timing.cpu.append(cpu)
                timing.worker_cpu.append(worker_cpu)
                print(f"  {contender.name}: {args.n / seconds:,.0f} rollouts/s", flush=True)
    _report(args.n, args.window, args.delay, contenders, timings)
    return 0


def _report(
    n: int, window: int, delay: float, contenders: list[Contender], timings: dict[str, Timing]
) -> None:
    best = {name: n / min(t.seconds) for name, t in timings.items()}
    median = {name: n / statistics.median(t.seconds) for name, t in timings.items()}
    base = best["in-process"]
    rows = []
    for c in contenders:
        t = timings[c.name]
        rows.append([
            c.name, f"{best[c.name]:,.0f}", f"{median[c.name]:,.0f}", f"{best[c.name] / base:.2f}x",
            f"{min(t.cpu) / n * 1e6:.0f}",
            "-" if not c.workers else f"{min(t.worker_cpu) / n * 1e6:.0f}",
        ])  # fmt: skip
    headers = ["contender", "rollouts/s (best)", "median", "vs in-process",
               "eval CPU µs/slot", "worker CPU µs/slot"]  # fmt: skip
    print(markdown_table(headers, rows))
    ceiling = window / delay if delay else float("inf")
    print(f"the window's ceiling: {window} / {delay:g} s = {ceiling:,.0f} rollouts/s")
    one, half = contenders[1].name, contenders[2].name
    ratio = best[one] / base
    print(goal_line(ratio >= 0.9, "--via with one worker >= 0.9x in-process",
                    f"{ratio:.2f}x ({best[one]:,.0f} vs {base:,.0f} rollouts/s)"))  # fmt: skip
    two = contenders[3].name
    scale = best[two] / best[half]
    print(goal_line(scale >= 1.8, "2 workers >= 1.8x one worker",
                    f"{scale:.2f}x ({best[two]:,.0f} vs {best[half]:,.0f} rollouts/s, "
                    f"each worker -c {contenders[2].worker_window})"))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
