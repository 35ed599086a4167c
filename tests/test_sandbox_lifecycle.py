"""A box for each rollout (SPEC 14): made on first use, destroyed when its scope ends however
it ends, admitted by its own window.

The boxes here are `MemoryBox`es (a dict of files, `exec` answering from a function): the
lifecycle and the admission are the env's, whatever the backend; the backends themselves
have their own conformance suite. Everything runs on trio's MockClock.
"""

from __future__ import annotations

import functools
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import pytest
import trio

import trio_tasksets as tt
from trio_tasksets._env.boxes import HostPressure, Pressure, SandboxAdmission, Sandboxes
from trio_tasksets.sandboxes import (
    ExecResult,
    NoSandboxError,
    SandboxStartError,
    current_or_none,
    using,
)
from trio_tasksets.testing import ScriptedClient, reply


class MemoryBox:
    """A box in memory: files in a dict; `exec` runs `run(argv)` (default: exit 0)."""

    def __init__(self, maker: Maker, number: int) -> None:
        self.maker = maker
        self.number = number
        self.files: dict[str, bytes] = {}
        self.closed = False

    # duplicates: Sandbox.exec's signature (SPEC 14), which this fake implements
    async def exec(
        self,
        command: str | Sequence[str],
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (the tt.Sandbox protocol's)
        input: bytes | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> ExecResult:
        assert not self.closed, "exec on a closed box"
        await trio.sleep(self.maker.exec_time)
        return ExecResult(0, f"box {self.number}".encode(), b"", False)

    async def read_file(self, path: str) -> bytes:
        assert not self.closed
        if path.startswith("/") or ".." in path.split("/"):
            raise PermissionError(f"{path!r} is outside the work folder")
        return self.files[path]

    async def write_file(self, path: str, data: bytes) -> None:
        assert not self.closed
        if path.startswith("/") or ".." in path.split("/"):
            raise PermissionError(f"{path!r} is outside the work folder")
        self.files[path] = data

    async def aclose(self) -> None:
        await trio.sleep(self.maker.close_time)
        self.closed = True
        self.maker.alive -= 1


class Maker:
    """A sandbox factory of `MemoryBox`es that counts them: made, alive, at most alive."""

    def __init__(
        self, *, make_time: float = 0.0, exec_time: float = 0.0, close_time: float = 0.0
    ) -> None:
        self.make_time = make_time
        self.exec_time = exec_time
        self.close_time = close_time
        self.boxes: list[MemoryBox] = []
        self.alive = 0
        self.peak = 0
        self.fail_next = 0

    async def __call__(self) -> MemoryBox:
        await trio.sleep(self.make_time)
        if self.fail_next:
            self.fail_next -= 1
            raise OSError("no room for a box")
        box = MemoryBox(self, len(self.boxes))
        self.boxes.append(box)
        self.alive += 1
        self.peak = max(self.peak, self.alive)
        return box


class Tasks(tt.Taskset[tt.Task, tt.TasksetConfig]):
    def __init__(self, count: int = 1) -> None:
        super().__init__()
        self.count = count

    def load(self) -> list[tt.Task]:
        return [tt.Task(f"task {i}", answer="ok", key=f"t{i}") for i in range(self.count)]


@tt.tool
async def run(command: str) -> str:
    """Run a command in the rollout's sandbox.

    Args:
        command: the command
    """
    result = await tt.current_sandbox().exec(command)
    return result.stdout.decode()


def tool_then_done(messages: list[dict[str, Any]], tools: Any) -> tt.Completion:
    """One tool call, then the final answer."""
    if messages[-1]["role"] == "tool":
        return tt.Completion("ok")
    return reply(tool_calls=[("run", {"command": "true"})])


def ctx(client: tt.ModelClient) -> tt.ModelContext:
    return tt.ModelContext(client, "m")


async def slots_of(env: tt.Env[Any]) -> AsyncIterator[tt.RunSlot[Any]]:
    for task in env.taskset:
        yield tt.RunSlot(task)


async def run_all(env: tt.Env[Any], client: tt.ModelClient, *, window: int = 64) -> list[Any]:
    return await tt.run_stream(
        slots_of(env), lambda slot: env.run_slot(slot, ctx(client)), window=window
    )


# --- the scope: made on first use, destroyed at its end ------------------------------------


async def test_a_box_per_rollout_is_made_on_first_use_and_closed_when_it_ends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    maker = Maker(make_time=0.5, close_time=0.1)
    env = tt.ToolEnv(Tasks(3), [run], sandbox=maker)
    episodes = await run_all(env, ScriptedClient(tool_then_done))
    assert all(e.ok for e in episodes)
    assert len(maker.boxes) == 3
    assert all(box.closed for box in maker.boxes)
    answers = {e.messages[2]["content"] for e in episodes}
    assert answers == {"box 0", "box 1", "box 2"}  # each rollout its own box
    assert maker.alive == 0


async def test_a_rollout_that_never_uses_its_box_makes_none(
    autojump_clock: trio.testing.MockClock,
) -> None:
    maker = Maker()
    env = tt.ToolEnv(Tasks(2), [run], sandbox=maker)
    episodes = await run_all(env, ScriptedClient("ok"))
    assert all(e.ok for e in episodes)
    assert maker.boxes == []


async def test_the_reward_runs_in_the_rollouts_box_before_it_is_closed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    maker = Maker()
    written: list[bytes] = []

    @tt.tool
    async def save(text: str) -> str:
        """Save the text.

        Args:
            text: what to save
        """
        await tt.current_sandbox().write_file("answer.txt", text.encode())
        return "saved"

    async def reward(task: tt.Task, completion: str) -> float:
        data = await tt.current_sandbox().read_file("answer.txt")
        written.append(data)
        return float(data == b"42")

    def script(messages: list[dict[str, Any]], tools: Any) -> tt.Completion:
        if messages[-1]["role"] == "tool":
            return tt.Completion("done")
        return reply(tool_calls=[("save", {"text": "42"})])

    env = tt.ToolEnv(Tasks(1), [save], sandbox=maker, reward=reward)
    [episode] = await run_all(env, ScriptedClient(script))
    assert episode.ok
    assert episode.reward == 1.0
    assert written == [b"42"]
    assert len(maker.boxes) == 1
    assert maker.boxes[0].closed


async def test_a_failed_attempt_closes_its_box_and_the_retry_gets_a_fresh_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    maker = Maker()
    calls = 0

    async def reward(task: tt.Task, completion: str) -> float:
        nonlocal calls
        calls += 1
        box = tt.current_sandbox()
        await box.write_file("x", b"1")
        if calls == 1:
            raise RuntimeError("the tests crashed")
        return 1.0

    env = tt.ToolEnv(Tasks(1), [run], sandbox=maker, reward=reward, retries=tt.RetryPolicy(1))
    [episode] = await run_all(env, ScriptedClient("ok"))
    assert episode.ok
    assert episode.attempts == 2
    assert len(maker.boxes) == 2
    assert all(box.closed for box in maker.boxes)


@pytest.mark.parametrize("how", ["deadline", "cancel", "first", "fail-fast", "policy update"])
async def test_every_cancellation_closes_the_box(
    autojump_clock: trio.testing.MockClock, how: str
) -> None:
    """A rollout timeout (a deadline), a cancelled eval, `tt.first`'s cut, a fan-out's
    fail-fast and a policy update that leaves rollouts too stale (`tt.Staleness`) each end
    the scope: every box made is closed and its place given back."""
    maker = Maker(make_time=0.2, exec_time=100.0, close_time=0.3)
    timeout = 5.0 if how == "deadline" else None
    env = tt.ToolEnv(Tasks(4), [run], sandbox=maker, max_sandboxes=2, rollout_timeout=timeout)
    client = ScriptedClient(tool_then_done)
    if how == "deadline":
        episodes = await run_all(env, client)
        assert [e.errors[0].type for e in episodes] == ["RolloutTimeoutError"] * 4
    elif how == "cancel":
        with trio.move_on_after(1.0):
            await run_all(env, client)
    elif how == "first":

        async def one(slot: tt.RunSlot[Any]) -> Any:
            if slot.task.key == "t0":
                await trio.sleep(1.0)  # the others have made their boxes
                return "quick"
            return await env.run_slot(slot, ctx(client))

        assert await tt.first(1, slots_of(env), one, window=4) == ["quick"]
    elif how == "policy update":
        staleness = tt.Staleness(max_lag=0)

        async def rollout(slot: tt.RunSlot[Any]) -> tt.Episode:
            return await env.run_slot(slot, ctx(client))

        run_stale = staleness.run(rollout)

        async def trainer() -> None:
            await trio.sleep(1.0)  # the rollouts are in their boxes
            staleness.advance()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trainer)
            results = await tt.run_stream(slots_of(env), run_stale, window=4)
        assert results == [None] * 4  # cancelled as stale
    else:

        async def doomed() -> None:
            await trio.sleep(1.0)
            raise KeyError("a sibling failed")

        thunks: list[Callable[[], Awaitable[Any]]] = [
            functools.partial(env.run_slot, tt.RunSlot(t), ctx(client)) for t in env.taskset
        ]
        with pytest.raises(KeyError):
            await tt.fan_out([*thunks, doomed])
    assert maker.boxes, "the boxes were made before the cut"
    assert all(box.closed for box in maker.boxes)
    assert maker.alive == 0
    assert env.sandboxes is not None
    assert env.sandboxes.admission.alive == 0


async def test_a_box_half_made_when_its_rollout_is_cancelled_is_made_whole_then_closed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    maker = Maker(make_time=2.0)
    env = tt.ToolEnv(Tasks(1), [run], sandbox=maker)
    with trio.move_on_after(1.0):  # mid-creation
        await run_all(env, ScriptedClient(tool_then_done))
    assert len(maker.boxes) == 1
    assert maker.boxes[0].closed
    assert maker.alive == 0


async def test_a_group_shares_one_box_closed_when_the_group_ends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    maker = Maker(make_time=0.5)
    env = tt.ToolEnv(Tasks(2), [run], sandbox=maker, sandbox_scope="group")
    client = ScriptedClient(tool_then_done)
    seen: list[set[str]] = []
    for task in env.taskset:
        group = tt.Group(task, [tt.RunSlot(task, rollout) for rollout in range(3)])
        episodes = await tt.run_group(env, group, lambda s: env.run_slot(s, ctx(client)))
        assert all(e.ok for e in episodes)
        seen.append({e.messages[2]["content"] for e in episodes})
    assert seen == [{"box 0"}, {"box 1"}]  # one box per group, shared by its 3 rollouts
    assert len(maker.boxes) == 2
    assert all(box.closed for box in maker.boxes)


# --- admission ------------------------------------------------------------------------------


async def test_at_most_max_sandboxes_alive_and_the_wait_is_not_working_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    maker = Maker(make_time=0.1, exec_time=10.0)
    env = tt.ToolEnv(Tasks(6), [run], sandbox=maker, max_sandboxes=2, working_limit=15.0)
    waits: dict[str, float] = {}

    class Waits(tt.CallObserver):
        def on_unpark(self, kind: str, seconds: float) -> None:
            waits[kind] = waits.get(kind, 0.0) + seconds

    with tt.observe_calls(Waits()):
        episodes = await run_all(env, ScriptedClient(tool_then_done))
    assert maker.peak == 2
    assert len(maker.boxes) == 6
    # the last pair waited ~20 s for a place: over the 15 s working limit, yet not cut
    assert all(e.ok and e.stop_reason is None for e in episodes)
    assert max(e.timing["duration"] for e in episodes) >= 30.0
    assert max(e.timing["working"] for e in episodes) < 11.0
    assert waits["sandbox"] == pytest.approx(2 * 10.1 + 2 * 20.2, abs=0.5)


async def test_a_burst_of_rollouts_makes_no_burst_of_boxes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """64 rollouts at once on the rollout window; the adaptive box window starts at 2 and
    grows as boxes are made cleanly: never 64 creations at once."""
    maker = Maker(make_time=0.2, exec_time=1.0)
    quiet = Pressure(0.0, 0.0)
    env = tt.ToolEnv(Tasks(64), [run], sandbox=maker, max_sandboxes=(1, 2, 64))
    assert env.sandboxes is not None
    env.sandboxes.admission.pressure = lambda: quiet
    episodes = await run_all(env, ScriptedClient(tool_then_done), window=64)
    assert all(e.ok for e in episodes)
    assert len(maker.boxes) == 64
    window = env.sandboxes.admission.window
    sizes = [size for _, size, _ in window.history]
    assert sizes[0] == 2
    assert max(sizes) > 2
    assert maker.peak < 64  # ... never all at once


async def test_host_pressure_cuts_the_adaptive_window_and_holds_its_growth(
    autojump_clock: trio.testing.MockClock,
) -> None:
    maker = Maker(make_time=0.1, exec_time=1.0)
    readings = {"now": Pressure(0.0, 0.0)}
    env = tt.ToolEnv(Tasks(40), [run], sandbox=maker, max_sandboxes=(1, 8, 64))
    assert env.sandboxes is not None
    admission = env.sandboxes.admission
    admission.pressure = lambda: readings["now"]
    admission.cores = 2
    readings["now"] = Pressure(0.9, 0.0)  # the CPU is saturated from the start
    await run_all(env, ScriptedClient(tool_then_done), window=64)
    reasons = [reason for _, _, reason in admission.window.history]
    assert "cpu pressure" in reasons
    # cut down to the host's cores (not below: fewer would leave CPUs idle), never grown
    assert admission.window.size == 2
    assert maker.peak <= 6  # cut at the first admission already (8 -> 6)
    assert not any(r in ("slow start", "grow") for r in reasons)
    # memory pressure cuts to the window's min
    readings["now"] = Pressure(0.0, 0.5)
    await run_all(env, ScriptedClient(tool_then_done), window=64)
    assert admission.window.size == 1
    assert admission.window.history[-1][2] == "memory pressure"
    # once the pressure is gone, clean starts grow it again
    readings["now"] = Pressure(0.0, 0.0)
    await run_all(env, ScriptedClient(tool_then_done), window=64)
    assert admission.window.size > 2


async def test_slow_start_ups_cut_the_window_to_the_cores(
    autojump_clock: trio.testing.MockClock,
) -> None:
    quiet = Pressure(0.0, 0.0)
    admission = SandboxAdmission(tt.AdaptiveWindow(1, 8, 64), pressure=lambda: quiet, cores=2)
    admission.created(0.01)
    admission.created(0.03)  # 3x the quickest: no trouble
    assert admission.window.size == 8
    admission.created(0.05)  # 5x, but under 0.1 s: jitter, not trouble
    assert admission.window.size == 8
    for _ in range(20):
        admission.created(0.5)  # 50x, and half a second: the host is struggling
        await trio.sleep(1.0)
    sizes = [size for _, size, reason in admission.window.history if reason == "slow start-up"]
    assert sizes == [6, 4, 3, 2]  # by a fifth a second, down to the cores


async def test_creation_failures_are_retried_and_cap_the_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    maker = Maker()
    maker.fail_next = 2
    env = tt.ToolEnv(Tasks(1), [run], sandbox=maker, max_sandboxes=(1, 4, 8))
    assert env.sandboxes is not None
    env.sandboxes.admission.pressure = lambda: Pressure(0.0, 0.0)
    [episode] = await run_all(env, ScriptedClient(tool_then_done))
    assert episode.ok
    assert env.sandboxes.admission.failed == 2
    assert env.sandboxes.admission.window.size == 2  # each failure cut it (by a fifth at most)

    maker.fail_next = 3
    [episode] = await run_all(env, ScriptedClient(tool_then_done))
    # the tool answered with the error; the box was never made and its place is free
    assert episode.ok
    assert "SandboxStartError" in episode.messages[2]["content"]
    assert env.sandboxes.admission.alive == 0


def test_host_pressure_reads_psi_deltas_and_falls_back_to_the_load_average(
    tmp_path: Any,
) -> None:
    (tmp_path / "pressure").mkdir()
    cpu, memory = tmp_path / "pressure" / "cpu", tmp_path / "pressure" / "memory"
    cpu.write_text("some avg10=12.50 avg60=0 avg300=0 total=1000\nfull avg10=0 total=0\n")
    memory.write_text("some avg10=0.00 avg60=0 avg300=0 total=0\n")
    reader = HostPressure(interval=0.0, root=str(tmp_path))
    first = reader.read()
    assert (first.cpu, first.memory, first.source) == (0.125, 0.0, "psi")
    cpu.write_text("some avg10=0.00 avg60=0 avg300=0 total=1e12\n")  # stalled all along
    assert reader.read().cpu == 1.0
    cpu.unlink()
    (tmp_path / "loadavg").write_text(f"{4 * (__import__('os').cpu_count() or 1)} 0 0 1/1 1\n")
    (tmp_path / "meminfo").write_text("MemTotal: 1000 kB\nMemAvailable: 500 kB\n")
    fallback = reader.read()
    assert fallback.source == "loadavg"
    assert fallback.cpu == 1.0
    assert fallback.memory == 0.0
    assert HostPressure(interval=0.0, root=str(tmp_path / "none")).read().source == "none"


# --- the current sandbox, and bad settings ----------------------------------------------------


async def test_current_sandbox_outside_a_scope_says_how_to_get_one() -> None:
    with pytest.raises(NoSandboxError, match=r"sandbox=tt\.sandboxes"):
        tt.current_sandbox()
    assert current_or_none() is None
    box = MemoryBox(Maker(), 0)
    with using(box):
        assert tt.current_sandbox() is box
    assert current_or_none() is None


async def test_a_closed_scopes_box_refuses_further_use(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sandboxes = Sandboxes.of(Maker(), max_sandboxes=1)
    async with sandboxes.attempt():
        box = tt.current_sandbox()
        await box.write_file("a", b"1")
        await box.aclose()
        assert sandboxes.admission.alive == 0
        with pytest.raises(SandboxStartError, match="scope has ended"):
            await box.read_file("a")


def test_bad_sandbox_settings_name_their_parameter() -> None:
    with pytest.raises(tt.ConfigError) as caught:
        tt.ToolEnv(Tasks(), [], sandbox="bwrap")
    assert caught.value.parameter == "sandbox"
    with pytest.raises(tt.ConfigError) as caught:
        tt.ToolEnv(Tasks(), [], sandbox=Maker(), sandbox_scope="task")
    assert caught.value.parameter == "sandbox_scope"
    with pytest.raises(tt.ConfigError) as caught:
        tt.ToolEnv(Tasks(), [], sandbox=Maker(), max_sandboxes=0)
    assert caught.value.parameter == "max_sandboxes"
    with pytest.raises(tt.ConfigError, match=r"need a sandbox"):
        tt.ToolEnv(Tasks(), [], max_sandboxes=4)


async def test_a_box_that_fails_to_close_is_said_and_counted(
    autojump_clock: trio.testing.MockClock, capsys: pytest.CaptureFixture[str]
) -> None:
    class Stuck(MemoryBox):
        async def aclose(self) -> None:
            raise OSError("device busy")

    async def stuck() -> MemoryBox:
        return Stuck(Maker(), 0)

    sandboxes = Sandboxes.of(stuck, max_sandboxes=1)
    async with sandboxes.attempt():
        await tt.current_sandbox().write_file("a", b"1")
    assert sandboxes.admission.stats()["close_failed"] == 1
    assert sandboxes.admission.alive == 0  # its place is given back all the same
    assert "a sandbox did not close (OSError: device busy)" in capsys.readouterr().err


async def test_a_factory_that_makes_no_box_says_so() -> None:
    async def wrong() -> str:
        return "not a box"

    sandboxes = Sandboxes.of(wrong)
    async with sandboxes.attempt():
        with pytest.raises(tt.ConfigError, match=r"not a tt\.Sandbox"):
            await tt.current_sandbox().exec("true")
    assert sandboxes.admission.alive == 0
    assert math.isinf(sandboxes.admission.quickest)
