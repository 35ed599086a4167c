"""`--stall-timeout S` / `Env(stall_timeout=S)` and `tt.StalledError`, and
`--max-consecutive-failures N` (SPEC 12). On the autojump clock."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import forkserver
import pytest
import trio
import trio.testing

import trio_tasksets as tt
from trio_tasksets._core.limits import parked, report_progress
from trio_tasksets._models import ModelContext
from trio_tasksets._monitor.dashboard import Progress


class Some(tt.Taskset[tt.Task, tt.TasksetConfig]):
    def load(self) -> list[tt.Task]:
        return [tt.Task(f"say {i}", answer=f"say {i}") for i in range(20)]


CTX = ModelContext(tt.EchoClient(), "echo")


async def _one(env: tt.Env[Any]) -> tt.Episode:
    return await env.run_slot(tt.RunSlot(tt.Task("hi", answer="hi")), CTX)


class HangsOnce(tt.Env[tt.Task]):
    """The first attempt gets a reply, then waits forever on something of its own."""

    attempts = 0

    async def rollout(self, task: tt.Task, ctx: ModelContext) -> tuple[list[Any], str]:
        type(self).attempts += 1
        first = type(self).attempts == 1
        reply = await ctx.chat([{"role": "user", "content": task.prompt}])
        if first:
            await trio.sleep_forever()
        return [], reply.content


async def test_a_stalled_attempt_is_cancelled_as_stalled_error_and_retried(
    autojump_clock: trio.testing.MockClock,
) -> None:
    HangsOnce.attempts = 0
    policy = tt.RetryPolicy(max_retries=1, backoff=0.0)
    env = HangsOnce(Some(), stall_timeout=10.0, retries=policy)
    start = trio.current_time()
    episode = await _one(env)
    assert trio.current_time() - start == pytest.approx(10.0)
    assert episode.ok
    assert [e.type for e in episode.errors] == ["StalledError"]
    assert "10s" in episode.errors[0].message
    assert issubclass(tt.StalledError, TimeoutError)


async def test_without_retries_a_stall_fails_the_episode(
    autojump_clock: trio.testing.MockClock,
) -> None:
    class Hangs(tt.Env[tt.Task]):
        async def rollout(self, task: tt.Task, ctx: ModelContext) -> tuple[list[Any], str]:
            await trio.sleep_forever()
            raise AssertionError  # pragma: no cover

    episode = await _one(Hangs(Some(), stall_timeout=5.0))
    assert not episode.ok
    assert [e.type for e in episode.errors] == ["StalledError"]


async def test_progress_keeps_a_slow_rollout_alive_and_parked_time_is_no_stall(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Calls that each finish within the stall timeout (model replies, tool calls that
    report progress), and a 300 s wait on the runner's own limiters, are no stall."""

    class Slow(tt.Env[tt.Task]):
        async def rollout(self, task: tt.Task, ctx: ModelContext) -> tuple[list[Any], str]:
            for _ in range(5):
                await ctx.chat([{"role": "user", "content": "hi"}])
                await trio.sleep(8.0)  # a tool call of 8 s
                report_progress()
            with parked("rpm"):
                await trio.sleep(300.0)
            await trio.sleep(8.0)
            return [], "done"

    start = trio.current_time()
    episode = await _one(Slow(Some(), stall_timeout=10.0))
    assert (episode.ok, episode.errors) == (True, [])
    assert trio.current_time() - start == pytest.approx(348.0)


async def test_the_dashboard_names_stalls(tmp_path: Path) -> None:
    progress = Progress(title="run")
    assert progress.health_text() is None
    progress.stalled = 2
    assert "2 stalled (StalledError)" in progress.line()


async def test_an_eval_counts_stalls_on_its_dashboard(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    HangsOnce.attempts = 0
    env = HangsOnce(Some(), stall_timeout=3.0, retries=tt.RetryPolicy(1, backoff=0.0))
    lines: list[str] = []
    config = tt.EvalConfig(output_dir=str(tmp_path), run_name="run", dashboard=False,
                           num_examples=2)  # fmt: skip
    import trio_tasksets._monitor.dashboard as dashboard

    original = dashboard.Progress.line

    def spy(self: Progress) -> str:
        line = original(self)
        lines.append(line)
        return line

    dashboard.Progress.line = spy  # type: ignore[method-assign]
    try:
        result = await tt.run_eval(env, CTX, config)
    finally:
        dashboard.Progress.line = original  # type: ignore[method-assign]
    assert result.summary["ok"] == 2
    assert sorted([e.type for e in ep.errors] for ep in result.episodes) == [[], ["StalledError"]]
    assert "1 stalled (StalledError)" in lines[-1]


class Fails(tt.Env[tt.Task]):
    """Every episode fails but those whose prompt is in `good`."""

    good: frozenset[str] = frozenset()

    async def rollout(self, task: tt.Task, ctx: ModelContext) -> tuple[list[Any], str]:
        await trio.sleep(1.0)
        if task.prompt not in self.good:
            raise ConnectionError("the service is down")
        return [], task.prompt


async def test_max_consecutive_failures_stops_the_run(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    config = tt.EvalConfig(output_dir=str(tmp_path), run_name="run", dashboard=False,
                           max_concurrent=1, max_consecutive_failures=4)  # fmt: skip
    result = await tt.run_eval(Fails(Some()), CTX, config)
    summary = result.summary
    assert summary["stopped"] == "max_consecutive_failures"
    assert summary["finished"] == 4
    assert summary["error"].startswith("max_consecutive_failures 4: 4 episodes failed in a row")
    assert "ConnectionError: the service is down" in summary["error"]


async def test_a_success_resets_the_count(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    env = Fails(Some())
    env.good = frozenset({f"say {i}" for i in range(0, 20, 3)})  # fails 2 in a row at most
    config = tt.EvalConfig(output_dir=str(tmp_path), run_name="run", dashboard=False,
                           max_concurrent=1, max_consecutive_failures=3)  # fmt: skip
    result = await tt.run_eval(env, CTX, config)
    assert result.summary["stopped"] is None
    assert result.summary["finished"] == 20


async def test_max_consecutive_failures_is_checked(tmp_path: Path) -> None:
    for bad in (0, -2, 1.5, True):
        with pytest.raises(tt.EvalConfigError, match="max_consecutive_failures") as info:
            tt.EvalConfig(output_dir=str(tmp_path), max_consecutive_failures=bad)  # type: ignore[arg-type]
        assert info.value.parameter == "max_consecutive_failures"


def test_cli_max_consecutive_failures_exits_1(tmp_path: Path) -> None:
    taskset = tmp_path / "failing.py"
    taskset.write_text(
        "import trio_tasksets as tt\n"
        "class Failing(tt.Taskset):\n"
        "    def load(self):\n"
        "        return [tt.Task(f'q{i}') for i in range(50)]\n"
        "    def reward(self, task, completion):\n"
        "        raise KeyError('scor')\n"
    )
    argv = [sys.executable, "-m", "trio_tasksets", "eval", f"{taskset}:Failing", "-c", "1",
            "--max-consecutive-failures", "3", "-o", str(tmp_path / "out"), "--run-name",
            "run", "--no-dashboard", "--stall-timeout", "30"]  # fmt: skip
    done = forkserver.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert "--max-consecutive-failures 3: 3 episodes failed in a row" in done.stderr
    summary = json.loads((tmp_path / "out" / "run" / "summary.json").read_text())
    assert summary["finished"] == 3
    config = json.loads((tmp_path / "out" / "run" / "config.json").read_text())
    assert config["limits"]["stall_timeout"] == 30.0
