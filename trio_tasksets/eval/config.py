"""`EvalConfig`, `EvalResult` and the checks made before any work."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import attrs

from ..env import Env, Episode
from ..envspec import TravelError
from ..models import ModelContext
from .served import check_travel


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
    via: str | None = None  # --via (a Redis URL: the slots go to workers through it)
    stream: str | None = None  # --stream (with --via: the workers' task stream; "tasks")


@attrs.define
class EvalResult:
    """What an eval produced: its episodes (kept and new), its run dir and its summary."""

    episodes: list[Episode]
    run_dir: Path
    summary: dict[str, Any]


# The saved config keys that decide which slots a run owes; a resume must match them all.
IDENTITY = ("taskset", "taskset_config", "model", "sampling", "num_examples",
             "rollouts_per_example", "shuffle", "seed")  # fmt: skip


def _check_int(value: object, flag: str, minimum: int, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise EvalConfigError(f"{flag} must be an integer >= {minimum}, got {value!r}")


def preflight(env: Env[Any], ctx: ModelContext, config: EvalConfig) -> None:
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
    _check_via(config)


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


def _check_via(config: EvalConfig) -> None:
    """`--via`'s settings (the URL is parsed here; `via.reach` connects, before any write)."""
    if config.via is None:
        if config.stream is not None:
            raise EvalConfigError("--stream names the workers' stream: it needs --via URL")
        return
    if config.serve or config.server_url:
        flag = "--serve" if config.serve else "--server-url"
        raise EvalConfigError(f"--via and {flag}: choose one (workers over Redis, or a server)")
    if config.stream is not None and (not isinstance(config.stream, str) or not config.stream):
        raise EvalConfigError(
            f"--stream must name a stream, e.g. --stream tasks, got {config.stream!r}"
        )
    try:
        from ..redis.entries import check_url  # redis-py is an optional extra
    except ImportError as exc:
        raise EvalConfigError(
            f"--via needs redis-py ({exc}): pip install 'trio-tasksets[redis]'"
        ) from None
    try:
        check_url(config.via)
    except ValueError as exc:
        raise EvalConfigError(f"--via: {exc}") from None


def via_stream(config: EvalConfig) -> str:
    """The task stream of a `--via` eval: `--stream`, else "tasks"."""
    return config.stream if config.stream is not None else "tasks"


def run_identity(env: Env[Any], ctx: ModelContext, config: EvalConfig) -> dict[str, Any]:
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


def run_dir_for(env: Env[Any], ctx: ModelContext, config: EvalConfig) -> Path:
    name = config.run_name
    if name is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        name = f"{type(env.taskset).__name__}-{ctx.model}-{stamp}".replace("/", "_")
    if not name or "/" in name or name in (".", ".."):
        raise EvalConfigError(f"--run-name must be a plain directory name, got {name!r}")
    return Path(config.output_dir) / name
