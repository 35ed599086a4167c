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
"""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .._core.runner import run_stream
from .._core.tasksets import Taskset
from .._core.window import Window
from .._env.env import Episode, EpisodeError, Reward, split_score
from .._env.spec import rebuild_task
from .._env.traces import read_rows, write_atomic
from .config import EvalConfigError, EvalResult
from .run import metric_summary, summarize

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


async def rescore(
    run_dir: str | Path,
    reward: Reward,
    *,
    reward_name: str | None = None,
    output_dir: str | Path | None = None,
    run_name: str | None = None,
    window: int | Window | None = 32,
    command: list[str] | None = None,
) -> EvalResult:
    """Score `run_dir`'s rows with `reward` into a new run dir (module docstring):
    `<output_dir>/<run_name>`, by default next to `run_dir` as `<its name>-rescored-<time>`;
    `window` (an int or a `tt.Window`) bounds the rewards scored at once.

    Raises `EvalConfigError` (a `ConfigError`) naming `run_dir` for a path that is not a run
    dir, `run_name` / `output_dir` for a run dir that exists already, before anything is
    written; a bad `window` is a `ConfigError` naming it."""
    source = Path(run_dir)
    config = _load_json(source / "config.json")
    rows, _bad = read_rows(source / "traces.jsonl")
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

    async def one(row: dict[str, Any]) -> Episode:
        episode = Episode.from_row(row)
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

    async def each_row() -> AsyncIterator[dict[str, Any]]:
        for row in rows:
            yield row

    episodes: list[Episode] = await run_stream(each_row(), one, window=window)
    target.mkdir(parents=True, exist_ok=True)
    write_atomic(target / "traces.jsonl", (e.to_row() for e in episodes))
    record = {
        **config,
        "command": command if command is not None else config.get("command"),
        "started_at": datetime.now(UTC).isoformat(timespec="milliseconds"),
        "run_dir": str(target),
        "rescore": {"from": str(source), "reward": reward_name or _name_of(reward)},
    }
    write_atomic(target / "config.json", text=json.dumps(record, indent=2, default=str))
    planned = original.get("planned", len(episodes))
    summary = summarize(episodes, planned if isinstance(planned, int) else len(episodes))
    summary.update({k: original[k] for k in _KEPT if k in original})
    summary.update(config.get("identity") or {})
    summary["metrics"] = metric_summary(episodes)
    summary["rescored_from"] = str(source)
    write_atomic(target / "summary.json", text=json.dumps(summary, indent=2, default=str))
    return EvalResult(episodes=episodes, run_dir=target, summary=summary)


def _name_of(reward: Reward) -> str:
    module = getattr(reward, "__module__", None)
    name = getattr(reward, "__qualname__", None) or repr(reward)
    return f"{module}:{name}" if module else str(name)
