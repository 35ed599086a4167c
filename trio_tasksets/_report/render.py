"""The report's static part, as HTML: per run its summary, config, errors and charts.

Every number shown comes from `Figures`; each headline number is a `<span data-figure=NAME
data-value=REPR>` so that a test (or a script) reads the exact value behind the rounded text.
Every text from the run is escaped: a model's output is data, never markup.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from html import escape
from typing import Any

from .._monitor.dashboard import FAILED_COUNT_0
from .._transport import redact_url
from .charts import Bar, Line, Mark, Plot, fmt_number, fmt_seconds
from .data import RunData
from .figures import Figures, Histogram

NONE = "\u2013"  # an en dash: no value

__all__ = ["compare_table", "fmt_count", "fmt_rate", "fmt_reward", "run_section"]


def fmt_count(value: int | None) -> str:
    return NONE if value is None else f"{value:,}"


def fmt_reward(value: float | None) -> str:
    return NONE if value is None else f"{value:.3f}"


def fmt_rate(value: float | None) -> str:
    return NONE if value is None else f"{value:,.1f}"


def _figure(name: str, value: object, text: str) -> str:
    shown = "" if value is None else json.dumps(value)
    return (
        f'<span class="num" data-figure="{name}" data-value="{escape(shown)}">{escape(text)}</span>'
    )


def _kpi(label: str, body: str, note: str = "", multi: bool = False) -> str:
    small = f'<p class="note">{note}</p>' if note else ""
    css = ' class="multi"' if multi else ""
    return f'<div class="kpi"><dt>{escape(label)}</dt><dd{css}>{body}{small}</dd></div>'


def _kpis(fig: Figures) -> str:
    planned = f" of {fmt_count(fig.planned)} planned" if fig.planned is not None else ""
    kept = f"; {fmt_count(fig.kept_from_resume)} kept from a resume" if fig.kept_from_resume else ""
    share = f"{fig.failed / fig.finished:.1%} of finished" if fig.finished else ""
    if fig.reward_ci is not None:
        low, high = fig.reward_ci.low, fig.reward_ci.high
        ci = (
            f"95% CI {_figure('reward_ci_low', low, f'{low:.3f}')}{NONE}"
            f"{_figure('reward_ci_high', high, f'{high:.3f}')} "
            f"({escape(fig.reward_ci.method)}, {fig.reward_n:,} rewards, "
            f"clustered by {fig.ci_clusters:,} tasks)"
        )
    elif fig.reward_n == 0:
        ci = "no rewards yet"
    else:
        ci = "too few tasks for an interval"
    std = f"; std {fmt_reward(fig.reward_std)}" if fig.reward_std is not None else ""
    if fig.failed and fig.reward_mean is not None:  # as the command line and the dashboard say
        ci = f"{FAILED_COUNT_0}; {ci}"
    rate_note = (
        f"{fmt_rate(fig.rows_rate)}/s over the rows' wall-clock span"
        if fig.rows_rate is not None
        else ""
    )
    parts = [
        _kpi("Finished", _figure("finished", fig.finished, fmt_count(fig.finished)),
             escape(planned + kept).lstrip("; ")),
        _kpi("OK", _figure("ok", fig.ok, fmt_count(fig.ok))),
        _kpi("Failed", _figure("failed", fig.failed, fmt_count(fig.failed)), share),
        _kpi("Reward mean", _figure("reward_mean", fig.reward_mean, fmt_reward(fig.reward_mean)),
             ci + std),
        _kpi("Rollouts / s", _figure("rate", fig.rate, fmt_rate(fig.rate)), rate_note),
    ]  # fmt: skip
    if fig.duration_s is not None:
        parts.append(
            _kpi("Duration", _figure("duration_s", fig.duration_s, fmt_seconds(fig.duration_s)))
        )
    if fig.percentiles:
        body = "<br>".join(
            f'<span class="muted">{name}</span> {_figure(name, value, fmt_seconds(value))}'
            for name, value in fig.percentiles.items()
        )
        parts.append(_kpi("Latency", body, "per episode, all attempts", multi=True))
    if fig.usage:
        body = "<br>".join(
            f'<span class="muted">{escape(name.removesuffix("_tokens"))}</span> '
            f"{_figure(name, value, fmt_count(value))}"
            for name, value in fig.usage.items()
        )
        per = f"{sum(fig.usage.values()) / fig.finished:,.1f} per rollout" if fig.finished else ""
        parts.append(_kpi("Tokens", body, per, multi=True))
    if fig.metrics:
        lines = []
        for name, (mean, n, interval) in fig.metrics.items():
            ci = (
                f" (95% CI {interval.low:.3f}{NONE}{interval.high:.3f}, {escape(interval.method)})"
                if interval is not None
                else ""
            )
            lines.append(
                f'<span class="muted">{escape(name)}</span> '
                f"{_figure(f'metric:{escape(name)}', mean, fmt_reward(mean))}{ci} · n {n:,}"
            )
        parts.append(_kpi("Metrics", "<br>".join(lines), "named metrics of the rows", multi=True))
    return f'<dl class="kpis">{"".join(parts)}</dl>'


def _config_rows(config: dict[str, Any], summary: dict[str, Any] | None) -> list[tuple[str, str]]:
    sources = [config, config.get("identity") or {}, config.get("eval") or {}, summary or {}]

    def get(name: str) -> Any:
        for source in sources:
            if isinstance(source, dict) and source.get(name) is not None:
                return source[name]
        return None

    rows: list[tuple[str, str]] = []

    def add(label: str, value: Any) -> None:
        if value is None or value == "" or value == {}:
            return
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            text = shlex.join(value)
        elif isinstance(value, dict | list):
            text = json.dumps(value, default=str)
        else:
            text = str(value)
        rows.append((label, redact_url(text)))  # (a run recorded before URLs were redacted)

    add("model", get("model"))
    add("taskset", get("taskset"))
    add("base URL", get("base_url"))
    add("API key variable", get("api_key_var"))
    n, r, c = get("num_examples"), get("rollouts_per_example"), get("max_concurrent")
    add("-n -r -c", f"-n {'all' if n is None else n} -r {r if r is not None else '?'} "
                    f"-c {c if c is not None else '?'}")  # fmt: skip
    add("shuffle / seed", f"{get('shuffle')} / {get('seed')}" if get("shuffle") else None)
    sampling = get("sampling")
    if isinstance(sampling, dict):
        chosen = {k: v for k, v in sampling.items() if v not in (None, {}, [])}
        add("sampling", chosen or "model defaults")
    add("taskset config", get("taskset_config"))
    add("version", get("version"))
    add("started at", get("started_at"))
    add("command", get("command"))
    return rows


def _config(run: RunData) -> str:
    rows = "".join(
        f"<tr><th scope=row>{escape(k)}</th><td><code>{escape(v)}</code></td></tr>"
        for k, v in _config_rows(run.config, run.summary)
    )
    if not rows:
        rows = '<tr><td colspan="2">no config.json</td></tr>'
    return f'<table class="kv"><caption>Config</caption>{rows}</table>'


def _errors(run: RunData, fig: Figures) -> str:
    if not fig.errors_by_type:
        return '<table class="errors"><caption>Errors by type</caption></table><p class="muted">No errors.</p>'
    examples: dict[str, str] = {}
    for errors in run.errors:
        for kind, message, _ in errors:
            examples.setdefault(run.strings[kind], run.strings[message])
    rows = "".join(
        f"<tr><th scope=row><code>{escape(kind)}</code></th>"
        f'<td class="n">{_figure("errors." + kind, count, fmt_count(count))}</td>'
        f'<td class="n">{fmt_count(fig.failed_by_type.get(kind, 0))}</td>'
        f'<td class="first">{escape(examples.get(kind, "")[:300])}</td></tr>'
        for kind, count in fig.errors_by_type.items()
    )
    return (
        f'<table class="errors"><caption>Errors by type <span class="muted">(counts from '
        f"{escape(fig.errors_source)})</span></caption><thead><tr><th scope=col>type</th>"
        f'<th scope=col class="n">errors</th><th scope=col class="n">failed rows</th>'
        f"<th scope=col>first message</th></tr></thead><tbody>{rows}</tbody></table>"
    )


def _hist_bars(hist: Histogram, what: str, fmt: Any) -> tuple[list[Bar], list[str] | None, float]:
    if hist.values is not None:
        labels = [fmt_number(v) for v in hist.values]
        bars = [
            Bar(i, i + 1, ((c, "bar"),), f"{labels[i]}: {c:,} {what}")
            for i, c in enumerate(hist.counts)
        ]
        return bars, labels, len(bars)
    edges = hist.edges or [0.0, 1.0]
    bars = [
        Bar(edges[i], edges[i + 1], ((c, "bar"),),
            f"{fmt(edges[i])} to {fmt(edges[i + 1])}: {c:,} {what}")
        for i, c in enumerate(hist.counts)
    ]  # fmt: skip
    end = edges[-1]
    if hist.overflow:
        width = edges[1] - edges[0]
        bars.append(Bar(end + width, end + 3 * width, ((hist.overflow, "bar bar-over"),),
                        f"over {fmt(end)}: {hist.overflow:,} {what}"))  # fmt: skip
        end += 3 * width
    return bars, None, end


def _describe(bars: Sequence[Bar], limit: int = 16) -> str:
    tips = [b.tip for b in bars if any(v > 0 for v, _ in b.segments)]
    more = f"; and {len(tips) - limit} more" if len(tips) > limit else ""
    return "; ".join(tips[:limit]) + more


def _hist_chart(hist: Histogram, ident: str, title: str, x_label: str, seconds: bool) -> Plot:
    fmt = fmt_seconds if seconds else fmt_number
    bars, labels, end = _hist_bars(hist, "rows", fmt)
    start = 0.0 if labels is not None else (hist.edges or [0.0])[0]
    top = max((sum(v for v, _ in b.segments) for b in bars), default=1)
    plot = Plot(title, _describe(bars), x_label, "rows", ident, (start, end), top * 1.1,
                x_format="seconds" if seconds else "number", categories=labels,
                y_integer=True)  # fmt: skip
    plot.bars(bars)
    return plot


def _charts(fig: Figures, ident: str) -> list[tuple[str, str]]:
    charts: list[tuple[str, str]] = []
    if fig.reward_hist is not None:
        plot = _hist_chart(fig.reward_hist, f"{ident}-reward", "Reward", "reward", False)
        charts.append(("Reward", plot.svg()))
    if fig.latency is not None:
        plot = _hist_chart(fig.latency, f"{ident}-latency", "Latency", "episode duration", True)
        for row, (name, value) in enumerate(fig.percentiles.items()):
            plot.mark(Mark(value, name), row)
        marks = ", ".join(f"{name} {fmt_seconds(v)}" for name, v in fig.percentiles.items())
        charts.append((f"Latency ({marks})", plot.svg()))
    if fig.throughput is not None:
        tp = fig.throughput
        bars = [
            Bar(i * tp.width, (i + 1) * tp.width,
                ((ok / tp.width, "bar"), (failed / tp.width, "bar bar-fail")),
                f"{fmt_seconds(i * tp.width)}: {ok:,} ok, {failed:,} failed "
                f"({(ok + failed) / tp.width:,.1f}/s)")
            for i, (ok, failed) in enumerate(zip(tp.ok, tp.failed, strict=True))
        ]  # fmt: skip
        top = max((sum(v for v, _ in b.segments) for b in bars), default=1.0)
        plot = Plot("Throughput", _describe(bars, 8), "time since start", "completions / s",
                    f"{ident}-throughput", (0.0, len(bars) * tp.width), top * 1.15,
                    x_format="seconds")  # fmt: skip
        plot.bars(bars)
        plot.legend([("ok", "bar"), ("failed", "bar bar-fail")])
        charts.append((f"Throughput (completions per {fmt_seconds(tp.width)})", plot.svg()))
    if fig.in_flight or fig.window:
        charts.append(_flight_chart(fig, ident))
    return charts


def _flight_chart(fig: Figures, ident: str) -> tuple[str, str]:
    window = fig.window or []
    end = max([t for t, _ in fig.in_flight] + [t for t, _, _ in window] + [1e-6])
    top = max([n for _, n in fig.in_flight] + [s for _, s, _ in window] + [1])
    what = f"peak {fig.max_in_flight:,} rollouts in flight"
    if window:
        what += f"; window from {window[0][1]:g} to {window[-1][1]:g} ({len(window)} changes)"
    plot = Plot("Concurrency", what, "time since start", "rollouts", f"{ident}-flight",
                (0.0, end), top * 1.15, x_format="seconds", y_integer=True)  # fmt: skip
    entries = []
    if fig.in_flight:
        plot.line(Line(tuple((t, float(n)) for t, n in fig.in_flight), "line-flight",
                       "rollouts in flight (sampled)"), end)  # fmt: skip
        entries.append(("in flight", "line-flight"))
    if window:
        points = tuple((t, s) for t, s, _ in window)
        plot.line(Line(points, "line-window", "window size"), end)
        entries.append(("window", "line-window"))
    plot.legend(entries)
    title = "Window and rollouts in flight" if window else "Rollouts in flight"
    return (f"{title} (peak {fig.max_in_flight:,})", plot.svg())


def _tasks(fig: Figures, ident: str) -> str:
    tasks = fig.tasks
    if not tasks.rollouts:
        return ""
    rows = "".join(
        f'<tr><th scope=row>pass@{k}</th><td class="n">'
        f"{_figure(f'pass@{k}', value, f'{value:.3f}')}</td>"
        f'<td class="n">{count:,}</td></tr>'
        for k, value, count in tasks.pass_at_k
    )
    spread = "".join(
        f'<tr><th scope=row>{passed} of {n}</th><td class="n">{count:,}</td></tr>'
        for passed, n, count in tasks.passed_counts[:40]
    )
    more = len(tasks.passed_counts) - 40
    if more > 0:
        spread += f'<tr><td colspan="2">and {more} more</td></tr>'
    rule = f"ok and reward ≥ {fmt_number(tasks.threshold)}"
    return (
        f'<div class="pair"><table class="kv"><caption>pass@k over {len(tasks.rollouts):,} tasks '
        f'<span class="muted">(a rollout passes when {escape(rule)})</span></caption>'
        f'<thead><tr><th scope=col>k</th><th scope=col class="n">pass@k</th>'
        f'<th scope=col class="n">tasks</th>'
        f'</tr></thead><tbody>{rows}</tbody></table><table class="kv"><caption>Tasks by '
        f"passing rollouts</caption><thead><tr><th scope=col>passed</th>"
        f'<th scope=col class="n">tasks</th></tr></thead><tbody>{spread}</tbody></table></div>'
    )


def _groups(run: RunData, fig: Figures) -> str:
    """The groups table (`--group` runs): each group's rollouts and reward spread."""
    groups = fig.groups
    if groups is None:
        return ""
    limit = 200
    rows = "".join(
        f"<tr><th scope=row>{escape(run.task_keys[task][:16])}</th>"
        f'<td class="n">{ok:,}/{n:,}</td><td class="n">{fmt_reward(mean)}</td>'
        f'<td class="n">{fmt_reward(lo)} to {fmt_reward(hi)}</td>'
        f'<td class="n">{fmt_reward(None if lo is None or hi is None else hi - lo)}</td></tr>'
        for task, n, ok, mean, lo, hi in groups.groups[:limit]
    )
    more = len(groups.groups) - limit
    if more > 0:
        rows += f'<tr><td colspan="5">and {more:,} more</td></tr>'
    count = len(groups.groups)
    return (
        f'<table class="kv"><caption>{count:,} groups '
        f'<span class="muted">({_figure("groups_flat", groups.flat, f"{groups.flat:,}")} with '
        f"no reward spread)</span></caption><thead><tr><th scope=col>task</th>"
        f'<th scope=col class="n">ok</th><th scope=col class="n">reward mean</th>'
        f'<th scope=col class="n">min to max</th><th scope=col class="n">spread</th></tr>'
        f"</thead><tbody>{rows}</tbody></table>"
    )


