"""`EvalConfig` (valid once built), `EvalResult` and the checks made before any work."""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from .._core.adaptive import (
    AdaptiveBounds,
    AdaptiveWindow,
    WindowArgumentError,
    WindowSpec,
    check_window_spec,
)
from .._core.exceptions import ConfigError, EmptyEvalError
from .._core.exceptions import EvalConfigError as EvalConfigError  # their home is _exceptions
from .._core.exceptions import EvalWarning as EvalWarning
from .._env.backend import InProcess, SlotBackend, served_backend
from .._env.env import Env, Episode
from .._env.groups import Advantage, check_advantage
from .._env.loading import taskset_label, taskset_short_name, upgraded_label
from .._env.rollout_limits import is_seconds
from .._models import ModelContext
from .._monitor.metrics import check_metrics

Check = Callable[[Any], None]
"""One field's check: raises `ConfigError` naming the field for a bad value."""


def _valid(config: EvalConfig, attribute: attrs.Attribute[Any], value: Any) -> None:
    """The attrs validator of every `EvalConfig` field: the field's own check (`_CHECKS`),
    then the contradictions it takes part in (`_CONTRADICTIONS`). A problem raises one
    `EvalConfigError` that names every bad field of `config` and every contradiction between
    its fields: attrs runs the validators of a new instance once all its fields are set, so
    the first one to find a problem sees them all."""
    name = _parameter(attribute)
    values = {**parameter_values(config), name: value}
    try:
        _CHECKS[name](value)
        for names, contradiction in _CONTRADICTIONS:
            if name in names:
                contradiction(values)
    except ConfigError:
        raise _one(_problems(values)) from None


@attrs.define
class EvalConfig:
    """How to run an eval; each field is a `trio-tasksets eval` option (`backend`: the
    command builds it from its options for where the slots run).

    Built, it is valid: bad values raise one `EvalConfigError` naming every bad parameter
    (`parameters`) and every contradiction, at construction (a bad value assigned later, at
    the assignment). What needs the env too (a stream without `num_examples`) is checked by
    `run_eval`.

    Where the slots run is `backend` alone: `tt.InProcess()` by default, `tt.ServedBackend(
    ...)`, `trio_tasksets.redis.ViaBackend(...)`, or one of your own. ``serve=True`` (with
    ``workers=K``) is the shorthand for ``backend=tt.ServedBackend(workers=K)``, resolved into
    `backend` at construction in place of the in-process one; ``workers`` without
    ``serve``, or ``serve`` with another backend, is an `EvalConfigError`.
    """

    num_examples: int | None = attrs.field(default=None, validator=_valid)  # -n/--num-examples
    # -r/--rollouts-per-example
    rollouts_per_example: int = attrs.field(default=1, validator=_valid)
    # -c/--max-concurrent: the rollout window. N, AdaptiveBounds(min, start, max) (the CLI's
    # MIN-START-MAX: an AdaptiveWindow fed by the runs' 429s, 5xx, timeouts and successes),
    # or a tt.Window (a tt.AdaptiveWindow) of your own.
    max_concurrent: WindowSpec | tuple[int, int, int] = attrs.field(default=32, validator=_valid)
    shuffle: bool = attrs.field(default=False, validator=_valid)  # --shuffle
    seed: int = attrs.field(default=0, validator=_valid)  # --seed
    resume: bool = attrs.field(default=False, validator=_valid)  # --resume
    output_dir: str = attrs.field(default="outputs", validator=_valid)  # -o/--output-dir
    run_name: str | None = attrs.field(default=None, validator=_valid)  # --run-name
    # serve=True, workers=K (--serve, --workers): shorthands for a served backend, resolved
    # into `backend` at construction (and then back to their defaults, so that attrs.evolve
    # passes the backend alone).
    _serve: bool = attrs.field(default=False, validator=_valid, repr=False, eq=False)
    _workers: int = attrs.field(default=1, validator=_valid, repr=False, eq=False)
    dashboard: bool = attrs.field(default=True, validator=_valid)  # --no-dashboard
    # --max-failures: stop (exit 1) once this many episodes failed (an int >= 1), or once the
    # failed ones exceed this fraction (a float in (0, 1)) of the planned slots (a stream: of
    # the finished ones). None: never stop early.
    max_failures: int | float | None = attrs.field(default=None, validator=_valid)
    # Where the slots run (a tt.SlotBackend): the CLI builds it from --serve, --workers,
    # --server-url (with --token-var), --via and --stream.
    backend: SlotBackend = attrs.field(default=attrs.Factory(InProcess), validator=_valid)
    # --time-limit: seconds after which the eval stops pulling, cancels the runs in flight,
    # keeps the finished rows and ends with `stopped: "time_limit"`. None: no limit.
    time_limit: float | None = attrs.field(default=None, validator=_valid)
    # --max-consecutive-failures: stop (exit 1) after this many failed episodes in a row (in
    # the order they finished): a dead service fails every one. None: never.
    max_consecutive_failures: int | None = attrs.field(default=None, validator=_valid)
    # --metrics-port: serve the run's counters and health as Prometheus text on 127.0.0.1 at
    # this port (0: a free one, printed) while it runs. None: no metrics server.
    metrics_port: int | None = attrs.field(default=None, validator=_valid)
    # --engine-metrics: the Prometheus /metrics URL of the engine behind the model (vLLM,
    # SGLang); an adaptive max_concurrent reads the engine's own load from it every second.
    engine_metrics: str | None = attrs.field(default=None, validator=_valid)
    # --group: a task's rollouts are one group: run together, scored together by
    # Env.score_group, written together; one failing after its retries fails the group.
    group: bool = attrs.field(default=False, validator=_valid)
    # --advantage: with group, the advantages of an env without a score_group of its own:
    # "mean" (reward minus the group mean), "std" (divided by the group's standard
    # deviation; 0.0 when the rewards are all equal) or "none" (null).
    advantage: Advantage = attrs.field(default="mean", validator=_valid)
    # Recorded in config.json only (never compared by a resume): the command line that ran
    # the eval (default: sys.argv) and the name of the variable the model's API key came from.
    command: list[str] | None = attrs.field(default=None, validator=_valid)
    api_key_var: str | None = attrs.field(default=None, validator=_valid)

    def __attrs_post_init__(self) -> None:
        if self._serve:  # the shorthand, resolved (in an order each assignment finds valid)
            backend = served_backend(workers=self._workers)
            self._workers = 1
            self._serve = False
            self.backend = backend


