"""Agents: the tool loop's CPU per turn, `fan_out`'s cost per child, and the bound it keeps.

Run from the project root: ``python -m bench.agents`` (``--quick`` for a smoke run).

1. **CPU per turn of a 4-turn tool rollout.** The fake OpenAI server
   (`tests/fixtures/chat_server.py --tools --tool-turns 4 --parallel-calls 1`, 0 ms, in a
   process of its own so that its CPU is not counted) answers three turns with one `add`
   tool call each, then the sum. Two contenders drive the same `OpenAIClient` through
   `tt.run_stream` (window 8) over the same tasks: `tt.ToolEnv(...).run_slot` (episode
   records, the schema checks, `fan_out` for the calls, the rows' counts), and a hand-written
   trio loop (send, append the message, `json.loads` each call's arguments, call the tool,
   append its answer). The figure is this process's CPU time (`time.process_time`) per model
   turn; repeats are interleaved and the best is compared. Goal: ToolEnv <= 1.3x the loop.
2. **fan_out per child against a bare nursery.** Many fan-outs of `K` children whose thunk
   is one checkpoint: a bare `trio.open_nursery()` storing results by index, `tt.fan_out`
   outside any window, and `tt.fan_out` inside a run of `tt.run_stream` with a window larger
   than `K` (every child draws a place of the window). Wall time per child, best of the
   interleaved repeats. Goal: fan_out (in a window) <= 2x the bare nursery.
3. **The bound at any depth.** A best-of-8 env (each rollout `fan_out`s 8 model calls) over
   32 tasks at `-c 16` (`tt.run_eval`, `max_concurrent=16`), the server (in threads of this
   process, 200 ms per reply) counting the model calls in flight: with `tt.fan_out` at most
   16, where the same env gathering its 8 calls in a plain nursery keeps 128.

Figures are measured under whatever load the machine has; compare the ratios.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import trio

import trio_tasksets as tt

from .common import env_info, goal_line, markdown_table

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
sys.path.insert(0, str(FIXTURES))

from chat_server import ChatServer  # noqa: E402

GOAL_LOOP = 1.3
GOAL_FAN_OUT = 2.0
TURNS = 4


# --- 1. the tool loop -----------------------------------------------------------------------


@tt.tool
async def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


class Sums(tt.Taskset[tt.Task, tt.TasksetConfig]):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def load(self) -> list[tt.Task]:
        return [tt.Task(f"What is {i} + {i + 1}?", answer=str(2 * i + 1)) for i in range(self.n)]


async def hand_loop(task: tt.Task, ctx: tt.ModelContext) -> tuple[list[dict[str, Any]], str]:
    """The same conversation, written by hand."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": task.prompt}]
    tools = [add.schema]
    while True:
        reply = await ctx.chat(messages, tools=tools)
        messages.append(reply.message)
        if not reply.tool_calls:
            return messages, reply.content
        for call in reply.tool_calls:
            arguments = json.loads(call.raw_arguments)
            result = await add.fn(**arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})


