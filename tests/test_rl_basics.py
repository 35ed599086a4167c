"""RL basics a user should not have to write (issue 35, item 5).

* GRPO's advantage by default: a group whose env has no `score_group` of its own gets
  reward minus the group mean (`"mean"`), or that over the group's standard deviation
  (`"std"`; 0.0 when the rewards are all equal), or none; an env's own `score_group` wins.
  The same in process (`run_group`, `run_eval`), on the command line (`--advantage`), and
  on a worker (the group entry carries it: `TaskEntry.advantage`, the Redis field).
* `EpisodeTask.prompt` and `.answer`.
* `tt.batches`: a feed of groups run into trainer batches under a `Staleness`.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import forkserver
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trio.testing import MockClock

import trio_tasksets as tt
from trio_tasksets.testing import MemoryTaskQueue
from trio_tasksets.worker import TaskEntry, consume

# --- EpisodeTask.prompt and .answer ---------------------------------------------------------


async def test_an_episodes_task_has_its_prompt_and_answer() -> None:
    env: tt.Env[Any] = tt.Env(tt.Taskset())
    ctx = tt.ModelContext(tt.EchoClient(), "echo")
    episode = await env.run_slot(tt.RunSlot(tt.Task("say 42", answer="42")), ctx)
    assert episode.task.prompt == "say 42"
    assert episode.task.answer == "42"
    chat = tt.EpisodeTask("k", {"prompt": [{"role": "user", "content": "hi"}], "answer": None})
    assert chat.prompt == [{"role": "user", "content": "hi"}]
    assert chat.answer is None
    other = tt.EpisodeTask("k", {"text": "q1", "level": 2})  # a task class of its own
    assert (other.prompt, other.answer) == (None, None)
    back = tt.Episode.from_row(episode.to_row())
    assert (back.task.prompt, back.task.answer) == ("say 42", "42")


# --- the default advantage ------------------------------------------------------------------


REWARDS = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]  # mean 2/3, population std sqrt(2)/3


def scripted(rewards: list[float]) -> Callable[[tt.RunSlot[Any]], Any]:
    async def rollout(slot: tt.RunSlot[Any]) -> tt.Episode:
        await trio.sleep(1 + slot.rollout % 3)
        return tt.Episode(
            id=f"e{slot.rollout}", task=tt.EpisodeTask("k", {}), rollout=slot.rollout, ok=True,
            reward=rewards[slot.rollout],
        )  # fmt: skip

    return rollout


def group(size: int, **kw: Any) -> tt.Group:
    task = tt.Task("p")
    return tt.Group(task, [tt.RunSlot(task, r) for r in range(size)], **kw)


def expected(rewards: list[float], how: str) -> list[float | None]:
    if how == "none":
        return [None] * len(rewards)
    mean = statistics.fmean(rewards)
    scale = statistics.pstdev(rewards) if how == "std" else 1.0
    return [(r - mean) / scale for r in rewards]


@pytest.mark.parametrize("how", ["mean", "std", "none"])
async def test_a_group_without_score_group_gets_grpos_advantage(
    autojump_clock: MockClock, how: str
) -> None:
    env: tt.Env[Any] = tt.Env(tt.Taskset())
    kw = {} if how == "mean" else {"advantage": how}  # "mean" is the default
    episodes = await tt.run_group(env, group(6, **kw), scripted(REWARDS))
    got = [e.advantage for e in episodes]
    assert got == pytest.approx(expected(REWARDS, how))


@pytest.mark.parametrize("how", ["mean", "std"])
async def test_equal_rewards_give_a_zero_advantage(autojump_clock: MockClock, how: str) -> None:
    env: tt.Env[Any] = tt.Env(tt.Taskset())
    episodes = await tt.run_group(env, group(3, advantage=how), scripted([0.1, 0.1, 0.1]))
    assert [e.advantage for e in episodes] == [0.0, 0.0, 0.0]  # exactly: no 0/0, no residue


async def test_an_envs_own_score_group_has_full_control(autojump_clock: MockClock) -> None:
    class BestOfN(tt.Env[Any]):
        async def score_group(self, task: Any, episodes: list[tt.Episode]) -> None:
            for episode in episodes:
                episode.reward = 2 * episode.reward  # no advantage of its own: none is added

    class Rescaled(tt.Env[Any]):
        async def score_group(self, task: Any, episodes: list[tt.Episode]) -> None:
            for episode in episodes:
                episode.reward += episode.rollout
            tt.group_advantages(episodes, "std")  # the default's arithmetic, on its rewards

    best = await tt.run_group(BestOfN(tt.Taskset()), group(3, advantage="std"), scripted(REWARDS))
    assert [e.advantage for e in best] == [None, None, None]
    rescaled = await tt.run_group(Rescaled(tt.Taskset()), group(3), scripted(REWARDS))
    assert [e.advantage for e in rescaled] == pytest.approx(expected([1.0, 1.0, 2.0], "std"))


async def test_a_failed_group_gets_no_advantage(autojump_clock: MockClock) -> None:
    async def failing(slot: tt.RunSlot[Any]) -> tt.Episode:
        episode = await scripted(REWARDS)(slot)
        episode.ok = slot.rollout != 1
        return episode  # type: ignore[no-any-return]

    episodes = await tt.run_group(tt.Env(tt.Taskset()), group(3), failing)
    assert [e.advantage for e in episodes] == [None, None, None]


def test_a_bad_advantage_is_refused_naming_it() -> None:
    for make in (
        lambda: group(2, advantage="zscore"),
        lambda: tt.group_feed(tt.testing.Feed(), 2, None, advantage="zscore"),  # type: ignore[arg-type]
        lambda: TaskEntry(None, "1-0", "k", {"prompt": "hi"}, advantage="zscore"),  # type: ignore[arg-type]
    ):
        with pytest.raises(tt.ConfigError, match=r"advantage.*'mean', 'std', 'none'") as raised:
            make()
        assert raised.value.parameter == "advantage"
    with pytest.raises(tt.EvalConfigError, match="advantage") as bad:
        tt.EvalConfig(group=True, advantage="z")  # type: ignore[arg-type]
    assert bad.value.parameters == ("advantage",)
    with pytest.raises(tt.EvalConfigError, match="applies to groups") as alone:
        tt.EvalConfig(advantage="std")
    assert alone.value.parameters == ("advantage", "group")
    with pytest.raises(tt.ConfigError, match="how"):
        tt.group_advantages([], "z")  # type: ignore[arg-type]


class Counted(tt.Env[Any]):
    """Rewards that differ within a group: the n-th rollout of a prompt scored gets n % 3
    (no score_group of its own). Counted per prompt, so that groups scored in any
    interleaving (one counter for all could give a group 1, 4, 7, 10) still differ."""

    scored: ClassVar[Counter[str]] = Counter()

    async def score(self, task: Any, completion: str) -> float:
        Counted.scored[task.prompt] += 1
        return float(Counted.scored[task.prompt] % 3)


def check_rows(rows: list[dict[str, Any]], how: str) -> None:
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row["group"], []).append(row)
    assert groups
    for members in groups.values():
        rewards = [r["reward"] for r in members]
        assert len(set(rewards)) > 1
        assert [r["advantage"] for r in members] == pytest.approx(expected(rewards, how))


@pytest.mark.parametrize("how", ["mean", "std"])
async def test_run_eval_writes_the_default_advantage(
    autojump_clock: MockClock, tmp_path: Path, how: str
) -> None:
    config = tt.EvalConfig(num_examples=3, rollouts_per_example=4, group=True,
                           advantage=how, output_dir=str(tmp_path), dashboard=False)  # type: ignore[arg-type]  # fmt: skip
    ctx = tt.ModelContext(tt.EchoClient(), "echo")
    result = await tt.run_eval(Counted(tt.EchoTaskset()), ctx, config)
    rows = [json.loads(line) for line in (result.run_dir / "traces.jsonl").read_text().splitlines()]
    assert len(rows) == 12
    check_rows(rows, how)
    saved = json.loads((result.run_dir / "config.json").read_text())
    assert saved["identity"].get("advantage") == (None if how == "mean" else how)


async def test_a_resume_keeps_one_advantage_rule(autojump_clock: MockClock, tmp_path: Path) -> None:
    ctx = tt.ModelContext(tt.EchoClient(), "echo")
    kw: dict[str, Any] = dict(num_examples=2, rollouts_per_example=2, group=True,
                              output_dir=str(tmp_path), run_name="r", dashboard=False)  # fmt: skip
    await tt.run_eval(Counted(tt.EchoTaskset()), ctx, tt.EvalConfig(advantage="std", **kw))
    again = tt.EvalConfig(resume=True, **kw)  # the default: mean
    with pytest.raises(tt.EvalConfigError, match="advantage: saved 'std', now None"):
        await tt.run_eval(Counted(tt.EchoTaskset()), ctx, again)
    resumed = await tt.run_eval(
        Counted(tt.EchoTaskset()), ctx, tt.EvalConfig(resume=True, advantage="std", **kw)
    )
    assert resumed.summary["kept_from_resume"] == 4


async def test_a_worker_computes_the_advantage_the_entry_asks_for(
    autojump_clock: MockClock,
) -> None:
    queue = MemoryTaskQueue()
    for i, how in enumerate(["std", "mean", "none"]):
        queue.put(tt.Task(f"t{i}", answer="x"), group=f"g{i}", rollouts=4, advantage=how)  # type: ignore[arg-type]
    ctx = tt.ModelContext(tt.EchoClient(delay=0.1), "echo")
    async with trio.open_nursery() as nursery:
        shut_down = await nursery.start(functools_partial_consume, queue, ctx)
        with trio.fail_after(60):
            while len(queue.answered) < 3:  # noqa: ASYNC110
                await trio.sleep(0.1)
        shut_down("done")
    for finished in queue.answered:
        how = {"g0": "std", "g1": "mean", "g2": "none"}[str(finished.entry.group)]
        rows = [e.to_row() for e in finished.episodes]
        if how == "none":
            assert all(r["advantage"] is None for r in rows)
        else:
            check_rows(rows, how)


async def functools_partial_consume(
    queue: MemoryTaskQueue,
    ctx: tt.ModelContext,
    *,
    task_status: trio.TaskStatus[Callable[[str], None]],
) -> None:
    await consume(queue, ctx, window=tt.Window(8), env=Counted(tt.EchoTaskset()), live=False,
                  handle_signals=False, log=lambda line: None, task_status=task_status)  # fmt: skip


def test_a_redis_group_entry_carries_its_advantage() -> None:
    from trio_tasksets.redis import EntryRef, MalformedEntry, encode_task
    from trio_tasksets.redis._entries import ADVANTAGE_FIELD, decode_entry
    from trio_tasksets.redis._queue import task_entry

    entry = EntryRef("s", "g", "1-0")
    task = encode_task(tt.Task("hi")).decode()
    fields = {"task": task, "group": "g7", "rollouts": "4"}
    assert task_entry(decode_entry(entry, fields)).advantage == "mean"  # an older producer's
    got = task_entry(decode_entry(entry, {**fields, ADVANTAGE_FIELD: "std"}))
    assert got.advantage == "std"
    with pytest.raises(MalformedEntry, match="'advantage' must be one of mean, std, none"):
        decode_entry(entry, {**fields, ADVANTAGE_FIELD: "zscore"})


ENVS = """
import collections
import trio_tasksets as tt