def _parameter(field: attrs.Attribute[Any]) -> str:
    """A field's parameter name: ``serve`` for the field ``_serve``."""
    return field.alias or field.name


def parameter_values(config: EvalConfig) -> dict[str, Any]:
    """The config's fields by their parameter names (``serve`` for the field ``_serve``)."""
    return {_parameter(field): getattr(config, field.name) for field in attrs.fields(EvalConfig)}


def _problems(values: dict[str, Any]) -> list[ConfigError]:
    """Every bad value among `values` (by parameter name), then every contradiction between
    values that are each fine."""
    found: list[ConfigError] = []
    bad: set[str] = set()
    for name, check in _CHECKS.items():
        try:
            check(values[name])
        except ConfigError as exc:
            found.append(exc)
            bad.add(name)
    for names, contradiction in _CONTRADICTIONS:
        if bad.isdisjoint(names):
            try:
                contradiction(values)
            except ConfigError as exc:
                found.append(exc)
    return found


def _one(problems: list[ConfigError]) -> EvalConfigError:
    """One `EvalConfigError` for `problems`: their messages joined, naming every parameter."""
    names = tuple(dict.fromkeys(name for exc in problems for name in exc.parameters))
    return EvalConfigError("; ".join(exc.template for exc in problems), parameter=names)


# --- each field's check ---------------------------------------------------------------------


def _count(name: str, minimum: int, *, optional: bool = False) -> Check:
    def check(value: object) -> None:
        if optional and value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise EvalConfigError(
                f"{{{name}}} must be an integer >= {minimum}, got {value!r}", parameter=name
            )

    return check


def _switch(name: str) -> Check:
    def check(value: object) -> None:
        if not isinstance(value, bool):
            raise EvalConfigError(
                f"{{{name}}} is a switch (True or False), got {value!r}", parameter=name
            )

    return check


def _text(name: str, what: str, *, optional: bool = True) -> Check:
    def check(value: object) -> None:
        if optional and value is None:
            return
        if not isinstance(value, str):
            raise EvalConfigError(f"{{{name}}} must be {what}, got {value!r}", parameter=name)

    return check


def _check_window(value: object) -> None:
    try:
        check_window_spec(value, parameter="max_concurrent")
    except WindowArgumentError as exc:
        raise EvalConfigError(exc.template, parameter=exc.parameters) from None


