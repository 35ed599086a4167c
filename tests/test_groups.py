"""Groups (SPEC 10) on trio's MockClock: a task's rollouts as one unit of work.

* `Window` priority: a group's waiting rollout takes a freed place before a runner's pull;
* `run_group` under a windowed runner: live rollouts <= the window, a freed place goes to an
  open group first, `score_group` once, group ids, a failure after retries fails the group
  (the others cancelled at once, every rollout answered exactly once, the cause kept);
* a hypothesis property over random group sizes, durations, failures, windows and outside
  cancellations: every dispatched rollout is answered exactly once, no group's rollouts
  outlive it, the window bounds live rollouts;
* `run_eval(EvalConfig(group=True))`: rows of a group together with `group` and
  `advantage`, streams, resume of a half-finished group.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trio.testing import MockClock

import trio_tasksets as tt
from trio_tasksets._core.window import Window, prioritized
from trio_tasksets._env.groups import Group, GroupFailedError, OpenGroups, group_slots, run_group

PROPERTY = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


async def test_a_prioritized_waiter_takes_a_freed_place_first(autojump_clock: MockClock) -> None:
    window = Window(1)
    await window.acquire("holder")
    order: list[str] = []

    async def take(name: str, urgent: bool) -> None:
        if urgent:
            with prioritized():
                await window.acquire(name)
        else:
            await window.acquire(name)
        order.append(name)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(take, "pull", False)  # queued first
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(take, "rollout", True)
        await trio.testing.wait_all_tasks_blocked()
        window.release("holder")
        await trio.testing.wait_all_tasks_blocked()
        assert order == ["rollout"]
        window.release("rollout")
    assert order == ["rollout", "pull"]
    assert window.in_flight == 1


# --- run_group under a runner ---------------------------------------------------------------


@attrs.define
class Scripted:
    """A `run_rollout` with a duration and an outcome per (task, rollout); records starts,
    ends and cancellations in virtual time."""

    durations: Mapping[tuple[str, int], float]
    failing: set[tuple[str, int]] = attrs.Factory(set)
    live: set[tuple[str, int]] = attrs.Factory(set)
    peak: int = 0
    starts: dict[tuple[str, int], float] = attrs.Factory(dict)
    cancelled: list[tuple[str, int]] = attrs.Factory(list)
    calls: list[tuple[str, int]] = attrs.Factory(list)

    async def __call__(self, slot: tt.RunSlot[tt.Task]) -> tt.Episode:
        key = (str(slot.task.prompt), slot.rollout)
        self.calls.append(key)
        self.starts[key] = trio.current_time()
        self.live.add(key)
        self.peak = max(self.peak, len(self.live))
        episode = tt.Episode(
            id=f"{key}", task=tt.EpisodeTask(str(slot.task.prompt), {}), rollout=slot.rollout
        )
        try:
            await trio.sleep(self.durations[key])
        except trio.Cancelled:
            self.cancelled.append(key)
            raise
        finally:
            self.live.discard(key)
        episode.attempts = 1
        if key in self.failing:
            episode.errors.append(tt.EpisodeError("ModelHTTPError", "HTTP 500", 1))
        else:
            episode.ok = True
            episode.reward = float(slot.rollout)
        return episode


class Grpo(tt.Env[tt.Task]):
    """GRPO's advantage: each reward minus the group mean; counts its calls."""

    scored: list[tuple[str, int]]

    def __init__(self, taskset: tt.Taskset[tt.Task, Any], **kwargs: Any) -> None:
        super().__init__(taskset, **kwargs)
        self.scored = []

    async def score_group(self, task: tt.Task, episodes: list[tt.Episode]) -> None:
        self.scored.append((str(task.prompt), len(episodes)))
        mean = statistics.fmean(e.reward for e in episodes)
        for episode in episodes:
            episode.advantage = episode.reward - mean


