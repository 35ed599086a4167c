"""`EvalConfig`, `EvalResult` and the checks made before any work."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import attrs

from .._core.adaptive import AdaptiveBounds, AdaptiveWindow, WindowArgumentError, build_window
from .._core.exceptions import EvalConfigError as EvalConfigError  # their home is _exceptions
from .._core.exceptions import EvalWarning as EvalWarning
from .._core.window import Window
from .._env.backend import InProcess, SlotBackend, backend_for
from .._env.env import Env, Episode
from .._env.loading import taskset_label, taskset_short_name, upgraded_label
from .._models import ModelContext
from .._monitor.metrics import check_metrics


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
    # With server_url: the server's bearer token (the CLI's --token-var; never recorded).
    server_token: str | None = attrs.field(default=None, repr=False)
    # Where the slots run, as an object (a tt.backend.SlotBackend): instead of serve /
    # workers / server_url / via / stream, which name the built-in ones.
    backend: SlotBackend | None = None
    # --time-limit: seconds after which the eval stops pulling, cancels the runs in flight,
    # keeps the finished rows and ends with `stopped: "time_limit"`. None: no limit.
    time_limit: float | None = None
    # --max-consecutive-failures: stop (exit 1) after this many failed episodes in a row (in
    # the order they finished): a dead service fails every one. None: never.
    max_consecutive_failures: int | None = None
    # --metrics-port: serve the run's counters and health as Prometheus text on 127.0.0.1 at
    # this port (0: a free one, printed) while it runs. None: no metrics server.
    metrics_port: int | None = None
    # --engine-metrics: the Prometheus /metrics URL of the engine behind the model (vLLM,
    # SGLang); an adaptive -c reads the engine's own load from it every second.
    engine_metrics: str | None = None
    # --group: a task's rollouts are one group: run together, scored together by
    # Env.score_group, written together; one failing after its retries fails the group.
    group: bool = False
    # Recorded in config.json only (never compared by a resume): the command line that ran
    # the eval (default: sys.argv) and the name of the variable the model's API key came from.
    command: list[str] | None = None
    api_key_var: str | None = None

    def slot_backend(self) -> SlotBackend:
        """Where the slots run, chosen once: `backend` if given, else the built-in backend
        that `serve`, `workers`, `server_url`, `via` and `stream` name (`EvalConfigError`,
        naming the parameter, when they contradict each other or a value is bad)."""
        flat = backend_for(
            serve=self.serve, workers=self.workers, server_url=self.server_url,
            server_token=self.server_token, via=self.via, stream=self.stream,
        )  # fmt: skip
        if self.backend is None:
            return flat
        if not isinstance(self.backend, SlotBackend):
            raise EvalConfigError(
                f"backend must be a SlotBackend (check, reach, open, remote), got "
                f"{type(self.backend).__name__}",
                parameter="backend",
            )
        if not isinstance(flat, InProcess):
            raise EvalConfigError(
                "backend and serve/server_url/via: choose one (the backend says where slots run)",
                parameter="backend",
            )
        return self.backend


# EvalConfig fields that describe the record, not the run: config.json keeps them apart.
RECORD_FIELDS = ("command", "api_key_var")
# EvalConfig fields never written to config.json (a secret; an object, recorded as its repr).
UNRECORDED_FIELDS = ("server_token", "backend")


@attrs.define
class EvalResult:
    """What an eval produced: its episodes (kept and new), its run dir and its summary."""

    episodes: list[Episode]
    run_dir: Path
    summary: dict[str, Any]


# The saved config keys that decide which slots a run owes; a resume must match them all.
IDENTITY = ("taskset", "taskset_config", "model", "sampling", "num_examples",
             "rollouts_per_example", "shuffle", "seed", "group")  # fmt: skip


def _check_int(value: object, name: str, minimum: int, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise EvalConfigError(
            f"{{{name}}} must be an integer >= {minimum}, got {value!r}", parameter=name
        )


def check_metrics_port(port: object) -> None:
    """`EvalConfigError` naming `metrics_port` unless `port` is None or a port 0-65535 and
    prometheus_client is installed."""
    if port is None:
        return
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise EvalConfigError(
            f"{{metrics_port}} must be a port number 0-65535 (0: a free one), got {port!r}",
            parameter="metrics_port",
        )
    missing = check_metrics()
    if missing is not None:
        raise EvalConfigError(
            f"{{metrics_port}} needs prometheus_client: {missing}", parameter="metrics_port"
        )


def eval_window(value: int | AdaptiveBounds | Window) -> Window:
    """The rollout window an eval runs under: the `tt.Window` given, or a fresh one
    (`build_window`); `EvalConfigError` naming `max_concurrent` for a bad value."""
    try:
        return build_window(value, parameter="max_concurrent")
    except WindowArgumentError as exc:
        raise EvalConfigError(exc.template, parameter=exc.parameters) from None


def check_window(value: object) -> None:
    """`EvalConfigError` naming `max_concurrent` unless `value` is an int >= 1,
    `AdaptiveBounds` with 1 <= min <= start <= max, or a `tt.Window`."""
    eval_window(value)  # type: ignore[arg-type]  # checked there


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
        f"{{max_failures}} takes N (an integer >= 1: stop once N episodes failed) or a FRACTION "
        f"between 0 and 1 (stop once more than that share failed), got {value!r}",
        parameter="max_failures",
    )


def preflight(env: Env[Any], ctx: ModelContext, config: EvalConfig) -> SlotBackend:
    """Every check that needs no pull and no file write; the backend the slots run on."""
    _check_int(config.num_examples, "num_examples", 0, optional=True)
    _check_int(config.rollouts_per_example, "rollouts_per_example", 1)
    check_window(config.max_concurrent)
    limit = config.time_limit
    if limit is not None and (
        isinstance(limit, bool)
        or not isinstance(limit, int | float)
        or not math.isfinite(limit)
        or limit <= 0
    ):
        raise EvalConfigError(
            f"{{time_limit}} must be a number of seconds > 0, got {limit!r}",
            parameter="time_limit",
        )
    if not isinstance(config.group, bool):
        raise EvalConfigError(
            f"{{group}} is a switch (True or False), got {config.group!r}", parameter="group"
        )
    check_max_failures(config.max_failures)
    _check_int(config.max_consecutive_failures, "max_consecutive_failures", 1, optional=True)
    check_metrics_port(config.metrics_port)
    _check_engine_metrics(config)
    taskset = env.taskset
    name = type(taskset).__name__
    if taskset.streaming or taskset.INFINITE:
        kind = "streams its tasks" if taskset.streaming else "is INFINITE"
        if config.num_examples is None:
            raise EvalConfigError(
                f"taskset {name} {kind}: bound the run with {{num_examples}} N "
                f"(the eval takes the next N tasks and ends)",
                parameter="num_examples",
            )
        if taskset.streaming and config.shuffle:
            raise EvalConfigError(
                f"taskset {name} {kind}: cannot shuffle (drop {{shuffle}})", parameter="shuffle"
            )
        if taskset.streaming and config.resume:
            raise EvalConfigError(
                f"taskset {name} {kind}: cannot resume (there is no list of tasks to compare "
                f"against; drop {{resume}})",
                parameter="resume",
            )
    backend = config.slot_backend()
    backend.check(env, ctx)
    return backend


def _check_engine_metrics(config: EvalConfig) -> None:
    url = config.engine_metrics
    if url is None:
        return
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise EvalConfigError(
            f"{{engine_metrics}} must be an http:// or https:// URL, got {url!r} "
            f"(e.g. http://127.0.0.1:8000/metrics)",
            parameter="engine_metrics",
        )
    if not isinstance(config.max_concurrent, AdaptiveBounds | AdaptiveWindow):
        raise EvalConfigError(
            "{engine_metrics} moves an adaptive window: give {max_concurrent} as "
            "MIN-START-MAX (e.g. 1-8-1024)",
            parameter=("engine_metrics", "max_concurrent"),
        )


def run_identity(env: Env[Any], ctx: ModelContext, config: EvalConfig) -> dict[str, Any]:
    taskset = env.taskset
    identity: dict[str, Any] = {
        "taskset": taskset_label(taskset),
        "taskset_config": json.loads(json.dumps(attrs.asdict(taskset.config), default=str)),
        "model": ctx.model,
        "sampling": json.loads(json.dumps(attrs.asdict(ctx.sampling), default=str)),
        "num_examples": config.num_examples,
        "rollouts_per_example": config.rollouts_per_example,
        "shuffle": config.shuffle,
        "seed": config.seed,
    }
    if config.group:  # absent otherwise: runs saved before groups existed still resume
        identity["group"] = True
    return identity


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
        same = upgraded_label(saved["identity"].get("taskset")) == identity["taskset"]
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
                f"{{resume}}: {config.output_dir} holds no run of taskset "
                f"{type(env.taskset).__name__} with model {ctx.model!r}; name the run to "
                f"resume with {{run_name}} (or {{output_dir}})",
                parameter=("resume", "run_name", "output_dir"),
            )
        return latest
    if name is None:
        name = default_run_name(env, ctx)
    if not name or "/" in name or name in (".", ".."):
        raise EvalConfigError(
            f"{{run_name}} must be a plain directory name, got {name!r}", parameter="run_name"
        )
    return Path(config.output_dir) / name
