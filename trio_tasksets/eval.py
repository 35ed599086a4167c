"""The bounded eval: plan slots, run them through the windowed core, keep durable traces.

`run_eval` checks everything it can before it pulls a task or writes a file (a bad value is an
`EvalConfigError`, a ValueError naming the command-line flag), then:

* static taskset: every slot is planned up front (shuffled, then the first `-n` tasks, `-r`
  slots each); `-c` bounds what runs;
* streaming taskset: takes the next `-n` tasks of the feed (never an (n+1)th), plans a task's
  `-r` slots as it arrives, and its slots enter the `-c` window one by one.

Both go through `run_stream`. Each finished episode is appended to `traces.jsonl` at once.
"""

from __future__ import annotations

import functools
import json
import math
import statistics
import sys
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from . import dashboard
from .client import SlotRunner, check_travel, served_runner
from .env import Env, Episode, RunSlot, task_data, task_key
from .models import ModelContext
from .runner import pick_one, run_stream
from .traces import open_traces, read_rows, write_atomic
from .wire import TravelError

__all__ = ["EvalConfig", "EvalConfigError", "EvalResult", "run_eval"]


class EvalConfigError(ValueError):
    """A bad eval setting, found before any task is pulled or file written (CLI: exit 2)."""


@attrs.define
class EvalConfig:
    """How to run an eval; each field is a `trio-tasksets eval` option."""

    num_examples: int | None = None  # -n/--num-examples
    rollouts_per_example: int = 1  # -r/--rollouts-per-example
    max_concurrent: int = 32  # -c/--max-concurrent
    shuffle: bool = False  # --shuffle
    seed: int = 0  # --seed
    resume: bool = False  # --resume
    output_dir: str = "outputs"  # -o/--output-dir
    run_name: str | None = None  # --run-name
    serve: bool = False  # --serve
    workers: int = 1  # --workers
    dashboard: bool = True  # --no-dashboard
    server_url: str | None = None  # --server-url (a running `trio-tasksets serve`)


@attrs.define
class EvalResult:
    """What an eval produced: its episodes (kept and new), its run dir and its summary."""

    episodes: list[Episode]
    run_dir: Path
    summary: dict[str, Any]


# The saved config keys that decide which slots a run owes; a resume must match them all.
_IDENTITY = ("taskset", "taskset_config", "model", "sampling", "num_examples",
             "rollouts_per_example", "shuffle", "seed")  # fmt: skip


