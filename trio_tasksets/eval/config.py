"""`EvalConfig`, `EvalResult` and the checks made before any work."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import attrs

from ..env import Env, Episode
from ..envspec import TravelError
from ..loading import taskset_label, taskset_short_name
from ..models import ModelContext
from ..window import AdaptiveBounds, AdaptiveWindow, Window, build_window
from .served import check_travel


class EvalConfigError(ValueError):
    """A bad eval setting, found before any task is pulled or file written (CLI: exit 2)."""


class EvalWarning(UserWarning):
    """A setting that works, but not as written (`-n` larger than a static taskset)."""


@attrs.define
class EvalConfig:
    """How to run an eval; each field is a `trio-tasksets eval` option."""

    num_examples: int | None = None  # -n/--num-examples
    rollouts_per_example: int = 1  # -r/--rollouts-per-example
    # -c/--max-concurrent: the rollout window. N, AdaptiveBounds(min, start, max) (the CLI's
    # MIN-START-MAX: an AdaptiveWindow fed by the runs' 429s, 5xx, timeouts and successes),
    # or a tt.Window (a tt.AdaptiveWindow) of your own.
    max_concurrent: int | AdaptiveBounds | Window = 32
    shuffle: bool = False  # --shuffle
    seed: int = 0  # --seed
    resume: bool = False  # --resume
    output_dir: str = "outputs"  # -o/--output-dir
    run_name: str | None = None  # --run-name
    serve: bool = False  # --serve
    workers: int = 1  # --workers
    dashboard: bool = True  # --no-dashboard
    server_url: str | None = None  # --server-url (a running `trio-tasksets serve`)
    # --max-failures: stop (exit 1) once this many episodes failed (an int >= 1), or once the
    # failed ones exceed this fraction (a float in (0, 1)) of the planned slots (a stream: of
    # the finished ones). None: never stop early.
    max_failures: int | float | None = None
    via: str | None = None  # --via (a Redis URL: the slots go to workers through it)
    stream: str | None = None  # --stream (with --via: the workers' task stream; "tasks")
    # --time-limit: seconds after which the eval stops pulling, cancels the runs in flight,
    # keeps the finished rows and ends with `stopped: "time_limit"`. None: no limit.
    time_limit: float | None = None
    # Recorded in config.json only (never compared by a resume): the command line that ran
    # the eval (default: sys.argv) and the name of the variable the model's API key came from.
    command: list[str] | None = None
    api_key_var: str | None = None


# EvalConfig fields that describe the record, not the run: config.json keeps them apart.
RECORD_FIELDS = ("command", "api_key_var")


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


def check_window(value: object) -> None:
    """`EvalConfigError` naming -c unless `value` is an int >= 1, `AdaptiveBounds` with
    1 <= min <= start <= max, or a `tt.Window`."""
    if isinstance(value, Window):
        return
    if isinstance(value, tuple):
        try:
            AdaptiveWindow(*value)
        except (TypeError, ValueError) as exc:
            raise EvalConfigError(
                f"-c/--max-concurrent: adaptive bounds are (min, start, max) with 1 <= min <= "
                f"start <= max, got {value!r} ({exc})"
            ) from None
        return
    _check_int(value, "-c/--max-concurrent", 1)


def eval_window(value: int | AdaptiveBounds | Window) -> Window:
    """The rollout window an eval runs under: the `tt.Window` given, or a fresh one."""
    if isinstance(value, Window):
        return value
    return build_window(AdaptiveBounds(*value) if isinstance(value, tuple) else value)


def check_max_failures(value: object) -> None:
    """`EvalConfigError` unless `value` is None, an int >= 1 or a fraction in (0, 1)."""
    if value is None:
        return
    if isinstance(value, int) and not isinstance(value, bool):
        if value >= 1:
            return
    elif isinstance(value, float) and 0 < value < 1:
        return
    raise EvalConfigError(
        f"--max-failures takes N (an integer >= 1: stop once N episodes failed) or a FRACTION "
        f"between 0 and 1 (stop once more than that share failed), got {value!r}"
    )


def preflight(env: Env[Any], ctx: ModelContext, config: EvalConfig) -> None:
    """Every check that needs no pull and no file write."""
    _check_int(config.num_examples, "-n/--num-examples", 0, optional=True)
    _check_int(config.rollouts_per_example, "-r/--rollouts-per-example", 1)
    check_window(config.max_concurrent)
    limit = config.time_limit
    if limit is not None and (
        isinstance(limit, bool)
        or not isinstance(limit, int | float)
        or not math.isfinite(limit)
        or limit <= 0
    ):
        raise EvalConfigError(f"--time-limit must be a number of seconds > 0, got {limit!r}")
    _check_int(config.workers, "--workers", 1)
    check_max_failures(config.max_failures)
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
        from ..redis.entries import check_url  # hiredis is an optional extra
    except ImportError as exc:
        raise EvalConfigError(
            f"--via needs hiredis ({exc}): pip install 'trio-tasksets[redis]'"
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
    return {
        "taskset": taskset_label(taskset),
        "taskset_config": json.loads(json.dumps(attrs.asdict(taskset.config), default=str)),
        "model": ctx.model,
        "sampling": json.loads(json.dumps(attrs.asdict(ctx.sampling), default=str)),
        "num_examples": config.num_examples,
        "rollouts_per_example": config.rollouts_per_example,
        "shuffle": config.shuffle,
        "seed": config.seed,
    }


def default_run_name(env: Env[Any], ctx: ModelContext) -> str:
    """`<Taskset>-<model>-<YYYYmmdd-HHMMSS>`, the run name when none is given (`<Taskset>`:
    the class name, or a verifiers env's taskset id)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return f"{taskset_short_name(env.taskset)}-{ctx.model}-{stamp}".replace("/", "_")


def latest_run(env: Env[Any], ctx: ModelContext, output_dir: str) -> Path | None:
    """The run dir in `output_dir` whose saved run is the latest (by its `started_at`) of the
    same taskset class and model, or None."""
    identity = run_identity(env, ctx, EvalConfig())
    found: list[tuple[str, float, Path]] = []
    root = Path(output_dir)
    for config_path in root.glob("*/config.json") if root.is_dir() else ():
        try:
            saved = json.loads(config_path.read_text())
            mtime = config_path.stat().st_mtime
        except (OSError, ValueError):
            continue
        if not isinstance(saved, dict) or not isinstance(saved.get("identity"), dict):
            continue
        same = saved["identity"].get("taskset") == identity["taskset"]
        if same and saved["identity"].get("model") == identity["model"]:
            found.append((str(saved.get("started_at", "")), mtime, config_path.parent))
    return max(found)[2] if found else None


def run_dir_for(env: Env[Any], ctx: ModelContext, config: EvalConfig) -> Path:
    """`<output_dir>/<run_name>`; with `resume` and no run name, the latest run of the same
    taskset and model there (`EvalConfigError` if there is none)."""
    name = config.run_name
    if name is None and config.resume:
        latest = latest_run(env, ctx, config.output_dir)
        if latest is None:
            raise EvalConfigError(
                f"--resume: {config.output_dir} holds no run of taskset "
                f"{type(env.taskset).__name__} with model {ctx.model!r}; name the run to "
                f"resume with --run-name (or -o/--output-dir)"
            )
        return latest
    if name is None:
        name = default_run_name(env, ctx)
    if not name or "/" in name or name in (".", ".."):
        raise EvalConfigError(f"--run-name must be a plain directory name, got {name!r}")
    return Path(config.output_dir) / name
