"""`trio-tasksets report` / `tt.report` (SPEC 4b): the figures, the page, and the page in a
real headless Chromium (Debian's /usr/bin/chromium driven by selenium and chromedriver)."""

from __future__ import annotations

import importlib
import json
import math
import re
import statistics
import sys
import tempfile
from collections.abc import Iterable, Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import forkserver
import pytest
import trio
from helpers import need, which
from trio.testing import MockClock

import trio_tasksets as tt
from trio_tasksets._cli import main
from trio_tasksets._report import embed_json, page
from trio_tasksets._report.data import MIN_CAP, ReportError, load_run, run_from_rows
from trio_tasksets._report.figures import compute
from trio_tasksets._report.stats import (
    mean_interval,
    pass_at_k,
    percentile,
    t_quantile,
)
from trio_tasksets.testing import Gate

# The module (`trio_tasksets.report` the attribute is `tt.report`, the function).
report_module = importlib.import_module("trio_tasksets._report")
HOSTILE = "Say <b>{i}</b> & </script><script>window.pwned=1</script>"


class Graded(tt.Taskset[tt.Task, tt.TasksetConfig]):
    """Ten tasks whose rewards fail or vary: tasks 3 and 7 cannot be graded (ValueError),
    task 5 raises KeyError, tasks 1 and 8 score 0, task 4 scores 0.5, task 6 passes on its
    first graded rollout only, the rest score 1. Prompts hold markup that must stay text."""

    def __init__(self, config: tt.TasksetConfig | None = None) -> None:
        super().__init__(config)
        self.graded: dict[int, int] = {}

    def load(self) -> Iterable[tt.Task]:
        return [
            tt.Task(HOSTILE.format(i=i), answer=str(i), info={"i": i}, key=f"t{i}")
            for i in range(10)
        ]

    def reward(self, task: tt.Task, completion: str) -> float:
        i = task.info["i"]
        seen = self.graded[i] = self.graded.get(i, 0) + 1
        if i in (3, 7):
            raise ValueError(f"cannot grade task {i}")
        if i == 5:
            raise KeyError("missing field")
        if i == 6:
            return 1.0 if seen == 1 else 0.0
        return {1: 0.0, 8: 0.0, 4: 0.5}.get(i, 1.0)


def eval_config(out: Path, name: str = "graded", **kw: Any) -> tt.EvalConfig:
    return tt.EvalConfig(output_dir=str(out), run_name=name, dashboard=False, **kw)


def make_run(out: Path, name: str = "graded") -> Path:
    """A finished run of Graded: 10 tasks x 2 rollouts, 6 of them failed."""
    ctx = tt.ModelContext(tt.EchoClient(), "echo")
    config = eval_config(out, name, rollouts_per_example=2, max_concurrent=4)
    result = trio.run(tt.run_eval, tt.Env(Graded()), ctx, config)
    return result.run_dir


def trace_rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "traces.jsonl").read_text().splitlines()]


def summary_of(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())  # type: ignore[no-any-return]


@pytest.fixture
def graded(tmp_path: Path) -> Path:
    return make_run(tmp_path)