def make_groups(sizes: list[int]) -> list[Group]:
    slots = [
        tt.RunSlot(task, r)
        for task in (tt.Task(prompt=f"t{i}") for i in range(len(sizes)))
        for r in range(sizes[int(str(task.prompt)[1:])])
    ]
    return group_slots(slots)


async def source(groups: list[Group]) -> AsyncIterator[Group]:
    for group in groups:
        yield group


async def run_gated(
    sizes: list[int], seconds: Mapping[tuple[str, int], float], places: int
) -> tuple[Scripted, tt.Window]:
    """Groups of `sizes` through an `OpenGroups` gate on a window of `places`; rollout r of
    task tN takes ``seconds[("tN", r)]``."""
    script = Scripted(seconds)
    env = Grpo(tt.testing.FeedTaskset())
    window = tt.Window(places)
    gate = OpenGroups(window)
    await tt.run_stream(
        gate.gate(source(make_groups(sizes))), lambda g: run_group(env, g, script), window=window
    )
    return script, window


async def test_a_freed_place_goes_to_the_open_group_first(autojump_clock: MockClock) -> None:
    seconds = {("t0", 0): 10, ("t0", 1): 1, ("t0", 2): 10, ("t0", 3): 1}
    script, _ = await run_gated([4, 4], seconds | {("t1", r): 1 for r in range(4)}, places=3)
    # t0/1 ends at 1: its place goes to t0/3 (waiting), not to a pull of t1
    assert script.starts[("t0", 3)] == 1.0
    assert min(script.starts[("t1", r)] for r in range(4)) == 2.0
    assert script.peak == 3


async def test_score_group_once_and_group_ids(autojump_clock: MockClock) -> None:
    groups = make_groups([3, 2])
    script = Scripted({(f"t{g}", r): 1.0 + r for g in range(2) for r in range(3)})
    env = Grpo(tt.testing.FeedTaskset())
    done = await tt.run_stream(source(groups), lambda g: run_group(env, g, script), window=2)
    assert sorted(env.scored) == [("t0", 3), ("t1", 2)]
    for group, episodes in zip(groups, done, strict=True):
        assert [e.rollout for e in episodes] == [s.rollout for s in group.slots]
        assert {e.group for e in episodes} == {group.id}
        mean = statistics.fmean(range(len(episodes)))
        assert [e.advantage for e in episodes] == [r - mean for r in range(len(episodes))]
    assert groups[0].id != groups[1].id


async def test_a_failed_rollout_fails_its_group_at_once(autojump_clock: MockClock) -> None:
    (group,) = make_groups([4])
    script = Scripted(
        {("t0", 0): 100, ("t0", 1): 2, ("t0", 2): 1, ("t0", 3): 100}, failing={("t0", 1)}
    )
    env = Grpo(tt.testing.FeedTaskset())
    t0 = trio.current_time()
    (episodes,) = await tt.run_stream(
        source([group]), lambda g: run_group(env, g, script), window=8
    )
    assert trio.current_time() - t0 == 2.0  # the stragglers were cancelled, not awaited out
    assert sorted(script.cancelled) == [("t0", 0), ("t0", 3)]
    assert env.scored == []
    assert [e.rollout for e in episodes] == [0, 1, 2, 3]
    assert not any(e.ok for e in episodes)
    failed = episodes[1]
    assert [e.type for e in failed.errors] == ["ModelHTTPError"]
    for other in (episodes[0], episodes[2], episodes[3]):
        assert other.errors[-1].type == GroupFailedError.__name__
        assert "rollout 1 of its group failed" in other.errors[-1].message
        assert "ModelHTTPError: HTTP 500" in other.errors[-1].message
    assert {e.group for e in episodes} == {group.id}


async def test_score_group_raising_fails_the_group(autojump_clock: MockClock) -> None:
    class Broken(tt.Env[tt.Task]):
        async def score_group(self, task: tt.Task, episodes: list[tt.Episode]) -> None:
            raise ZeroDivisionError("no variance")

    (group,) = make_groups([2])
    script = Scripted({("t0", 0): 1, ("t0", 1): 1})
    episodes = await run_group(Broken(tt.testing.FeedTaskset()), group, script)
    assert [e.ok for e in episodes] == [False, False]
    assert all(e.errors[-1].type == "ZeroDivisionError" for e in episodes)