def start_server() -> tuple[subprocess.Popen[str], str]:
    server = subprocess.Popen(
        [sys.executable, str(FIXTURES / "chat_server.py"), "--tools", "--tool-turns",
         str(TURNS), "--parallel-calls", "1"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert server.stdout is not None
    url = server.stdout.readline().strip()
    if not url.startswith("http://127.0.0.1:"):
        server.kill()
        raise RuntimeError(f"the chat server did not start (said {url!r})")
    return server, url


async def tool_rollouts(name: str, url: str, n: int) -> float:
    """CPU seconds of `n` rollouts by contender `name` (the check that they went right
    included)."""
    taskset = Sums(n)
    env = tt.ToolEnv(taskset, [add], max_turns=TURNS + 1)
    async with tt.OpenAIClient(url, max_retries=0) as client:
        ctx = tt.ModelContext(client, "m")
        tasks = list(taskset)

        async def source() -> AsyncIterator[tt.Task]:
            for task in tasks:
                yield task

        async def by_env(task: tt.Task) -> tuple[float, int]:
            episode = await env.run_slot(tt.RunSlot(task), ctx)
            return episode.reward, episode.turns

        async def by_hand(task: tt.Task) -> tuple[float, int]:
            messages, completion = await hand_loop(task, ctx)
            turns = sum(1 for m in messages if m["role"] == "assistant")
            return (1.0 if task.answer and task.answer in completion else 0.0), turns

        run = by_env if name == "ToolEnv" else by_hand
        await tt.run_stream(source(), run, window=8)  # warm the connections
        gc.collect()
        start = time.process_time()
        results = await tt.run_stream(source(), run, window=8)
        cpu = time.process_time() - start
    if results != [(1.0, TURNS)] * n:
        raise RuntimeError(f"{name}: wrong rollouts: {results[:3]}")
    return cpu


# --- 2. fan_out per child -------------------------------------------------------------------


async def child() -> int:
    await trio.lowlevel.checkpoint()
    return 1


async def bare(thunks: list[Callable[[], Awaitable[int]]]) -> list[int]:
    results = [0] * len(thunks)

    async def one(i: int, thunk: Callable[[], Awaitable[int]]) -> None:
        results[i] = await thunk()

    async with trio.open_nursery() as nursery:
        for i, thunk in enumerate(thunks):
            nursery.start_soon(one, i, thunk)
    return results


def fan_out_wall(kind: str, k: int, rounds: int) -> float:
    """Seconds of `rounds` fan-outs of `k` children (inside one trio.run, its start-up not
    counted)."""
    thunks = [child] * k
    elapsed = 0.0

    async def rounds_of(fn: Callable[[list[Any]], Coroutine[Any, Any, list[int]]]) -> None:
        nonlocal elapsed
        start = time.perf_counter()
        for _ in range(rounds):
            assert sum(await fn(thunks)) == k
        elapsed = time.perf_counter() - start

    async def main() -> None:
        if kind == "bare nursery":
            await rounds_of(bare)
        elif kind == "fan_out, no window":
            await rounds_of(tt.fan_out)
        else:

            async def one() -> AsyncIterator[int]:
                yield 0

            await tt.run_stream(one(), lambda _: rounds_of(tt.fan_out), window=k + 1)

    gc.collect()
    trio.run(main)
    return elapsed


FAN_OUT_KINDS = ("bare nursery", "fan_out, no window", "fan_out in a window")


# --- 3. the bound ---------------------------------------------------------------------------


class BestOf8(tt.Env[tt.Task]):
    """Eight attempts per rollout through `tt.fan_out`: on the eval's window."""

    async def rollout(self, task: tt.Task, ctx: tt.ModelContext) -> tuple[list[Any], str]:
        messages = [{"role": "user", "content": task.prompt}]
        replies = await tt.fan_out([lambda: ctx.chat(messages)] * 8)
        return messages, replies[0].content


class Gathered(tt.Env[tt.Task]):
    """The same eight attempts in a plain nursery: outside the window."""

    async def rollout(self, task: tt.Task, ctx: tt.ModelContext) -> tuple[list[Any], str]:
        messages = [{"role": "user", "content": task.prompt}]
        replies: list[tt.Completion] = []

        async def attempt() -> None:
            replies.append(await ctx.chat(messages))

        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(attempt)
        return messages, replies[0].content


async def peak_calls(env_cls: type[tt.Env[tt.Task]], n: int, delay: float) -> tuple[int, float]:
    with ChatServer(delay=delay) as server, tempfile.TemporaryDirectory() as out:
        async with tt.OpenAIClient(server.url, max_retries=0) as client:
            config = tt.EvalConfig(max_concurrent=16, output_dir=out, run_name="b", dashboard=False)
            start = time.perf_counter()
            result = await tt.run_eval(env_cls(Sums(n)), tt.ModelContext(client, "m"), config)
            wall = time.perf_counter() - start
        if result.summary["ok"] != n or len(server.requests) != 8 * n:
            raise RuntimeError(f"{env_cls.__name__}: {result.summary}")
        return server.peak, wall


# --- the driver -----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.agents", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    p.add_argument("--repeat", type=int, help="interleaved repeats (default 5; quick 2)")
    args = p.parse_args(argv)
    repeat = args.repeat or (2 if args.quick else 5)
    n = 20 if args.quick else 100
    k, rounds = (100, 50) if args.quick else (100, 500)

    print("# bench.agents\n")
    print(markdown_table(["", ""], env_info()))

    server, url = start_server()
    try:
        cpu: dict[str, list[float]] = {"ToolEnv": [], "hand-written loop": []}
        for r in range(repeat):
            order = list(cpu) if r % 2 == 0 else list(reversed(cpu))
            for name in order:
                cpu[name].append(trio.run(tool_rollouts, name, url, n))
    finally:
        server.kill()
        server.wait()
    turns = n * TURNS
    best = {name: min(values) / turns * 1e6 for name, values in cpu.items()}
    print(f"\n## 1. a {TURNS}-turn tool rollout: CPU per model turn ({n} rollouts, window 8)\n")
    print(markdown_table(
        ["contender", "best µs CPU/turn", "median µs CPU/turn"],
        [(name, f"{best[name]:.0f}", f"{sorted(v)[len(v) // 2] / turns * 1e6:.0f}")
         for name, v in cpu.items()],
    ))  # fmt: skip
    ratio = best["ToolEnv"] / best["hand-written loop"]
    print(goal_line(ratio <= GOAL_LOOP, f"ToolEnv <= {GOAL_LOOP}x the loop", f"{ratio:.2f}x"))

    walls: dict[str, list[float]] = {kind: [] for kind in FAN_OUT_KINDS}
    for r in range(repeat):
        kinds = FAN_OUT_KINDS[r % 3 :] + FAN_OUT_KINDS[: r % 3]
        for kind in kinds:
            walls[kind].append(fan_out_wall(kind, k, rounds))
    per = {kind: min(v) / (k * rounds) * 1e6 for kind, v in walls.items()}
    print(f"\n## 2. fan_out per child ({rounds} fan-outs of {k} one-checkpoint children)\n")
    print(markdown_table(
        ["contender", "best µs/child", "vs bare nursery"],
        [(kind, f"{per[kind]:.2f}", f"{per[kind] / per['bare nursery']:.2f}x")
         for kind in FAN_OUT_KINDS],
    ))  # fmt: skip
    windowed = per["fan_out in a window"] / per["bare nursery"]
    print(goal_line(
        windowed <= GOAL_FAN_OUT, f"fan_out in a window <= {GOAL_FAN_OUT}x a bare nursery",
        f"{windowed:.2f}x (no window: {per['fan_out, no window'] / per['bare nursery']:.2f}x)",
    ))  # fmt: skip

    tasks = 32
    rows = []
    peaks = {}
    for env_cls in (BestOf8, Gathered):
        peak, wall = trio.run(peak_calls, env_cls, tasks, 0.2)
        peaks[env_cls] = peak
        rows.append((env_cls.__name__, env_cls.__doc__ or "", str(peak), f"{wall:.2f}"))
    print(f"\n## 3. best-of-8 over {tasks} tasks at -c 16: model calls in flight at the server\n")
    print(markdown_table(["env", "how", "peak in flight", "wall s"], rows))
    print(goal_line(
        peaks[BestOf8] <= 16 and peaks[Gathered] == 128,
        "fan_out keeps <= 16; the plain gather 128",
        f"{peaks[BestOf8]} vs {peaks[Gathered]}",
    ))  # fmt: skip


if __name__ == "__main__":
    main()