def _notes(run: RunData, fig: Figures) -> str:
    notes = []
    if run.summary is None:
        notes.append(
            f"No summary.json yet: the run is still being written, or was killed. The figures "
            f"are from the {len(run):,} whole rows read so far."
        )
    if fig.error:
        notes.append(f"The run ended on an error: {escape(fig.error)}")
    if run.torn:
        notes.append("The last line of traces.jsonl is incomplete (a row being written, or "
                     "torn by a kill): it is left out.")  # fmt: skip
    if run.unreadable:
        lines = ", ".join(str(n) for n in run.unreadable[:10])
        notes.append(f"{len(run.unreadable):,} lines of traces.jsonl are not JSON rows and are "
                     f"left out (lines {lines}{', …' if len(run.unreadable) > 10 else ''}).")  # fmt: skip
    if run.sample is not None and run.table is not None:
        notes.append(escape(run.sample.describe(len(run.table), len(run))))
    for mismatch in fig.mismatches:
        notes.append(f"summary.json and the rows disagree on {escape(mismatch)}.")
    if run.cap is not None:
        notes.append(
            f"{len(run.cut):,} texts longer than {run.cap:,} characters are cut in this page to "
            f"keep it small; each row names its line in traces.jsonl, which holds them whole."
        )
    return "".join(f'<p class="notice" role="note">{n}</p>' for n in notes)