@given(
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=6),
    durations=st.lists(st.integers(1, 9), min_size=36, max_size=36),
    failing=st.sets(st.integers(0, 35), max_size=4),
    window=st.integers(1, 8),
    cancel_at=st.one_of(st.none(), st.integers(1, 30)),
    gated=st.booleans(),
)
@PROPERTY
async def test_property_every_rollout_answered_once_and_none_outlives_its_group(
    autojump_clock: MockClock,
    sizes: list[int],
    durations: list[int],
    failing: set[int],
    window: int,
    cancel_at: int | None,
    gated: bool,
) -> None:
    groups = make_groups(sizes)
    keys = [(str(g.task.prompt), s.rollout) for g in groups for s in g.slots]
    script = Scripted(
        {key: durations[i] + 0.25 * (i % 3) for i, key in enumerate(keys)},
        {key for i, key in enumerate(keys) if i in failing},
    )
    env = Grpo(tt.testing.FeedTaskset())
    finished: dict[str, list[tt.Episode]] = {}
    outlived: list[str] = []

    async def one(group: Group) -> list[tt.Episode]:
        episodes = await run_group(env, group, script)
        name = str(group.task.prompt)
        if any(key[0] == name for key in script.live):
            outlived.append(name)
        finished[name] = episodes
        return episodes

    places: int | tt.Window = window
    feed = source(groups)
    if gated:  # as the eval runs groups: a tt.Window, pulls gated by the open groups
        places = tt.Window(window)
        feed = OpenGroups(places).gate(feed)
    with trio.fail_after(10_000):
        with trio.move_on_after(cancel_at + 0.125 if cancel_at is not None else 1e9):
            await tt.run_stream(feed, one, window=places)
    assert script.live == set()  # nothing runs once the runner is done or cancelled
    assert outlived == []  # no group returns while one of its rollouts still runs
    assert script.peak <= window
    assert len(script.calls) == len(set(script.calls))  # no rollout dispatched twice
    for name, episodes in finished.items():  # a finished group answers each rollout once
        group = next(g for g in groups if g.task.prompt == name)
        assert [e.rollout for e in episodes] == [s.rollout for s in group.slots]
        failed = [e for e in episodes if e.errors and e.errors[-1].type != "GroupFailedError"]
        assert all(not e.ok for e in episodes) == bool(failed)
        assert len(failed) <= 1
        if not failed:
            assert (name, len(episodes)) in env.scored
    if gated:  # a new group opens only once every earlier group's rollouts have started
        firsts = {
            g: min(t for (n, _), t in script.starts.items() if n == g) for g, _ in script.starts
        }
        for later, opened_at in firsts.items():
            for (name, _), started in script.starts.items():
                if int(name[1:]) < int(later[1:]):
                    assert started <= opened_at, (name, later)


# --- the eval ------------------------------------------------------------------------------


class Numbers(tt.Taskset[tt.Task, tt.TasksetConfig]):
    def load(self) -> list[tt.Task]:
        return [tt.Task(prompt=f"say {i}", answer=str(i % 2)) for i in range(3)]


class Offline(tt.EchoClient):
    """An offline model: a call waits `seconds(messages)` (1 s), then answers
    `reply(messages, n)` (which may raise), n counting the calls that got that far."""

    def __init__(
        self, reply: Callable[[str, int], str], seconds: Callable[[str], float] = lambda _: 1
    ) -> None:
        super().__init__()
        self.reply = reply
        self.seconds = seconds
        self.count = 0

    async def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        model: str,
        sampling: tt.Sampling,
        tools: list[dict[str, Any]] | None = None,
    ) -> tt.Completion:
        await trio.sleep(self.seconds(str(messages)))
        self.count += 1
        return tt.Completion(self.reply(str(messages), self.count))


