"""`report`: one self-contained HTML page for one or more run dirs (no network at view time).

    trio-tasksets report RUN_DIR [RUN_DIR ...] [-o FILE]
    tt.report("outputs/my-run")            # -> Path("outputs/my-run/report.html")

The page needs no network when it is viewed (its CSS, script, charts and data are inline, and
its Content-Security-Policy forbids any fetch): the summary with a confidence interval, errors
by type, reward and latency histograms, throughput and concurrency over time, pass@k, and a
filterable, sortable, paged table of the rows, each expanding to its messages. Figures are
computed in Python (`report_figures`); the page's script only draws the table.

It reads a run that is still being written (whole lines only) and 100,000 rows in seconds.
The table holds at most 50,000 rows (a larger run's is a sample, and the page says so; the
figures count every row), so the page stays near its bound at any row count.
"""

from __future__ import annotations

import gc
import os
import re
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from html import escape
from importlib import metadata, resources
from pathlib import Path
from typing import Any, TypeVar

import orjson

from .._env.traces import write_atomic
from .data import ReportError, RunData, load_run
from .figures import Figures, compute
from .render import compare_table, run_section

__all__ = ["ReportError", "page", "payload", "report"]

MAX_SIZE = 27_000_000  # bytes: about the largest page; row texts are cut to fit it
MIN_TEXT = 1_000_000  # characters of texts a run keeps, whatever its size
_RESERVE = 400_000  # bytes for the template and the summary's HTML
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")
T = TypeVar("T")


def _scaled(values: list[float | None], scale: float, base: float = 0.0) -> list[int | None]:
    # Whole milliseconds or microseconds: shorter in JSON than floats, and quicker to write.
    return [None if v is None else int((v - base) * scale + 0.5) for v in values]


def payload(run: RunData, fig: Figures) -> dict[str, Any]:
    """The table's data for one run, column by column, without its texts (`run.strings`,
    which `page` adds as `S`; text columns hold indices into it). A run with a sampled
    table (`run.table`) gives the sampled rows only, and the tasks they name."""
    t0 = fig.t0 or 0.0
    tasks = fig.tasks
    pick = run.table
    used: list[int] | None = None  # the tasks the sampled rows name (None: all)
    task_ids = run.task
    if pick is not None:
        used = sorted({run.task[i] for i in pick})
        task_of = {t: j for j, t in enumerate(used)}
        task_ids = [task_of[run.task[i]] for i in pick]

    def keep_rows(column: Sequence[T]) -> list[T]:
        return _taken(column, pick)

    def keep_tasks(column: Sequence[T]) -> list[T]:
        return _taken(column, used)

    line = keep_rows(run.line)
    consecutive = pick is None and all(n == i for i, n in enumerate(line, 1))
    turns, calls, advantages = (
        keep_rows(run.turns),
        keep_rows(run.tool_calls),
        keep_rows(run.advantage),
    )
    # The rows table's columns beyond the fixed ones, only when a row has them: an agent's
    # turns and tool calls (a single-turn row has 1 and 0: no column for it), a group's
    # advantage (a run without any carries no such column, nor its data).
    agent = any(calls) or any(n > 1 for n in turns)
    advantage = any(value is not None for value in advantages)
    more = [*(["tn", "tc"] if agent else []), *(["adv"] if advantage else [])]
    extra = run.extra if pick is None else {
        j: run.extra[i] for j, i in enumerate(pick) if i in run.extra
    }  # fmt: skip
    return {
        "name": run.name,
        "more": more,
        "cut": run.cut,
        "t0": fig.t0,
        "threshold": tasks.threshold,
        "tasks": {
            "key": keep_tasks(run.task_keys),
            "fields": [(name, kind, keep_tasks(column)) for name, kind, column in run.task_fields],
            "n": keep_tasks(tasks.rollouts),
            "ok": keep_tasks(tasks.ok),
            "passed": keep_tasks(tasks.passed),
            "mean": keep_tasks(tasks.reward_mean),
        },
        "rows": {
            "line": None if consecutive else line,  # None: row i is on line i + 1
            "id": keep_rows(run.id),
            "task": task_ids,
            "rollout": keep_rows(run.rollout),
            "ok": [1 if ok else 0 for ok in keep_rows(run.ok)],
            "reward": keep_rows(run.reward),
            "att": keep_rows(run.attempts),
            "start": _scaled(keep_rows(run.started), 1e3, t0),  # ms since t0
            "fin": _scaled(keep_rows(run.finished), 1e3, t0),
            "dur": _scaled(keep_rows(run.duration), 1e6),  # µs
            "err": [errors[-1][0] if errors else -1 for errors in keep_rows(run.errors)],
            "errs": keep_rows(run.errors),
            "comp": keep_rows(run.completion),
            "msgs": keep_rows(run.messages),
            "pt": keep_rows(run.prompt_tokens),
            "ct": keep_rows(run.completion_tokens),
            "fr": keep_rows(run.finish_reason),
            "tn": turns,
            "tc": calls,
            "sr": keep_rows(run.stop_reason),
            "adv": advantages if advantage else None,
            "extra": extra,
        },
    }


def _taken(column: Sequence[T], indices: list[int] | None) -> list[T]:
    if indices is None:
        return column if isinstance(column, list) else list(column)
    return [column[i] for i in indices]


