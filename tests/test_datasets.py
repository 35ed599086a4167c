"""Dataset loaders (issue 25): `tt.JsonlTaskset`, `tt.CsvTaskset`, `tt.HFTaskset`, and the
TASKSET forms `data.jsonl`, `data.csv`, `hf:NAME[:SPLIT]` with `--prompt-field`,
`--answer-field` and `--follow`. Lazy reads, the rest of a record in `info`, clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import trio
from helpers import cli

import trio_tasksets as tt
from trio_tasksets._core.datasets import record_problem


def write_jsonl(path: Path, records: list[dict[str, Any]], tail: str = "") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


def rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "traces.jsonl").read_text().splitlines()]


SUMS = [{"question": f"What is {i} + 1?", "answer": i + 1, "level": i % 3} for i in range(20)]


def test_a_jsonl_record_is_a_task_with_the_rest_in_info(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "data.jsonl", SUMS[:2])
    tasks = list(tt.JsonlTaskset(path))
    assert tasks == [
        tt.Task("What is 0 + 1?", answer="1", info={"level": 0}),
        tt.Task("What is 1 + 1?", answer="2", info={"level": 1}),
    ]
    assert tasks[0].key == next(iter(tt.JsonlTaskset(str(path)))).key  # stable: resume finds it
    named = list(tt.JsonlTaskset(path, prompt_field="level", answer_field="question"))
    assert named[1] == tt.Task("1", answer="What is 1 + 1?", info={"answer": 2})


def test_chat_messages_as_the_prompt_and_a_missing_answer(tmp_path: Path) -> None:
    chat = [{"role": "user", "content": "hi"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": chat, "id": 7}])
    (task,) = tt.JsonlTaskset(path)
    assert (task.prompt, task.answer, task.info) == (chat, None, {"id": 7})


def test_head_reads_only_the_records_it_takes(tmp_path: Path) -> None:
    """-n 10 of a huge file decodes 10 records: the 11th line is not JSON, and is never read
    as a record (read, it is a task whose row fails, naming the file and line)."""
    path = write_jsonl(tmp_path / "big.jsonl", SUMS[:10], tail="{not json\n" * 1000)
    assert len(list(tt.JsonlTaskset(path).head(10))) == 10
    eleventh = list(tt.JsonlTaskset(path).head(11))[-1]
    assert str(record_problem(eleventh)).startswith(f"{path}:11: not a JSON line")


def test_eval_of_a_data_file_with_n_reads_n_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "big.jsonl", SUMS[:10], tail="{not json\n" * 1000)
    assert cli("eval", "big.jsonl", "-n", "10", "--run-name", "r", "--no-dashboard") == 0
    written = rows(tmp_path / "outputs" / "r")
    assert len(written) == 10
    assert sorted(r["task"]["data"]["prompt"] for r in written) == sorted(
        str(r["question"]) for r in SUMS[:10]
    )
    assert {json.dumps(r["task"]["data"]["info"]) for r in written} == {
        json.dumps({"level": level}) for level in range(3)
    }
    summary = json.loads((tmp_path / "outputs" / "r" / "summary.json").read_text())
    assert summary["taskset"] == "big.jsonl"


def test_eval_of_jsonl_and_csv_with_named_fields(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "qa.csv").write_text("q,a,topic\nsay yes,yes,x\nsay no,maybe,y\n")
    code = cli("eval", "qa.csv", "--prompt-field", "q", "--answer-field", "a",
               "--run-name", "c", "--no-dashboard")  # fmt: skip
    assert code == 0
    written = sorted(rows(tmp_path / "outputs" / "c"), key=lambda r: r["completion"])
    assert [(r["completion"], r["reward"]) for r in written] == [("say no", 0.0), ("say yes", 1.0)]
    assert written[1]["task"]["data"]["info"] == {"topic": "x"}
    # the run is named by the file, and --resume finds it
    assert cli("eval", "qa.csv", "--prompt-field", "q", "--answer-field", "a", "--resume",
               "--no-dashboard") == 0  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [(["missing.jsonl"], "no file missing.jsonl"),
     (["echo", "--prompt-field", "q"], "--prompt-field applies to a data file TASKSET"),
     (["qa.csv", "--follow", "-n", "1"], "--follow follows a growing JSONL file"),
     (["qa.csv", "-a", '{"delimiter": 3}'], "field 'delimiter' takes a string")],
)  # fmt: skip
def test_data_file_usage_errors_exit_2(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    message: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "qa.csv").write_text("q,a\nx,y\n")
    assert cli("eval", *args, "--no-dashboard") == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "outputs").exists()


def test_a_record_without_a_prompt_names_the_line_and_the_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}, {"text": "b", "label": 1}])
    assert cli("eval", "d.jsonl", "--no-dashboard") == 1
    err = capsys.readouterr().err
    assert "d.jsonl:2: the record has no 'prompt' or 'question' for the prompt" in err
    assert "(its fields: text, label)" in err
    assert "--prompt-field NAME" in err
    assert not (tmp_path / "outputs").exists()  # found while planning: nothing written


def test_a_loader_built_in_python_runs_under_run_eval(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "say ok", "answer": "ok"}] * 3)
    config = tt.EvalConfig(output_dir=str(tmp_path), run_name="p", dashboard=False)
    env = tt.Env(tt.JsonlTaskset(tt.JsonlConfig(path=str(path))))
    result = trio.run(tt.run_eval, env, tt.ModelContext(tt.EchoClient(), "echo"), config)
    assert result.summary["ok"] == 3
    assert result.summary["reward_mean"] == 1.0


# --- --follow: a feed of the lines appended to a file ----------------------------------------


async def test_follow_yields_lines_as_they_are_appended_and_waits_for_whole_ones(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    path = write_jsonl(tmp_path / "feed.jsonl", [{"prompt": "one"}])
    taskset = tt.JsonlTaskset(path, follow=True)
    assert taskset.streaming
    with trio.fail_after(60):
        async with taskset.channel() as tasks:
            assert (await tasks.receive()).prompt == "one"
            with path.open("a") as file:
                file.write('{"prompt": "tw')  # half a line: not a task yet
            with trio.move_on_after(5):
                await tasks.receive()
                pytest.fail("a half-written line became a task")
            with path.open("a") as file:
                file.write('o"}\n{"prompt": "three"}\n')
            assert (await tasks.receive()).prompt == "two"
            assert (await tasks.receive()).prompt == "three"
            path.write_text('{"prompt": "after truncation"}\n')  # rotated in place
            assert (await tasks.receive()).prompt == "after truncation"


async def test_follow_takes_exactly_n_under_an_eval(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    path = write_jsonl(tmp_path / "feed.jsonl", [{"prompt": f"p{i}", "answer": f"p{i}"}
                                                for i in range(2)])  # fmt: skip
    env = tt.Env(tt.JsonlTaskset(path, follow=True))
    config = tt.EvalConfig(num_examples=3, output_dir=str(tmp_path), run_name="f",
                           dashboard=False)  # fmt: skip

    async def append_later() -> None:
        await trio.sleep(2)
        with path.open("a") as file:
            file.write('{"prompt": "late", "answer": "late"}\n')

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(append_later)
            result = await tt.run_eval(env, tt.ModelContext(tt.EchoClient(), "echo"), config)
    assert [e.completion for e in result.episodes] == ["p0", "p1", "late"]
    with pytest.raises(tt.EvalConfigError, match="num_examples"):
        await tt.run_eval(env, tt.ModelContext(tt.EchoClient(), "echo"),
                          tt.EvalConfig(output_dir=str(tmp_path), dashboard=False))  # fmt: skip


# --- Hugging Face datasets (the `hf` extra), offline on local data --------------------------


@pytest.fixture
def datasets() -> ModuleType:
    """Hugging Face `datasets`, imported by the tests that use it (not at collection, where
    every xdist worker would pay its seconds of import time)."""
    module: ModuleType = pytest.importorskip(
        "datasets", reason="needs datasets: pip install -e '.[test]'"
    )
    return module


def test_hf_a_local_dataset_folder_and_a_saved_one(tmp_path: Path, datasets: ModuleType) -> None:
    folder = tmp_path / "arith"
    folder.mkdir()
    write_jsonl(folder / "test.jsonl", SUMS[:5])
    tasks = list(tt.HFTaskset(str(folder), split="test").head(3))
    assert [t.prompt for t in tasks] == ["What is 0 + 1?", "What is 1 + 1?", "What is 2 + 1?"]
    assert tasks[0].answer == "1"
    assert tasks[0].info == {"level": 0}
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(SUMS[:4]).save_to_disk(str(saved))
    assert len(list(tt.HFTaskset(str(saved)))) == 4
    with pytest.raises(tt.DatasetError, match="cannot load dataset"):
        list(tt.HFTaskset(str(tmp_path / "nothing-here"), split="test"))


@pytest.mark.usefixtures("datasets")
def test_cli_hf_name_split(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    (tmp_path / "arith").mkdir()
    write_jsonl(tmp_path / "arith" / "test.jsonl", SUMS[:6])
    code = cli("eval", "hf:arith:test", "-n", "4", "--run-name", "h", "--no-dashboard")
    assert code == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith("4/4 ok")
    written = rows(tmp_path / "outputs" / "h")
    assert len(written) == 4
    assert all(r["ok"] for r in written)
    summary = json.loads((tmp_path / "outputs" / "h" / "summary.json").read_text())
    assert summary["taskset"] == "hf:arith:test"