counter = collections.Counter()  # per prompt: a group's rewards differ in any interleaving


class Words(tt.Taskset):
    def load(self):
        return [tt.Task(prompt=f"say {word}", answer=word) for word in ("red", "green")]


class Counted(tt.Env):
    async def score(self, task, completion):
        counter[task.prompt] += 1
        return float(counter[task.prompt] % 3)
"""


def run_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "envs.py").write_text(ENVS)
    return forkserver.run(
        [sys.executable, "-m", "trio_tasksets", "eval", f"{tmp_path / 'envs.py'}:Words",
         "--env-class", f"{tmp_path / 'envs.py'}:Counted", "-o", str(tmp_path / "out"),
         "--no-dashboard", "--run-name", "g", *args],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip


@pytest.mark.parametrize(
    ("how", "where"), [("mean", ()), ("std", ()), ("std", ("--serve",)), ("none", ("--serve",))]
)
def test_the_command_line_writes_the_advantage(
    tmp_path: Path, how: str, where: tuple[str, ...]
) -> None:
    extra = () if how == "mean" else ("--advantage", how)
    done = run_cli(tmp_path, "--group", "-r", "4", *extra, *where)
    assert done.returncode == 0, done.stderr
    text = (tmp_path / "out" / "g" / "traces.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines()]
    if how == "none":
        assert len(rows) == 8
        assert all(row["advantage"] is None for row in rows)
    else:
        check_rows(rows, how)  # served: each rollout on the server, the group scored here


def test_the_command_line_refuses_a_bad_advantage(tmp_path: Path) -> None:
    bad = run_cli(tmp_path, "--group", "--advantage", "zscore")
    assert bad.returncode == 2
    assert "--advantage: invalid choice: 'zscore'" in bad.stderr
    alone = run_cli(tmp_path, "--advantage", "std")
    assert alone.returncode == 2
    assert "--advantage applies to groups: add --group" in alone.stderr
    assert not (tmp_path / "out" / "g").exists()


# --- tt.batches -----------------------------------------------------------------------------


# duplicates: a counting source as test_training's; each file reads alone
class Source:
    """Items 0, 1, ... (`limit` of them, or endless); counts pulls and closes."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self.pulled = 0
        self.closed = 0

    def __aiter__(self) -> Source:
        return self

    async def __anext__(self) -> int:
        if self.limit is not None and self.pulled >= self.limit:
            raise StopAsyncIteration
        await trio.lowlevel.checkpoint()
        self.pulled += 1
        return self.pulled - 1

    async def aclose(self) -> None:
        self.closed += 1


