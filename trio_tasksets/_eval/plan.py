"""Planning an eval's slots: static up front, streaming as tasks arrive, resume."""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import trio

from .._env.env import Env, Episode, RunSlot, task_data, task_key
from .._env.groups import Advantage, Group, group_slots
from .._env.loading import upgraded_label
from .._env.traces import TraceRows
from .._monitor import dashboard
from .config import IDENTITY, EvalConfig, EvalConfigError, EvalWarning


def static_slots(env: Env[Any], config: EvalConfig) -> list[RunSlot[Any]]:
    taskset = env.taskset
    view = taskset
    n = config.num_examples
    if config.shuffle:
        # Shuffle the whole set, then take n: a random sample. An INFINITE set can only be
        # bounded first.
        if taskset.INFINITE:
            view = taskset.head(n if n is not None else 0).shuffle(config.seed)
        else:
            view = taskset.shuffle(config.seed)
            view = view.head(n) if n is not None else view
    elif n is not None:
        view = taskset.head(n)
    return [RunSlot(t, r) for t in view for r in range(config.rollouts_per_example)]


def keep_resumable(
    run_dir: Path, identity: dict[str, Any], slots: list[RunSlot[Any]], *, groups: bool = False
) -> tuple[list[dict[str, Any]], list[RunSlot[Any]]]:
    """The whole ok rows of a matching run that planned slots still need, and the owed slots.
    With `groups`, a group (a task's run of consecutive slots) is one unit: a group with a
    missing or failed row is owed whole, and its other rows are dropped."""
    config_path = run_dir / "config.json"
    if not config_path.exists():
        raise EvalConfigError(
            f"{{resume}}: {run_dir} holds no run to resume (no config.json); drop {{resume}} "
            f"to start it",
            parameter="resume",
        )
    saved = json.loads(config_path.read_text()).get("identity", {})
    if isinstance(saved, dict) and "taskset" in saved:
        saved = {**saved, "taskset": upgraded_label(saved["taskset"])}
    differ = sorted(k for k in IDENTITY if saved.get(k) != identity.get(k))
    if differ:
        detail = ", ".join(f"{k}: saved {saved.get(k)!r}, now {identity.get(k)!r}" for k in differ)
        raise EvalConfigError(
            f"{{resume}}: the saved config of {run_dir} differs ({detail}); resume with the "
            f"same settings, or start a new run with another {{run_name}}",
            parameter=("resume", "run_name"),
        )
    # A row stands for a slot by its task's key, its rollout and the task's own data (two
    # different tasks may share a key); only whole, ok rows that read back as an episode.
    # Any other line (not JSON, nested too deep, not an episode) is skipped and counted, and
    # said once (file, count, first lines), as `report` and `rescore` do.
    read = TraceRows(run_dir / "traces.jsonl", accept=episode_problem)
    rows = [row for _line, row in read]
    if read.bad:
        warnings.warn(EvalWarning(f"{{resume}}: {read.describe()}; left out, as the report leaves them",
                                  parameter="resume"), stacklevel=3)  # fmt: skip
    by_slot: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for row in rows:
        episode = Episode.from_row(row)
        if episode.ok and math.isfinite(episode.reward):
            slot_id = (episode.task.key, episode.rollout, _canonical(episode.task.data))
            by_slot.setdefault(slot_id, []).append(row)
    chosen: set[int] = set()  # ids of the row objects kept, to keep them in file order
    by_id = {id(row): row for row in rows}
    owed: list[RunSlot[Any]] = []
    for slot in slots:
        slot_id = (task_key(slot.task), slot.rollout, _canonical(task_data(slot.task)))
        matching = by_slot.get(slot_id)
        if matching:
            chosen.add(id(matching.pop(0)))
        else:
            owed.append(slot)
    if groups:
        owed_ids = {id(slot) for slot in owed}
        owed = []
        for group in group_slots(slots):
            if any(id(slot) in owed_ids for slot in group.slots):
                owed.extend(group.slots)
        dropped = {_slot_id(slot) for slot in owed}
        chosen = {i for i in chosen if _row_slot(by_id[i]) not in dropped}
    return [row for row in rows if id(row) in chosen], owed


def row_episode(row: dict[str, Any]) -> Episode | str:
    """The episode of a trace row, or why the row is not one (a field missing or of the
    wrong type: `{}`, a row without `task`, `"reward": "abc"`)."""
    try:
        return Episode.from_row(row)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        detail = f"no field {exc}" if isinstance(exc, KeyError) else str(exc)
        return f"not an episode row ({detail})"


def episode_problem(row: dict[str, Any]) -> str | None:
    """Why a trace row is not an episode row, None when it is one (`TraceRows`'s accept)."""
    found = row_episode(row)
    return found if isinstance(found, str) else None


def _slot_id(slot: RunSlot[Any]) -> tuple[str, int, str]:
    return (task_key(slot.task), slot.rollout, _canonical(task_data(slot.task)))


def _row_slot(row: dict[str, Any]) -> tuple[str, int, str]:
    return (str(row["task"]["key"]), int(row["rollout"]), _canonical(dict(row["task"]["data"])))


def _canonical(data: dict[str, Any]) -> str:
    """A task's data as it reads back from a trace row, for comparing the two."""
    return json.dumps(data, sort_keys=True, default=str)


async def from_list(slots: list[RunSlot[Any]]) -> AsyncIterator[RunSlot[Any]]:
    for slot in slots:
        yield slot


async def plan_groups(
    tasks: trio.abc.ReceiveChannel[Any],
    rollouts: int,
    progress: dashboard.Progress,
    advantage: Advantage = "mean",
) -> AsyncIterator[Group]:
    """A task's `rollouts` slots as one group, as each task arrives (`--group`)."""
    async for task in tasks:
        progress.planned(rollouts)
        slots = [RunSlot(task, rollout) for rollout in range(rollouts)]
        yield Group(task, slots, advantage=advantage)
    progress.stop_growing()


async def from_groups(groups: list[Group]) -> AsyncIterator[Group]:
    for group in groups:
        yield group


async def plan_stream(
    tasks: trio.abc.ReceiveChannel[Any], rollouts: int, progress: dashboard.Progress
) -> AsyncIterator[RunSlot[Any]]:
    """A task's `rollouts` slots, one at a time, as each task arrives."""
    async for task in tasks:
        progress.planned(rollouts)
        for rollout in range(rollouts):
            yield RunSlot(task, rollout)
    progress.stop_growing()
