"""run_eval, SPEC section 4, in process: planning, the window, traces, resume, refusals."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import trio
from trio.testing import MockClock

import trio_tasksets as tt
from trio_tasksets.testing import FeedTaskset, Gate


class Numbers(tt.Taskset[tt.Task, tt.TasksetConfig]):
    def load(self) -> Iterable[tt.Task]:
        return [tt.Task(f"say {i}", answer=str(i)) for i in range(8)]


class Endless(tt.Taskset[tt.Task, tt.TasksetConfig]):
    INFINITE = True

    def load(self) -> Iterable[tt.Task]:
        i = 0
        while True:
            yield tt.Task(f"say {i}", answer=str(i))
            i += 1


def echo(delay: float = 1.0) -> tt.ModelContext:
    return tt.ModelContext(tt.EchoClient(delay=delay), "echo")


def config(tmp_path: Path, **kw: Any) -> tt.EvalConfig:
    return tt.EvalConfig(output_dir=str(tmp_path), run_name="run", dashboard=False, **kw)


def rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "traces.jsonl").read_text().splitlines()]


async def test_static_n5_r2_gives_10_rows_with_the_spec_fields(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    result = await tt.run_eval(
        tt.Env(Numbers()), echo(), config(tmp_path, num_examples=5, rollouts_per_example=2)
    )
    assert len(result.episodes) == 10
    written = rows(result.run_dir)
    assert len(written) == 10
    assert set(written[0]) == {
        "id", "task", "rollout", "ok", "reward", "completion", "messages", "errors",
        "attempts", "timing", "usage", "finish_reason",
    }  # fmt: skip
    assert set(written[0]["task"]) == {"key", "data"}
    assert set(written[0]["task"]["data"]) == {"prompt", "answer", "info", "system_prompt"}
    assert sorted((r["task"]["data"]["prompt"], r["rollout"]) for r in written) == sorted(
        (f"say {i}", r) for i in range(5) for r in range(2)
    )
    assert all(r["ok"] and r["reward"] == 1.0 for r in written)
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary["finished"] == summary["ok"] == 10
    assert summary["reward_mean"] == 1.0
    saved = json.loads((result.run_dir / "config.json").read_text())
    assert saved["identity"]["num_examples"] == 5


async def test_c_bounds_what_runs(autojump_clock: MockClock, tmp_path: Path) -> None:
    gate = Gate(opened=True)

    class Gated(tt.Env[tt.Task]):
        async def rollout(self, task: tt.Task, ctx: tt.ModelContext) -> Any:
            async with gate.held():
                return await super().rollout(task, ctx)

    await tt.run_eval(Gated(Numbers()), echo(), config(tmp_path, max_concurrent=3))
    assert gate.peak == 3
    assert gate.finished == 8


async def test_stream_takes_the_next_n_and_never_an_extra(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    feed = FeedTaskset()
    feed.put(*(str(i) for i in range(10)))  # never ends
    with trio.fail_after(60):
        result = await tt.run_eval(tt.Env(feed), echo(), config(tmp_path, num_examples=3))
    assert feed.pulled == 3
    assert feed.closed
    assert len(rows(result.run_dir)) == 3
    assert all(e.ok for e in result.episodes)


async def test_a_streamed_tasks_rollouts_enter_the_window_one_by_one(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    feed = FeedTaskset()
    feed.put("only")
    gate = Gate(opened=True)

    class Counted(tt.Env[tt.Task]):
        async def rollout(self, task: tt.Task, ctx: tt.ModelContext) -> Any:
            async with gate.held():
                return await super().rollout(task, ctx)

    with trio.fail_after(600):
        result = await tt.run_eval(
            Counted(feed), echo(), config(tmp_path, num_examples=1, rollouts_per_example=50,
                                          max_concurrent=1)
        )  # fmt: skip
    assert len(result.episodes) == 50
    assert gate.peak == 1
    assert feed.pulled == 1
    assert feed.closed


@pytest.mark.parametrize("taskset", [FeedTaskset, Endless])
async def test_stream_or_infinite_without_n_is_refused_before_anything(
    autojump_clock: MockClock, tmp_path: Path, taskset: type[tt.Taskset[tt.Task, Any]]
) -> None:
    ts = taskset()
    with pytest.raises(tt.EvalConfigError, match="-n/--num-examples"):
        await tt.run_eval(tt.Env(ts), echo(), config(tmp_path))
    assert not (tmp_path / "run").exists()
    if isinstance(ts, FeedTaskset):
        assert ts.pulled == 0


@pytest.mark.parametrize(
    ("flag", "kw"), [("shuffle", {"shuffle": True}), ("resume", {"resume": True})]
)
async def test_shuffle_and_resume_are_refused_on_a_stream(
    autojump_clock: MockClock, tmp_path: Path, flag: str, kw: dict[str, Any]
) -> None:
    with pytest.raises(tt.EvalConfigError, match=f"cannot {flag}"):
        await tt.run_eval(tt.Env(FeedTaskset()), echo(), config(tmp_path, num_examples=3, **kw))
    assert not (tmp_path / "run").exists()


async def test_infinite_with_n_and_shuffle_samples_the_head(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    result = await tt.run_eval(
        tt.Env(Endless()), echo(), config(tmp_path, num_examples=4, shuffle=True, seed=1)
    )
    assert sorted(str(e.task.data["prompt"]) for e in result.episodes) == [
        "say 0", "say 1", "say 2", "say 3",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("kw", "flag"),
    [({"max_concurrent": 0}, "-c/--max-concurrent"), ({"rollouts_per_example": 0}, "-r"),
     ({"num_examples": -1}, "-n/--num-examples")],
)  # fmt: skip
async def test_bad_values_name_their_flag(
    autojump_clock: MockClock, tmp_path: Path, kw: dict[str, Any], flag: str
) -> None:
    with pytest.raises(tt.EvalConfigError, match=flag):
        await tt.run_eval(tt.Env(Numbers()), echo(), config(tmp_path, **kw))
    assert not (tmp_path / "run").exists()


async def test_a_non_empty_run_dir_is_refused_without_resume(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    await tt.run_eval(tt.Env(Numbers()), echo(), config(tmp_path, num_examples=1))
    with pytest.raises(tt.EvalConfigError, match="--resume"):
        await tt.run_eval(tt.Env(Numbers()), echo(), config(tmp_path, num_examples=1))


async def test_resume_keeps_whole_ok_rows_and_reruns_exactly_what_is_owed(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    cfg = config(tmp_path, num_examples=4, rollouts_per_example=2)
    first = await tt.run_eval(tt.Env(Numbers()), echo(), cfg)
    path = first.run_dir / "traces.jsonl"
    lines = path.read_text().splitlines()
    failed = json.loads(lines[1])
    failed["ok"] = False
    # Keep rows 0, 2, 3, 4, 5; row 1 failed; row 6 is missing; row 7 is torn.
    kept = [lines[0], json.dumps(failed), *lines[2:6]]
    path.write_text("\n".join(kept) + "\n" + lines[7][: len(lines[7]) // 2])

    resumed = await tt.run_eval(tt.Env(Numbers()), echo(), config(tmp_path, num_examples=4,
                                rollouts_per_example=2, resume=True))  # fmt: skip
    after = rows(resumed.run_dir)
    assert len(after) == 8
    slots = sorted((r["task"]["key"], r["rollout"]) for r in after)
    assert len(set(slots)) == 8  # no duplicates
    assert slots == sorted((json.loads(line)["task"]["key"], json.loads(line)["rollout"])
                           for line in lines)  # fmt: skip
    kept_ids = {json.loads(line)["id"] for line in [lines[0], *lines[2:6]]}
    assert kept_ids <= {r["id"] for r in after}
    assert resumed.summary["kept_from_resume"] == 5
    assert len(resumed.episodes) == 8

    # Nothing owed: a second resume runs nothing and changes nothing.
    again = await tt.run_eval(tt.Env(Numbers()), echo(), config(tmp_path, num_examples=4,
                              rollouts_per_example=2, resume=True))  # fmt: skip
    assert rows(again.run_dir) == after
    assert again.summary["kept_from_resume"] == 8


async def test_resume_refuses_a_differing_config_naming_the_keys(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    await tt.run_eval(tt.Env(Numbers()), echo(), config(tmp_path, num_examples=2))
    with pytest.raises(tt.EvalConfigError, match=r"differs \(num_examples"):
        await tt.run_eval(tt.Env(Numbers()), echo(), config(tmp_path, num_examples=3, resume=True))
    with pytest.raises(tt.EvalConfigError, match="no run to resume"):
        await tt.run_eval(tt.Env(Numbers()), echo(), config(tmp_path / "x", resume=True))


async def test_failed_episodes_are_rows_not_errors(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    class Broken(tt.Env[tt.Task]):
        async def rollout(self, task: tt.Task, ctx: tt.ModelContext) -> Any:
            raise RuntimeError("env broke")

    result = await tt.run_eval(Broken(Numbers()), echo(), config(tmp_path, num_examples=2))
    assert [r["ok"] for r in rows(result.run_dir)] == [False, False]
    assert rows(result.run_dir)[0]["errors"][0]["type"] == "RuntimeError"
    assert result.summary["failed"] == 2


async def test_an_outside_cancel_keeps_finished_rows(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    feed = FeedTaskset()
    feed.put("a", "b")  # then the feed goes quiet: the run waits for a third task
    with trio.move_on_after(30) as scope:
        await tt.run_eval(tt.Env(feed), echo(), config(tmp_path, num_examples=3))
    assert scope.cancelled_caught
    assert feed.closed
    assert len(rows(tmp_path / "run")) == 2
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["interrupted"] is True
    assert summary["finished"] == 2


async def test_resume_tells_apart_two_tasks_that_share_a_key(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    class SameKey(tt.Taskset[tt.Task, tt.TasksetConfig]):
        def load(self) -> Iterable[tt.Task]:
            return [
                tt.Task("say A", answer="A", key="dup"),
                tt.Task("say B", answer="B", key="dup"),
            ]

    first = await tt.run_eval(tt.Env(SameKey()), echo(), config(tmp_path))
    path = first.run_dir / "traces.jsonl"
    only_b = [line for line in path.read_text().splitlines() if "say B" in line]
    path.write_text(only_b[0] + "\n")  # as if killed after B finished, while A ran
    resumed = await tt.run_eval(tt.Env(SameKey()), echo(), config(tmp_path, resume=True))
    assert sorted(str(r["task"]["data"]["prompt"]) for r in rows(resumed.run_dir)) == [
        "say A", "say B",
    ]  # fmt: skip


async def test_an_error_keeps_its_own_cause_through_run_eval(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    class FeedError(Exception):
        pass

    feed = FeedTaskset()
    error = FeedError("the feed broke")
    error.__cause__ = ConnectionResetError("peer reset")  # as `raise ... from reset` sets it
    feed.fail(error)
    with trio.fail_after(5), pytest.raises(FeedError) as info:
        await tt.run_eval(tt.Env(feed), echo(), config(tmp_path, num_examples=3))
    assert isinstance(info.value.__cause__, ConnectionResetError)


async def test_a_row_orjson_cannot_encode_is_written_as_json_would(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    class Huge(tt.Taskset[tt.Task, tt.TasksetConfig]):
        def load(self) -> Iterable[tt.Task]:
            return [tt.Task("say 1", answer="1", info={"id": 2**70})]

    result = await tt.run_eval(tt.Env(Huge()), echo(), config(tmp_path))
    assert rows(result.run_dir)[0]["task"]["data"]["info"] == {"id": 2**70}
