"""The report's figures, computed here (not in the page) so that tests can check every one.

Where `summary.json` gives a figure (counts, reward mean, rate, usage, errors by type), the
report shows its value, and checks it against the same figure recomputed from the rows
(`Figures.mismatches` names any that differ). A run still being written has no summary yet:
every figure then comes from its rows.
"""

from __future__ import annotations

import bisect
import math
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime
from typing import Any

import attrs

from .data import RunData
from .stats import Interval, mean_and_std, nice_step, pass_at_k, percentile, reward_interval

__all__ = [
    "Figures",
    "Histogram",
    "TaskFigures",
    "Throughput",
    "compute",
]

REWARD_VALUES = 12  # at most this many distinct rewards: one bar per value
BINS = 30
FLIGHT_SAMPLES = 300


@attrs.frozen
class Histogram:
    """Bars: `counts[i]` values in [edges[i], edges[i+1]) (the last bin closed), or, when
    `edges` is None, equal to `values[i]`. `overflow` values lie above the last edge."""

    counts: list[int]
    edges: list[float] | None = None
    values: list[float] | None = None
    overflow: int = 0


@attrs.frozen
class Throughput:
    """Completions per time bin since `t0`: bin i is [i*width, (i+1)*width) seconds."""

    width: float
    ok: list[int]
    failed: list[int]


@attrs.frozen
class TaskFigures:
    """Per task (in order of first appearance): its rollouts, ok ones, passing ones (ok and
    reward >= threshold), mean reward; pass@k over the tasks; tasks per (passed, rollouts)."""

    threshold: float
    rollouts: list[int]
    ok: list[int]
    passed: list[int]
    reward_mean: list[float | None]
    pass_at_k: list[tuple[int, float, int]]  # (k, pass@k, tasks with >= k rollouts)
    passed_counts: list[tuple[int, int, int]]  # (passed, rollouts, tasks)


@attrs.frozen
class GroupFigures:
    """Rows grouped by `group` (an eval run with `--group`): per group, in order of first
    appearance, (task index, rollouts, ok rollouts, reward mean, min, max); and how many
    groups have no reward spread (all rewards equal: no learning signal for GRPO)."""

    groups: list[tuple[int, int, int, float | None, float | None, float | None]]
    flat: int


@attrs.frozen
class Figures:
    """Everything the report shows about one run."""

    status: str
    error: str | None
    finished: int
    ok: int
    failed: int
    planned: int | None
    kept_from_resume: int | None
    reward_n: int
    reward_mean: float | None
    reward_std: float | None
    reward_ci: Interval | None  # inside the rewards' bounds; its `method` says how made
    ci_clusters: int
    duration_s: float | None
    rate: float | None
    rows_rate: float | None
    usage: dict[str, int] | None
    errors_by_type: dict[str, int]
    errors_source: str  # "summary.json" or "rows"
    failed_by_type: dict[str, int]  # failed rows by their last error's type
    reward_hist: Histogram | None
    latency: Histogram | None
    percentiles: dict[str, float]
    throughput: Throughput | None
    in_flight: list[tuple[float, int]]
    max_in_flight: int
    window: list[tuple[float, float, str]] | None
    t0: float | None
    tasks: TaskFigures
    mismatches: list[str]
    groups: GroupFigures | None = None
    # Each named metric of the rows (`metrics`, besides the reward): (mean, n, interval).
    metrics: dict[str, tuple[float, int, Interval | None]] = attrs.Factory(dict)


# --- the figures -------------------------------------------------------------------------


def _reward_hist(rewards: Sequence[float]) -> Histogram | None:
    if not rewards:
        return None
    distinct = sorted(set(rewards))
    if len(distinct) <= REWARD_VALUES:
        counts = Counter(rewards)
        return Histogram(counts=[counts[v] for v in distinct], values=distinct)
    return _binned(rewards, min(rewards), max(rewards))


def _bin_counts(values: Iterable[float], low: float, width: float, high: float) -> Counter[int]:
    """How many values fall in each bin [low + i*width, low + (i+1)*width); -1 counts those
    above `high`. (Counter counts in C: a loop here would cost ~0.1 s on 100,000 rows.)"""
    scale = 1.0 / width
    return Counter(int((v - low) * scale) if v <= high else -1 for v in values)


