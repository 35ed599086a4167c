"""`rescore`: score an existing run's rows again with another reward, without the model.

    trio-tasksets rescore RUN_DIR --reward my_rewards.py:strict [-o DIR] [--run-name NAME]
    await trio_tasksets._eval.rescore(run_dir, reward, output_dir=None, run_name=None)

What a user iterating on a reward needs (`inspect score` gives the same): each row of
`RUN_DIR/traces.jsonl` whose episode got a completion is scored by `reward(task, completion)`
(sync or async; a number, or named metrics with a `reward` entry), the task rebuilt from the
row's `task.data`; its `reward` and `metrics` are replaced, everything else (messages, usage,
timing, errors) kept. A reward that raises on a row fails that row (`ok: false`, the error
appended, its reward 0 and no metrics), as it would in an eval. Rows without a completion
(episodes that failed before one) are kept as they were. The result is a new run dir (never the old one rewritten): its
`traces.jsonl`, a `summary.json` recomputed from the new rows (the run's duration and rate
kept from the original), and a `config.json` that records where it came from (`rescore`:
the source run dir and the reward's name). Rewards run `window` at a time (an LLM judge is a
reward too), through the project's runner.

Rows stream: each is read, scored and written in turn (in the order their scores finish,
as an eval writes them), so memory stays flat in the number of rows (10^6 rows, 633 MB of
traces: see docs/benchmarks.md). A line that is not an episode row (not JSON, nested too
deep, `{}`, a row without `task`, `"reward": "abc"`) is skipped and counted, as `report`
does: `summary.json` gives `skipped_lines` and `skipped` (the file and the first lines,
with why), and the command prints it.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import secrets
import time
from array import array
from collections import Counter
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import trio

from .._core.runner import as_completed
from .._core.tasksets import Taskset
from .._core.window import Window
from .._env.env import Episode, EpisodeError, Reward, split_score
from .._env.spec import rebuild_task
from .._env.traces import TraceRows, TraceWriter, open_traces, write_atomic
from .._report.stats import mean_and_std
from .config import EvalConfigError, EvalResult
from .plan import row_episode
from .run import first_error, metric_figures

__all__ = ["rescore"]

# summary.json fields of the original run that a rescore keeps (how the run went, not scores)
_KEPT = ("duration_s", "rollouts_per_s", "window_history", "connection_history", "waited_s",
         "stopped", "interrupted", "error")  # fmt: skip


def _load_json(path: Path) -> dict[str, Any]:
    try:
        found = json.loads(path.read_text())
    except FileNotFoundError:
        raise EvalConfigError(
            f"{path.parent} is not a run dir (no {path.name}): pass <output-dir>/<run-name>, "
            f"as `trio-tasksets eval` prints it",
            parameter="run_dir",
        ) from None
    except (OSError, ValueError) as exc:
        raise EvalConfigError(f"cannot read {path}: {exc}", parameter="run_dir") from None
    if not isinstance(found, dict):
        raise EvalConfigError(f"{path} does not hold a JSON object", parameter="run_dir")
    return found


async def _score(reward: Reward, task: Any, completion: str) -> tuple[float, dict[str, float]]:
    value = reward(task, completion)
    if inspect.isawaitable(value):
        value = await value
    return split_score(value)


class _Figures:
    """`summary.json`'s figures, gathered one episode at a time (a rescore keeps no row:
    memory grows by a few numbers per row, and a task's key per task with named metrics)."""

    def __init__(self) -> None:
        self.finished = self.ok = 0
        self.rewards = array("d")
        self.failed_by: Counter[str] = Counter()
        self.first_error: EpisodeError | None = None
        self.prompt_tokens = self.completion_tokens = 0
        self.waited = {"connection": 0.0, "rate": 0.0}
        self.metrics: dict[str, list[float]] = {}
        self.clusters: dict[str, list[int]] = {}
        self.tasks: dict[str, int] = {}

    def add(self, episode: Episode) -> None:
        self.finished += 1
        if episode.ok:
            self.ok += 1
        else:
            last = episode.errors[-1] if episode.errors else None
            self.failed_by[last.type if last else "unknown"] += 1
            if self.first_error is None:
                self.first_error = last
        if math.isfinite(episode.reward):
            self.rewards.append(episode.reward)
        usage = episode.usage
        self.prompt_tokens += usage.get("prompt_tokens", 0)
        self.completion_tokens += usage.get("completion_tokens", 0)
        for kind in ("connection", "rate"):
            waited = episode.timing.get(f"waited_{kind}", 0.0)
            if isinstance(waited, int | float) and math.isfinite(waited):
                self.waited[kind] += waited
        if episode.metrics:
            task = self.tasks.setdefault(episode.task.key, len(self.tasks))
            for name, value in episode.metrics.items():
                self.metrics.setdefault(name, []).append(value)
                self.clusters.setdefault(name, []).append(task)

    def summary(self, planned: int) -> dict[str, Any]:
        """The figures an eval's `summary.json` gives for the same episodes."""
        mean, std = mean_and_std(self.rewards) if self.rewards else (None, None)
        first = self.first_error
        return {
            "planned": planned, "finished": self.finished, "ok": self.ok,
            "failed": self.finished - self.ok, "kept_from_resume": 0,
            "reward_mean": mean, "reward_std": std, "interrupted": False, "stopped": None,
            "error": None, "errors_by_type": dict(self.failed_by.most_common()),
            "first_error": None if first is None else first_error(first),
            "usage": {"prompt_tokens": self.prompt_tokens,
                      "completion_tokens": self.completion_tokens},
            "waited_s": dict(self.waited),
            "metrics": metric_figures(self.metrics, self.clusters),
        }  # fmt: skip