class Runs:
    """A run of item i takes `seconds(i)`; records what runs and what was cancelled."""

    def __init__(self, seconds: Callable[[int], float] = lambda i: 1.0 + i % 3) -> None:
        self.seconds = seconds
        self.live: set[int] = set()
        self.peak = 0
        self.cancelled: list[int] = []
        self.started: dict[int, int] = {}  # item -> the policy version it started at

    async def __call__(self, item: int) -> int:
        self.live.add(item)
        self.peak = max(self.peak, len(self.live))
        try:
            await trio.sleep(self.seconds(item))
        except trio.Cancelled:
            self.cancelled.append(item)
            raise
        finally:
            self.live.discard(item)
        return item


async def test_batches_of_size_in_completion_order_and_a_short_last_one(
    autojump_clock: MockClock,
) -> None:
    source, runs = Source(10), Runs(lambda i: 10 - i)  # the later, the sooner done
    with trio.fail_after(100):
        async with tt.batches(4, source, runs, window=10) as feed:
            got = [batch async for batch in feed]
    assert got == [[9, 8, 7, 6], [5, 4, 3, 2], [1, 0]]
    assert source.closed == 1
    assert runs.peak == 10


async def test_batches_keep_what_accept_takes(autojump_clock: MockClock) -> None:
    async def even(result: int) -> bool:
        await trio.sleep(0.5)
        return result % 2 == 0

    with trio.fail_after(100):
        async with tt.batches(2, Source(9), Runs(lambda i: i), window=3, accept=even) as feed:
            got = [batch async for batch in feed]
    assert got == [[0, 2], [4, 6], [8]]


