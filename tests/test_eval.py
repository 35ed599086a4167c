"""run_eval, SPEC section 4, in process: planning, the window, traces, resume, refusals."""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
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
    return tt.EvalConfig(**{"output_dir": str(tmp_path), "run_name": "run", "dashboard": False,
                            **kw})  # fmt: skip


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
        "attempts", "timing", "usage", "finish_reason", "turns", "tool_calls", "stop_reason",
        "metrics",
    }  # fmt: skip
    assert {(r["turns"], r["tool_calls"], r["stop_reason"]) for r in written} == {(1, 0, None)}
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
    with pytest.raises(tt.EvalConfigError, match="num_examples"):
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
    [({"max_concurrent": 0}, "max_concurrent"),
     ({"rollouts_per_example": 0}, "rollouts_per_example"),
     ({"num_examples": -1}, "num_examples")],
)  # fmt: skip
async def test_bad_values_name_their_parameter(
    autojump_clock: MockClock, tmp_path: Path, kw: dict[str, Any], flag: str
) -> None:
    # The library names the parameter (the command line shows its flag instead).
    with pytest.raises(tt.EvalConfigError, match=f"^{flag} ") as raised:
        await tt.run_eval(tt.Env(Numbers()), echo(), config(tmp_path, **kw))
    assert raised.value.parameter == flag
    assert "--" not in str(raised.value)
    assert not (tmp_path / "run").exists()


