"""Odd files and hostile rows (issue 36: F5, F7, F9, F10): a data record or a trace line that
cannot be read is an error naming the file and line, counted, never the end of the run;
`--follow` follows a file by name through log rotation; `rescore` streams its rows."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

import trio_tasksets as tt
from trio_tasksets._core.exceptions import EvalWarning
from trio_tasksets._env.traces import TraceRows, open_traces, read_rows
from trio_tasksets._eval.rescore import rescore


def echo() -> tt.ModelContext:
    return tt.ModelContext(tt.EchoClient(), "echo")


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "traces.jsonl").read_text().splitlines()]


async def a_run(tmp_path: Path, name: str = "r", n: int = 4) -> Path:
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}", "answer": f"p{i}"}
                                             for i in range(n)])  # fmt: skip
    config = tt.EvalConfig(output_dir=str(tmp_path), run_name=name, dashboard=False)
    result = await tt.run_eval(tt.Env(tt.JsonlTaskset(data)), echo(), config)
    return result.run_dir


# --- F9: one hostile row never ends rescore, --resume or report ------------------------------

HOSTILE = {
    "empty": "{}",
    "no task": json.dumps({"id": "x", "rollout": 0, "ok": True, "reward": 1.0}),
    "reward abc": "",  # a whole row but for its reward (built from a real row below)
    "nested 100,000 deep": "[" * 100_000 + "]" * 100_000,
    "not UTF-8": b'{"id": "\xff"}'.decode("latin-1"),
}


def _poison(run_dir: Path) -> list[str]:
    """Put a hostile line before each whole row of `run_dir`; the lines' reasons, in order."""
    whole = (run_dir / "traces.jsonl").read_text().splitlines()
    bad = dict(HOSTILE, **{"reward abc": json.dumps({**json.loads(whole[0]), "reward": "abc"})})
    lines = [*bad.values(), *whole]
    (run_dir / "traces.jsonl").write_bytes(
        b"".join(line.encode("latin-1" if "\xff" in line else "utf-8") + b"\n" for line in lines)
    )
    return list(bad)


async def test_rescore_skips_and_counts_hostile_lines_naming_file_and_line(
    tmp_path: Path,
) -> None:
    run_dir = await a_run(tmp_path)
    _poison(run_dir)
    result = await rescore(run_dir, lambda task, completion: 0.5, run_name="again")
    assert result.summary["finished"] == result.summary["ok"] == 4
    assert result.summary["reward_mean"] == 0.5
    assert result.summary["skipped_lines"] == 5
    said = result.summary["skipped"]
    assert said.startswith(f"{run_dir / 'traces.jsonl'}: 5 lines skipped")
    assert "line 1: not an episode row (no field 'id')" in said
    assert "line 2: not an episode row (no field 'task')" in said
    assert "line 3: not an episode row (could not convert string to float: 'abc')" in said
    assert "line 4: nested deeper than 1024 levels" in said
    assert "line 5: not UTF-8" in said
    assert len(rows(result.run_dir)) == 4


async def test_resume_skips_hostile_lines_and_says_so(tmp_path: Path) -> None:
    run_dir = await a_run(tmp_path)
    _poison(run_dir)
    config = tt.EvalConfig(output_dir=str(tmp_path), run_name="r", dashboard=False, resume=True)
    with pytest.warns(EvalWarning, match=r"traces.jsonl: 5 lines skipped.*line 4: nested"):
        result = await tt.run_eval(tt.Env(tt.JsonlTaskset(tmp_path / "d.jsonl")), echo(), config)
    assert result.summary["kept_from_resume"] == 4
    assert len(rows(run_dir)) == 4  # the hostile lines are dropped with the rewrite


@pytest.mark.parametrize("edge", [1e308, -1e308, math.inf, math.nan])
async def test_numeric_edges_in_report_rescore_and_resume(tmp_path: Path, edge: float) -> None:
    run_dir = await a_run(tmp_path)
    whole = rows(run_dir)
    for row in whole[:2]:
        row["reward"] = edge
        row["metrics"] = {"size": edge if math.isfinite(edge) else 1.0}
    (run_dir / "traces.jsonl").write_text("".join(json.dumps(r) + "\n" for r in whole))
    assert tt.report(run_dir).is_file()  # 1e308 twice overflowed the report's std
    again = await rescore(run_dir, lambda task, completion: {"reward": edge, "size": edge}
                          if math.isfinite(edge) else 1.0, run_name="again")  # fmt: skip
    for value in (again.summary["reward_mean"], again.summary["reward_std"]):
        assert math.isfinite(value)
    config = tt.EvalConfig(output_dir=str(tmp_path), run_name="r", dashboard=False, resume=True)
    resumed = await tt.run_eval(tt.Env(tt.JsonlTaskset(tmp_path / "d.jsonl")), echo(), config)
    assert math.isfinite(resumed.summary["reward_mean"])
    assert tt.report(again.run_dir).is_file()


# --- F5: a row that cannot be encoded, a trace line that cannot be read ----------------------


async def test_a_lone_surrogate_never_makes_the_trace_writer_raise(tmp_path: Path) -> None:
    path = tmp_path / "traces.jsonl"
    async with open_traces(path) as out:
        out.write({"id": "a", "text": "bad \ud800 text", "big": 2**70})
        out.write_rows([{"id": "b", "key": "\udfff"}])
    found, bad = read_rows(path)
    assert bad == 0
    assert found[0]["text"] == "bad \ud800 text"  # written escaped, read back the same
    assert found[1]["key"] == "\udfff"


def test_trace_rows_stream_and_count_what_is_not_a_row(tmp_path: Path) -> None:
    path = tmp_path / "traces.jsonl"
    path.write_bytes(b'{"a": 1}\n[1, 2]\n\n{"b": NaN}\nnot json\n{"torn": ')
    read = TraceRows(path)
    assert [(n, row) for n, row in read if n != 4] == [(1, {"a": 1})]
    assert (read.bad, read.torn) == (2, True)
    assert [b.line for b in read.first_bad] == [2, 5]
    assert "a list, not a JSON object" in read.first_bad[0].reason
    assert list(TraceRows(tmp_path / "missing.jsonl")) == []
