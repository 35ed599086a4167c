"""Rollouts that live through a policy update (issue 33): synchronous training against
`tt.Policy` updates in `wait`, `keep` and `abort` mode, at max staleness 1 and 2.

    python -m bench.async_rl [--steps 12] [--quick]

A simulated engine (`trio_tasksets.testing.SimulatedEngine`, on trio's MockClock: virtual
time, so the figures are exact and the same on any machine): reply lengths drawn from a
lognormal (mean 256 tokens, sigma 1: a long tail), 20 ms a token per request, at most 64
requests decoding at once (the rest queue). A trainer takes batches of 8 groups of 8
rollouts; each step takes 4 s and then updates the policy (its weights pushed: 0.5 s).

* ``synchronous``: the trainer waits for every rollout of a batch; the engine idles while
  it trains.
* ``wait`` / ``keep`` / ``abort`` at max staleness 1 and 2: the rollouts run on while the
  trainer trains (`tt.batches` over a window of 16 groups, `tt.Staleness(max_lag,
  policy=...)`), and each update is `policy.update(step, mode=...)`.

Figure: accepted tokens per second of the run (the tokens of the rollouts of the batches
the trainer took, over the run's virtual time). Goals: the best asynchronous mode >= 2x
synchronous; 0 tokens thrown away by `abort` (`policy.discarded_tokens`: a cut call that
could not continue); the tokens thrown away by the staleness gate (rollouts cancelled as
stale) are shown too.

Then the gate's own cost: the same asynchronous run with no update (process CPU time of a
run on the MockClock: pure Python), with and without a `tt.Policy` on the model context.
Goal: <= 3 % more. Best and median of `--repeat` runs, interleaved. And as a user sees it:
an eval-shaped run (`tt.run_stream` of `ModelContext.chat` calls, 64 in flight) against a
real HTTP server in another process (the tests' fake OpenAI server,
`tests/fixtures/chat_server.py`: short replies, the client's work per call at its least), with and without `policy=`,
alternated: calls a second and the client's CPU per call.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import AsyncIterator
from typing import Any

import attrs
import orjson
import trio
import trio.testing

import trio_tasksets as tt
from trio_tasksets.testing import SimulatedEngine

from .verifiers import start_server

GROUP = 8  # rollouts of a group
BATCH = 8  # groups a step trains on
STEP = 4.0  # seconds of a trainer step
LOAD = 0.5  # seconds of a weight push
WINDOW = 16  # groups in flight, asynchronous


@attrs.define
class Outcome:
    name: str
    seconds: float
    accepted: int
    generated: int
    discarded_by_abort: int = 0
    cut: int = 0
    stale_cancelled: int = 0
    stale_dropped: int = 0

    @property
    def rate(self) -> float:
        return self.accepted / self.seconds


def engine() -> SimulatedEngine:
    return SimulatedEngine(
        decode_time=0.02, mean_tokens=256, sigma=1.0, longest=4096, max_running=64, seed=7
    )


async def _groups() -> AsyncIterator[int]:
    number = 0
    while True:
        yield number
        number += 1


async def run_group(ctx: tt.ModelContext, number: int) -> int:
    """One group: its rollouts at once; the tokens they made."""
    tokens = [0] * GROUP

    async def rollout(index: int) -> None:
        reply = await ctx.chat([{"role": "user", "content": f"task {number} sample {index}"}])
        tokens[index] = reply.usage.get("completion_tokens", 0)

    async with trio.open_nursery() as nursery:
        for index in range(GROUP):
            nursery.start_soon(rollout, index)
    return sum(tokens)


async def synchronous(steps: int) -> Outcome:
    sim = engine()
    ctx = tt.ModelContext(sim, "sim")
    accepted = 0
    start = trio.current_time()
    for step in range(steps):
        async with trio.open_nursery() as nursery:
            done: list[int] = []

            async def one(number: int, done: list[int] = done) -> None:
                done.append(await run_group(ctx, number))

            for number in range(step * BATCH, (step + 1) * BATCH):
                nursery.start_soon(one, number)
        accepted += sum(done)
        await trio.sleep(STEP + LOAD)  # the engine idles: train, then push the weights
    return Outcome("synchronous", trio.current_time() - start, accepted, sim.generated)


async def asynchronous(steps: int, mode: str, max_lag: int) -> Outcome:
    sim = engine()
    policy = tt.Policy(0, engines=[sim])
    staleness = tt.Staleness(max_lag, policy=policy)
    ctx = tt.ModelContext(sim, "sim", policy=policy)
    accepted = 0
    start = trio.current_time()

    async def run(number: int) -> int:
        return await run_group(ctx, number)

    async def load() -> None:
        await trio.sleep(LOAD)

    async with tt.batches(BATCH, _groups(), run, window=WINDOW, staleness=staleness) as feed:
        step = 0
        async for batch in feed:
            accepted += sum(batch)
            await trio.sleep(STEP)
            step += 1
            await policy.update(step, mode=mode, load=load)  # type: ignore[arg-type]
            if step == steps:
                break
    name = f"{mode}, max staleness {max_lag}"
    return Outcome(
        name,
        trio.current_time() - start,
        accepted,
        sim.generated,
        discarded_by_abort=policy.discarded_tokens,
        cut=policy.cut,
        stale_cancelled=staleness.cancelled,
        stale_dropped=staleness.dropped,
    )


def virtual(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return trio.run(lambda: fn(*args, **kwargs), clock=trio.testing.MockClock(autojump_threshold=0))


async def idle(steps: int, gated: bool) -> tuple[int, float]:
    """The asynchronous run with no update (no staleness gate either: nothing would advance
    it), its model context with a `tt.Policy` (`gated`) or without: the gate's own cost."""
    sim = engine()
    ctx = tt.ModelContext(sim, "sim", policy=tt.Policy(0, engines=[sim]) if gated else None)
    accepted = 0
    start = trio.current_time()

    async def run(number: int) -> int:
        return await run_group(ctx, number)

    async with tt.batches(BATCH, _groups(), run, window=WINDOW) as feed:
        step = 0
        async for batch in feed:
            accepted += sum(batch)
            await trio.sleep(STEP)
            step += 1
            if step == steps:
                break
    return accepted, trio.current_time() - start