def alternating() -> Offline:
    """Replies that alternate per call, so a group's rewards differ."""
    return Offline(lambda _, count: str(count % 2))


def read_rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "traces.jsonl").read_text().splitlines()]


async def test_eval_group_rows(autojump_clock: MockClock, tmp_path: Path) -> None:
    env = Grpo(Numbers())
    ctx = tt.ModelContext(alternating(), "alt")
    config = tt.EvalConfig(
        rollouts_per_example=4, group=True, max_concurrent=3, output_dir=str(tmp_path),
        run_name="g", dashboard=False,
    )  # fmt: skip
    result = await tt.run_eval(env, ctx, config)
    rows = read_rows(result.run_dir)
    assert len(rows) == 12
    by_group: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_group.setdefault(row["group"], []).append(row)
    assert len(by_group) == 3
    for members in by_group.values():
        assert sorted(r["rollout"] for r in members) == [0, 1, 2, 3]
        assert len({r["task"]["key"] for r in members}) == 1
        mean = statistics.fmean(r["reward"] for r in members)
        assert all(r["advantage"] == pytest.approx(r["reward"] - mean) for r in members)
    # a group's rows are written together: contiguous in the file
    order = [row["group"] for row in rows]
    assert all(order[i] == order[i - 1] for i in range(1, 12) if i % 4)
    saved = json.loads((result.run_dir / "config.json").read_text())
    assert saved["identity"]["group"] is True