async def test_a_pull_cancelled_midway_loses_no_result(autojump_clock: MockClock) -> None:
    async def slow_accept(result: int) -> bool:
        await trio.sleep(2)
        return True

    got: list[list[int]] = []
    with trio.fail_after(100):
        async with tt.batches(
            2, Source(6), Runs(lambda i: 1), window=2, accept=slow_accept
        ) as feed:
            iterator = aiter(feed)
            for pull in itertools.count():
                with trio.move_on_after(1.5 if pull % 2 else 10):  # odd: cut in `accept`
                    try:
                        got.append(await anext(iterator))
                    except StopAsyncIteration:
                        break
    assert sorted(item for batch in got for item in batch) == list(range(6))


async def test_leaving_the_block_cancels_and_awaits_the_runs_and_closes_the_source(
    autojump_clock: MockClock,
) -> None:
    source, runs = Source(), Runs()
    with trio.fail_after(100):
        async with tt.batches(3, source, runs, window=5) as feed:
            async for batch in feed:
                assert len(batch) == 3
                await trio.sleep(1)  # the trainer: the runs go on meanwhile
                if len(runs.cancelled) == 0 and source.pulled >= 12:
                    break
    assert runs.live == set()  # nothing it started still runs
    assert runs.cancelled  # those in flight were cancelled, not awaited out
    assert source.closed == 1
    assert runs.peak <= 5