def _check_seed(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise EvalConfigError(f"{{seed}} must be an integer, got {value!r}", parameter="seed")


def _check_output_dir(value: object) -> None:
    if not isinstance(value, str | os.PathLike):
        raise EvalConfigError(
            f"{{output_dir}} must be a directory's path, got {value!r}", parameter="output_dir"
        )


def _check_run_name(name: object) -> None:
    if name is None:
        return
    if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
        raise EvalConfigError(
            f"{{run_name}} must be a plain directory name, got {name!r}", parameter="run_name"
        )


def check_max_failures(value: object) -> None:
    """Raises `EvalConfigError` naming ``max_failures`` unless `value` is None, an int >= 1
    or a fraction in (0, 1)."""
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


def _check_backend(value: object) -> None:
    if not isinstance(value, SlotBackend):
        raise EvalConfigError(
            f"{{backend}} must be a SlotBackend (check, reach, open, remote), got "
            f"{type(value).__name__}",
            parameter="backend",
        )


def _check_time_limit(limit: object) -> None:
    if limit is not None and not is_seconds(limit):
        raise EvalConfigError(
            f"{{time_limit}} must be a number of seconds > 0, got {limit!r}",
            parameter="time_limit",
        )


def _check_port(port: object) -> None:
    if port is None:
        return
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise EvalConfigError(
            f"{{metrics_port}} must be a port number 0-65535 (0: a free one), got {port!r}",
            parameter="metrics_port",
        )


def check_metrics_port(port: object) -> None:
    """Raises `EvalConfigError` naming ``metrics_port`` unless `port` is None, or a port
    0-65535 and prometheus_client is installed."""
    _check_port(port)
    missing = None if port is None else check_metrics()
    if missing is not None:
        raise EvalConfigError(
            f"{{metrics_port}} needs prometheus_client: {missing}", parameter="metrics_port"
        )


def _check_engine_metrics(url: object) -> None:
    if url is not None and (
        not isinstance(url, str) or not url.startswith(("http://", "https://"))
    ):
        raise EvalConfigError(
            f"{{engine_metrics}} must be an http:// or https:// URL, got {url!r} "
            f"(e.g. http://127.0.0.1:8000/metrics)",
            parameter="engine_metrics",
        )


def _check_advantage(value: object) -> None:
    try:
        check_advantage(value)
    except ConfigError as exc:
        raise EvalConfigError(exc.template, parameter=exc.parameters) from None


def _check_command(value: object) -> None:
    if value is not None and not (
        isinstance(value, list | tuple) and all(isinstance(word, str) for word in value)
    ):
        raise EvalConfigError(
            f"{{command}} must be the command line's words (a list of str), got {value!r}",
            parameter="command",
        )


_CHECKS: dict[str, Check] = {
    "num_examples": _count("num_examples", 0, optional=True),
    "rollouts_per_example": _count("rollouts_per_example", 1),
    "max_concurrent": _check_window,
    "shuffle": _switch("shuffle"),
    "seed": _check_seed,
    "resume": _switch("resume"),
    "output_dir": _check_output_dir,
    "run_name": _check_run_name,
    "serve": _switch("serve"),
    "workers": _count("workers", 1),
    "dashboard": _switch("dashboard"),
    "max_failures": check_max_failures,
    "backend": _check_backend,
    "time_limit": _check_time_limit,
    "max_consecutive_failures": _count("max_consecutive_failures", 1, optional=True),
    "metrics_port": _check_port,
    "engine_metrics": _check_engine_metrics,
    "group": _switch("group"),
    "advantage": _check_advantage,
    "command": _check_command,
    "api_key_var": _text("api_key_var", "the name of an environment variable"),
}


# --- contradictions between fields (each checked when its fields are each fine) -------------


def _workers_need_serve(values: dict[str, Any]) -> None:
    if values["workers"] != 1 and not values["serve"]:
        raise EvalConfigError(
            "{workers} applies to a spawned server: add {serve}", parameter=("workers", "serve")
        )


def _serve_or_backend(values: dict[str, Any]) -> None:
    if values["serve"] and not isinstance(values["backend"], InProcess):
        raise EvalConfigError(
            "{backend} and {serve}: choose one (serve=True is the shorthand for a served backend)",
            parameter=("backend", "serve"),
        )


def _engine_metrics_need_adaptive(values: dict[str, Any]) -> None:
    if values["engine_metrics"] is not None and not isinstance(
        values["max_concurrent"], AdaptiveBounds | AdaptiveWindow
    ):
        raise EvalConfigError(
            "{engine_metrics} moves an adaptive window: give {max_concurrent} as "
            "MIN-START-MAX (e.g. 1-8-1024)",
            parameter=("engine_metrics", "max_concurrent"),
        )


def _advantage_needs_group(values: dict[str, Any]) -> None:
    if values["advantage"] != "mean" and not values["group"]:
        raise EvalConfigError(
            "{advantage} applies to groups: add {group}", parameter=("advantage", "group")
        )


_CONTRADICTIONS: list[tuple[tuple[str, ...], Check]] = [
    (("workers", "serve"), _workers_need_serve),
    (("serve", "backend"), _serve_or_backend),
    (("engine_metrics", "max_concurrent"), _engine_metrics_need_adaptive),
    (("advantage", "group"), _advantage_needs_group),
]


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
             "rollouts_per_example", "shuffle", "seed", "group", "advantage")  # fmt: skip