async def rescore(
    run_dir: str | Path,
    reward: Reward,
    *,
    reward_name: str | None = None,
    output_dir: str | Path | None = None,
    run_name: str | None = None,
    window: int | Window | None = 32,
    command: list[str] | None = None,
    keep_episodes: bool = True,
) -> EvalResult:
    """Score `run_dir`'s rows with `reward` into a new run dir (module docstring):
    `<output_dir>/<run_name>`, by default next to `run_dir` as `<its name>-rescored-<time>`;
    `window` (an int or a `tt.Window`) bounds the rewards scored at once. Rows stream from
    the old traces to the new ones; the result's `episodes` hold every one unless
    `keep_episodes` is False (then it is empty, the rows are in the new run dir's
    traces.jsonl, and memory does not grow with the run: the command line's way). A line that is not an episode row is skipped and counted
    (`summary.json`'s `skipped_lines`, its file and first lines in `skipped`), never fatal.

    Raises `EvalConfigError` (a `ConfigError`) naming `run_dir` for a path that is not a run
    dir, `run_name` / `output_dir` for a run dir that exists already, before anything is
    written; a bad `window` is a `ConfigError` naming it."""
    source = Path(run_dir)
    config = _load_json(source / "config.json")
    original = _load_json(source / "summary.json") if (source / "summary.json").exists() else {}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = run_name if run_name is not None else f"{source.name}-rescored-{stamp}"
    if not name or "/" in name or name in (".", ".."):
        raise EvalConfigError(
            f"{{run_name}} must be a plain directory name, got {name!r}", parameter="run_name"
        )
    target = Path(output_dir if output_dir is not None else source.parent) / name
    if target.exists() and any(target.iterdir()):
        raise EvalConfigError(
            f"{target} already holds a run: choose another {{run_name}} or {{output_dir}}",
            parameter=("run_name", "output_dir"),
        )

    async def one(episode: Episode) -> Episode:
        if episode.completion is None:
            return episode  # nothing to score: kept as it was
        try:
            task = rebuild_task(Taskset, episode.task.key, dict(episode.task.data))
            score, metrics = await _score(reward, task, episode.completion)
        except Exception as exc:  # a failed row's reward is 0, as in an eval
            episode.ok, episode.reward, episode.metrics = False, 0.0, {}
            episode.errors.append(EpisodeError(type(exc).__name__, str(exc), episode.attempts))
            return episode
        episode.reward, episode.metrics = score, metrics
        episode.ok = True
        return episode

    rows = TraceRows(source / "traces.jsonl")

    async def each_episode() -> AsyncIterator[Episode]:
        for line, row in rows:
            found = row_episode(row)
            if isinstance(found, str):
                rows.refuse(line, found)
            else:
                yield found

    figures = _Figures()
    episodes: list[Episode] = []
    made = not target.exists()
    target.mkdir(parents=True, exist_ok=True)
    partial = target / f".traces.jsonl.{secrets.token_hex(8)}.tmp"
    scoring = as_completed(each_episode(), one, window=window)  # a bad window raises here

    def keep(out: TraceWriter, episode: Episode) -> None:
        out.write(episode.to_row())
        figures.add(episode)
        if keep_episodes:
            episodes.append(episode)

    try:
        async with open_traces(partial) as out:
            if _is_async(reward):  # `window` rewards (an LLM judge) at once, through the runner
                async with scoring as scored:
                    async for _index, episode in scored:
                        keep(out, episode)
            else:  # a sync reward gains nothing from a window: scored in turn, no task each
                async for episode in each_episode():
                    keep(out, await one(episode))
                    if figures.finished % 256 == 0:
                        await trio.lowlevel.checkpoint()
        partial.replace(target / "traces.jsonl")
    except BaseException:
        partial.unlink(missing_ok=True)
        if made:
            with contextlib.suppress(OSError):
                target.rmdir()
        raise
    record = {
        **config,
        "command": command if command is not None else config.get("command"),
        "started_at": datetime.now(UTC).isoformat(timespec="milliseconds"),
        "run_dir": str(target),
        "rescore": {"from": str(source), "reward": reward_name or _name_of(reward)},
    }
    write_atomic(target / "config.json", text=json.dumps(record, indent=2, default=str))
    planned = original.get("planned", figures.finished)
    summary = figures.summary(planned if isinstance(planned, int) else figures.finished)
    summary["duration_s"] = summary["rollouts_per_s"] = None  # the original's, if it has them
    summary.update({k: original[k] for k in _KEPT if k in original})
    summary.update(config.get("identity") or {})
    summary["rescored_from"] = str(source)
    if rows.bad:
        summary["skipped_lines"] = rows.bad
        summary["skipped"] = rows.describe()
    write_atomic(target / "summary.json", text=json.dumps(summary, indent=2, default=str))
    return EvalResult(episodes=episodes, run_dir=target, summary=summary)


def _is_async(reward: Reward) -> bool:
    """Whether `reward` is an async function (or a callable whose `__call__` is one)."""
    return inspect.iscoroutinefunction(reward) or inspect.iscoroutinefunction(type(reward).__call__)


def _name_of(reward: Reward) -> str:
    module = getattr(reward, "__module__", None)
    name = getattr(reward, "__qualname__", None) or repr(reward)
    return f"{module}:{name}" if module else str(name)