def _check_int(value: object, flag: str, minimum: int, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise EvalConfigError(f"{flag} must be an integer >= {minimum}, got {value!r}")


def _preflight(env: Env[Any], ctx: ModelContext, config: EvalConfig) -> None:
    """Every check that needs no pull and no file write."""
    _check_int(config.num_examples, "-n/--num-examples", 0, optional=True)
    _check_int(config.rollouts_per_example, "-r/--rollouts-per-example", 1)
    _check_int(config.max_concurrent, "-c/--max-concurrent", 1)
    _check_int(config.workers, "--workers", 1)
    taskset = env.taskset
    name = type(taskset).__name__
    if taskset.streaming or taskset.INFINITE:
        kind = "streams its tasks" if taskset.streaming else "is INFINITE"
        if config.num_examples is None:
            raise EvalConfigError(
                f"taskset {name} {kind}: bound the run with -n/--num-examples N "
                f"(the eval takes the next N tasks and ends)"
            )
        if taskset.streaming and config.shuffle:
            raise EvalConfigError(f"taskset {name} {kind}: cannot shuffle (drop --shuffle)")
        if taskset.streaming and config.resume:
            raise EvalConfigError(
                f"taskset {name} {kind}: cannot resume (there is no list of tasks to compare "
                f"against; drop --resume)"
            )
    _check_served(env, ctx, config)


def _check_served(env: Env[Any], ctx: ModelContext, config: EvalConfig) -> None:
    """The served path's settings, and that the env and the model can travel to a server."""
    if config.serve and config.server_url:
        raise EvalConfigError("--serve and --server-url: choose one (spawn a server, or use one)")
    if config.workers != 1 and not config.serve:
        raise EvalConfigError("--workers applies to a spawned server: add --serve")
    url = config.server_url
    if url is not None and not url.startswith(("http://", "https://")):
        raise EvalConfigError(f"--server-url must be an http:// or https:// URL, got {url!r}")
    if config.serve or url:
        try:
            check_travel(env, ctx, spawn=config.serve)
        except TravelError as exc:
            flag = "--serve" if config.serve else "--server-url"
            raise EvalConfigError(f"{flag}: {exc}") from None


def _identity(env: Env[Any], ctx: ModelContext, config: EvalConfig) -> dict[str, Any]:
    taskset = env.taskset
    cls = type(taskset)
    return {
        "taskset": f"{cls.__module__}:{cls.__qualname__}",
        "taskset_config": json.loads(json.dumps(attrs.asdict(taskset.config), default=str)),
        "model": ctx.model,
        "sampling": json.loads(json.dumps(attrs.asdict(ctx.sampling), default=str)),
        "num_examples": config.num_examples,
        "rollouts_per_example": config.rollouts_per_example,
        "shuffle": config.shuffle,
        "seed": config.seed,
    }


def _run_dir(env: Env[Any], ctx: ModelContext, config: EvalConfig) -> Path:
    name = config.run_name
    if name is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        name = f"{type(env.taskset).__name__}-{ctx.model}-{stamp}".replace("/", "_")
    if not name or "/" in name or name in (".", ".."):
        raise EvalConfigError(f"--run-name must be a plain directory name, got {name!r}")
    return Path(config.output_dir) / name


def _static_slots(env: Env[Any], config: EvalConfig) -> list[RunSlot[Any]]:
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


def _keep_resumable(
    run_dir: Path, identity: dict[str, Any], slots: list[RunSlot[Any]]
) -> tuple[list[dict[str, Any]], list[RunSlot[Any]]]:
    """The whole ok rows of a matching run that planned slots still need, and the owed slots."""
    config_path = run_dir / "config.json"
    if not config_path.exists():
        raise EvalConfigError(
            f"--resume: {run_dir} holds no run to resume (no config.json); drop --resume "
            f"to start it"
        )
    saved = json.loads(config_path.read_text()).get("identity", {})
    differ = sorted(k for k in _IDENTITY if saved.get(k) != identity.get(k))
    if differ:
        detail = ", ".join(f"{k}: saved {saved.get(k)!r}, now {identity.get(k)!r}" for k in differ)
        raise EvalConfigError(
            f"--resume: the saved config of {run_dir} differs ({detail}); resume with the "
            f"same settings, or start a new run with another --run-name"
        )
    rows, _bad = read_rows(run_dir / "traces.jsonl")
    # A row stands for a slot by its task's key, its rollout and the task's own data (two
    # different tasks may share a key); only whole, ok rows that read back as an episode.
    by_slot: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for row in rows:
        try:
            episode = Episode.from_row(row)
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
        if episode.ok and math.isfinite(episode.reward):
            slot_id = (episode.task.key, episode.rollout, _canonical(episode.task.data))
            by_slot.setdefault(slot_id, []).append(row)
    chosen: set[int] = set()  # ids of the row objects kept, to keep them in file order
    owed: list[RunSlot[Any]] = []
    for slot in slots:
        slot_id = (task_key(slot.task), slot.rollout, _canonical(task_data(slot.task)))
        matching = by_slot.get(slot_id)
        if matching:
            chosen.add(id(matching.pop(0)))
        else:
            owed.append(slot)
    return [row for row in rows if id(row) in chosen], owed


def _canonical(data: dict[str, Any]) -> str:
    """A task's data as it reads back from a trace row, for comparing the two."""
    return json.dumps(data, sort_keys=True, default=str)


async def _from_list(slots: list[RunSlot[Any]]) -> AsyncIterator[RunSlot[Any]]:
    for slot in slots:
        yield slot


async def _plan_stream(
    tasks: trio.abc.ReceiveChannel[Any], rollouts: int, progress: dashboard.Progress
) -> AsyncIterator[RunSlot[Any]]:
    """A task's `rollouts` slots, one at a time, as each task arrives."""
    async for task in tasks:
        progress.planned(rollouts)
        for rollout in range(rollouts):
            yield RunSlot(task, rollout)
    progress.stop_growing()


def _summary(
    episodes: list[Episode], planned: int, began: float, kept: int, interrupted: bool
) -> dict[str, Any]:
    rewards = [e.reward for e in episodes if math.isfinite(e.reward)]
    ok = sum(1 for e in episodes if e.ok)
    duration = time.monotonic() - began
    return {
        "planned": planned,
        "finished": len(episodes),
        "ok": ok,
        "failed": len(episodes) - ok,
        "kept_from_resume": kept,
        "reward_mean": statistics.fmean(rewards) if rewards else None,
        "reward_std": statistics.pstdev(rewards) if rewards else None,
        "duration_s": duration,
        "rollouts_per_s": (len(episodes) - kept) / duration if duration > 0 else math.nan,
        "interrupted": interrupted,
    }


async def run_eval(env: Env[Any], ctx: ModelContext, config: EvalConfig) -> EvalResult:
    """Run an eval of `env` against the model in `ctx`; see the module docstring."""
    _preflight(env, ctx, config)
    identity = _identity(env, ctx, config)
    run_dir = _run_dir(env, ctx, config)
    streaming = env.taskset.streaming
    slots: list[RunSlot[Any]] = [] if streaming else _static_slots(env, config)
    planned = len(slots)
    kept_rows: list[dict[str, Any]] = []
    if config.resume:
        kept_rows, slots = _keep_resumable(run_dir, identity, slots)
    elif run_dir.exists() and any(run_dir.iterdir()):
        raise EvalConfigError(
            f"{run_dir} already holds a run: pass --resume to continue it, or choose another "
            f"--run-name / -o/--output-dir"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    resolved = {"identity": identity, "eval": attrs.asdict(config), "run_dir": str(run_dir)}
    write_atomic(run_dir / "config.json", text=json.dumps(resolved, indent=2, default=str))
    traces_path = run_dir / "traces.jsonl"
    if config.resume:
        write_atomic(traces_path, kept_rows)  # drop torn, failed and surplus rows, atomically

    kept = [Episode.from_row(row) for row in kept_rows]
    progress = dashboard.Progress(title=run_dir.name, growing=streaming)
    progress.planned(planned)
    for episode in kept:
        progress.started()
        progress.finished(episode.ok, episode.reward)
    progress.carried = len(kept)
    new: list[Episode] = []
    recorded: list[Episode] = []  # in completion order, for an interrupted run's summary
    began = time.monotonic()
    interrupted = True
    try:
        new = await _execute(env, ctx, config, slots, traces_path, progress, recorded)
        interrupted = False
    finally:
        done = kept + (recorded if interrupted else new)
        summary = _summary(done, progress.total, began, len(kept), interrupted)
        summary.update(identity)
        try:
            write_atomic(run_dir / "summary.json", text=json.dumps(summary, indent=2, default=str))
        except Exception as exc:  # never in place of what ended the run (Ctrl-C, a failure)
            if interrupted:
                print(f"trio_tasksets: could not write summary.json: {exc}", file=sys.stderr)
            else:
                raise
    return EvalResult(episodes=done, run_dir=run_dir, summary=summary)


def _slot_runner(
    env: Env[Any], ctx: ModelContext, config: EvalConfig
) -> AbstractAsyncContextManager[SlotRunner]:
    """How each slot runs: in this process under `env.serving()`, or on an env server (one
    `client.run` per slot; the taskset and the traces stay here)."""
    if config.serve or config.server_url:
        return served_runner(
            env, ctx, workers=config.workers, server_url=config.server_url,
            window=config.max_concurrent,
        )  # fmt: skip
    return _in_process(env, ctx)


@asynccontextmanager
async def _in_process(env: Env[Any], ctx: ModelContext) -> AsyncIterator[SlotRunner]:
    async with env.serving():
        yield functools.partial(env.run_slot, ctx=ctx)


async def _execute(
    env: Env[Any],
    ctx: ModelContext,
    config: EvalConfig,
    slots: list[RunSlot[Any]],
    traces_path: Path,
    progress: dashboard.Progress,
    recorded: list[Episode],
) -> list[Episode]:
    """Run the planned (static) or streamed slots through `run_stream`, recording each episode."""
    try:
        async with (
            _slot_runner(env, ctx, config) as run_slot,
            open_traces(traces_path) as writer,
            dashboard.show(progress, live=config.dashboard),
        ):

            def record(episode: Episode) -> None:
                writer.write(episode.to_row())
                recorded.append(episode)
                progress.finished(episode.ok, episode.reward)

            async def run(slot: RunSlot[Any]) -> Episode:
                progress.started()
                return await run_slot(slot, on_complete=record)

            if not env.taskset.streaming:
                return await run_stream(_from_list(slots), run, window=config.max_concurrent)
            assert config.num_examples is not None
            async with env.taskset.head(config.num_examples).channel() as tasks:
                source = _plan_stream(tasks, config.rollouts_per_example, progress)
                return await run_stream(source, run, window=config.max_concurrent)
    except BaseExceptionGroup as group:
        # The context managers' nurseries wrap what passes through them: hand on the one
        # exception (a KeyboardInterrupt, a Cancelled, the runner's failure) bare.
        error = pick_one(group)
    raise error