def _dump(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)


def _safe(data: bytes) -> bytes:
    # `<`, `>` and `&` occur in JSON only inside strings, where a \u escape means the same.
    return data.replace(b"<", b"\\u003c").replace(b">", b"\\u003e").replace(b"&", b"\\u0026")


def embed_json(value: Any) -> str:
    """`value` as JSON that is safe inside a <script> element: no `<`, `>` or `&` appears
    (each is written as a JSON \\u escape), so no text can close the element."""
    return _safe(_dump(value)).decode()


def _fit(runs: Sequence[RunData], data: Sequence[dict[str, Any]], max_size: int) -> None:
    """Cut the runs' texts so that the page takes about `max_size` bytes (`data`: their
    payloads, whose raw JSON the cuts shorten in place)."""
    fixed = _RESERVE + sum(len(_dump(d)) for d in data)
    budget = max((max_size - fixed) // len(runs), MIN_TEXT)
    caps = [run.fit_texts(budget) for run in runs]
    for _ in range(3):  # characters are not bytes (escapes, UTF-8): measure, then correct
        total = fixed + sum(len(_dump(run.strings)) + len(_dump(run.cut)) for run in runs)
        if total <= max_size or budget <= MIN_TEXT:
            return
        budget = max(int(budget * (max_size - fixed) / (total - fixed) * 0.98), MIN_TEXT)
        before, caps = caps, [run.fit_texts(budget) for run in runs]
        if caps == before:  # every run is at MIN_CAP already
            return


def _data(runs: Sequence[RunData], data: Sequence[dict[str, Any]]) -> str:
    parts = [
        b'{"S":' + _dump(run.strings) + b"," + _dump(d)[1:]
        for run, d in zip(runs, data, strict=True)
    ]
    return _safe(b'{"runs":[' + b",".join(parts) + b"]}").decode()


def _template() -> str:
    return resources.files(__name__).joinpath("template.html").read_text("utf-8")


def _version() -> str:
    try:
        return metadata.version("trio-tasksets")
    except metadata.PackageNotFoundError:
        return "unknown"


def page(runs: Sequence[RunData], *, threshold: float = 1.0, max_size: int = MAX_SIZE) -> str:
    """The whole HTML page for `runs` (their texts cut to keep it near `max_size` bytes)."""
    figures = [compute(run, threshold=threshold) for run in runs]
    data = [payload(run, fig) for run, fig in zip(runs, figures, strict=True)]
    _fit(runs, data, max_size)
    names = [run.name for run in runs]
    title = names[0] if len(runs) == 1 else f"{len(runs)} runs: {', '.join(names)}"
    body = "".join(
        run_section(i, run, fig) for i, (run, fig) in enumerate(zip(runs, figures, strict=True))
    )
    values = {
        "title": escape(f"{title} · trio-tasksets report"),
        "heading": "Eval report" if len(runs) == 1 else escape(f"Eval report: {len(runs)} runs"),
        "generated": escape(
            f"trio-tasksets {_version()} · written {time.strftime('%Y-%m-%d %H:%M:%S %Z')}"
        ),
        "count": str(len(runs)),
        "compare": compare_table(runs, figures) if len(runs) > 1 else "",
        "body": body,
        "data": _data(runs, data),
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
            f"{{output}} {str(path)!r}: its directory {str(path.parent)!r} does not exist "
            f"(create it, or write the report elsewhere)",
            parameter="output",
        )
    return path


def report(
    run_dirs: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    output: str | Path | None = None,
    *,
    threshold: float = 1.0,
    max_size: int = MAX_SIZE,
) -> Path:
    """Write the HTML report of one run dir (or several, side by side); return its path.

    `output` defaults to RUN_DIR/report.html (with several runs, the first one's
    compare.html); an existing directory gets a report.html inside. A rollout counts as
    passing for pass@k when it is ok and its reward is >= `threshold`. The longest texts are
    cut so that the page stays near `max_size` bytes (each cut says so, and the row's line in
    traces.jsonl holds it whole). A missing or unreadable run dir raises `ReportError` (a
    ValueError).
    """
    if isinstance(run_dirs, str | os.PathLike):
        run_dirs = [run_dirs]
    dirs = [Path(d) for d in run_dirs]
    if not dirs:
        raise ReportError("no RUN_DIR given: pass at least one run dir", parameter="run_dirs")
    target = _output(dirs, output)
    with _gc_paused():
        runs = [load_run(d) for d in dirs]
        _unique_names(runs)
        html = page(runs, threshold=threshold, max_size=max_size)
    write_atomic(target, text=html)
    target.chmod(0o644)  # a page to share, not a secret
    return target


@contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside: reading a run makes millions of containers that
    all stay alive, and the collector would walk them again and again (about 20% of the CPU
    time on 100,000 rows, bench/report.py)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _unique_names(runs: Sequence[RunData]) -> None:
    """Two runs with one name (outputs/a/run, outputs/b/run) get their parents' names too."""
    seen: dict[str, int] = {}
    for run in runs:
        seen[run.name] = seen.get(run.name, 0) + 1
    for run in runs:
        if seen[run.name] > 1:
            run.path = run.path.resolve()
            run.label = f"{run.path.parent.name}/{run.path.name}"
