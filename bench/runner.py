"""Per-item overhead of the windowed runner against a hand-written baseline and its rivals.

Run from the project root: ``python -m bench.runner`` (``--quick`` for a smoke run).

Speed: every contender runs the same trivial ``run`` (one checkpoint, returns ``2 * x``) over
the same ``N`` items with the same window, in one process. Each measurement is the wall time of
the *whole* ``trio.run(...)`` / ``asyncio.run(...)`` call (event loop start-up and shutdown
included, nothing subtracted), after a ``gc.collect()``; the garbage collector stays on during
the run. The contenders are interleaved across repeats (the order rotates every repeat) and
each one's best and median are reported. The goals are judged on the bests: on a shared
machine interference only ever adds time (the worst wall/CPU ratio of a run is printed to show
how much there was), so the best is the steadiest estimate of the cost itself.

Contenders:

* ``baseline``: hand-written trio, a ``CapacityLimiter(window)`` acquired on behalf of a
  per-item token before each pull/spawn, ``nursery.start_soon``, the child stores its result
  by index and releases the token; fed by an async generator, closed shielded at the end.
* ``tt.run_stream``: the same generator and ``run``.
* ``tt.run_stream, tt.Window`` (reference, no goal): the same with ``window=tt.Window(w)``,
  a resizable window (here never resized): what taking slots from a shared limiter costs.
* ``tt.as_completed``: the same, consumed by a loop that stores each result by index (it pays
  one zero-buffer channel hand-off per item on top of ``run_stream``'s work).
* ``aiometer.run_all`` / ``aiometer.amap`` with ``max_at_once=window`` under ``trio.run``
  (aiometer is built on anyio). aiometer takes a ``Sequence``, not an async iterable, so the
  generator is first drained into a list (and, for ``run_all``, wrapped in one
  ``functools.partial`` per item); that cost is part of aiometer's contract and is timed.
  ``amap`` yields results in completion order without their index: it is reported, but
  ``run_all`` (ordered, like ``run_stream``) is the like-for-like rival.
* ``asyncio``: the same contract written the way most asyncio code is, under ``asyncio.run``
  (see ``aio_run_stream``); its ``run`` awaits ``asyncio.sleep(0)``. It keeps every task for
  a final ``gather``, so its cost grows with N (the cyclic GC walks the live tasks: compare
  ``--no-gc``).
* ``asyncio, by index`` (reference, no goal): the same without a task list or ``gather``.

Memory: ``tt.as_completed`` over a generator that never ends, ``window=64``, consumed item by
item and left after a fixed count. ``tracemalloc`` is started before ``trio.run``; after a
warm-up the peak is reset, then the peak traced memory over the next ``n`` items is read.
This is done for a small ``n`` and a large one; the goal is a ratio within 10%.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import sys
import time
import tracemalloc
from collections.abc import AsyncGenerator, AsyncIterable, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import aiometer
import trio

import trio_tasksets as tt
from trio_tasksets._core.window import Window

from .common import Timings, env_info, goal_line, markdown_table, per_item_us

T = TypeVar("T")
R = TypeVar("R")

# Goals stated in the issue; reported as PASS/MISS, never enforced.
GOAL_VS_BASELINE = 1.2
GOAL_VS_AIOMETER = 2.5
GOAL_MEMORY_RATIO = 1.10


# --- the shared workload ---------------------------------------------------------------------


async def counter(n: int) -> AsyncGenerator[int, None]:
    """The feed: 0, 1, ..., n-1 (no awaits of its own, works under trio and asyncio)."""
    for i in range(n):
        yield i


async def forever() -> AsyncGenerator[int, None]:
    """An unbounded feed: 0, 1, 2, ... until closed."""
    i = 0
    while True:
        yield i
        i += 1


async def trio_run(x: int) -> int:
    await trio.lowlevel.checkpoint()
    return x * 2


async def aio_run(x: int) -> int:
    await asyncio.sleep(0)
    return x * 2


# --- contender 1: the hand-written trio baseline ---------------------------------------------


async def baseline_run_stream(
    source: AsyncIterable[T], run: Callable[[T], Awaitable[R]], window: int
) -> list[R | None]:
    limiter = trio.CapacityLimiter(window)
    results: list[R | None] = []
    iterator = aiter(source)

    async def one(index: int, item: T) -> None:
        try:
            results[index] = await run(item)
        finally:
            limiter.release_on_behalf_of(index)

    try:
        async with trio.open_nursery() as nursery:
            index = 0
            while True:
                await limiter.acquire_on_behalf_of(index)
                try:
                    item = await iterator.__anext__()
                except StopAsyncIteration:
                    limiter.release_on_behalf_of(index)
                    break
                results.append(None)
                nursery.start_soon(one, index, item)
                index += 1
    finally:
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            with trio.CancelScope(shield=True):
                await aclose()
    return results


# --- contender 5: the same contract in everyday asyncio --------------------------------------


async def aio_run_stream(
    source: AsyncIterable[T], run: Callable[[T], Coroutine[Any, Any, R]], window: int
) -> list[R]:
    """Windowed, ordered, fail-fast map over an async iterable, asyncio style.

    A puller task takes a semaphore slot before each pull and creates one task per item; a done
    callback frees the slot and records the first failure. The main coroutine races the puller
    against that failure with ``asyncio.wait(FIRST_COMPLETED)``, then races ``gather`` of all
    the tasks (results in order) against it; on failure it cancels the rest, waits for them and
    re-raises the failure itself.
    """
    loop = asyncio.get_running_loop()
    semaphore = asyncio.Semaphore(window)
    tasks: list[asyncio.Task[R]] = []
    failure: asyncio.Future[BaseException] = loop.create_future()

    def on_done(task: asyncio.Task[R]) -> None:
        semaphore.release()
        if task.cancelled() or failure.done():
            return
        exc = task.exception()
        if exc is not None:
            failure.set_result(exc)

    async def pull() -> None:
        iterator = aiter(source)
        try:
            while True:
                await semaphore.acquire()
                try:
                    item = await anext(iterator)
                except StopAsyncIteration:
                    semaphore.release()
                    return
                task = loop.create_task(run(item))
                task.add_done_callback(on_done)
                tasks.append(task)
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                await aclose()

    def raise_failure() -> None:
        if failure.done():
            raise failure.result()

    puller = loop.create_task(pull())
    gathered: asyncio.Future[list[R]] | None = None
    try:
        racers: set[asyncio.Future[Any]] = {puller, failure}
        while not puller.done():
            await asyncio.wait(racers, return_when=asyncio.FIRST_COMPLETED)
            raise_failure()
        puller.result()  # a source error is re-raised here
        gathered = asyncio.gather(*tasks)
        racers = {gathered, failure}
        await asyncio.wait(racers, return_when=asyncio.FIRST_COMPLETED)
        raise_failure()
        return gathered.result()
    except BaseException:
        rest = [t for t in (puller, *tasks) if not t.done()]
        for t in rest:
            t.cancel()
        await asyncio.gather(*rest, return_exceptions=True)
        if gathered is not None:
            gathered.cancel()
            if gathered.done() and not gathered.cancelled():
                gathered.exception()  # retrieved: no "exception was never retrieved" log
        raise


async def aio_run_stream_by_index(
    source: AsyncIterable[T], run: Callable[[T], Coroutine[Any, Any, R]], window: int
) -> list[R | None]:
    """A reference variant of ``aio_run_stream`` that keeps no task per item.

    Each task stores its result by index (as the trio baseline does) and is dropped once done;
    the main coroutine races the puller, then "all runs done", against the first failure.
    Only the running tasks are alive at any time, so the cyclic GC has little to walk.
    """
    loop = asyncio.get_running_loop()
    semaphore = asyncio.Semaphore(window)
    results: list[R | None] = []
    running: set[asyncio.Task[None]] = set()
    failure: asyncio.Future[BaseException] = loop.create_future()
    idle: asyncio.Future[None] = loop.create_future()

    async def one(index: int, item: T) -> None:
        results[index] = await run(item)

    def on_done(task: asyncio.Task[None]) -> None:
        running.discard(task)
        semaphore.release()
        if not task.cancelled() and not failure.done():
            exc = task.exception()
            if exc is not None:
                failure.set_result(exc)
        if not running and puller.done() and not idle.done():
            idle.set_result(None)

    async def pull() -> None:
        iterator = aiter(source)
        try:
            index = 0
            while True:
                await semaphore.acquire()
                try:
                    item = await anext(iterator)
                except StopAsyncIteration:
                    semaphore.release()
                    return
                results.append(None)
                task = loop.create_task(one(index, item))
                task.add_done_callback(on_done)
                running.add(task)
                index += 1
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                await aclose()

    def raise_failure() -> None:
        if failure.done():
            raise failure.result()

    puller = loop.create_task(pull())
    try:
        racers: set[asyncio.Future[Any]] = {puller, failure}
        while not puller.done():
            await asyncio.wait(racers, return_when=asyncio.FIRST_COMPLETED)
            raise_failure()
        puller.result()
        if running:
            racers = {idle, failure}
            await asyncio.wait(racers, return_when=asyncio.FIRST_COMPLETED)
            raise_failure()
    except BaseException:
        rest = [t for t in (puller, *running) if not t.done()]
        for t in rest:
            t.cancel()
        await asyncio.gather(*rest, return_exceptions=True)
        raise
    return results


# --- the contenders as timed whole-loop calls ------------------------------------------------


@dataclass(frozen=True)
class Contender:
    name: str
    note: str
    ordered: bool  # results come back in submission order (else: compare as a multiset)
    call: Callable[[int, int], list[Any]]  # (n, window) -> results; timed as a whole


def c_baseline(n: int, window: int) -> list[Any]:
    return trio.run(baseline_run_stream, counter(n), trio_run, window)


def c_run_stream(n: int, window: int) -> list[Any]:
    async def main() -> list[int]:
        return await tt.run_stream(counter(n), trio_run, window=window)

    return trio.run(main)


def c_run_stream_window(n: int, window: int) -> list[Any]:
    async def main() -> list[int]:
        return await tt.run_stream(counter(n), trio_run, window=Window(window))

    return trio.run(main)


def c_as_completed(n: int, window: int) -> list[Any]:
    async def main() -> list[int | None]:
        out: list[int | None] = [None] * n
        async with tt.as_completed(counter(n), trio_run, window=window) as results:
            async for index, result in results:
                out[index] = result
        return out

    return trio.run(main)


def c_aiometer_run_all(n: int, window: int) -> list[Any]:
    async def main() -> list[int]:
        items = [x async for x in counter(n)]  # aiometer needs a Sequence: drain the feed
        jobs = [functools.partial(trio_run, x) for x in items]
        return await aiometer.run_all(jobs, max_at_once=window)

    return trio.run(main)


def c_aiometer_amap(n: int, window: int) -> list[Any]:
    async def main() -> list[int]:
        items = [x async for x in counter(n)]
        out: list[int] = []
        async with aiometer.amap(trio_run, items, max_at_once=window) as results:
            async for result in results:
                out.append(result)
        return out

    return trio.run(main)


def c_asyncio(n: int, window: int) -> list[Any]:
    return asyncio.run(aio_run_stream(counter(n), aio_run, window))


def c_asyncio_by_index(n: int, window: int) -> list[Any]:
    return asyncio.run(aio_run_stream_by_index(counter(n), aio_run, window))


BASELINE = "baseline (trio)"
RUN_STREAM = "tt.run_stream"
RUN_STREAM_WINDOW = "tt.run_stream, tt.Window"
AS_COMPLETED = "tt.as_completed"
RUN_ALL = "aiometer.run_all"
AMAP = "aiometer.amap"
ASYNCIO = "asyncio impl"
ASYNCIO_BY_INDEX = "asyncio, by index"

CONTENDERS = [
    Contender(BASELINE, "limiter before spawn, results by index", True, c_baseline),
    Contender(RUN_STREAM, "same source and run", True, c_run_stream),
    Contender(RUN_STREAM_WINDOW, "a resizable window (never resized)", True, c_run_stream_window),
    Contender(AS_COMPLETED, "+ one channel hand-off per item", True, c_as_completed),
    Contender(RUN_ALL, "list built up front, on trio", True, c_aiometer_run_all),
    Contender(AMAP, "list built up front, on trio, unordered", False, c_aiometer_amap),
    Contender(ASYNCIO, "Semaphore + create_task + wait + gather", True, c_asyncio),
    Contender(ASYNCIO_BY_INDEX, "reference: no task list, no gather", True, c_asyncio_by_index),
]


def measure(contender: Contender, n: int, window: int, gc_off: bool = False) -> tuple[float, float]:
    """Wall and CPU seconds of one whole call; the results are checked afterwards, untimed."""
    gc.collect()
    if gc_off:
        gc.disable()
    try:
        cpu = time.process_time()
        start = time.perf_counter()
        results = contender.call(n, window)
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu
    finally:
        gc.enable()
    expected = [2 * i for i in range(n)]
    got = results if contender.ordered else sorted(results)
    if got != expected:
        raise AssertionError(f"{contender.name} returned wrong results (n={n}, window={window})")
    return elapsed, cpu


def speed(n: int, window: int, repeat: int, gc_off: bool = False) -> dict[str, Timings]:
    timings = {c.name: Timings(c.name, n) for c in CONTENDERS}
    for c in CONTENDERS:  # warm-up: imports, code paths, allocator pools
        measure(c, min(n, 2000), window, gc_off)
    for r in range(repeat):
        shift = r % len(CONTENDERS)
        for c in CONTENDERS[shift:] + CONTENDERS[:shift]:
            wall, cpu = measure(c, n, window, gc_off)
            timings[c.name].seconds.append(wall)
            timings[c.name].cpu_seconds.append(cpu)
    return timings


def report_speed(timings: dict[str, Timings], n: int, window: int, repeat: int) -> None:
    base = timings[BASELINE]
    rows = []
    for c in CONTENDERS:
        t = timings[c.name]
        rows.append(
            [
                c.name,
                f"{t.best_us:.2f}",
                f"{t.median_us:.2f}",
                f"{n / t.best / 1000:.0f}k",
                f"{t.best / base.best:.2f}x",
                f"{t.median / base.median:.2f}x",
                c.note,
            ]
        )
    headers = [
        "contender",
        "µs/item best",
        "(median)",
        "items/s best",
        "vs baseline (best)",
        "(median)",
        "note",
    ]
    print(f"\n## speed: N={n:,}, window={window}, {repeat} repeats, interleaved\n")
    print(markdown_table(headers, rows, left=(0, 6)))
    contention = max(t.contention for t in timings.values())
    print(f"\nworst wall/CPU ratio of a run: {contention:.2f}", end="")
    print(" (another process competed for the CPU: trust 'best')" if contention > 1.1 else "")

    def ratio(a: str, b: str) -> tuple[float, float]:
        """time(a) / time(b): (of the bests, of the medians)."""
        return timings[a].best / timings[b].best, timings[a].median / timings[b].median

    vs_base = ratio(RUN_STREAM, BASELINE)
    vs_run_all = ratio(RUN_ALL, RUN_STREAM)
    vs_amap = ratio(AMAP, RUN_STREAM)
    vs_aio = ratio(ASYNCIO, RUN_STREAM)
    print("\ngoals (reported, not enforced; judged on bests, medians in brackets):")
    print(
        goal_line(
            vs_base[0] <= GOAL_VS_BASELINE,
            f"run_stream <= {GOAL_VS_BASELINE}x baseline",
            f"{vs_base[0]:.2f}x [{vs_base[1]:.2f}x]",
        )
    )
    print(
        goal_line(
            min(vs_run_all[0], vs_amap[0]) >= GOAL_VS_AIOMETER,
            f"run_stream >= {GOAL_VS_AIOMETER}x faster than aiometer",
            f"{vs_run_all[0]:.2f}x [{vs_run_all[1]:.2f}x] vs run_all, "
            f"{vs_amap[0]:.2f}x [{vs_amap[1]:.2f}x] vs amap",
        )
    )
    print(
        goal_line(
            vs_aio[0] > 1.0,
            "run_stream faster than the asyncio implementation",
            f"asyncio takes {vs_aio[0]:.2f}x [{vs_aio[1]:.2f}x] run_stream's time",
        )
    )
    vs_index = ratio(ASYNCIO_BY_INDEX, RUN_STREAM)
    vs_completed = ratio(AS_COMPLETED, RUN_STREAM)
    vs_window = ratio(RUN_STREAM_WINDOW, RUN_STREAM)
    print(
        f"  (reference, no goal) asyncio by index takes {vs_index[0]:.2f}x [{vs_index[1]:.2f}x] "
        f"run_stream's time; as_completed {vs_completed[0]:.2f}x [{vs_completed[1]:.2f}x]; "
        f"with a tt.Window {vs_window[0]:.2f}x [{vs_window[1]:.2f}x]"
    )


# --- memory ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Memory:
    n: int
    at_reset: int  # traced bytes right after the warm-up (peak reset there)
    peak: int  # peak traced bytes over the n measured items
    seconds: float  # wall time of the whole run, tracemalloc on


def memory_run(n: int, warmup: int, window: int) -> Memory:
    """Peak traced memory of ``as_completed`` over an unbounded feed, over ``n`` items."""
    at_reset = 0
    peak = 0

    async def main() -> None:
        nonlocal at_reset, peak
        count = 0
        async with tt.as_completed(forever(), trio_run, window=window) as results:
            async for _index, _result in results:
                count += 1
                if count == warmup:
                    gc.collect()
                    tracemalloc.reset_peak()
                    at_reset = tracemalloc.get_traced_memory()[0]
                elif count == warmup + n:
                    peak = tracemalloc.get_traced_memory()[1]
                    break

    gc.collect()
    tracemalloc.start()
    start = time.perf_counter()
    try:
        trio.run(main)
    finally:
        elapsed = time.perf_counter() - start
        tracemalloc.stop()
    return Memory(n, at_reset, peak, elapsed)


def report_memory(small: Memory, large: Memory, window: int, warmup: int) -> None:
    rows = [
        [
            f"{m.n:,}",
            f"{m.at_reset / 1024:.1f}",
            f"{m.peak / 1024:.1f}",
            f"{(m.peak - m.at_reset) / 1024:.1f}",
            f"{m.seconds:.1f}",
            f"{per_item_us(m.seconds, m.n + warmup):.1f}",
        ]
        for m in (small, large)
    ]
    headers = [
        "items measured",
        "KiB at reset",
        "peak KiB",
        "peak - reset KiB",
        "seconds",
        "µs/item (traced)",
    ]
    print(
        f"\n## memory: tt.as_completed over an unbounded feed, window={window}, "
        f"warm-up {warmup:,} items, tracemalloc peak\n"
    )
    print(markdown_table(headers, rows, left=()))
    ratio = large.peak / small.peak
    print("\ngoal (reported, not enforced):")
    print(
        goal_line(
            ratio <= GOAL_MEMORY_RATIO,
            f"peak at {large.n:,} items within 10% of peak at {small.n:,}",
            f"ratio {ratio:.3f}",
        )
    )


# --- command line ----------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.runner",
        description="Per-item overhead of tt.run_stream / tt.as_completed vs a hand-written trio "
        "baseline, aiometer on trio and an asyncio implementation; as_completed's memory over "
        "an unbounded feed.",
    )
    p.add_argument("--n", type=int, help="items per speed run (default 100000; quick: 5000)")
    p.add_argument(
        "--window", type=int, nargs="+", default=[64], help="window(s) to measure (default 64)"
    )
    p.add_argument("--repeat", type=int, help="interleaved repeats (default 5; quick: 3)")
    p.add_argument("--quick", action="store_true", help="small sizes for a smoke run (< 10 s)")
    p.add_argument(
        "--mem-n", type=int, help="items in the large memory run (default 1000000; quick: 20000)"
    )
    p.add_argument(
        "--mem-small", type=int, help="items in the small memory run (default 10000; quick: 2000)"
    )
    p.add_argument("--mem-window", type=int, default=64, help="window of the memory runs")
    p.add_argument("--no-speed", action="store_true", help="skip the speed runs")
    p.add_argument("--no-mem", action="store_true", help="skip the memory runs")
    p.add_argument(
        "--no-gc",
        action="store_true",
        help="disable the cyclic GC during each timed speed run (diagnostic; default: GC on)",
    )
    args = p.parse_args(argv)
    q = args.quick
    args.n = args.n if args.n is not None else (5_000 if q else 100_000)
    args.repeat = args.repeat if args.repeat is not None else (3 if q else 5)
    args.mem_n = args.mem_n if args.mem_n is not None else (20_000 if q else 1_000_000)
    args.mem_small = args.mem_small if args.mem_small is not None else (2_000 if q else 10_000)
    for name in ("n", "repeat", "mem_n", "mem_small", "mem_window"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if any(w < 1 for w in args.window):
        p.error("--window must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    print("# bench.runner")
    print("command: python -m bench.runner " + " ".join(sys.argv[1:] if argv is None else argv))
    for key, value in env_info():
        print(f"{key}: {value}")
    print(
        "timing: wall time of each whole trio.run()/asyncio.run() call (loop start-up "
        f"included, nothing subtracted), gc {'OFF' if args.no_gc else 'on'}, "
        "gc.collect() before each"
    )
    if not args.no_speed:
        for window in args.window:
            timings = speed(args.n, window, args.repeat, args.no_gc)
            report_speed(timings, args.n, window, args.repeat)
    if not args.no_mem:
        warmup = max(10 * args.mem_window, 1000)
        small = memory_run(args.mem_small, warmup, args.mem_window)
        large = memory_run(args.mem_n, warmup, args.mem_window)
        report_memory(small, large, args.mem_window, warmup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
