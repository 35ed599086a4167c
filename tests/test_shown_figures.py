"""What the command line, the dashboard and the report show of a run (issue 35, items 4 and
10): each named metric with its mean and 95% interval in `eval`'s and `rescore`'s output and
on the dashboard; a reward mean that says failed rows count 0; the --debug hint only after a
message that gives no fix of its own; the report's turns, tool-call and advantage columns."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import pytest

import trio_tasksets as tt
from trio_tasksets._report import payload
from trio_tasksets._report.data import load_run, run_from_rows
from trio_tasksets._report.figures import compute
from trio_tasksets._report.stats import reward_interval

FIXTURES = Path(__file__).resolve().parent / "fixtures"
if str(FIXTURES) not in sys.path:
    sys.path.insert(0, str(FIXTURES))

from helpers import cli  # noqa: E402

# The echo model repeats the prompt: "exact" passes for even lengths; prompts whose length
# is a multiple of 5 make the reward raise (a failed row).
REWARDS = """
def graded(task, completion):
    n = len(task.prompt)
    return {"reward": float(n % 2 == 0), "exact": float(n % 2 == 0), "chars": float(n)}

def flaky(task, completion):
    n = len(task.prompt)
    if n % 5 == 0:
        raise ValueError("cannot grade this one")
    return {"reward": float(n % 2 == 0), "exact": float(n % 2 == 0), "chars": float(n)}
"""


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rewards.py").write_text(REWARDS)
    return tmp_path


def summary_of(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())  # type: ignore[no-any-return]


def metrics_line(summary: dict[str, Any]) -> str:
    """The named metrics as summary.json holds them, in the line's format."""
    parts = []
    for name, figures in summary["metrics"].items():
        low, high = figures["ci"]
        parts.append(f"{name} {figures['mean']:.3f} [{low:.3f}, {high:.3f}]")
    return "metrics (95% CI): " + ", ".join(parts)


# --- 4: named metrics, with their mean and interval --------------------------------------


@pytest.mark.parametrize(
    ("values", "clusters"),
    [
        ([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0], [0, 0, 1, 1, 2, 2, 3, 3]),  # wilson
        ([1.0, 0.0, 1.0, 0.0], [0, 0, 1, 1]),  # every task's mean equal: n = tasks
        ([1.0] * 6, [0, 1, 2, 3, 4, 5]),  # every value equal
        ([0.25, 0.5, 1.0, 0.75, 0.0, 0.5], [0, 0, 1, 1, 2, 2]),  # clipped t
        ([3.0, -1.0, 2.0, 40.5, 7.25], [0, 1, 2, 3, 4]),  # t
        ([1e6 + 0.001, 1e6 + 0.002, 1e6 + 0.004], [0, 1, 2]),  # far from 0: no precision lost
    ],
)
def test_the_running_interval_is_the_reward_interval(
    values: list[float], clusters: list[int]
) -> None:
    from trio_tasksets._report.stats import RunningInterval

    running = RunningInterval()
    for value, cluster in zip(values, clusters, strict=True):
        running.add(value, f"task-{cluster}")
    expected = reward_interval(values, clusters)
    found = running.interval()
    assert expected is not None
    assert found is not None
    assert found.method == expected.method
    assert (found.low, found.high) == pytest.approx((expected.low, expected.high), rel=1e-9)
    assert running.mean == pytest.approx(sum(values) / len(values), rel=1e-12)


def test_the_running_interval_follows_random_runs_and_needs_two_tasks() -> None:
    from trio_tasksets._report.stats import RunningInterval

    draw = random.Random(35)
    for kind in ("binary", "unit", "wide"):
        values: list[float] = []
        clusters: list[int] = []
        running = RunningInterval()
        assert running.mean is None
        assert running.interval() is None
        for _ in range(200):
            task = draw.randrange(30)
            value = {"binary": float(draw.random() < 0.3), "unit": draw.random(),
                     "wide": draw.gauss(5, 3)}[kind]  # fmt: skip
            values.append(value)
            clusters.append(task)
            running.add(value, task)
        expected, found = reward_interval(values, clusters), running.interval()
        assert expected is not None
        assert found is not None
        assert found.method == expected.method
        assert (found.low, found.high) == pytest.approx((expected.low, expected.high), rel=1e-9)
    one = RunningInterval()
    one.add(1.0, "t")
    one.add(0.0, "t")
    assert one.interval() is None  # one task: no interval, as the summary says