def preflight(env: Env[Any], ctx: ModelContext, config: EvalConfig) -> SlotBackend:
    """Every check that needs more than the config (the env, the model, this machine) and no
    pull nor file write; the backend the slots run on.

    Raises:
        EvalConfigError: naming the parameter: a streaming or INFINITE taskset without
            ``num_examples`` (or with ``shuffle`` or ``resume``), ``metrics_port`` without
            prometheus_client, or what the backend's `check` refuses.
        EmptyEvalError: ``num_examples`` 0 (the eval would plan no slot).
    """
    check_metrics_port(config.metrics_port)
    if config.num_examples == 0:
        raise EmptyEvalError(
            "{num_examples} 0 plans no slot: there is nothing to evaluate (no run dir is written)",
            parameter="num_examples",
            fix="give {num_examples} N >= 1, or leave it out to take every task of a static "
            "taskset",
        )
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
    config.backend.check(env, ctx)
    return config.backend


def _sampling_identity(ctx: ModelContext) -> dict[str, Any]:
    """The sampling of a run's identity: every field but `stream`, how the replies travel
    (a run resumed with or without it gets the same replies; and runs begun before it
    existed resume)."""
    sampling = attrs.asdict(ctx.sampling)
    del sampling["stream"]
    return sampling


def run_identity(env: Env[Any], ctx: ModelContext, config: EvalConfig) -> dict[str, Any]:
    taskset = env.taskset
    identity: dict[str, Any] = {
        "taskset": taskset_label(taskset),
        "taskset_config": json.loads(json.dumps(attrs.asdict(taskset.config), default=str)),
        "model": ctx.model,
        "sampling": json.loads(json.dumps(_sampling_identity(ctx), default=str)),
        "num_examples": config.num_examples,
        "rollouts_per_example": config.rollouts_per_example,
        "shuffle": config.shuffle,
        "seed": config.seed,
    }
    if config.group:  # absent otherwise: runs saved before groups existed still resume
        identity["group"] = True
        if config.advantage != "mean":  # (likewise: runs saved before it still resume)
            identity["advantage"] = config.advantage
    return identity


def default_run_name(env: Env[Any], ctx: ModelContext) -> str:
    """`<Taskset>-<model>-<YYYYmmdd-HHMMSS>`, the run name when none is given (`<Taskset>`:
    the class name, or a verifiers env's taskset id). Two evals may start within a second:
    `claim_run_dir` makes the name unique."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return f"{taskset_short_name(env.taskset)}-{ctx.model}-{stamp}".replace("/", "_")


def claim_run_dir(run_dir: Path) -> tuple[Path, list[Path]]:
    """Make a new, empty run dir at `run_dir` or, when that name is taken, at the next free
    one (`NAME-2`, `NAME-3`, ...): each try is one `mkdir`, which the file system makes
    atomic, so evals started at once (in processes or in one) each get their own. The run
    dir made, and every directory this made (innermost first: it, then the parents it
    needed), for taking them back when the run keeps nothing."""
    parents = [p for p in run_dir.parents if not p.exists()]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        candidate = run_dir if n == 1 else run_dir.with_name(f"{run_dir.name}-{n}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return candidate, [candidate, *parents]
    raise AssertionError("unreachable")  # pragma: no cover


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
    return Path(config.output_dir) / name
