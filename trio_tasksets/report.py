"""`report`: one self-contained HTML page for one or more run dirs (SPEC 4b).

    trio-tasksets report RUN_DIR [RUN_DIR ...] [-o FILE]
    tt.report("outputs/my-run")            # -> Path("outputs/my-run/report.html")

The page needs no network when it is viewed (its CSS, script, charts and data are inline, and
its Content-Security-Policy forbids any fetch): the summary with a confidence interval, errors
by type, reward and latency histograms, throughput and concurrency over time, pass@k, and a
filterable, sortable, paged table of the rows, each expanding to its messages. Figures are
computed in Python (`report_figures`); the page's script only draws the table.

It reads a run that is still being written (whole lines only) and 100,000 rows in seconds.
"""

from __future__ import annotations

import argparse
import os
import re
import time
from collections.abc import Sequence
from html import escape
from importlib import metadata, resources
from pathlib import Path
from typing import Any

import orjson

from .report_data import ReportError, RunData, load_run
from .report_figures import Figures, compute
from .report_render import compare_table, run_section
from .traces import write_atomic

__all__ = ["ReportError", "add_report_command", "page", "payload", "report", "report_command"]

TEXT_BUDGET = 20_000_000  # characters of row texts in one page, over all its runs
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


def _round(value: float | None, base: float = 0.0) -> float | None:
    return None if value is None else round(value - base, 6)


def payload(run: RunData, fig: Figures) -> dict[str, Any]:
    """The table's data for one run, column by column (texts as indices into `S`)."""
    t0 = fig.t0 or 0.0
    tasks = fig.tasks
    return {
        "name": run.name,
        "S": run.strings,
        "cut": {str(k): v for k, v in run.cut.items()},
        "t0": fig.t0,
        "threshold": tasks.threshold,
        "tasks": {
            "key": run.task_keys,
            "data": run.task_data,
            "n": tasks.rollouts,
            "ok": tasks.ok,
            "passed": tasks.passed,
            "mean": tasks.reward_mean,
        },
        "rows": {
            "line": run.line,
            "id": run.id,
            "task": run.task,
            "rollout": run.rollout,
            "ok": [1 if ok else 0 for ok in run.ok],
            "reward": run.reward,
            "att": run.attempts,
            "start": [_round(s, t0) for s in run.started],
            "fin": [_round(f, t0) for f in run.finished],
            "dur": [_round(d) for d in run.duration],
            "err": [errors[-1][0] if errors else -1 for errors in run.errors],
            "errs": run.errors,
            "comp": run.completion,
            "msgs": run.messages,
            "pt": run.prompt_tokens,
            "ct": run.completion_tokens,
            "fr": run.finish_reason,
            "extra": run.extra,
        },
    }


def embed_json(value: Any) -> str:
    """`value` as JSON that is safe inside a <script> element: no `<`, `>` or `&` appears
    (each is written as a JSON \\u escape), so no text can close the element."""
    data = orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)
    return (
        data.replace(b"<", b"\\u003c").replace(b">", b"\\u003e").replace(b"&", b"\\u0026").decode()
    )


def _template() -> str:
    return resources.files("trio_tasksets").joinpath("report_template.html").read_text("utf-8")


def _version() -> str:
    try:
        return metadata.version("trio-tasksets")
    except metadata.PackageNotFoundError:
        return "unknown"


def page(
    runs: Sequence[RunData],
    *,
    threshold: float = 1.0,
    text_budget: int = TEXT_BUDGET,
) -> str:
    """The whole HTML page for `runs` (their texts are cut to fit `text_budget`)."""
    figures = [compute(run, threshold=threshold) for run in runs]
    caps = [run.fit_texts(text_budget // len(runs)) for run in runs]
    names = [run.name for run in runs]
    title = names[0] if len(runs) == 1 else f"{len(runs)} runs: {', '.join(names)}"
    body = "".join(
        run_section(i, run, fig, cap)
        for i, (run, fig, cap) in enumerate(zip(runs, figures, caps, strict=True))
    )
    if len(runs) > 1:
        body = compare_table(runs, figures) + body
    values = {
        "title": escape(f"{title} · trio-tasksets report"),
        "heading": "Eval report" if len(runs) == 1 else escape(f"Eval report: {len(runs)} runs"),
        "generated": escape(
            f"trio-tasksets {_version()} · written {time.strftime('%Y-%m-%d %H:%M:%S %Z')}"
        ),
        "count": str(len(runs)),
        "body": body,
        "data": embed_json({"runs": [payload(r, f) for r, f in zip(runs, figures, strict=True)]}),
    }
    # One pass: a value is never scanned for placeholders (a run's text may hold "{{data}}").
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], _template())


def _output(dirs: Sequence[Path], output: str | Path | None) -> Path:
    if output is None:
        return dirs[0] / ("report.html" if len(dirs) == 1 else "compare.html")
    path = Path(output)
    if path.is_dir():
        return path / "report.html"
    if not path.parent.is_dir():
        raise ReportError(
            f"-o/--output {str(path)!r}: its directory {str(path.parent)!r} does not exist "
            f"(create it, or write the report elsewhere)"
        )
    return path


def report(
    run_dirs: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    output: str | Path | None = None,
    *,
    threshold: float = 1.0,
    text_budget: int = TEXT_BUDGET,
) -> Path:
    """Write the HTML report of one run dir (or several, side by side); return its path.

    `output` defaults to RUN_DIR/report.html (with several runs, the first one's
    compare.html); an existing directory gets a report.html inside. A rollout counts as
    passing for pass@k when it is ok and its reward is >= `threshold`. Texts are cut so that
    the page holds about `text_budget` characters of them. A missing or unreadable run dir
    raises `ReportError` (a ValueError).
    """
    if isinstance(run_dirs, str | os.PathLike):
        run_dirs = [run_dirs]
    dirs = [Path(d) for d in run_dirs]
    if not dirs:
        raise ReportError("no RUN_DIR given: pass at least one run dir")
    target = _output(dirs, output)
    runs = [load_run(d) for d in dirs]
    _unique_names(runs)
    write_atomic(target, text=page(runs, threshold=threshold, text_budget=text_budget))
    target.chmod(0o644)  # a page to share, not a secret
    return target


def _unique_names(runs: Sequence[RunData]) -> None:
    """Two runs with one name (outputs/a/run, outputs/b/run) get their parents' names too."""
    seen: dict[str, int] = {}
    for run in runs:
        seen[run.name] = seen.get(run.name, 0) + 1
    for run in runs:
        if seen[run.name] > 1:
            run.path = run.path.resolve()
            run.label = f"{run.path.parent.name}/{run.path.name}"


# --- the command line (wired into trio_tasksets.cli) --------------------------------------


def add_report_command(commands: Any) -> None:
    """Add `report RUN_DIR [RUN_DIR ...] [-o FILE]` to the CLI's subcommands."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "report",
        help="write a run dir's HTML report",
        description=(
            "Write one self-contained HTML report (no network needed to view it) of a run "
            "dir, or of several side by side. It reads a run still being written."
        ),
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="<output-dir>/<run-name>")
    parser.add_argument(
        "-o",
        "--output",
        default=None,
        metavar="FILE",
        help="where to write it (default RUN_DIR/report.html; several runs: the first "
        "RUN_DIR/compare.html)",
    )


def report_command(args: argparse.Namespace) -> int:
    """Run `trio-tasksets report`: write the page, print its path. ReportError: usage (2)."""
    print(report(args.run_dirs, args.output))
    return 0