async def test_a_non_empty_run_dir_is_refused_without_resume(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    await tt.run_eval(tt.Env(Numbers()), echo(), config(tmp_path, num_examples=1))
    with pytest.raises(tt.EvalConfigError, match="pass resume"):
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
    assert summary["stopped"] == "cancelled"


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


# --- how an eval ends (SPEC 4b) ---------------------------------------------------------------


class FailsOn(tt.Env[tt.Task]):
    """Fails the tasks whose prompt is in `failing` (a RuntimeError), echoes the others."""

    failing: frozenset[str] = frozenset()

    async def rollout(self, task: tt.Task, ctx: tt.ModelContext) -> Any:
        if task.prompt in self.failing:
            await trio.sleep(1)
            raise RuntimeError(f"no luck with {task.prompt}")
        return await super().rollout(task, ctx)


def fails_on(*prompts: str, taskset: tt.Taskset[tt.Task, Any] | None = None) -> FailsOn:
    env = FailsOn(taskset if taskset is not None else Numbers())
    env.failing = frozenset(prompts)
    return env


ALL = [f"say {i}" for i in range(8)]


@pytest.mark.parametrize(("limit", "finished"), [(3, 3), (0.25, 3), (1, 1)])
async def test_max_failures_stops_drains_and_says_why(
    autojump_clock: MockClock, tmp_path: Path, limit: float, finished: int
) -> None:
    """N: stop once N failed; FRACTION of a static plan: once more than that share of the 8
    planned slots failed (0.25 -> at the 3rd). Nothing in flight is lost: the window is 1."""
    result = await tt.run_eval(
        fails_on(*ALL), echo(), config(tmp_path, max_failures=limit, max_concurrent=1)
    )
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary == {**summary, "stopped": "max_failures", "finished": finished, "ok": 0}
    assert summary["error"].startswith(f"max_failures {limit:g}: {finished}")
    assert "--" not in summary["error"]  # the library names the parameter; the CLI, its flag
    assert summary["errors_by_type"] == {"RuntimeError": finished}
    first = summary["first_error"]
    assert (first["type"], first["message"]) == ("RuntimeError", "no luck with say 0")
    assert "no luck with" in first["traceback"]  # raised by the test's env: the user's frames
    assert len(rows(result.run_dir)) == finished


async def test_max_failures_fraction_on_a_stream_counts_the_finished_ones(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    feed = FeedTaskset()
    feed.put("ok 1", "bad 2", "bad 3", "ok 4", "ok 5")
    env = fails_on("bad 2", "bad 3", taskset=feed)
    with trio.fail_after(60):
        result = await tt.run_eval(
            env, echo(), config(tmp_path, num_examples=5, max_failures=0.5, max_concurrent=1)
        )
    # 1 of 2 finished is not more than half; 2 of 3 is.
    assert (result.summary["stopped"], result.summary["finished"]) == ("max_failures", 3)
    assert feed.closed


async def test_without_max_failures_failures_never_stop_the_run(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    result = await tt.run_eval(fails_on(*ALL), echo(), config(tmp_path, max_concurrent=2))
    assert result.summary["finished"] == result.summary["failed"] == 8
    assert result.summary["stopped"] is None
    assert result.summary["error"] is None


async def test_the_summary_counts_errors_by_type_names_the_first_and_sums_usage(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    class Mixed(tt.Env[tt.Task]):
        async def rollout(self, task: tt.Task, ctx: tt.ModelContext) -> Any:
            if task.prompt in ("say 1", "say 2"):
                raise ValueError(f"bad {task.prompt}")
            if task.prompt == "say 5":
                raise KeyError("five")
            return await super().rollout(task, ctx)

    result = await tt.run_eval(Mixed(Numbers()), echo(), config(tmp_path, max_concurrent=1))
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary["errors_by_type"] == {"ValueError": 2, "KeyError": 1}
    first = summary["first_error"]
    assert (first["type"], first["message"]) == ("ValueError", "bad say 1")
    # The echo model counts words: "say i" in, "say i" out, for each of the 5 that ran.
    assert summary["usage"] == {"prompt_tokens": 10, "completion_tokens": 10}
    assert [r["usage"] for r in rows(result.run_dir) if r["ok"]] == [
        {"prompt_tokens": 2, "completion_tokens": 2}
    ] * 5
    assert {r["finish_reason"] for r in rows(result.run_dir)} == {"stop", None}
    assert (summary["stopped"], summary["error"], summary["interrupted"]) == (None, None, False)


async def test_a_run_that_fails_before_its_first_slot_leaves_no_run_dir(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    class NoSandbox(tt.Env[tt.Task]):
        def serving(self) -> Any:
            raise RuntimeError("no sandbox today")

    out = tmp_path / "out"
    cfg = tt.EvalConfig(output_dir=str(out), run_name="r", dashboard=False)
    with pytest.raises(RuntimeError, match="no sandbox today"):
        await tt.run_eval(NoSandbox(Numbers()), echo(), cfg)
    assert not out.exists()  # neither the run dir nor the -o it made
    result = await tt.run_eval(tt.Env(Numbers()), echo(), cfg)  # the same name starts afresh
    assert len(rows(result.run_dir)) == 8


async def test_a_feed_that_breaks_midway_is_the_summary_error(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    class FeedError(Exception):
        pass

    feed = FeedTaskset()
    feed.put("a", "b")
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:

            async def break_later() -> None:
                await trio.sleep(10)
                feed.fail(FeedError("the feed broke"))

            nursery.start_soon(break_later)
            with pytest.raises(FeedError):
                await tt.run_eval(tt.Env(feed), echo(), config(tmp_path, num_examples=5))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["error"] == "FeedError: the feed broke"
    assert (summary["finished"], summary["stopped"], summary["interrupted"]) == (2, None, True)


async def test_config_json_records_what_reproduces_the_run(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    # Nothing answers at port 9: the one slot fails (a run that plans no slot writes nothing).
    ctx = tt.ModelContext(tt.OpenAIClient("http://127.0.0.1:9/v1"), "m")
    cfg = config(tmp_path, num_examples=1, command=["trio-tasksets", "eval", "x"],
                 api_key_var="MY_KEY")  # fmt: skip
    result = await tt.run_eval(tt.Env(Numbers()), ctx, cfg)
    await ctx.client.aclose()
    saved = json.loads((result.run_dir / "config.json").read_text())
    assert saved["version"] == tt.__version__
    assert saved["command"] == ["trio-tasksets", "eval", "x"]
    assert saved["base_url"] == "http://127.0.0.1:9/v1"
    assert saved["api_key_var"] == "MY_KEY"
    assert datetime.fromisoformat(saved["started_at"]).tzinfo is not None
    assert "command" not in saved["eval"]
    # Where the slots ran, under the keys of the settings that name the built-in backends:
    assert {k: saved["eval"][k] for k in ("serve", "workers", "server_url", "via", "stream")} == {
        "serve": False, "workers": 1, "server_url": None, "via": None, "stream": None,
    }  # fmt: skip
    assert "backend" not in saved["eval"]
    assert "_serve" not in saved["eval"]


def test_an_eval_config_is_valid_once_built_and_names_every_bad_parameter() -> None:
    with pytest.raises(tt.EvalConfigError) as raised:
        tt.EvalConfig(
            num_examples=-1, max_concurrent=0, workers=0, time_limit=-5,
            group="yes",  # type: ignore[arg-type]
        )  # fmt: skip
    assert raised.value.parameters == (
        "num_examples", "max_concurrent", "workers", "time_limit", "group",
    )  # fmt: skip
    assert isinstance(raised.value, tt.ConfigError)
    assert "--" not in str(raised.value)
    # A contradiction is named with the bad values, each fine field checked alone:
    with pytest.raises(tt.EvalConfigError) as raised:
        tt.EvalConfig(num_examples=-1, workers=2, engine_metrics="http://h/metrics")
    assert raised.value.parameters == (
        "num_examples", "workers", "serve", "engine_metrics", "max_concurrent",
    )  # fmt: skip
    # A bad value assigned later is refused too, and the config keeps its value:
    config = tt.EvalConfig(run_name="r")
    with pytest.raises(tt.EvalConfigError, match="plain directory name") as raised:
        config.run_name = "a/b"
    assert (raised.value.parameters, config.run_name) == (("run_name",), "r")
    with pytest.raises(tt.EvalConfigError) as raised:  # a contradiction, by assignment
        config.engine_metrics = "http://h/metrics"
    assert raised.value.parameters == ("engine_metrics", "max_concurrent")
    assert config.engine_metrics is None


@pytest.mark.parametrize(
    ("kw", "parameter"),
    [({"shuffle": 1}, "shuffle"), ({"seed": "1"}, "seed"), ({"resume": None}, "resume"),
     ({"output_dir": 3}, "output_dir"), ({"run_name": ".."}, "run_name"),
     ({"dashboard": "no"}, "dashboard"), ({"max_failures": 0}, "max_failures"),
     ({"max_failures": 1.5}, "max_failures"), ({"backend": object()}, "backend"),
     ({"time_limit": float("nan")}, "time_limit"), ({"metrics_port": 70000}, "metrics_port"),
     ({"engine_metrics": "h:1/metrics"}, "engine_metrics"), ({"command": "eval"}, "command"),
     ({"api_key_var": 1}, "api_key_var"), ({"max_consecutive_failures": 0},
                                            "max_consecutive_failures"),
     ({"rollouts_per_example": True}, "rollouts_per_example")],
)  # fmt: skip
def test_every_field_is_validated(kw: dict[str, Any], parameter: str) -> None:
    with pytest.raises(tt.EvalConfigError) as raised:
        tt.EvalConfig(**kw)
    assert raised.value.parameters == (parameter,)
    assert str(raised.value).startswith(parameter)


def test_evolve_keeps_working() -> None:
    import attrs

    base = tt.EvalConfig(num_examples=3, serve=True, workers=2)
    changed = attrs.evolve(base, num_examples=5)
    assert (changed.num_examples, changed.backend) == (5, base.backend)
    assert attrs.evolve(tt.EvalConfig(), serve=True).backend == tt.ServedBackend()
    with pytest.raises(tt.EvalConfigError, match="num_examples"):
        attrs.evolve(base, num_examples=-1)


async def test_resume_without_a_run_name_picks_the_latest_of_the_same_taskset_and_model(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    older = await tt.run_eval(tt.Env(Numbers()), echo(), config(tmp_path, run_name="older"))
    await trio.sleep(1)
    newer = await tt.run_eval(tt.Env(Numbers()), echo(), config(tmp_path, run_name="newer"))
    other = tt.ModelContext(tt.EchoClient(), "other-model")
    await trio.sleep(1)
    await tt.run_eval(tt.Env(Numbers()), other, config(tmp_path, run_name="other"))
    (newer.run_dir / "traces.jsonl").write_text("")  # newer owes every slot
    assert tt._eval.latest_run(tt.Env(Numbers()), echo(), str(tmp_path)) == newer.run_dir
    resumed = await tt.run_eval(
        tt.Env(Numbers()), echo(), config(tmp_path, run_name=None, resume=True)
    )
    assert resumed.run_dir == newer.run_dir
    assert len(rows(newer.run_dir)) == 8
    assert len(rows(older.run_dir)) == 8
    with pytest.raises(tt.EvalConfigError, match="run_name"):
        await tt.run_eval(tt.Env(Endless()), echo(),
                          config(tmp_path, run_name=None, resume=True, num_examples=1))  # fmt: skip


async def test_n_larger_than_a_static_taskset_says_so(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    with pytest.warns(tt._eval.EvalWarning, match=r"num_examples 20 .* \(8 tasks\)"):
        result = await tt.run_eval(tt.Env(Numbers()), echo(), config(tmp_path, num_examples=20))
    assert len(result.episodes) == 8


OLD_ECHO = "trio_tasksets.builtin:EchoTaskset"  # privatise: keep (the path before the move)
OLD_FEED = "trio_tasksets.redis.feed:RedisStreamTaskset"  # privatise: keep
OLD_NOTHING = "trio_tasksets.builtin:NoSuchThing"  # privatise: keep


def test_a_label_an_earlier_release_recorded_reads_as_its_public_home_today() -> None:
    from trio_tasksets._env.loading import upgraded_label

    assert upgraded_label(OLD_ECHO) == "trio_tasksets:EchoTaskset"
    assert upgraded_label(OLD_FEED) == "trio_tasksets.redis:RedisStreamTaskset"
    for unchanged in ("trio_tasksets:EchoTaskset", OLD_NOTHING, "my_tasks.py:Numbers",
                      "othermod.sub:EchoTaskset", None):  # fmt: skip
        assert upgraded_label(unchanged) == unchanged


async def test_resume_accepts_a_run_an_earlier_release_recorded_by_its_old_module_path(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    first = await tt.run_eval(tt.Env(tt.EchoTaskset()), echo(), config(tmp_path, num_examples=4))
    config_path = first.run_dir / "config.json"
    saved = json.loads(config_path.read_text())
    assert saved["identity"]["taskset"] == "trio_tasksets:EchoTaskset"
    saved["identity"]["taskset"] = OLD_ECHO
    config_path.write_text(json.dumps(saved))
    traces = first.run_dir / "traces.jsonl"
    traces.write_text("".join(traces.read_text().splitlines(keepends=True)[:2]))

    assert tt._eval.latest_run(tt.Env(tt.EchoTaskset()), echo(), str(tmp_path)) == first.run_dir
    resumed = await tt.run_eval(tt.Env(tt.EchoTaskset()), echo(),
                                config(tmp_path, num_examples=4, resume=True))  # fmt: skip
    assert resumed.summary["kept_from_resume"] == 2
    assert len(rows(resumed.run_dir)) == 4