class Figures(HTMLParser):
    """The data-figure spans of a page: name -> (data-value, shown text)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: dict[str, tuple[str, str]] = {}
        self._open: tuple[str, str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        named = dict(attrs)
        if "data-figure" in named:
            self._open = (named["data-figure"] or "", named.get("data-value") or "")

    def handle_data(self, data: str) -> None:
        if self._open is not None:
            name, value = self._open
            self.found[name] = (value, data)
            self._open = None


def shown_figures(html: str) -> dict[str, tuple[str, str]]:
    parser = Figures()
    parser.feed(html)
    return parser.found


# --- the figures -------------------------------------------------------------------------


def test_figures_equal_summary_json_and_a_recomputation_from_rows(graded: Path) -> None:
    summary = summary_of(graded)
    rows = trace_rows(graded)
    assert (summary["finished"], summary["ok"], summary["failed"]) == (20, 14, 6)

    from_summary = compute(load_run(graded))
    run = load_run(graded)
    run.summary = None
    from_rows = compute(run)
    for fig in (from_summary, from_rows):
        assert (fig.finished, fig.ok, fig.failed) == (20, 14, 6)
        assert fig.reward_mean == pytest.approx(summary["reward_mean"], rel=1e-12)
        assert fig.reward_std == pytest.approx(summary["reward_std"], rel=1e-12)
    assert from_summary.mismatches == []
    assert from_summary.rate == summary["rollouts_per_s"]
    assert from_summary.status == "finished"
    assert from_rows.status.startswith("running")

    # By hand, from the raw rows.
    rewards = [r["reward"] for r in rows]
    assert from_rows.reward_mean == pytest.approx(statistics.fmean(rewards))
    errors: dict[str, int] = {}
    for row in rows:
        for error in row["errors"]:
            errors[error["type"]] = errors.get(error["type"], 0) + 1
    assert from_rows.errors_by_type == {"ValueError": 4, "KeyError": 2} == errors
    assert from_rows.failed_by_type == {"ValueError": 4, "KeyError": 2}
    durations = sorted(r["timing"]["duration"] for r in rows)
    cuts = statistics.quantiles(durations, n=100, method="inclusive")
    assert from_rows.percentiles == pytest.approx({"p50": cuts[49], "p90": cuts[89],
                                                   "p99": cuts[98]})  # fmt: skip
    assert from_rows.latency is not None
    assert sum(from_rows.latency.counts) + from_rows.latency.overflow == 20
    assert from_rows.reward_hist is not None
    assert from_rows.reward_hist.values == [0.0, 0.5, 1.0]
    assert from_rows.reward_hist.counts == [sum(1 for r in rewards if r == v) for v in (0, 0.5, 1)]
    assert from_rows.throughput is not None
    assert sum(from_rows.throughput.ok) == 14
    assert sum(from_rows.throughput.failed) == 6
    assert 1 <= from_rows.max_in_flight <= 4  # -c 4


def test_tasks_group_their_rollouts_with_pass_at_k(graded: Path) -> None:
    fig = compute(load_run(graded))
    tasks = fig.tasks
    assert tasks.rollouts == [2] * 10
    by_key = dict(zip(load_run(graded).task_keys, tasks.passed, strict=True))
    assert by_key == {"t0": 2, "t1": 0, "t2": 2, "t3": 0, "t4": 0, "t5": 0, "t6": 1, "t7": 0,
                      "t8": 0, "t9": 2}  # fmt: skip
    # pass@1: the mean pass rate; pass@2: tasks with any pass.
    assert [k for k, _, _ in tasks.pass_at_k] == [1, 2]
    assert [value for _, value, _ in tasks.pass_at_k] == pytest.approx([7 / 20, 4 / 10])
    assert [n for _, _, n in tasks.pass_at_k] == [10, 10]
    assert tasks.passed_counts == [(0, 2, 6), (1, 2, 1), (2, 2, 3)]


def test_pass_at_k_is_the_unbiased_estimator() -> None:
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))
    assert pass_at_k(10, 3, 4) == pytest.approx(1 - math.comb(7, 4) / math.comb(10, 4))
    assert pass_at_k(3, 0, 3) == 0.0
    assert pass_at_k(3, 1, 3) == 1.0


@pytest.mark.parametrize(
    ("df", "expected"),
    [(1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (9, 2.262), (30, 2.042), (1000, 1.962)],
)
def test_t_quantile_matches_the_table(df: int, expected: float) -> None:
    assert t_quantile(0.975, df) == pytest.approx(expected, rel=1.5e-3)


def test_mean_interval_is_the_t_interval_with_one_value_per_task() -> None:
    values = [0.0, 1.0, 1.0, 0.5, 1.0, 0.0, 1.0, 1.0, 0.25, 1.0]
    low, high = mean_interval(values, list(range(10))) or (0.0, 0.0)
    half = t_quantile(0.975, 9) * statistics.stdev(values) / math.sqrt(10)
    assert (low, high) == pytest.approx((statistics.fmean(values) - half,
                                         statistics.fmean(values) + half))  # fmt: skip
    assert mean_interval([1.0, 0.0], [0, 0]) is None  # one task: no interval


def test_mean_interval_widens_when_a_tasks_rollouts_agree() -> None:
    # Two rollouts per task that always agree carry the information of one: the clustered
    # interval is the one of the task means, wider than treating rows as independent.
    per_task = [0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    values = [v for v in per_task for _ in range(2)]
    clusters = [t for t in range(8) for _ in range(2)]
    clustered = mean_interval(values, clusters)
    naive = mean_interval(values, list(range(16)))
    assert clustered is not None
    assert naive is not None
    assert clustered[1] - clustered[0] > naive[1] - naive[0]
    by_task = mean_interval(per_task, list(range(8)))
    assert by_task is not None
    assert clustered == pytest.approx(by_task)


def test_percentile_interpolates_like_statistics_quantiles() -> None:
    values = sorted([3.0, 1.0, 4.0, 1.5, 9.0, 2.6, 5.3, 5.8])
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    for q in (10, 50, 90, 99):
        assert percentile(values, q) == pytest.approx(cuts[q - 1])
    assert percentile([7.0], 99) == 7.0


def test_new_summary_fields_are_shown_when_present_and_never_required(graded: Path) -> None:
    summary = summary_of(graded)
    summary.update(
        errors_by_type={"ValueError": 4, "KeyError": 2},
        usage={"prompt_tokens": 1234, "completion_tokens": 56},
        window_history=[
            [0.0, 4, "start"],
            [0.5, 8, "grow"],
            {"t": 1.0, "size": 2, "reason": "429"},
        ],
        stopped="max_failures",
        error="6 episodes failed (--max-failures 6)",
    )
    (graded / "summary.json").write_text(json.dumps(summary))
    fig = compute(load_run(graded))
    assert fig.window == [(0.0, 4.0, "start"), (0.5, 8.0, "grow"), (1.0, 2.0, "429")]
    assert fig.errors_source == "summary.json"
    assert fig.status == "stopped: max_failures"
    assert fig.error == "6 episodes failed (--max-failures 6)"
    html = page([load_run(graded)])
    shown = shown_figures(html)
    assert shown["prompt_tokens"] == ("1234", "1,234")
    assert shown["errors.ValueError"] == ("4", "4")
    assert "Window and rollouts in flight" in html
    assert "max_failures" in html


def test_rows_with_usage_and_unknown_fields_are_summed_and_kept() -> None:
    rows = [
        {"id": "a", "task": {"key": "k", "data": {"prompt": "p"}}, "rollout": 0, "ok": True,
         "reward": 1.0, "usage": {"prompt_tokens": 10, "completion_tokens": 3},
         "finish_reason": "stop", "judge": {"score": 9}},
        {"id": "b", "task": {"key": "k", "data": {"prompt": "p"}}, "rollout": 1, "ok": False,
         "reward": 0.0, "usage": {"prompt_tokens": 7, "completion_tokens": 0},
         "finish_reason": "length"},
    ]  # fmt: skip
    run = run_from_rows(rows)
    fig = compute(run)
    assert fig.usage == {"prompt_tokens": 17, "completion_tokens": 3}
    assert run.extra == {0: {"judge": {"score": 9}}}
    assert [run.strings[i] for i in run.finish_reason] == ["stop", "length"]
    assert fig.latency is None  # no timing: no such charts
    assert fig.throughput is None
    assert "Latency" not in page([run])


# --- reading a run dir -------------------------------------------------------------------


def test_a_torn_last_line_is_left_out_and_a_bad_middle_line_is_counted(graded: Path) -> None:
    traces = graded / "traces.jsonl"
    lines = traces.read_bytes().splitlines(keepends=True)
    lines.insert(5, b"{not json\n")
    traces.write_bytes(b"".join(lines) + b'{"id": "torn", "task": {"key": "t1"')
    run = load_run(graded)
    assert len(run) == 20
    assert run.torn
    assert run.unreadable == [6]
    assert "torn" not in run.strings
    out = tt.report(graded)
    text = out.read_text()
    assert "The last line of traces.jsonl is incomplete" in text
    assert "1 lines of traces.jsonl are not JSON rows" in text


def test_a_tail_that_parses_but_has_no_newline_is_still_in_flight(graded: Path) -> None:
    traces = graded / "traces.jsonl"
    data = traces.read_bytes()
    last = data[:-1].rsplit(b"\n", 1)[1]
    traces.write_bytes(data + last)  # a whole JSON object, but its newline not yet written
    run = load_run(graded)
    assert len(run) == 20
    assert run.torn


async def test_a_run_still_being_written_is_reported_from_its_whole_rows(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    gate = Gate()

    class Held(tt.Env[tt.Task]):
        async def rollout(self, task: tt.Task, ctx: tt.ModelContext) -> Any:
            if task.info["i"] >= 3:
                async with gate.held():
                    pass
            return await super().rollout(task, ctx)

    ctx = tt.ModelContext(tt.EchoClient(delay=1.0), "echo")
    config = eval_config(tmp_path, num_examples=6)
    run_dir = tmp_path / "graded"
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tt.run_eval, Held(Graded()), ctx, config)
            await gate.wait_running(3)
            await trio.sleep(5)  # virtual: tasks 0-2 finish after their 1 s model call
            assert not (run_dir / "summary.json").exists()
            out = tt.report(run_dir)
            run = load_run(run_dir)
            fig = compute(run)
            assert (len(run), fig.finished, fig.ok) == (3, 3, 3)
            assert fig.planned is None
            assert "No summary.json yet" in out.read_text()
            gate.open()
    fig = compute(load_run(run_dir))
    assert (fig.finished, fig.status) == (6, "finished")


def test_a_run_dir_with_no_whole_row_yet_is_reported(tmp_path: Path) -> None:
    run_dir = tmp_path / "starting"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"identity": {"model": "m"}}))
    out = tt.report(run_dir)
    assert "no rewards yet" in out.read_text()
    (run_dir / "traces.jsonl").write_bytes(b'{"id": "a", "task": {"key"')
    run = load_run(run_dir)
    assert (len(run), run.torn) == (0, True)
    fig = compute(run)
    assert (fig.finished, fig.reward_mean, fig.latency, fig.throughput) == (0, None, None, None)
    assert fig.tasks.pass_at_k == []
    assert "0 whole rows read so far" in tt.report(run_dir).read_text()


@pytest.mark.parametrize("make", ["missing", "file", "empty dir"])
def test_a_path_that_is_not_a_run_dir_is_a_clear_error(tmp_path: Path, make: str) -> None:
    path = tmp_path / "x"
    if make == "file":
        path.write_text("")
    elif make == "empty dir":
        path.mkdir()
    with pytest.raises(ReportError, match=r"RUN_DIR .*x"):
        tt.report(path)


def test_a_bad_summary_json_names_the_file(graded: Path) -> None:
    (graded / "summary.json").write_text("{oops")
    with pytest.raises(ReportError, match=r"summary\.json"):
        tt.report(graded)


# --- the page ----------------------------------------------------------------------------


def test_the_page_shows_summary_json_numbers(graded: Path) -> None:
    summary = summary_of(graded)
    out = tt.report(graded)
    assert out == graded / "report.html"
    shown = shown_figures(out.read_text())
    for name in ("finished", "ok", "failed"):
        assert shown[name] == (str(summary[name]), str(summary[name]))
    assert float(shown["reward_mean"][0]) == summary["reward_mean"]
    assert shown["reward_mean"][1] == f"{summary['reward_mean']:.3f}"
    assert float(shown["rate"][0]) == summary["rollouts_per_s"]
    assert shown["rate"][1] == f"{summary['rollouts_per_s']:,.1f}"
    assert float(shown["duration_s"][0]) == summary["duration_s"]
    low, high = float(shown["reward_ci_low"][0]), float(shown["reward_ci_high"][0])
    assert low < summary["reward_mean"] < high


def test_the_page_is_self_contained_and_run_text_cannot_break_out(graded: Path) -> None:
    html = tt.report(graded).read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert '<link rel="stylesheet"' not in html
    assert "default-src 'none'" in html
    # The hostile prompt is in the page only as escaped data.
    assert "window.pwned" in html
    assert "<script>window.pwned" not in html
    assert "<b>0</b>" not in html
    start = html.index('<script type="application/json" id="report-data">')
    end = html.index("</script>", start)
    data = html[start:end].split(">", 1)[1]
    assert "<" not in data
    decoded = json.loads(data)
    strings = decoded["runs"][0]["S"]
    assert HOSTILE.format(i=0) in strings


def test_embed_json_round_trips_and_never_closes_a_script() -> None:
    value = {"a": "</script><!-- <script>", "b": "x & y > z", "c": [1.5, None, "\u2028"]}
    text = embed_json(value)
    assert not set("<>&") & set(text)
    assert json.loads(text) == value


def long_rows(n: int, length: int) -> list[dict[str, Any]]:
    return [
        {"id": str(i), "task": {"key": f"k{i}", "data": {"prompt": "short"}}, "rollout": 0,
         "ok": True, "reward": 1.0, "completion": ("x" * length) + str(i),
         "messages": [{"role": "user", "content": "short"},
                      {"role": "assistant", "content": ("x" * length) + str(i)}],
         "judge": {"notes": "y" * length}}
        for i in range(n)
    ]  # fmt: skip


def test_fit_texts_cuts_only_the_longest_texts_to_one_cap() -> None:
    run = run_from_rows(long_rows(4, 50_000))
    cap = run.fit_texts(40_000)
    assert cap is not None
    assert MIN_CAP <= cap <= 10_000
    assert len(run.cut) == 4
    assert all(length == 50_001 for length in run.cut.values())
    assert all(len(run.strings[i]) == cap for i in run.cut)
    assert "short" in run.strings  # short texts are never cut
    assert run.extra[0]["judge"]["notes"].endswith("[cut: 50,000 characters in all]")
    smaller = run.fit_texts(4_000)
    assert smaller is not None
    assert smaller < cap
    assert all(length == 50_001 for length in run.cut.values())  # still the whole length


def test_a_large_run_is_cut_to_keep_the_page_under_max_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(report_module, "MIN_TEXT", 0)
    run = run_from_rows(long_rows(400, 5_000))
    html = page([run], max_size=1_000_000)
    assert len(html.encode()) <= 1_000_000
    assert len(run.cut) == 400
    assert "texts longer than" in html
    assert "short" in run.strings


def test_several_runs_side_by_side(tmp_path: Path, graded: Path) -> None:
    other = make_run(tmp_path / "second", "graded")  # the same name in another output dir
    out = tt.report([graded, other])
    assert out == graded / "compare.html"
    html = out.read_text()
    assert "The runs side by side" in html
    assert html.count('<article class="run"') == 2
    assert f"{tmp_path.name}/graded" in html
    assert "second/graded" in html


# --- the command line --------------------------------------------------------------------


def test_cli_report_prints_the_path(graded: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = graded.parent / "page.html"
    assert main(["report", str(graded), "-o", str(target)]) == 0
    assert capsys.readouterr().out.strip() == str(target)
    assert target.read_text().startswith("<!doctype html>")


@pytest.mark.parametrize("case", ["missing", "not a run", "bad -o"])
def test_cli_report_bad_paths_exit_2_with_a_clear_message(
    tmp_path: Path, graded: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    args = {
        "missing": [str(tmp_path / "nope")],
        "not a run": [str(tmp_path)],
        "bad -o": [str(graded), "-o", str(tmp_path / "no" / "such" / "r.html")],
    }[case]
    with pytest.raises(SystemExit) as exit_:
        main(["report", *args])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    needle = "-o/--output" if case == "bad -o" else "RUN_DIR"
    assert needle in err


def test_the_report_command_is_wired_into_python_m_trio_tasksets(graded: Path) -> None:
    done = forkserver.run(
        [sys.executable, "-m", "trio_tasksets", "report", str(graded)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(graded / "report.html")
    missing = forkserver.run(
        [sys.executable, "-m", "trio_tasksets", "report", str(graded / "nope")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert missing.returncode == 2
    assert "usage:" in missing.stderr
    assert "does not exist" in missing.stderr


# --- in a real browser -------------------------------------------------------------------

CHROMIUM = which("chromium")
CHROMEDRIVER = which("chromedriver")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1400,1000")  # fmt: skip


@pytest.fixture
def browser() -> Iterator[Any]:
    need("chromium", "chromedriver", why="the report in a real browser")
    assert CHROMIUM is not None
    assert CHROMEDRIVER is not None
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    with tempfile.TemporaryDirectory(prefix="tt-chromium-") as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for flag in (*FLAGS, f"--user-data-dir={profile}"):
            options.add_argument(flag)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
        driver.set_page_load_timeout(30)
        try:
            yield driver
        finally:
            driver.quit()


def shown_lines(driver: Any) -> list[int]:
    from selenium.webdriver.common.by import By

    rows = driver.find_elements(By.CSS_SELECTOR, "#table tbody tr.main")
    return [int(row.find_elements(By.TAG_NAME, "td")[1].text) for row in rows]


def test_in_chromium_the_page_shows_the_run_and_its_table_works(graded: Path, browser: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    summary = summary_of(graded)
    rows = trace_rows(graded)
    out = tt.report(graded)
    browser.get(out.resolve().as_uri())

    # No console errors (a CSP violation, a script error, a failed fetch would be one).
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == []
    assert browser.execute_script("return window.pwned === undefined")

    # The numbers shown are summary.json's.
    def figure(name: str) -> Any:
        return browser.find_element(By.CSS_SELECTOR, f'[data-figure="{name}"]')

    for name in ("finished", "ok", "failed"):
        assert figure(name).text == f"{summary[name]:,}"
    assert figure("reward_mean").text == f"{summary['reward_mean']:.3f}"
    assert float(figure("reward_mean").get_attribute("data-value")) == summary["reward_mean"]
    assert figure("rate").text == f"{summary['rollouts_per_s']:,.1f}"
    count = browser.find_element(By.ID, "count")
    assert count.get_attribute("data-matched") == "20"
    assert sorted(shown_lines(browser)) == list(range(1, 21))

    # Filtering to failed rows shows exactly the failed rows.
    Select(browser.find_element(By.ID, "f-status")).select_by_value("failed")
    failed = [i for i, row in enumerate(rows, 1) if not row["ok"]]
    assert len(failed) == summary["failed"] == 6
    assert shown_lines(browser) == failed
    assert count.get_attribute("data-matched") == "6"
    assert {r.get_attribute("data-ok") for r in browser.find_elements(
        By.CSS_SELECTOR, "#table tbody tr.main")} == {"0"}  # fmt: skip

    # ... and by error type, and by text.
    Select(browser.find_element(By.ID, "f-error")).select_by_visible_text("KeyError (2)")
    keyerrors = [
        i for i, r in enumerate(rows, 1) if any(e["type"] == "KeyError" for e in r["errors"])
    ]
    assert shown_lines(browser) == keyerrors
    browser.find_element(By.ID, "f-reset").click()
    browser.find_element(By.ID, "f-text").send_keys("cannot grade task 7")
    WebDriverWait(browser, 10).until(lambda d: count.get_attribute("data-matched") == "2")
    assert shown_lines(browser) == [i for i, r in enumerate(rows, 1) if r["task"]["key"] == "t7"]
    browser.find_element(By.ID, "f-reset").click()

    # Sorting by reward, descending: the first row holds the highest reward.
    browser.find_element(By.CSS_SELECTOR, 'button.sort[data-key="reward"]').click()
    browser.find_element(By.CSS_SELECTOR, 'button.sort[data-key="reward"]').click()
    header = browser.find_element(By.CSS_SELECTOR, 'button.sort[data-key="reward"]')
    assert header.find_element(By.XPATH, "..").get_attribute("aria-sort") == "descending"
    first = browser.find_element(By.CSS_SELECTOR, "#table tbody tr.main td:nth-child(6)")
    assert first.text == "1.000"

    # Expanding a row shows its messages (the hostile prompt as text, never as markup).
    Select(browser.find_element(By.ID, "f-status")).select_by_value("ok")
    line = shown_lines(browser)[0]
    row = rows[line - 1]
    button = browser.find_element(By.CSS_SELECTOR, "#table tbody tr.main button.expand")
    assert button.get_attribute("aria-expanded") == "false"
    button.click()
    button = browser.find_element(By.CSS_SELECTOR, "#table tbody tr.main button.expand")
    assert button.get_attribute("aria-expanded") == "true"
    detail = browser.find_element(By.ID, button.get_attribute("aria-controls"))
    texts = [m.text for m in detail.find_elements(By.CSS_SELECTOR, ".msg pre")]
    assert [m["content"] for m in row["messages"]] == texts[: len(row["messages"])]
    assert row["id"] in detail.text
    assert detail.find_elements(By.TAG_NAME, "b") == []

    # A link to a row opens it, on its page.
    target = next(i for i, r in enumerate(rows, 1) if r["task"]["key"] == "t5")
    browser.get(f"{out.resolve().as_uri()}#line={target}")
    detail = browser.find_element(By.CSS_SELECTOR, "#table tr.detail")
    assert f"line\n{target} of traces.jsonl" in detail.text
    assert "KeyError: 'missing field'" in detail.text

    # The tasks view groups each task's rollouts.
    browser.find_element(By.CSS_SELECTOR, 'input[name="view"][value="tasks"]').click()
    assert count.get_attribute("data-matched") == "10"
    Select(browser.find_element(By.ID, "f-pass")).select_by_value("some")
    cells = browser.find_elements(By.CSS_SELECTOR, "#table tbody tr.main td")
    assert [c.text for c in cells[1:5]] == ["t6", "2", "2", "1 / 2"]

    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []


def test_in_chromium_an_agent_runs_table_has_turns_tool_calls_and_advantage_columns(
    tmp_path: Path, graded: Path, browser: Any
) -> None:
    """Issue 35 (10c): the columns a run's rows have (turns and tool calls of an agent, a
    group's advantage), sortable; a run without them shows none, also beside one with them."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    agent = tmp_path / "agent"
    agent.mkdir()
    rows = [
        {"id": f"r{i}", "task": {"key": f"t{i // 2}", "data": {"prompt": f"p{i}"}},
         "rollout": i % 2, "ok": True, "reward": float(i % 2), "completion": "c",
         "messages": [], "errors": [], "attempts": 1, "timing": {"duration": 0.5},
         "usage": {}, "finish_reason": "stop", "turns": i + 1, "tool_calls": i,
         "group": f"g{i // 2}", "advantage": (i % 2 - 0.5) * (i + 1)}
        for i in range(4)
    ]  # fmt: skip
    (agent / "traces.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (agent / "config.json").write_text("{}")
    out = tt.report([agent, graded], output=tmp_path / "both.html")
    browser.get(out.resolve().as_uri())

    def headers() -> list[str]:
        return [b.get_attribute("data-key")
                for b in browser.find_elements(By.CSS_SELECTOR, "#table thead button.sort")]  # fmt: skip

    assert headers() == ["line", "task", "rollout", "ok", "reward", "dur", "att", "tn", "tc",
                         "adv", "err"]  # fmt: skip
    first = browser.find_elements(By.CSS_SELECTOR, "#table tbody tr.main")[0]
    cells = [td.text for td in first.find_elements(By.TAG_NAME, "td")]
    assert cells[8:11] == ["1", "0", "-0.500"]
    adv = browser.find_element(By.CSS_SELECTOR, 'button.sort[data-key="adv"]')
    adv.click()
    adv = browser.find_element(By.CSS_SELECTOR, 'button.sort[data-key="adv"]')
    adv.click()  # descending: the largest advantage first
    assert shown_lines(browser)[0] == 4  # advantage 2.0
    # the other run has none of these: no such columns (and the sort falls back to lines)
    Select(browser.find_element(By.ID, "f-run")).select_by_index(1)
    assert headers() == ["line", "task", "rollout", "ok", "reward", "dur", "att", "err"]
    assert shown_lines(browser)[:3] == [1, 2, 3]
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []
