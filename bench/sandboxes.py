"""What a sandbox costs (issue 34), side by side.

    python -m bench.sandboxes [--n 200] [--turns 100] [--repeat 5] [--quick]

Same process, contenders interleaved across repeats, the figure per contender the median of
its wall time (the work is in other processes: this process's CPU would miss it):

* make + exec ``true`` + destroy, one after another: a bare ``trio.run_process(["true"])``
  (no sandbox at all) against `tt.sandboxes.local()` (a PID namespace per command, limits,
  a work folder) and `tt.sandboxes.bwrap()` (bubblewrap: namespaces, a read-only root
  built per command, a private /work and /tmp);
* a `ToolEnv` turn: a scripted model calls a shell tool (``echo hi``) 5 times, then
  answers; the tool runs in the rollout's box (made before the first turn, as
  ``ToolEnv(sandbox=...)`` makes it), `local` against `bwrap`, and, for reference,
  `tt.tools.shell` with no box of the rollout's (a fresh `local` box per call). The figure
  is per turn, the box's making included (spread over the rollout's turns). Goal: bwrap <=
  1.5x local.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Awaitable, Callable, Iterable

import trio

import trio_tasksets as tt
from trio_tasksets import sandboxes
from trio_tasksets.testing import ScriptedClient, reply

from .common import env_info, goal_line, markdown_table


async def _bare(n: int) -> None:
    for _ in range(n):
        await trio.run_process(["true"])


def _cycle(factory: sandboxes.SandboxFactory) -> Callable[[int], Awaitable[None]]:
    async def run(n: int) -> None:
        for _ in range(n):
            async with sandboxes.open_sandbox(factory) as box:
                result = await box.exec(["true"])
                assert result.returncode == 0, result

    return run


class Echo(tt.Taskset[tt.Task, tt.TasksetConfig]):
    size = 100

    def load(self) -> Iterable[tt.Task]:
        return [tt.Task(f"say hi {i}", answer="hi", key=str(i)) for i in range(self.size)]


TURNS = 5


def _box_shell(box: list[tt.Sandbox]) -> tt.Tool:
    @tt.tool(name="shell")
    async def shell(command: str) -> str:
        """Run a shell command.

        Args:
            command: the command
        """
        result = await box[0].exec(command)
        return (result.stdout + result.stderr).decode()

    return shell


def _turns(factory: sandboxes.SandboxFactory | None) -> Callable[[int], Awaitable[None]]:
    """`n` turns: rollouts of `TURNS` tool calls each, in a box of the rollout's (None:
    `tt.tools.shell`'s own box per call)."""

    async def run(n: int) -> None:
        holder: list[tt.Sandbox] = []
        tool = tt.tools.shell(timeout=30) if factory is None else _box_shell(holder)
        env = tt.ToolEnv(Echo(), [tool], max_turns=TURNS + 1)
        rollouts = max(1, n // TURNS)
        call = reply(tool_calls=[("shell", {"command": "echo hi"})])
        client = ScriptedClient([*([call] * TURNS), reply("hi")] * rollouts)
        ctx = tt.ModelContext(client, "m")
        for task in list(env.taskset)[:rollouts]:
            if factory is None:
                episode = await env.run_slot(tt.RunSlot(task), ctx)
            else:
                async with sandboxes.open_sandbox(factory) as box:
                    holder[:] = [box]
                    episode = await env.run_slot(tt.RunSlot(task), ctx)
            assert episode.ok, episode
            answers = [m["content"] for m in episode.messages if m["role"] == "tool"]
            assert answers == ["hi\n"] * TURNS, answers

    return run


def _interleave(
    contenders: dict[str, Callable[[int], Awaitable[None]]], n: int, repeat: int
) -> dict[str, list[float]]:
    figures: dict[str, list[float]] = {name: [] for name in contenders}
    for run in contenders.values():  # warm up (namespaces probe, page cache)
        trio.run(run, 2)
    for _ in range(repeat):
        for name, run in contenders.items():
            began = time.perf_counter()
            trio.run(run, n)
            figures[name].append((time.perf_counter() - began) / n)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--turns", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.n, args.turns, args.repeat = 40, 20, 3
    args.turns = max(TURNS, args.turns // TURNS * TURNS)
    print(env_info())
    cycles = _interleave(
        {
            "bare trio.run_process(['true'])": _bare,
            "local: make + exec true + destroy": _cycle(sandboxes.local()),
            "bwrap: make + exec true + destroy": _cycle(sandboxes.bwrap()),
        },
        args.n,
        args.repeat,
    )
    base = statistics.median(cycles["bare trio.run_process(['true'])"])
    rows = [
        [name, f"{statistics.median(v) * 1e3:.2f} ms", f"{statistics.median(v) / base:.2f}"]
        for name, v in cycles.items()
    ]
    print(markdown_table(["contender", "median per cycle", "ratio to bare"], rows))
    turns = _interleave(
        {"ToolEnv turn, local box per rollout": _turns(sandboxes.local()),
         "ToolEnv turn, bwrap box per rollout": _turns(sandboxes.bwrap()),
         "ToolEnv turn, tt.tools.shell (a local box per call)": _turns(None)},
        args.turns,
        args.repeat,
    )  # fmt: skip
    local = statistics.median(turns["ToolEnv turn, local box per rollout"])
    bwrap = statistics.median(turns["ToolEnv turn, bwrap box per rollout"])
    print(
        markdown_table(
            ["contender", "median per turn", "ratio to local"],
            [[name, f"{statistics.median(v) * 1e3:.2f} ms", f"{statistics.median(v) / local:.2f}"]
             for name, v in turns.items()],
        )
    )  # fmt: skip
    print(
        goal_line(bwrap <= 1.5 * local, "a bwrap turn <= 1.5x a local one", f"{bwrap / local:.2f}x")
    )


if __name__ == "__main__":
    main()
