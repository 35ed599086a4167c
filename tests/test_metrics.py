"""Named metrics (issue 25): a reward returning a mapping with a `reward` entry, or several
weighted reward functions; rows keep `metrics`, summary.json and the report show each one's
mean and interval, a resume keeps them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import trio_tasksets as tt
from trio_tasksets._report.data import load_run
from trio_tasksets._report.figures import compute
from trio_tasksets._report.stats import reward_interval


class Words(tt.Taskset[tt.Task, tt.TasksetConfig]):
    """Six prompts the echo model repeats; the answer is in half of them."""

    def load(self) -> list[tt.Task]:
        return [
            tt.Task(f"say {'yes' if i % 2 else 'no'} {'x' * i}", answer="yes", key=f"w{i}")
            for i in range(6)
        ]


def named(task: tt.Task, completion: str) -> dict[str, float]:
    exact = 1.0 if "yes" in completion else 0.0
    return {"reward": exact, "exact": exact, "length": float(len(completion))}


def config(tmp_path: Path, **kw: Any) -> tt.EvalConfig:
    return tt.EvalConfig(output_dir=str(tmp_path), run_name="m", dashboard=False, **kw)


def rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "traces.jsonl").read_text().splitlines()]


ECHO = tt.ModelContext(tt.EchoClient(), "echo")


async def test_a_reward_returning_a_mapping_fills_reward_and_metrics(tmp_path: Path) -> None:
    result = await tt.run_eval(tt.Env(Words(), reward=named), ECHO, config(tmp_path))
    written = rows(result.run_dir)
    by_key = {r["task"]["key"]: r for r in written}
    assert by_key["w1"]["reward"] == 1.0
    assert by_key["w1"]["metrics"] == {"exact": 1.0, "length": float(len("say yes x"))}
    assert by_key["w0"]["metrics"]["exact"] == 0.0
    summary = result.summary
    assert summary["reward_mean"] == 0.5
    exact = summary["metrics"]["exact"]
    assert (exact["mean"], exact["n"], exact["ci_method"]) == (0.5, 6, "wilson")
    expected = reward_interval([r["metrics"]["exact"] for r in written], list(range(6)))
    assert expected is not None
    assert exact["ci"] == pytest.approx([expected.low, expected.high])
    lengths = [r["metrics"]["length"] for r in written]
    assert summary["metrics"]["length"]["mean"] == pytest.approx(sum(lengths) / 6)
    assert summary["metrics"]["length"]["ci_method"] == "t"


async def test_weighted_reward_functions_sum_to_the_reward_and_keep_each_score(
    tmp_path: Path,
) -> None:
    def exact(task: tt.Task, completion: str) -> float:
        return 1.0 if "yes" in completion else 0.0

    async def short(task: tt.Task, completion: str) -> float:
        return 1.0 if len(completion) < 10 else 0.0

    env = tt.Env(Words(), reward={"exact": exact, "short": (short, 0.5)})
    result = await tt.run_eval(env, ECHO, config(tmp_path))
    for row in rows(result.run_dir):
        metrics = row["metrics"]
        assert set(metrics) == {"exact", "short"}
        assert row["reward"] == metrics["exact"] + 0.5 * metrics["short"]
    assert set(result.summary["metrics"]) == {"exact", "short"}


@pytest.mark.parametrize(
    ("reward", "error"),
    [(lambda t, c: {"exact": 1.0}, "must give its reward as the 'reward' entry"),
     (lambda t, c: {"reward": 1.0, "bad": float("nan")}, "metric 'bad' is nan"),
     (lambda t, c: {"reward": 1.0, "bad": "x"}, "metric 'bad' is 'x'")],
)  # fmt: skip
async def test_a_bad_mapping_is_an_episode_error_naming_the_entry(
    tmp_path: Path, reward: Any, error: str
) -> None:
    result = await tt.run_eval(tt.Env(Words(), reward=reward), ECHO, config(tmp_path))
    assert result.summary["ok"] == 0
    assert error in result.summary["first_error"]["message"]


def test_weighted_rewards_are_checked_when_the_env_is_built() -> None:
    with pytest.raises(ValueError, match="at least one"):
        tt.Env(Words(), reward={})
    with pytest.raises(TypeError, match="reward 'x': the weight must be a number"):
        tt.Env(Words(), reward={"x": (named, "heavy")})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="'reward' names the weighted sum"):
        tt.Env(Words(), reward={"reward": named})


async def test_metrics_survive_a_resume_and_the_report_shows_each(tmp_path: Path) -> None:
    first = await tt.run_eval(tt.Env(Words(), reward=named), ECHO, config(tmp_path))
    again = await tt.run_eval(tt.Env(Words(), reward=named), ECHO, config(tmp_path, resume=True))
    assert again.summary["kept_from_resume"] == 6
    assert again.summary["metrics"] == first.summary["metrics"]

    def by_key(result: tt.EvalResult) -> dict[str, dict[str, float]]:
        return {e.task.key: e.metrics for e in result.episodes}

    assert by_key(again) == by_key(first)
    figures = compute(load_run(again.run_dir))
    mean, n, interval = figures.metrics["exact"]
    assert (mean, n) == (0.5, 6)
    assert interval is not None
    assert interval.method == "wilson"
    html = tt.report(again.run_dir).read_text()
    assert 'data-figure="metric:exact"' in html
    assert 'data-figure="metric:length"' in html
    assert "wilson" in html


async def test_rows_without_metrics_have_an_empty_mapping_and_no_summary_entries(
    tmp_path: Path,
) -> None:
    result = await tt.run_eval(tt.Env(Words()), ECHO, config(tmp_path))
    assert {json.dumps(r["metrics"]) for r in rows(result.run_dir)} == {"{}"}
    assert result.summary["metrics"] == {}
    run = load_run(result.run_dir)
    # an empty `metrics` is not carried along as an unknown field of every row
    assert not any("metrics" in other for other in run.extra.values())
    assert compute(run).metrics == {}


async def test_a_tasksets_weighted_rewards_and_the_served_path_carry_metrics(
    tmp_path: Path,
) -> None:
    """A taskset may declare `reward = {name: fn or (fn, weight)}`; with --serve (the env in
    a server process) the rows' metrics come back over the wire the same."""
    (tmp_path / "scored.py").write_text(
        "import trio_tasksets as tt\n\n"
        "def exact(task, completion):\n    return float('yes' in completion)\n\n"
        "def length(task, completion):\n    return float(len(completion))\n\n"
        "class Scored(tt.Taskset):\n"
        "    reward = {'exact': exact, 'length': (length, 0.0)}\n\n"
        "    def load(self):\n"
        "        return [tt.Task(f'say {w}', answer='yes', key=w) for w in ('yes', 'no')]\n"
    )
    from trio_tasksets._env.loading import load_object

    scored = load_object(f"{tmp_path / 'scored.py'}:Scored")
    here = await tt.run_eval(tt.Env(scored()), ECHO, config(tmp_path))
    served = await tt.run_eval(
        tt.Env(scored()),
        ECHO,
        tt.EvalConfig(output_dir=str(tmp_path), run_name="s", dashboard=False, serve=True),
    )
    for result in (here, served):
        by_key = {e.task.key: e for e in result.episodes}
        assert by_key["yes"].reward == 1.0
        assert by_key["yes"].metrics == {"exact": 1.0, "length": 7.0}
        assert by_key["no"].metrics == {"exact": 0.0, "length": 6.0}
    assert rows(served.run_dir)[0]["metrics"] in ({"exact": 1.0, "length": 7.0},
                                                  {"exact": 0.0, "length": 6.0})  # fmt: skip
