"""Odd files and hostile rows (issue 36: F5, F7, F9, F10): a data record or a trace line that
cannot be read is an error naming the file and line, counted, never the end of the run;
`--follow` follows a file by name through log rotation; `rescore` streams its rows."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from helpers import cli

import trio_tasksets as tt
from trio_tasksets._core.datasets import record_problem
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


# --- F5: a data record that cannot be read fails its own row, not the run --------------------

POISON = {
    50: rb'{"prompt": "bad \ud800", "answer": "x"}',
    52: b'{"prompt": "caf\xe9"}',
    54: b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    56: b"{not json",
    58: b"[1, 2]",
}
REASONS = {
    50: "the record holds a lone surrogate (\\ud800), which is not text",
    52: "the line is not UTF-8 (invalid continuation byte at byte 16)",
    54: "the record nests deeper than 100 levels",
    56: "not a JSON line (",
    58: "a record must be a JSON object, got [1, 2]",
}


def test_poison_records_fail_their_own_rows_and_a_resume_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    lines = [json.dumps({"prompt": f"p{i}", "answer": f"p{i}"}).encode() for i in range(1, 62)]
    for number, line in POISON.items():
        lines[number - 1] = line
    (tmp_path / "d.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    for resume in ([], ["--resume"]):
        code = cli("eval", "d.jsonl", "-m", "echo", "--run-name", "x", "--no-dashboard", *resume)
        said = capsys.readouterr()
        err = said.out + said.err
        assert code == 0, err
        assert "56/61 ok" in err
        assert "5 failed: DatasetError 5; first error: DatasetError: d.jsonl:5" in err
        written = rows(tmp_path / "outputs" / "x")
        assert len(written) == 61
        failed = {r["errors"][-1]["message"] for r in written if not r["ok"]}
        assert len(failed) == 5
        for number, reason in REASONS.items():
            assert any(m.startswith(f"d.jsonl:{number}: {reason}") for m in failed), number
        assert all(r["attempts"] == 1 and r["completion"] is None for r in written if not r["ok"])


def test_csv_long_fields_and_bytes_that_are_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "d.csv"
    long = "x" * 200_000  # over Python's csv default limit of 131,072
    path.write_bytes(f"q,a\n{long},1\n".encode() + b"caf\xe9,2\nok,3\n")
    tasks = list(tt.CsvTaskset(path, prompt_field="q", answer_field="a"))
    assert tasks[0].prompt == long
    problem = record_problem(tasks[1])
    assert str(problem).startswith(f"{path}:3: the row is not UTF-8 (byte 0xe9 in field 'q')")
    assert tasks[2].prompt == "ok"
    small = list(tt.CsvTaskset(path, prompt_field="q", max_field=100_000_000))
    assert len(small) == 3
    with pytest.raises(tt.ConfigError, match="max_field"):
        tt.CsvConfig(max_field=0)


def test_a_csv_field_over_max_field_fails_its_row_naming_the_line(tmp_path: Path) -> None:
    import csv

    path = tmp_path / "d.csv"
    path.write_text("q\nshort\n" + "y" * 300 + "\nlast\n")
    limit = csv.field_size_limit()
    try:
        csv.field_size_limit(200)  # the process's limit is only ever raised to max_field
        tasks = list(tt.CsvTaskset(path, prompt_field="q", max_field=100))
    finally:
        csv.field_size_limit(limit)
    assert [t.prompt for t in tasks if record_problem(t) is None] == ["short", "last"]
    assert str(record_problem(tasks[1])).startswith(f"{path}:3: not a CSV row (field larger")


# --- F7: --follow follows the file by name through log rotation ------------------------------


def _line(prompt: str) -> str:
    return json.dumps({"prompt": prompt}) + "\n"


async def _next(tasks: trio.abc.ReceiveChannel[tt.Task]) -> str:
    with trio.fail_after(30):  # a MockClock's seconds: the feed polls every 0.25 s
        task = await tasks.receive()
    problem = record_problem(task)
    assert problem is None, problem  # never a line read from its middle
    return str(task.prompt)


@asynccontextmanager
async def _following(
    tmp_path: Path, *first: str
) -> AsyncIterator[tuple[Path, trio.abc.ReceiveChannel[tt.Task]]]:
    """A feed of `feed.jsonl` holding the records `first`, each taken already."""
    path = tmp_path / "feed.jsonl"
    path.write_text("".join(map(_line, first)))
    async with tt.JsonlTaskset(path, follow=True).channel() as tasks:
        assert [await _next(tasks) for _ in first] == list(first)
        yield path, tasks


async def test_follow_through_rename_and_create(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with _following(tmp_path, "one") as (path, tasks):
        with path.open("a") as old:
            old.write(_line("two, the old file's last"))
        path.rename(tmp_path / "feed.jsonl.1")  # logrotate's default: rename, then create
        path.write_text(_line("three, in the new file"))
        assert await _next(tasks) == "two, the old file's last"
        assert await _next(tasks) == "three, in the new file"
        with path.open("a") as new:
            new.write(_line("four"))
        assert await _next(tasks) == "four"


async def test_follow_through_delete_and_recreate(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with _following(tmp_path, "one") as (path, tasks):
        path.unlink()
        with trio.move_on_after(5):  # no file at the path: the feed waits for one
            await tasks.receive()
            pytest.fail("a task came from a deleted file")
        path.write_text(_line("two"))
        assert await _next(tasks) == "two"


async def test_follow_truncate_then_write_at_once_restarts_at_the_top(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with _following(tmp_path, "one", "two") as (path, tasks):
        # truncated and written again, longer than before, between two reads: the size alone
        # does not tell; the bytes before the position read so far do
        path.write_text(_line("a longer first line after the rotation") + _line("b"))
        assert await _next(tasks) == "a longer first line after the rotation"
        assert await _next(tasks) == "b"
        # and a half-written line, truncated under it, is never finished by other bytes
        with path.open("a") as file:
            file.write('{"prompt": "hal')
        await trio.sleep(1)
        path.write_text(_line("c") + _line("d, written at once with c"))
        assert await _next(tasks) == "c"
        assert await _next(tasks) == "d, written at once with c"


# --- F10: rescore streams; the report's page and memory stay bounded at any row count --------


def _big_run(root: Path, n: int, name: str = "big") -> Path:
    """A run dir of `n` distinct one-rollout tasks shaped as an echo eval writes them (every
    13th failed), written fast (as bench/scale.py does for 10^6 rows)."""
    import orjson

    run_dir = root / name
    run_dir.mkdir()
    lines = []
    for i in range(n):
        prompt = f"{i} + {i % 997} = ?"
        failed = i % 13 == 0
        row = {
            "id": f"{i:032x}", "task": {"key": f"{i:016x}", "data": {"prompt": prompt,
            "answer": str(i), "info": {}, "system_prompt": None}}, "rollout": 0,
            "ok": not failed, "reward": 0.0 if failed else 1.0,
            "completion": None if failed else prompt,
            "messages": [] if failed else [{"role": "user", "content": prompt},
                                           {"role": "assistant", "content": prompt}],
            "errors": [{"type": "ModelTimeoutError", "message": "no answer", "attempt": 1}]
            if failed else [],
            "attempts": 1, "timing": {"started": 1e9 + i, "finished": 1e9 + i + 0.5,
                                      "duration": 0.5},
            "usage": {"prompt_tokens": 3, "completion_tokens": 3}, "finish_reason": "stop",
        }  # fmt: skip
        lines.append(orjson.dumps(row, option=orjson.OPT_APPEND_NEWLINE))
    (run_dir / "traces.jsonl").write_bytes(b"".join(lines))
    (run_dir / "config.json").write_text(json.dumps({"identity": {"model": "echo"}}))
    return run_dir


def _peak(run: Any) -> int:
    """The peak of Python's allocations (tracemalloc) while `run()` runs, in bytes."""
    import tracemalloc

    tracemalloc.start()
    try:
        run()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_rescore_memory_is_flat_in_the_number_of_rows(tmp_path: Path) -> None:
    """Ten times the rows, about the same peak: rows stream from the old traces to the new
    (the old rescore held every row and episode: 6.8 GB at 10^6 rows; docs/benchmarks.md)."""
    peaks = []
    for n in (300, 3_000):
        run_dir = _big_run(tmp_path, n, f"r{n}")

        def run(run_dir: Path = run_dir) -> None:
            trio.run(partial(rescore, run_dir, lambda task, completion: 0.5, run_name="again",
                             keep_episodes=False))  # fmt: skip

        peaks.append(_peak(run))
        summary = json.loads((run_dir.parent / "again" / "summary.json").read_text())
        assert (summary["finished"], summary["ok"]) == (n, n - len(range(0, n, 13)))
        shutil.rmtree(run_dir.parent / "again")
    assert peaks[1] < 1.5 * peaks[0], peaks  # flat: not 10x


