"""`eval --reward SPEC` and `trio-tasksets rescore RUN_DIR --reward SPEC` (issue 25): score
with a reward named on the command line, and score an existing run again without the model.
The model is the project's fake OpenAI server, which counts its requests."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import trio_tasksets as tt
from trio_tasksets._eval.rescore import rescore

FIXTURES = Path(__file__).resolve().parent / "fixtures"
if str(FIXTURES) not in sys.path:
    sys.path.insert(0, str(FIXTURES))

from chat_server import ChatServer  # noqa: E402
from helpers import cli  # noqa: E402

REWARDS = """
def contains_answer(task, completion):
    return 1.0 if task.answer in completion else 0.0

async def strict(task, completion):
    return {"reward": float(completion.strip() == task.answer), "chars": len(completion)}

def picky(task, completion):
    if "7" in task.prompt:
        raise ValueError("cannot grade sevens")
    return 1.0
"""


@pytest.fixture(scope="module")
def server() -> Iterator[ChatServer]:
    with ChatServer() as chat:
        yield chat


def rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "traces.jsonl").read_text().splitlines()]


@pytest.fixture
def arith(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rewards.py").write_text(REWARDS)
    lines = [json.dumps({"question": f"What is {i} + {i}?", "answer": str(2 * i)})
             for i in range(9)]  # fmt: skip
    (tmp_path / "arith.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path


def test_eval_reward_scores_with_the_named_function(
    arith: Path, server: ChatServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli("eval", "arith.jsonl", "--reward", "rewards.py:strict", "-m", "m",
               "--base-url", server.url, "--run-name", "s", "--no-dashboard")  # fmt: skip
    assert code == 0, capsys.readouterr().err
    written = rows(arith / "outputs" / "s")
    # the server adds one to sums that are multiples of 3
    for row in written:
        assert row["reward"] == float(row["completion"] == row["task"]["data"]["answer"])
        assert row["metrics"] == {"chars": float(len(row["completion"]))}
    assert 0 < sum(r["reward"] for r in written) < 9


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--reward", "rewards.py:nope"], "--reward rewards.py:nope: "),
     (["--reward", "rewards.py:strict", "--via", "redis://127.0.0.1:9/0", "-m", "m"],
      "--reward with --via: the workers score the episodes")],
)  # fmt: skip
def test_eval_reward_usage_errors(
    arith: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert cli("eval", "arith.jsonl", *args, "--no-dashboard") == 2
    assert message in capsys.readouterr().err


def test_rescore_writes_a_new_run_without_calling_the_model(
    arith: Path, server: ChatServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli("eval", "arith.jsonl", "-m", "m", "--base-url", server.url, "--run-name", "r",
               "--no-dashboard") == 0  # fmt: skip
    before = rows(arith / "outputs" / "r")
    server.reset()
    capsys.readouterr()
    code = cli("rescore", "outputs/r", "--reward", "rewards.py:strict", "--run-name", "r2")
    assert code == 0, capsys.readouterr().err
    out = capsys.readouterr()
    assert server.requests == []  # the model was not called
    assert out.out.startswith("9/9 ok")
    assert "into outputs/r2" in out.err
    after = {r["id"]: r for r in rows(arith / "outputs" / "r2")}
    assert set(after) == {r["id"] for r in before}
    for old in before:
        new = after[old["id"]]
        assert new["completion"] == old["completion"]
        assert new["messages"] == old["messages"]
        assert new["usage"] == old["usage"]
        assert new["reward"] == float(old["completion"] == old["task"]["data"]["answer"])
        assert new["metrics"] == {"chars": float(len(old["completion"]))}
    summary = json.loads((arith / "outputs" / "r2" / "summary.json").read_text())
    assert summary["reward_mean"] == sum(r["reward"] for r in after.values()) / 9
    assert summary["rescored_from"] == "outputs/r"
    assert summary["metrics"]["chars"]["n"] == 9
    config = json.loads((arith / "outputs" / "r2" / "config.json").read_text())
    assert config["rescore"] == {"from": "outputs/r", "reward": "rewards.py:strict"}
    assert rows(arith / "outputs" / "r") == before  # the source is never rewritten
    # the new run dir is a run dir like any other
    assert tt.report(arith / "outputs" / "r2").is_file()


async def test_a_reward_that_raises_fails_its_row_and_failed_rows_are_kept(
    arith: Path,
) -> None:
    ctx = tt.ModelContext(tt.EchoClient(), "echo")
    env = tt.Env(tt.JsonlTaskset("arith.jsonl"))
    config = tt.EvalConfig(output_dir=str(arith), run_name="e", dashboard=False)
    first = await tt.run_eval(env, ctx, config)
    sys.path.insert(0, str(arith))
    try:
        import rewards  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(arith))
    result = await rescore(first.run_dir, rewards.picky, run_name="p", window=2)
    by_prompt = {e.task.data["prompt"]: e for e in result.episodes}
    failed = by_prompt["What is 7 + 7?"]
    assert (failed.ok, failed.errors[-1].type) == (False, "ValueError")
    assert failed.errors[-1].message == "cannot grade sevens"
    assert result.summary["ok"] == 8
    assert result.summary["errors_by_type"] == {"ValueError": 1}
    # rescoring the rescored run: the failed row has its completion, so it is scored again
    again = await rescore(result.run_dir, rewards.contains_answer, run_name="q")
    assert again.summary["ok"] == 9


async def test_rescore_refuses_what_is_not_a_run_dir_and_an_existing_target(
    tmp_path: Path,
) -> None:
    with pytest.raises(tt.EvalConfigError, match="is not a run dir"):
        await rescore(tmp_path, lambda t, c: 1.0)
    ctx = tt.ModelContext(tt.EchoClient(), "echo")
    from trio_tasksets._core.builtin import EchoTaskset

    config = tt.EvalConfig(output_dir=str(tmp_path), run_name="e", dashboard=False)
    run_dir = (await tt.run_eval(tt.Env(EchoTaskset()), ctx, config)).run_dir
    with pytest.raises(tt.EvalConfigError, match="already holds a run") as held:
        await rescore(run_dir, lambda t, c: 1.0, run_name="e")
    assert "choose another run_name or output_dir" in str(held.value)


def test_cli_rescore_of_a_missing_run_dir_exits_2(
    arith: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli("rescore", "nothing", "--reward", "rewards.py:strict") == 2
    err = capsys.readouterr().err
    assert "rescore: error: nothing is not a run dir (no config.json)" in err
    assert cli("rescore", "nothing", "--reward", "rewards.py:missing") == 2
    assert "--reward rewards.py:missing: " in capsys.readouterr().err