def test_eval_prints_each_named_metric_with_its_interval_and_the_dashboard_shows_it(
    here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli("eval", "echo", "-n", "8", "--reward", "rewards.py:graded", "--run-name", "m",
               "--no-dashboard")  # fmt: skip
    out = capsys.readouterr()
    assert code == 0, out.err
    summary = summary_of(here / "outputs" / "m")
    assert set(summary["metrics"]) == {"exact", "chars"}
    expected = metrics_line(summary)
    lines = out.out.splitlines()
    assert lines[0].startswith("8/8 ok, reward mean ")
    assert lines[1] == expected  # right under the summary line
    # the dashboard's last line (plain: not a terminal) shows the same figures, live
    dashboard = [line for line in out.err.splitlines() if line.startswith("m: ")]
    assert dashboard
    assert dashboard[-1].endswith(f"; {expected}")


def test_an_eval_without_named_metrics_prints_no_metrics_line(
    here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli("eval", "echo", "-n", "3", "--run-name", "plain", "--no-dashboard") == 0
    out = capsys.readouterr()
    assert "metrics" not in out.out
    assert "metrics" not in out.err


def test_rescore_prints_each_named_metric_with_its_interval(
    here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli("eval", "echo", "-n", "8", "--run-name", "r", "--no-dashboard") == 0
    capsys.readouterr()
    assert cli("rescore", "outputs/r", "--reward", "rewards.py:graded", "--run-name", "r2") == 0
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert lines[0].startswith("8/8 ok")
    assert lines[1] == metrics_line(summary_of(here / "outputs" / "r2"))


# --- 10a: the reward mean counts failed rows as 0, and says so ---------------------------


# duplicates: each CLI test runs an eval of its own reward; apart, each names what it shows
def test_the_reward_mean_says_failed_rows_count_0_in_the_cli_the_dashboard_and_the_report(
    here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli("eval", "echo", "-n", "8", "--reward", "rewards.py:flaky", "--run-name", "f",
               "--no-dashboard")  # fmt: skip
    out = capsys.readouterr()
    run_dir = here / "outputs" / "f"
    summary = summary_of(run_dir)
    assert code == 0
    assert summary["failed"] >= 1
    assert summary["ok"] >= 1
    rows = [json.loads(line) for line in (run_dir / "traces.jsonl").read_text().splitlines()]
    assert summary["reward_mean"] == pytest.approx(
        sum(r["reward"] if r["ok"] else 0.0 for r in rows) / len(rows)
    )
    mean = f"{summary['reward_mean']:.3f}"
    assert f"reward mean {mean} (failed rows count 0), " in out.out.splitlines()[0]
    dashboard = [line for line in out.err.splitlines() if line.startswith("f: ")][-1]
    assert f"reward {mean} (failed rows count 0), " in dashboard
    html = tt.report(run_dir).read_text()
    assert "failed rows count 0; 95% CI" in html
    # a run without failures says nothing of the kind
    assert cli("eval", "echo", "-n", "3", "--run-name", "ok", "--no-dashboard") == 0
    out = capsys.readouterr()
    assert "count 0" not in out.out + out.err
    assert "failed rows count 0" not in tt.report(here / "outputs" / "ok").read_text()


async def test_a_rescored_row_whose_reward_raises_counts_0(here: Path) -> None:
    namespace: dict[str, Any] = {}
    exec(REWARDS, namespace)  # the same functions, not imported: no module left behind
    ctx = tt.ModelContext(tt.EchoClient(), "echo")
    config = tt.EvalConfig(output_dir=str(here), run_name="e", dashboard=False)
    first = await tt.run_eval(tt.Env(tt.EchoTaskset(), reward=namespace["graded"]), ctx, config)
    assert all(e.ok and e.metrics for e in first.episodes)
    again = await tt.rescore(first.run_dir, namespace["flaky"], run_name="again")
    failed = [e for e in again.episodes if not e.ok]
    assert failed
    assert all((e.reward, e.metrics) == (0.0, {}) for e in failed)


# --- 10b: "run again with --debug" only when the message gives no fix ---------------------


def test_the_debug_hint_is_left_out_after_a_message_that_gives_its_fix() -> None:
    from trio_tasksets._cli.options import debug_fix

    hint = "run again with --debug for the traceback"
    assert debug_fix("KeyError: 'prompt'", debug=False) == hint
    assert debug_fix("DatasetError: data.jsonl:1: not a JSON line (Expecting value: line 1 "
                     "column 1 (char 0))", debug=False) == hint  # fmt: skip
    assert debug_fix("KeyError: 'prompt'", debug=True) is None  # the traceback is shown
    for message in (
        "DatasetError: HFTaskset reads ... cannot be imported (ModuleNotFoundError: No module "
        "named 'datasets'); install it with pip install 'trio-tasksets[hf]'",
        "the tasks (dict) cannot take one: give them a with_system_prompt(text) method",
        "no worker reads tt:tasks (no consumer group); start one on this Redis",
    ):
        assert debug_fix(message, debug=False) is None


TASKSETS = """
import trio_tasksets as tt

class Plain(tt.Taskset):
    def load(self):
        return [{"prompt": "hi", "key": str(i)} for i in range(3)]

class Broken(tt.Taskset):
    def load(self):
        raise KeyError("prompt")
"""


def test_an_eval_error_that_gives_its_fix_ends_without_the_debug_hint(
    here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (here / "tasks.py").write_text(TASKSETS)
    code = cli("eval", "tasks.py:Plain", "-n", "2", "--system-prompt", "be brief",
               "--no-dashboard")  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1
    assert "give them a with_system_prompt(text) method" in err
    assert "--debug" not in err
    # an error that says nothing of a fix still gets the hint
    assert cli("eval", "tasks.py:Broken", "-n", "2", "--no-dashboard") == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("KeyError: 'prompt'; fix: run again with --debug for the traceback")


# --- 10c: the report's turns, tool calls and advantage columns ----------------------------


def row(i: int, **fields: Any) -> dict[str, Any]:
    return {"id": f"r{i}", "task": {"key": f"t{i // 2}", "data": {"prompt": "p"}},
            "rollout": i % 2, "ok": True, "reward": float(i % 2), "completion": "c",
            "messages": [], "errors": [], "attempts": 1, "timing": {}, "usage": {},
            "finish_reason": "stop", **fields}  # fmt: skip


def test_the_rows_table_gets_turns_tool_calls_and_advantage_only_when_rows_have_them() -> None:
    for turns in (0, 1):  # rows from before turns were counted, single-turn rows
        plain = run_from_rows([row(i, turns=turns, tool_calls=0) for i in range(4)])
        data = payload(plain, compute(plain))
        assert data["more"] == []
        assert data["rows"]["adv"] is None
    agent = run_from_rows([row(i, turns=i + 1, tool_calls=i) for i in range(4)])
    data = payload(agent, compute(agent))
    assert data["more"] == ["tn", "tc"]
    assert (data["rows"]["tn"], data["rows"]["tc"]) == ([1, 2, 3, 4], [0, 1, 2, 3])
    grouped = run_from_rows([row(i, group=f"g{i // 2}", advantage=i % 2 - 0.5) for i in range(4)])
    data = payload(grouped, compute(grouped))
    assert data["more"] == ["adv"]
    assert data["rows"]["adv"] == [-0.5, 0.5, -0.5, 0.5]
    assert "advantage" not in (grouped.extra.get(0) or {})  # a column now, not "other fields"


async def test_a_grouped_tool_run_reports_its_columns(tmp_path: Path) -> None:
    """A `--group` run of a tool env: its rows' turns, tool calls and advantages reach the
    page's data (and the page's script, which shows `more`, is checked in Chromium)."""

    @tt.tool
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    class Scored(tt.ToolEnv[tt.Task]):
        async def score_group(self, task: tt.Task, episodes: list[tt.Episode]) -> None:
            for n, episode in enumerate(episodes):
                episode.advantage = n - 0.5

    def answer(messages: list[dict[str, Any]], tools: Any) -> Any:
        if messages[-1]["role"] == "tool":  # the tool answered: the final reply
            return tt.testing.reply("3")
        return tt.testing.reply(tool_calls=[("add", {"a": 1, "b": 2})])

    script = tt.testing.ScriptedClient(answer)
    env = Scored(tt.EchoTaskset(), tools=[add])
    config = tt.EvalConfig(output_dir=str(tmp_path), run_name="g", dashboard=False,
                           num_examples=2, rollouts_per_example=2, group=True,
                           max_concurrent=1)  # fmt: skip
    result = await tt.run_eval(env, tt.ModelContext(script, "scripted"), config)
    run = load_run(result.run_dir)
    data = payload(run, compute(run))
    assert data["more"] == ["tn", "tc", "adv"]
    assert data["rows"]["tn"] == [2] * 4
    assert data["rows"]["tc"] == [1] * 4
    assert sorted(data["rows"]["adv"]) == [-0.5, -0.5, 0.5, 0.5]