def _binned(values: Sequence[float], low: float, high: float) -> Histogram:
    if high <= low:
        high = low + 1.0
    width = (high - low) / BINS
    counts = [0] * BINS
    overflow = 0
    for index, count in _bin_counts(values, low, width, high).items():
        if index < 0:
            overflow += count
        else:
            counts[min(index, BINS - 1)] += count
    return Histogram(
        counts=counts, edges=[low + i * width for i in range(BINS + 1)], overflow=overflow
    )


def _latency(durations: Sequence[float]) -> tuple[Histogram | None, dict[str, float]]:
    if not durations:
        return None, {}
    ordered = array("d", sorted(durations))
    marks = {f"p{q}": percentile(ordered, q) for q in (50, 90, 99)}
    # A long tail would squeeze every bar into the first bin: past 3 x p99, one overflow bar.
    high = ordered[-1] if ordered[-1] <= 3 * marks["p99"] else 1.5 * marks["p99"]
    return _binned(ordered, 0.0, high), marks


def _start_time(config: dict[str, Any], started: Sequence[float]) -> float | None:
    """When the run began, in seconds since the epoch: config.json's `started_at` (a number
    or an ISO 8601 time), else the first row's start."""
    value = config.get("started_at")
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value).timestamp()
        except ValueError:
            pass
    return min(started) if started else None


def _throughput(
    run: RunData, t0: float | None
) -> tuple[Throughput | None, list[tuple[float, int]], int]:
    whole = [i for i, (s, f) in enumerate(zip(run.started, run.finished, strict=True))
             if s is not None and f is not None]  # fmt: skip
    if t0 is None or not whole:
        return None, [], 0
    ends = array("d", (f - t0 for f in run.finished if f is not None))
    last = max(max(ends), 1e-6)
    # About four completions a bin on a small run; at most 80 bins on a large one.
    width = nice_step(last / min(max(len(ends) / 4, 10), 80))
    bins = int(last / width) + 1
    ok, failed = [0] * bins, [0] * bins
    for bars, wanted in ((ok, True), (failed, False)):
        ends_of = (e for good, e in zip(run.ok, run.finished, strict=True) if good is wanted)
        for index, count in _bin_counts(_present(ends_of), t0, width, math.inf).items():
            bars[min(max(index, 0), bins - 1)] += count
    starts = array("d", sorted(run.started[i] or 0.0 for i in whole))
    finishes = array("d", sorted(run.finished[i] or 0.0 for i in whole))
    del whole
    # Rows in flight: exact at its peak (it peaks at a start), sampled evenly for the chart.
    peak = max(i + 1 - bisect.bisect_right(finishes, s) for i, s in enumerate(starts))
    samples = []
    for i in range(FLIGHT_SAMPLES + 1):
        t = t0 + last * i / FLIGHT_SAMPLES
        samples.append((t - t0, bisect.bisect_right(starts, t) - bisect.bisect_right(finishes, t)))
    return Throughput(width=width, ok=ok, failed=failed), samples, peak


def _window(summary: dict[str, Any] | None) -> list[tuple[float, float, str]] | None:
    history = (summary or {}).get("window_history")
    if not isinstance(history, list):
        return None
    points = []
    for entry in history:
        if isinstance(entry, list | tuple) and len(entry) >= 2:
            t, size = entry[0], entry[1]
            reason: object = entry[2] if len(entry) > 2 else ""
        elif isinstance(entry, dict):  # the same, as {"t": ..., "size": ..., "reason": ...}
            t = next((entry[k] for k in ("t", "time", "seconds") if k in entry), None)
            size = next((entry[k] for k in ("size", "window") if k in entry), None)
            reason = entry.get("reason", "")
        else:
            continue
        if _finite(t) and _finite(size):
            points.append((float(t), float(size), str(reason)))
    return points or None