def test_the_report_table_of_a_large_run_is_a_sample_and_says_so(tmp_path: Path) -> None:
    from trio_tasksets._report import page
    from trio_tasksets._report.data import load_run
    from trio_tasksets._report.figures import compute

    run_dir = _big_run(tmp_path, 3_000)
    run = load_run(run_dir, table_rows=200)
    assert len(run) == 3_000  # the figures count every row
    assert compute(run).failed == 231
    assert run.table is not None
    shown = [run.line[i] for i in run.table]
    assert len(shown) <= 200
    assert shown == sorted(shown)
    failed_lines = [i * 13 + 1 for i in range(231)]
    assert failed_lines[:100] == [n for n in shown if (n - 1) % 13 == 0][:100]  # failures first
    html = page([run])
    assert "The table shows 200 of the 3,000 rows: every 30th line of traces.jsonl" in html
    assert "the figures count every row" in html
    # the page does not grow with the rows the table leaves out
    small = page([load_run(_big_run(tmp_path, 600, "small"), table_rows=200)])
    assert len(html) < 1.3 * len(small)


def test_report_memory_per_row_left_out_of_the_table_is_small(tmp_path: Path) -> None:
    """A row the table leaves out keeps only the figures' numbers: the old report took 2.4 GB
    for 10^6 rows (2.4 KB a row)."""
    from trio_tasksets._report.data import load_run

    sizes = {n: _big_run(tmp_path, n, f"r{n}") for n in (1_000, 5_000)}
    peaks = {n: _peak(lambda d=d: load_run(d, table_rows=500)) for n, d in sizes.items()}
    per_row = (peaks[5_000] - peaks[1_000]) / 4_000
    assert per_row < 400, per_row  # 184 B here


async def test_a_row_nested_past_the_encoders_is_written_saying_so(tmp_path: Path) -> None:
    deep: Any = "bottom"
    for _ in range(5_000):
        deep = [deep]
    cycle: dict[str, Any] = {}
    cycle["self"] = cycle
    path = tmp_path / "traces.jsonl"
    async with open_traces(path) as out:
        out.write({"id": "a", "task": {"key": "k", "data": {"deep": deep}}, "info": cycle})
    (row,), bad = read_rows(path)
    assert (bad, row["id"]) == (0, "a")
    assert row["task"].startswith("<not written: RecursionError")
    assert row["info"].startswith("<not written: ValueError: Circular reference")