_REPLY = orjson.dumps({
    "choices": [{"message": {"role": "assistant", "content": "word " * 256},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 20, "completion_tokens": 256},
})  # fmt: skip


async def http_calls(calls: int, gated: bool) -> None:
    """`calls` model calls through an `OpenAIClient` whose transport answers in memory (the
    whole client path but the socket): the CPU of a model call, with or without the gate."""
    http = tt.HTTPClient(handler=lambda request: tt.Response(200, [], _REPLY))
    client = tt.OpenAIClient("http://engine.invalid/v1", http_client=http)
    ctx = tt.ModelContext(client, "m", policy=tt.Policy(0) if gated else None)
    messages = [{"role": "user", "content": "tell me a story"}]
    for _ in range(calls):
        await ctx.chat(messages)


SERVED_WINDOW = 64  # calls in flight, served


async def served(url: str, calls: int, gated: bool) -> tuple[float, float]:
    """`calls` model calls, `SERVED_WINDOW` in flight (`tt.run_stream`), through an
    `OpenAIClient` to the server at `url`, under a `tt.Policy` (`gated`) or not, after a
    warm-up: (wall seconds, process CPU seconds)."""
    sampling = tt.Sampling(max_tokens=16)
    async with tt.OpenAIClient(url, max_retries=0) as client:
        ctx = tt.ModelContext(client, "m", sampling, policy=tt.Policy(0) if gated else None)
        messages = [{"role": "user", "content": "What is 1 + 2?"}]

        async def source(n: int) -> AsyncIterator[int]:
            for i in range(n):
                yield i

        async def call(_: int) -> tt.Completion:
            return await ctx.chat(messages)

        await tt.run_stream(source(SERVED_WINDOW * 2), call, window=SERVED_WINDOW)  # warm
        gc.collect()
        wall, cpu = time.perf_counter(), time.process_time()
        await tt.run_stream(source(calls), call, window=SERVED_WINDOW)
        return time.perf_counter() - wall, time.process_time() - cpu


def _cpu(fn: Any, *args: Any, **kwargs: Any) -> float:
    """The process CPU time of one virtual run (less disturbed than the wall clock by other
    work on a shared machine)."""
    gc.collect()
    began = time.process_time()
    virtual(fn, *args, **kwargs)
    return time.process_time() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a smoke run (CI)")
    args = parser.parse_args()
    steps, repeat = (3, 1) if args.quick else (args.steps, args.repeat)

    print(f"async RL, virtual time: {steps} steps of {BATCH} groups x {GROUP} rollouts, "
          f"step {STEP:g} s + load {LOAD:g} s, lognormal lengths (mean 256, sigma 1), "
          f"20 ms/token, 64 decoding at once")  # fmt: skip
    results = [virtual(synchronous, steps)]
    for max_lag in (1, 2):
        for mode in ("wait", "keep", "abort"):
            results.append(virtual(asynchronous, steps, mode, max_lag))
    base = results[0].rate
    print(f"{'run':<26}{'seconds':>9}{'accepted tok/s':>16}{'vs sync':>9}"
          f"{'cut':>6}{'lost (abort)':>14}{'stale: cut/dropped':>20}{'made, unused':>14}")  # fmt: skip
    for r in results:
        stale = f"{r.stale_cancelled}/{r.stale_dropped}"
        print(f"{r.name:<26}{r.seconds:>9.1f}{r.rate:>16.0f}{r.rate / base:>8.2f}x"
              f"{r.cut:>6}{r.discarded_by_abort:>14}{stale:>20}"
              f"{r.generated - r.accepted:>14}")  # fmt: skip
    best = max(results[1:], key=lambda r: r.rate)
    lost = sum(r.discarded_by_abort for r in results if r.name.startswith("abort"))
    print(f"best asynchronous: {best.name}, {best.rate / base:.2f}x synchronous "
          f"(goal >= 2x: {'met' if best.rate / base >= 2 else 'NOT met'}); "
          f"tokens thrown away by abort: {lost} (goal 0)")  # fmt: skip

    # trio runs the tasks ready at once in a random order, so a run's schedule varies a
    # little from run to run: the gate adds no time if its runs fall within that spread
    plain_runs = [virtual(idle, steps, False) for _ in range(3)]
    gated_runs = [virtual(idle, steps, True) for _ in range(3)]
    low, high = min(s for _, s in plain_runs), max(s for _, s in plain_runs)
    glow, ghigh = min(s for _, s in gated_runs), max(s for _, s in gated_runs)
    same = glow <= high and low <= ghigh
    print(f"a run with no update, virtual seconds over 3 runs: {low:.2f}-{high:.2f} without "
          f"the gate, {glow:.2f}-{ghigh:.2f} with (trio's random order of ready tasks): "
          f"{'the same spread' if same else 'NOT the same'}")  # fmt: skip
    gated_idle: list[float] = []
    plain_idle: list[float] = []
    for _ in range(max(repeat, 1)):
        plain_idle.append(_cpu(idle, steps, False))
        gated_idle.append(_cpu(idle, steps, True))
    ratio = statistics.median(gated_idle) / statistics.median(plain_idle)
    print(f"the gate's cost, no update, a run on the simulated engine (CPU time of a virtual "
          f"run, best / median of {len(gated_idle)}): no policy {min(plain_idle) * 1000:.0f} / "
          f"{statistics.median(plain_idle) * 1000:.0f} ms, policy "
          f"{min(gated_idle) * 1000:.0f} / {statistics.median(gated_idle) * 1000:.0f} ms: "
          f"{ratio:.3f}x on medians, {min(gated_idle) / min(plain_idle):.3f}x on bests")  # fmt: skip
    calls = 500 if args.quick else 5000
    gated_http: list[float] = []
    plain_http: list[float] = []
    for _ in range(max(repeat, 1)):
        plain_http.append(_cpu(http_calls, calls, False) / calls)
        gated_http.append(_cpu(http_calls, calls, True) / calls)
    plain_us, gated_us = statistics.median(plain_http) * 1e6, statistics.median(gated_http) * 1e6
    print(f"the gate's cost per model call through OpenAIClient (its transport in memory, 256 "
          f"tokens a reply; median of {len(gated_http)}): {plain_us:.1f} us without, "
          f"{gated_us:.1f} us with: {gated_us / plain_us:.3f}x, {gated_us - plain_us:+.1f} us "
          f"a call (no socket: the client's work at its least)")  # fmt: skip

    server, url = start_server(0.0)  # the tests' fake OpenAI server, its own process
    try:
        calls = 1000 if args.quick else 5000
        runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for _ in range(max(repeat, 1)):
            for gated in (False, True):
                runs[gated].append(trio.run(served, url, calls, gated))
    finally:
        server.terminate()
        server.wait()
    rate = {g: statistics.median(calls / wall for wall, _ in r) for g, r in runs.items()}
    cpu = {g: statistics.median(c / calls * 1e6 for _, c in r) for g, r in runs.items()}
    print(f"the gate's cost as a user sees it: {calls} calls, {SERVED_WINDOW} in flight, to a "
          f"real HTTP server in another process (median of {len(runs[True])}, alternated): "
          f"{rate[False]:.0f} calls/s without, {rate[True]:.0f} with ({rate[True] / rate[False]:.3f}x); "
          f"client CPU {cpu[False]:.1f} us a call without, {cpu[True]:.1f} with "
          f"({cpu[True] / cpu[False]:.3f}x, {cpu[True] - cpu[False]:+.1f} us; goal <= 1.03x)")  # fmt: skip


if __name__ == "__main__":
    main()