def run_section(index: int, run: RunData, fig: Figures) -> str:
    """One run's article: header, notes, summary numbers, config, errors, charts, tasks."""
    ident = f"run{index}"
    status_class = "ok" if fig.status == "finished" and not fig.error else "warn"
    charts = "".join(
        f'<figure class="card chart-card"><figcaption>{escape(title)}</figcaption>{svg}</figure>'
        for title, svg in _charts(fig, ident)
    )
    return (
        f'<article class="run" id="{ident}" aria-labelledby="{ident}-name">'
        f'<header class="run-head"><h2 id="{ident}-name">{escape(run.name)}</h2>'
        f'<span class="status {status_class}" data-figure="status">{escape(fig.status)}</span>'
        f'<p class="path muted">{escape(str(run.path))}</p></header>{_notes(run, fig)}'
        f'<section class="card" aria-label="Summary of {escape(run.name)}">{_kpis(fig)}</section>'
        f'<div class="cards"><section class="card">{_config(run)}</section>'
        f'<section class="card">{_errors(run, fig)}{_tasks(fig, ident)}{_groups(run, fig)}</section>{charts}'
        "</div></article>"
    )


def compare_table(runs: Sequence[RunData], figures: Sequence[Figures]) -> str:
    """The runs side by side: one column per run, one row per headline figure."""
    head = "".join(f'<th scope=col class="n">{escape(run.name)}</th>' for run in runs)
    lines = [
        ("finished", [fmt_count(f.finished) for f in figures]),
        ("ok", [fmt_count(f.ok) for f in figures]),
        ("failed", [fmt_count(f.failed) for f in figures]),
        ("reward mean", [fmt_reward(f.reward_mean) for f in figures]),
        ("95% CI", [
            NONE if f.reward_ci is None else f"{f.reward_ci.low:.3f} to {f.reward_ci.high:.3f}"
            for f in figures
        ]),
        ("rollouts / s", [fmt_rate(f.rate) for f in figures]),
        ("p50 latency", [fmt_seconds(f.percentiles["p50"]) if f.percentiles else NONE
                         for f in figures]),
        ("p99 latency", [fmt_seconds(f.percentiles["p99"]) if f.percentiles else NONE
                         for f in figures]),
        ("pass@1", [f"{f.tasks.pass_at_k[0][1]:.3f}" if f.tasks.pass_at_k else NONE
                    for f in figures]),
        ("status", [f.status for f in figures]),
    ]  # fmt: skip
    body = "".join(
        f"<tr><th scope=row>{escape(name)}</th>"
        + "".join(f'<td class="n">{escape(v)}</td>' for v in values)
        + "</tr>"
        for name, values in lines
    )
    return (
        f'<section class="card compare"><table class="kv"><caption>The runs side by side'
        f"</caption><thead><tr><td></td>{head}</tr></thead><tbody>{body}</tbody></table>"
        f"</section>"
    )