async def test_a_failing_run_is_raised_and_the_source_closed(autojump_clock: MockClock) -> None:
    source = Source()

    async def run(item: int) -> int:
        await trio.sleep(1)
        if item == 4:
            raise RuntimeError("the sandbox died")
        return item

    with pytest.raises(RuntimeError, match="the sandbox died"), trio.fail_after(100):
        async with tt.batches(2, source, run, window=3) as feed:
            handed = [batch async for batch in feed]  # noqa: F841  # (it raises)
    assert source.closed == 1


async def test_under_a_staleness_every_batch_is_at_most_max_lag_old(
    autojump_clock: MockClock,
) -> None:
    for max_lag in (0, 1):
        staleness = tt.Staleness(max_lag)
        source, runs = Source(), Runs(lambda i: 1.0 + (7 * i) % 5)
        started: dict[int, int] = {}

        async def run(
            item: int,
            runs: Runs = runs,
            gate: tt.Staleness = staleness,
            at: dict[int, int] = started,
        ) -> int:
            at[item] = gate.version
            return await runs(item)

        lags: list[int] = []
        with trio.fail_after(1000):
            async with tt.batches(3, source, run, window=6, staleness=staleness) as feed:
                async for batch in feed:
                    assert len(batch) == 3
                    lags += [staleness.version - started[item] for item in batch]
                    assert staleness.handed_count - staleness.version <= max_lag + 1
                    await trio.sleep(4)  # a slow trainer
                    staleness.advance()
                    if staleness.version == 6:
                        break
        assert max(lags) <= max_lag
        assert source.closed == 1
        if max_lag == 0:  # on-policy: nothing is pulled while the trainer trains
            assert staleness.pauses > 0
            assert lags == [0] * 18
        else:  # the runs went on during training: some results are a version old
            assert 1 in lags
            assert staleness.dropped + staleness.cancelled > 0  # too old ones never handed


async def test_withheld_results_are_handed_out_marked(autojump_clock: MockClock) -> None:
    staleness = tt.Staleness(0, withhold=True)

    async def run(item: int) -> list[tt.Episode]:
        await trio.sleep(1 + item % 4)
        return [tt.Episode(id=str(item), task=tt.EpisodeTask("k", {}), rollout=0)]

    marked = 0
    with trio.fail_after(1000):
        async with tt.batches(2, Source(), run, window=4, staleness=staleness) as feed:
            async for batch in feed:
                marked += sum(e.stale for group in batch for e in group)
                await trio.sleep(3)
                staleness.advance()
                if staleness.version == 5:
                    break
    assert marked > 0
    assert staleness.dropped == 0


def test_batches_refuses_bad_arguments_naming_them() -> None:
    async def run(item: int) -> int:
        return item

    for kw, name in (
        ({"size": 0}, "size"),
        ({"size": True}, "size"),
        ({"staleness": 2}, "staleness"),
        ({"accept": "yes"}, "accept"),
        ({"window": 0}, "window"),
    ):
        args: dict[str, Any] = {"size": 2, "window": 2, **kw}
        size = args.pop("size")
        with pytest.raises(tt.ConfigError) as raised:
            tt.batches(size, Source(), run, **args)
        assert raised.value.parameter == name


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    durations=st.lists(st.integers(1, 5), min_size=0, max_size=25),
    size=st.integers(1, 6),
    window=st.integers(1, 6),
    stop_after=st.one_of(st.none(), st.integers(1, 4)),
)
def test_every_result_lands_in_exactly_one_batch(
    durations: list[int], size: int, window: int, stop_after: int | None
) -> None:
    source = Source(len(durations))
    runs = Runs(lambda i: durations[i])
    got: list[list[int]] = []

    async def main() -> None:
        with trio.fail_after(1000):
            async with tt.batches(size, source, runs, window=window) as feed:
                async for batch in feed:
                    got.append(batch)
                    if stop_after is not None and len(got) == stop_after:
                        break

    trio.run(main, clock=MockClock(autojump_threshold=0))
    seen = [item for batch in got for item in batch]
    assert len(seen) == len(set(seen))  # no result twice
    assert all(len(batch) == size for batch in got[:-1])
    assert all(0 < len(batch) <= size for batch in got)
    if stop_after is None or len(got) < stop_after:  # ran to the end: every one, once
        assert sorted(seen) == list(range(len(durations)))
    assert source.closed == 1
    assert runs.live == set()