def _present(values: Iterable[float | None]) -> Iterator[float]:
    return (v for v in values if v is not None)


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _tasks(run: RunData, threshold: float) -> TaskFigures:
    count = len(run.task_keys)
    rollouts, ok, passed = [0] * count, [0] * count, [0] * count
    sums, finite = [0.0] * count, [0] * count
    for task, good, reward in zip(run.task, run.ok, run.reward, strict=True):
        rollouts[task] += 1
        if reward is not None:
            sums[task] += reward
            finite[task] += 1
        if good:
            ok[task] += 1
            if reward is not None and reward >= threshold:
                passed[task] += 1
    widest = max(rollouts, default=0)
    ks = sorted({1, widest, *(2**i for i in range(1, 20) if 2**i < widest)} - {0})
    table = []
    for k in ks:
        eligible = [(n, c) for n, c in zip(rollouts, passed, strict=True) if n >= k]
        if eligible:
            value = math.fsum(pass_at_k(n, c, k) for n, c in eligible) / len(eligible)
            table.append((k, value, len(eligible)))
    spread = Counter(zip(passed, rollouts, strict=True))
    return TaskFigures(
        threshold=threshold,
        rollouts=rollouts,
        ok=ok,
        passed=passed,
        reward_mean=[s / n if n else None for s, n in zip(sums, finite, strict=True)],
        pass_at_k=table,
        passed_counts=sorted((c, n, tasks) for (c, n), tasks in spread.items()),
    )


def _groups(run: RunData) -> GroupFigures | None:
    members: dict[str, list[int]] = {}
    for row, group in enumerate(run.group):
        if group is not None:
            members.setdefault(group, []).append(row)
    if not members:
        return None
    table = []
    flat = 0
    for rows in members.values():
        rewards = [r for r in (run.reward[i] for i in rows) if r is not None]
        lo, hi = (min(rewards), max(rewards)) if rewards else (None, None)
        if lo is not None and lo == hi:
            flat += 1
        mean = mean_and_std(rewards)[0] if rewards else None
        ok = sum(1 for i in rows if run.ok[i])
        table.append((run.task[rows[0]], len(rows), ok, mean, lo, hi))
    return GroupFigures(groups=table, flat=flat)


def _status(summary: dict[str, Any] | None) -> tuple[str, str | None]:
    if summary is None:
        return "running, or stopped before writing summary.json", None
    error = summary.get("error")
    error = str(error) if error else None
    stopped = summary.get("stopped")
    if stopped:
        return f"stopped: {stopped}", error
    if error:
        return "ended on an error", error
    if summary.get("interrupted"):
        return "interrupted", error
    return "finished", error


