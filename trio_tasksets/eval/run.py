"""`run_eval`: the eval over the windowed core, with durable traces."""

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

from .. import dashboard
from ..env import Env, Episode, RunSlot
from ..models import ModelContext
from ..runner import pick_one, run_stream
from ..traces import open_traces, write_atomic
from .config import (
    EvalConfig,
    EvalConfigError,
    EvalResult,
    preflight,
    run_dir_for,
    run_identity,
    via_stream,
)
from .plan import from_list, keep_resumable, plan_stream, static_slots
from .served import SlotRunner, served_runner


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
    preflight(env, ctx, config)
    redis_run_id = await _reach(config)
    identity = run_identity(env, ctx, config)
    run_dir = run_dir_for(env, ctx, config)
    streaming = env.taskset.streaming
    slots: list[RunSlot[Any]] = [] if streaming else static_slots(env, config)
    planned = len(slots)
    kept_rows: list[dict[str, Any]] = []
    if config.resume:
        kept_rows, slots = keep_resumable(run_dir, identity, slots)
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
        new = await _execute(env, ctx, config, slots, traces_path, progress, recorded, redis_run_id)
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


async def _reach(config: EvalConfig) -> str | None:
    """With `--via`: Redis's run id, or `EvalConfigError` if it cannot be reached."""
    if config.via is None:
        return None
    from .via import reach

    return await reach(config.via)


def _slot_runner(
    env: Env[Any],
    ctx: ModelContext,
    config: EvalConfig,
    progress: dashboard.Progress,
    redis_run_id: str | None,
) -> AbstractAsyncContextManager[SlotRunner]:
    """How each slot runs: in this process under `env.serving()`, on an env server (one
    `client.run` per slot), or on workers through Redis (one entry per slot); the taskset
    and the traces stay here."""
    if config.via is not None:
        from .via import via_runner

        return via_runner(
            env, ctx, url=config.via, stream=via_stream(config), progress=progress,
            run_id=redis_run_id,
        )  # fmt: skip
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
    redis_run_id: str | None = None,
) -> list[Episode]:
    """Run the planned (static) or streamed slots through `run_stream`, recording each episode."""
    try:
        async with (
            _slot_runner(env, ctx, config, progress, redis_run_id) as run_slot,
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
                return await run_stream(from_list(slots), run, window=config.max_concurrent)
            assert config.num_examples is not None
            async with env.taskset.head(config.num_examples).channel() as tasks:
                source = plan_stream(tasks, config.rollouts_per_example, progress)
                return await run_stream(source, run, window=config.max_concurrent)
    except BaseExceptionGroup as group:
        # The context managers' nurseries wrap what passes through them: hand on the one
        # exception (a KeyboardInterrupt, a Cancelled, the runner's failure) bare.
        error = pick_one(group)
    raise error