async def test_a_groups_rows_reach_the_file_in_one_write(
    autojump_clock: MockClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One `write()` per group (its rows whole together, one system call), one per row
    without groups."""
    writes: list[bytes] = []
    real_write = os.write

    def write(fd: int, data: Any) -> int:
        writes.append(bytes(data))
        return real_write(fd, data)

    monkeypatch.setattr("trio_tasksets._env.traces.os.write", write)
    for group in (True, False):
        writes.clear()
        config = tt.EvalConfig(
            rollouts_per_example=4, group=group, max_concurrent=3, output_dir=str(tmp_path),
            run_name=f"w{group}", dashboard=False,
        )  # fmt: skip
        ctx = tt.ModelContext(alternating(), "alt")
        result = await tt.run_eval(Grpo(Numbers()), ctx, config)
        assert [len(data.splitlines()) for data in writes] == [4] * 3 if group else [1] * 12
        assert b"".join(writes) == (result.run_dir / "traces.jsonl").read_bytes()
        if group:
            for data in writes:
                assert len({json.loads(line)["group"] for line in data.splitlines()}) == 1


async def test_eval_group_on_a_stream(autojump_clock: MockClock, tmp_path: Path) -> None:
    taskset = tt.testing.FeedTaskset()
    taskset.put("a", "b", "c")
    env = Grpo(taskset)
    config = tt.EvalConfig(
        num_examples=2, rollouts_per_example=3, group=True, max_concurrent=2,
        output_dir=str(tmp_path), run_name="s", dashboard=False,
    )  # fmt: skip
    with trio.fail_after(100):
        result = await tt.run_eval(env, tt.ModelContext(tt.EchoClient(), "echo"), config)
    assert taskset.pulled == 2
    rows = read_rows(result.run_dir)
    assert [len({r["group"] for r in rows[i : i + 3]}) for i in (0, 3)] == [1, 1]
    assert sorted(env.scored) == [("a", 3), ("b", 3)]


async def test_eval_resume_reruns_a_half_finished_group_whole(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    env = Grpo(Numbers())
    ctx = tt.ModelContext(alternating(), "alt")

    def config(resume: bool = False) -> tt.EvalConfig:
        return tt.EvalConfig(
            rollouts_per_example=2, group=True, output_dir=str(tmp_path), run_name="r",
            dashboard=False, resume=resume,
        )  # fmt: skip

    first = await tt.run_eval(env, ctx, config())
    rows = read_rows(first.run_dir)
    victim = rows[2]["group"]  # drop one row of the second group: half of it is left
    kept = [r for r in rows if not (r["group"] == victim and r["rollout"] == 1)]
    (first.run_dir / "traces.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    env.scored.clear()
    second = await tt.run_eval(env, ctx, config(resume=True))
    assert len(env.scored) == 1  # only the broken group ran again, whole
    after = read_rows(second.run_dir)
    assert len(after) == 6
    groups = {r["group"] for r in after}
    assert victim not in groups  # its surviving row was dropped, not mixed with new ones
    assert len(groups) == 3
    assert second.summary["kept_from_resume"] == 4


async def test_eval_group_failing_after_retries(autojump_clock: MockClock, tmp_path: Path) -> None:
    def flaky(messages: str, _: int) -> str:
        if "say 1" in messages:
            raise tt.ModelHTTPError("returned HTTP 500", status=500)
        return "ok"

    env = Grpo(Numbers(), retries=tt.RetryPolicy(max_retries=2, backoff=0.0))
    config = tt.EvalConfig(
        num_examples=2, rollouts_per_example=3, group=True, output_dir=str(tmp_path),
        run_name="f", dashboard=False,
    )  # fmt: skip
    result = await tt.run_eval(
        env, tt.ModelContext(Offline(flaky, lambda m: 1 if "say 1" in m else 50), "m"), config
    )
    rows = read_rows(result.run_dir)
    failed = [r for r in rows if r["task"]["data"]["prompt"] == "say 1"]
    assert len(failed) == 3
    assert not any(r["ok"] for r in failed)
    own = [r for r in failed if r["errors"][-1]["type"] == "ModelHTTPError"]
    assert len(own) >= 1
    assert own[0]["attempts"] == 3
    assert rows.index(own[0]) == min(rows.index(r) for r in failed)  # the cause is written first
    assert result.summary["first_error"]["type"] == "ModelHTTPError"
    ok = [r for r in rows if r["task"]["data"]["prompt"] == "say 0"]
    assert [r["ok"] for r in ok] == [True, True, True]


async def test_the_report_groups_rows_and_shows_the_spread(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    from trio_tasksets._report.data import load_run
    from trio_tasksets._report.figures import compute

    same = Offline(lambda *_: "0")  # "say 0" always right, "say 1" always wrong: no spread

    config = tt.EvalConfig(
        rollouts_per_example=3, group=True, output_dir=str(tmp_path), run_name="p",
        dashboard=False,
    )  # fmt: skip
    result = await tt.run_eval(Grpo(Numbers()), tt.ModelContext(same, "same"), config)
    groups = compute(load_run(result.run_dir)).groups
    assert groups is not None
    assert sorted((n, ok, lo, hi) for _, n, ok, _, lo, hi in groups.groups) == [
        (3, 3, 0.0, 0.0), (3, 3, 1.0, 1.0), (3, 3, 1.0, 1.0),
    ]  # fmt: skip
    assert groups.flat == 3
    html = tt.report(result.run_dir).read_text()
    assert "3 groups" in html
    assert 'data-figure="groups_flat" data-value="3"' in html


async def test_group_feed_under_first_closes_the_tasks(autojump_clock: MockClock) -> None:
    from trio_tasksets._env.groups import group_feed

    feed = tt.testing.Feed(*(tt.Task(prompt=f"t{i}") for i in range(100)))
    script = Scripted({(f"t{i}", r): 1.0 + i % 3 for i in range(100) for r in range(3)})
    env = Grpo(tt.testing.FeedTaskset())
    window = tt.Window(4)
    groups = group_feed(feed, 3, window)
    got = await tt.first(2, groups, lambda g: run_group(env, g, script), window=window)
    assert len(got) == 2
    assert all(len(group) == 3 for group in got)
    assert feed.closed
    assert script.live == set()
    assert script.peak <= 4
    with pytest.raises(tt.ConfigError, match="rollouts must be an int >= 1") as caught:
        group_feed(feed, 0, window)
    assert caught.value.parameter == "rollouts"


async def test_a_group_feed_closed_before_its_first_pull_closes_its_tasks_once(
    autojump_clock: MockClock,
) -> None:
    env = Grpo(tt.testing.FeedTaskset())
    script = Scripted({})
    for how in ("first(0)", "aclose", "cancelled run_stream", "cancelled first"):
        feed = tt.testing.Feed(*(tt.Task(prompt=f"t{i}") for i in range(3)))
        window = tt.Window(2)
        groups = tt.group_feed(feed, 2, window)
        if how == "first(0)":
            assert (
                await tt.first(0, groups, lambda g: run_group(env, g, script), window=window) == []
            )
        elif how == "aclose":
            await groups.aclose()  # type: ignore[attr-defined]
            await groups.aclose()  # type: ignore[attr-defined]
        else:
            with trio.CancelScope() as scope:
                scope.cancel()  # cancelled before the first pull
                if how == "cancelled run_stream":
                    await tt.run_stream(groups, lambda g: run_group(env, g, script), window=window)
                else:
                    await tt.first(1, groups, lambda g: run_group(env, g, script), window=window)
        assert (feed.close_calls, feed.pulled) == (1, 0), how
    assert script.calls == []


@given(
    tasks=st.integers(0, 6),
    rollouts=st.integers(1, 3),
    places=st.integers(1, 4),
    n=st.one_of(st.none(), st.integers(0, 8)),  # None: run_stream, else first(n)
    cancel_at=st.one_of(st.none(), st.integers(0, 12)),
    source_fails_at=st.one_of(st.none(), st.integers(0, 6)),
    run_fails_at=st.one_of(st.none(), st.integers(0, 6)),
    quiet=st.booleans(),  # the feed goes quiet after its tasks (never ends)
)
@PROPERTY
async def test_property_a_group_feed_closes_its_tasks_exactly_once(
    autojump_clock: MockClock,
    tasks: int,
    rollouts: int,
    places: int,
    n: int | None,
    cancel_at: int | None,
    source_fails_at: int | None,
    run_fails_at: int | None,
    quiet: bool,
) -> None:
    feed = tt.testing.Feed(*(tt.Task(prompt=f"t{i}") for i in range(tasks)))
    if source_fails_at is not None and source_fails_at <= tasks:
        feed = tt.testing.Feed(*(tt.Task(prompt=f"t{i}") for i in range(source_fails_at)))
        feed.fail(ValueError("the source broke"))
    elif not quiet:
        feed.end()
    script = Scripted({(f"t{i}", r): 1.0 + (i + r) % 3 for i in range(tasks) for r in range(3)})
    env = Grpo(tt.testing.FeedTaskset())
    window = tt.Window(places)
    groups = tt.group_feed(feed, rollouts, window)

    async def run(group: Group) -> list[tt.Episode]:
        if run_fails_at is not None and str(group.task.prompt) == f"t{run_fails_at}":
            await trio.sleep(0.5)
            raise KeyError("the run broke")
        return await run_group(env, group, script)

    with trio.move_on_after(cancel_at + 0.25 if cancel_at is not None else 100):
        try:
            if n is None:
                await tt.run_stream(groups, run, window=window)
            else:
                await tt.first(n, groups, run, window=window)
        except (ValueError, KeyError):
            pass
    assert feed.close_calls == 1
    assert not feed.foreign_close
    assert script.live == set()


async def test_a_group_waiting_for_its_last_rollouts_lends_its_place(
    autojump_clock: MockClock,
) -> None:
    seconds = {("t0", 0): 1, ("t0", 1): 10, ("t1", 0): 1, ("t1", 1): 1}
    script, window = await run_gated([2, 2], seconds, places=2)
    # t0/0 ends at 1 and t0 waits for t0/1 until 10: its place goes to t1 meanwhile
    assert script.starts[("t1", 0)] == 1.0
    assert script.peak == 2
    assert window.in_flight == 0
    assert window.limiter.total_tokens == 2  # every lent place given back