def _summary_number(summary: dict[str, Any] | None, name: str) -> float | None:
    value = (summary or {}).get(name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _summary_int(summary: dict[str, Any] | None, name: str) -> int | None:
    value = (summary or {}).get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


_TOKEN_FIELDS = ("prompt_tokens", "completion_tokens")


def _usage(
    from_summary: object,
    from_rows: dict[str, int] | None,
    pick: Callable[[str, Any, Any], Any],
) -> dict[str, int] | None:
    """summary.json's token counts (checked against the rows' when they have any): prompt
    and completion tokens only. A summary written by an older version summed every integer
    field of the replies' `usage`, a server's `total_tokens` included: those keys are left out,
    so such a run's figures are right too."""
    if not isinstance(from_summary, dict):
        return from_rows
    counts = {
        k: int(v)
        for k, v in from_summary.items()
        if k in _TOKEN_FIELDS
        and isinstance(v, int | float)
        and not isinstance(v, bool)
        and math.isfinite(v)
    }
    if from_rows is None:
        return counts
    return pick("usage", counts, from_rows)  # type: ignore[no-any-return]


def _metrics(run: RunData) -> dict[str, tuple[float, int, Interval | None]]:
    """The rows' named metrics (a row's `metrics` object), each one's mean and interval
    (clustered by task, as the reward's)."""
    values: dict[str, list[float]] = {}
    clusters: dict[str, list[int]] = {}
    for index, other in run.extra.items():
        found = other.get("metrics")
        if type(found) is not dict:
            continue
        for name, value in found.items():
            if type(value) in (int, float) and math.isfinite(value):
                values.setdefault(str(name), []).append(float(value))
                clusters.setdefault(str(name), []).append(run.task[index])
    return {
        name: (mean_and_std(numbers)[0], len(numbers),
               reward_interval(numbers, clusters[name]))
        for name, numbers in sorted(values.items())
    }  # fmt: skip


def compute(run: RunData, *, threshold: float = 1.0) -> Figures:
    """The figures of `run`: summary.json's where it has them, else the rows'."""
    summary = run.summary
    ok = sum(run.ok)
    finished = len(run)
    # Arrays, not lists of float objects: 8 bytes a row on a run of millions of rows.
    rewards = array("d", (r for r in run.reward if r is not None))
    clusters = array("q", (t for t, r in zip(run.task, run.reward, strict=True) if r is not None))
    rows_mean, rows_std = mean_and_std(rewards) if rewards else (None, None)
    durations = array("d", (d for d in run.duration if d is not None))
    started = array("d", (s for s in run.started if s is not None))
    ends = array("d", (f for f in run.finished if f is not None))
    span = max(ends) - min(started) if started and ends else None
    rows_rate = len(ends) / span if span else None
    errors = Counter(kind for kinds in run.error_types for kind in kinds)
    failed_by = Counter(
        kinds[-1] for kinds, good in zip(run.error_types, run.ok, strict=True) if kinds and not good
    )
    prompt = [p for p in run.prompt_tokens if p is not None]
    completion = [c for c in run.completion_tokens if c is not None]
    rows_usage = (
        {"prompt_tokens": sum(prompt), "completion_tokens": sum(completion)}
        if prompt or completion
        else None
    )

    mismatches: list[str] = []

    def pick(name: str, from_summary: Any, from_rows: Any) -> Any:
        if from_summary is None:
            return from_rows
        differs = (
            from_rows is None
            or (isinstance(from_rows, float) and not math.isclose(from_summary, from_rows,
                                                                  rel_tol=1e-9, abs_tol=1e-12))
            or (not isinstance(from_rows, float) and from_summary != from_rows)
        )  # fmt: skip
        if differs:
            mismatches.append(f"{name}: summary.json {from_summary!r}, rows {from_rows!r}")
        return from_summary

    s_usage = (summary or {}).get("usage")
    s_errors = (summary or {}).get("errors_by_type")
    if isinstance(s_errors, dict):
        s_errors = {str(k): v for k, v in s_errors.items() if type(v) is int}
    t0 = _start_time(run.config, started)
    throughput, in_flight, peak = _throughput(run, t0)
    latency, marks = _latency(durations)
    status, error = _status(summary)
    return Figures(
        status=status,
        error=error,
        finished=pick("finished", _summary_int(summary, "finished"), finished),
        ok=pick("ok", _summary_int(summary, "ok"), ok),
        failed=pick("failed", _summary_int(summary, "failed"), finished - ok),
        planned=_summary_int(summary, "planned"),
        kept_from_resume=_summary_int(summary, "kept_from_resume"),
        reward_n=len(rewards),
        reward_mean=pick("reward_mean", _summary_number(summary, "reward_mean"), rows_mean),
        reward_std=pick("reward_std", _summary_number(summary, "reward_std"), rows_std),
        reward_ci=reward_interval(rewards, clusters),
        ci_clusters=len(set(clusters)),
        duration_s=_summary_number(summary, "duration_s"),
        rate=_summary_number(summary, "rollouts_per_s") if summary is not None else rows_rate,
        rows_rate=rows_rate,
        usage=_usage(s_usage, rows_usage, pick),
        errors_by_type=dict(
            sorted(
                (s_errors if isinstance(s_errors, dict) else errors).items(),
                key=lambda item: (-item[1], item[0]),
            )
        ),
        errors_source="summary.json" if isinstance(s_errors, dict) else "rows",
        failed_by_type=dict(failed_by.most_common()),
        reward_hist=_reward_hist(rewards),
        latency=latency,
        percentiles=marks,
        throughput=throughput,
        in_flight=in_flight,
        max_in_flight=peak,
        window=_window(summary),
        t0=t0,
        tasks=_tasks(run, threshold),
        mismatches=mismatches,
        groups=_groups(run),
        metrics=_metrics(run),
    )
