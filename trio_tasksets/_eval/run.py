"""`run_eval`: the eval over the windowed core, with durable traces, and how it ends.

An eval ends in one of three ways, and `summary.json` is written on each of them:

* it completes (every planned slot ran): `stopped` and `error` are null;
* it is stopped early, and drains (stops pulling, cancels the runs in flight, keeps every
  finished row): by `max_failures` (or `max_consecutive_failures`), by `time_limit`, or
  with ``handle_signals`` by SIGINT or SIGTERM. It returns; `summary["stopped"]` says why;
* something ends it that is not an episode's own failure (the feed raised, an env's
  `serving()` failed, an outside cancellation, a KeyboardInterrupt): the summary records it
  (`error`, or `stopped: "SIGINT"` / `"cancelled"`) and `run_eval` raises it.

A run that did not complete and in which no episode finished leaves no run dir behind. An
eval that plans no slot (``num_examples=0``, an empty taskset or data file, a stream that
ends before its first task) raises `EmptyEvalError` and leaves none either.

The rollout window is `config.max_concurrent` as a `tt.Window`; an adaptive one is fed by
the runs (`WindowFeed`), and `summary.json` keeps its `window_history` (and, when the model
client's endpoint limits adapt their connections, each endpoint's `connection_history`).
"""

from __future__ import annotations

import functools
import json
import math
import re
import sys
import time
import warnings
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import attrs
import trio

from .._core.adaptive import AdaptiveWindow, build_window, window_spec
from .._core.datasets import DATA_SUFFIXES
from .._core.drain import stop_on
from .._core.exceptions import EmptyEvalError
from .._core.health import Health
from .._core.limits import EndpointLimits, observe_calls
from .._core.runner import pick_one, require_trio, run_stream
from .._core.version import __version__
from .._core.window import Window
from .._env.backend import DescribedBackend, GroupRunner, SlotBackend
from .._env.env import Env, Episode, EpisodeError, RunSlot, WindowFeed
from .._env.groups import Group, OpenGroups, cause_first, group_slots, run_group
from .._env.traces import open_traces, write_atomic
from .._models import ModelContext, describe
from .._models.engine import EngineMetrics
from .._monitor import dashboard
from .._report.stats import RunningInterval, mean_and_std, reward_interval
from .._transport import redact_url
from .config import (
    RECORD_FIELDS,
    EvalConfig,
    EvalConfigError,
    EvalResult,
    EvalWarning,
    claim_run_dir,
    parameter_values,
    preflight,
    run_dir_for,
    run_identity,
)
from .lock import LOCK_NAME, RunDirLock
from .plan import from_groups, from_list, keep_resumable, plan_groups, plan_stream, static_slots

# What each file of a run dir is called; a run that leaves no row behind removes them.
_FILES = ("config.json", "traces.jsonl", "summary.json")


@attrs.define
class LiveMetrics:
    """Each named metric of the episodes so far, its mean and 95% interval as
    `metric_summary` will give them (by task, the report's reward interval), kept one
    episode at a time: O(1) per episode and per reading, for the dashboard's redraws."""

    tallies: dict[str, RunningInterval] = attrs.Factory(dict)

    def add(self, episode: Episode) -> None:
        key = episode.task.key
        for name, value in episode.metrics.items():
            tally = self.tallies.get(name)
            if tally is None:
                tally = self.tallies[name] = RunningInterval()
            tally.add(value, key)

    def figures(self) -> dict[str, tuple[float, tuple[float, float] | None]]:
        """Per metric: (mean, (low, high) or None with fewer than two tasks)."""
        found: dict[str, tuple[float, tuple[float, float] | None]] = {}
        for name, tally in self.tallies.items():
            interval = tally.interval()
            found[name] = (
                tally.mean or 0.0,
                None if interval is None else (interval.low, interval.high),
            )
        return found


@attrs.define
class Tally:
    """What the eval has recorded so far, and whether (and why) it was told to stop."""

    max_failures: int | float | None = None
    max_consecutive: int | None = None  # EvalConfig.max_consecutive_failures
    consecutive: int = 0  # failed episodes in a row, the latest last
    # The model endpoints' URLs while they are not known to answer (None: known, or no URL):
    # the first episode to finish tells (see `dead_endpoint`).
    unproven: list[str] | None = None
    model: str | None = None  # the model's name the calls send (a 404 may name it)
    planned: int | None = None  # the static plan's slots (a fraction's base); None on a stream
    recorded: list[Episode] = attrs.Factory(list)  # new episodes, in completion order
    failed: int = 0
    # "SIGINT" | "SIGTERM" | "max_failures" | "max_consecutive_failures" | "time_limit" |
    # "cancelled"
    stopped: str | None = None
    # What ended the run, as `Type: message`; a limit that stopped it, as "<its parameter>
    # <its value>: what happened" (the command line spells the parameter as its flag).
    error: str | None = None
    scope: trio.CancelScope | None = None  # cancelled to stop early
    named: LiveMetrics = attrs.Factory(LiveMetrics)  # the dashboard's metrics line

    def record(self, episode: Episode) -> None:
        self.recorded.append(episode)
        if episode.metrics:
            self.named.add(episode)
        if self.unproven is not None:
            dead = dead_endpoint(episode, model=self.model)
            if dead is not None and self.stopped is None:
                urls = ", ".join(self.unproven)
                many = len(self.unproven) > 1
                what = (
                    f"{'do' if many else 'does'} not serve model {self.model!r}"
                    if _names_model(episode.errors[-1], self.model)
                    else f"{'are' if many else 'is'} dead"
                )
                self.error = f"the model endpoint{'s' if many else ''} {urls} {what}: {dead}"
                self.stop("dead_endpoint")
            self.unproven = None
        if episode.ok:
            self.consecutive = 0
            return
        self.failed += 1
        self.consecutive += 1
        if self.max_failures is not None and self.stopped is None and self._over():
            self.error = self._limit_message()
            self.stop("max_failures")
        limit = self.max_consecutive
        if limit is not None and self.stopped is None and self.consecutive >= limit:
            last = episode.errors[-1] if episode.errors else None
            said = f"; the last: {last.type}: {last.message}" if last is not None else ""
            self.error = (
                f"max_consecutive_failures {limit}: {self.consecutive} episodes failed in "
                f"a row{said}"
            )
            self.stop("max_consecutive_failures")

    def _over(self) -> bool:
        if isinstance(self.max_failures, int):
            return self.failed >= self.max_failures
        assert self.max_failures is not None
        base = self.planned if self.planned is not None else len(self.recorded)
        return self.failed > self.max_failures * base

    def _limit_message(self) -> str:
        if isinstance(self.max_failures, int):
            return f"max_failures {self.max_failures}: {self.failed} episodes failed"
        base, of = (
            (self.planned, "planned slots")
            if self.planned is not None
            else (len(self.recorded), "finished episodes")
        )
        return (
            f"max_failures {self.max_failures:g}: {self.failed} of {base} {of} failed "
            f"(more than {self.max_failures:.0%})"
        )

    def stop(self, reason: str) -> None:
        """Stop the eval early (the first reason given is the one kept) and drain it."""
        if self.stopped is None:
            self.stopped = reason
        if self.scope is not None:
            self.scope.cancel()

    def ended_by(self, exc: BaseException) -> None:
        """Note what ended the run, when it raised."""
        if isinstance(exc, KeyboardInterrupt):
            self.stopped = self.stopped or "SIGINT"
        elif isinstance(exc, trio.Cancelled):
            self.stopped = self.stopped or "cancelled"
        elif self.error is None:
            self.error = f"{type(exc).__name__}: {exc}"


def dead_endpoint(episode: Episode, *, model: str | None = None) -> str | None:
    """Why the first episode of a run to finish says its endpoint is dead, or None: it failed
    because the endpoint could not be reached (refused, DNS, TLS: `ModelConnectionError`,
    after the client's retries), refused the key (HTTP 401 or 403), or does not serve
    `model` (an HTTP 404 whose message names it: vLLM's "The model `x` does not exist.",
    OpenAI's "... does not exist or you do not have access to it.", Ollama's "model "x" not
    found"). Nothing has answered before it, so no slot would do better: the eval stops
    (`stopped: "dead_endpoint"`) instead of spending every slot on it."""
    if episode.ok or not episode.errors:
        return None
    last = episode.errors[-1]
    refused = last.type == "ModelHTTPError" and last.status in (401, 403)
    if last.type == "ModelConnectionError" or refused or _names_model(last, model):
        return f"{last.type}: {last.message}"
    return None


def _names_model(error: EpisodeError, model: str | None) -> bool:
    """A 404 whose message names `model` (as a whole name: quoted, or set apart by spaces)
    and speaks of a model: the server does not serve it. A 404 that does not name it (a
    wrong path) says nothing of the model."""
    if model is None or error.type != "ModelHTTPError" or error.status != 404:
        return False
    name = re.compile(rf"(?<![\w./:-]){re.escape(model)}(?![\w/:-]|\.\w)")
    said = error.message
    return _MODEL_WORD.search(said) is not None and name.search(said) is not None


_MODEL_WORD = re.compile(r"\bmodel\b", re.IGNORECASE)


def _waited(episodes: list[Episode]) -> dict[str, float]:
    """Seconds the episodes' model calls waited, summed: for connections, for rpm/tpm."""
    connection = rate = 0.0
    for episode in episodes:
        connection += episode.timing.get("waited_connection", 0.0)
        rate += episode.timing.get("waited_rate", 0.0)
    return {"connection": connection, "rate": rate}


def endpoint_limits(ctx: ModelContext) -> EndpointLimits | None:
    """The model client's `EndpointLimits` (an `OpenAIClient(limits=...)`), if it has any."""
    return describe(ctx.client).limits


def endpoint_name(key: object) -> str:
    """An endpoint key as text: `(base_url, api_key_var)` as "URL (VAR)"."""
    if isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str):
        url = redact_url(key[0])
        return url if key[1] is None else f"{url} ({key[1]})"
    return redact_url(str(key))


def _shown(value: Any) -> Any:
    """`value` as config.json records it: a str with its URLs' passwords redacted."""
    return redact_url(value) if isinstance(value, str) else value


def _histories(window: Window, ctx: ModelContext, t0: float) -> dict[str, Any]:
    """`window_history`, and `connection_history` per endpoint when they adapt."""
    found: dict[str, Any] = {"window_history": window.history_since(t0)}
    if isinstance(window, AdaptiveWindow):  # the objective, where it settled, measured there
        found["window"] = window.report()
    limits = endpoint_limits(ctx)
    if limits is not None and limits.connections is not None:
        found["connection_history"] = {
            endpoint_name(key): endpoint.history_since(t0)
            for key, endpoint in limits.connections.windows.items()
        }
    stats = describe(ctx.client).endpoint_stats
    endpoints = stats() if stats is not None else None
    if endpoints:  # many --base-url: calls, errors, latency per endpoint
        found["endpoints"] = endpoints
    return found


USAGE_FIELDS = ("prompt_tokens", "completion_tokens")
"""The token counts `summary.json`'s `usage` sums. A server's `total_tokens` (their sum) and
its detail fields stay in the rows: summing them too would count every token twice."""


def _usage(episodes: list[Episode]) -> dict[str, int]:
    prompt = completion = 0
    for episode in episodes:
        usage = episode.usage
        prompt += usage.get("prompt_tokens", 0)
        completion += usage.get("completion_tokens", 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion}


def metric_summary(episodes: list[Episode]) -> dict[str, dict[str, Any]]:
    """`summary.json`'s `metrics`: for each named metric the episodes carry, its `mean`,
    `std`, `n` and 95% interval (`ci`: [low, high], or null with fewer than two tasks;
    `ci_method` as the report's reward interval: "wilson" for 0/1 values, ...)."""
    values: dict[str, list[float]] = {}
    clusters: dict[str, list[int]] = {}
    tasks: dict[str, int] = {}
    for episode in episodes:
        if not episode.metrics:
            continue
        task = tasks.setdefault(episode.task.key, len(tasks))
        for name, value in episode.metrics.items():
            values.setdefault(name, []).append(value)
            clusters.setdefault(name, []).append(task)
    return metric_figures(values, clusters)


def metric_figures(
    values: Mapping[str, list[float]], clusters: Mapping[str, list[int]]
) -> dict[str, dict[str, Any]]:
    """`metric_summary` from each metric's values and their tasks' numbers (`clusters`)."""
    found: dict[str, dict[str, Any]] = {}
    for name, numbers in values.items():
        interval = reward_interval(numbers, clusters[name])
        mean, std = mean_and_std(numbers)  # finite for any finite values (1e308 included)
        found[name] = {
            "mean": mean,
            "std": std,
            "n": len(numbers),
            "ci": None if interval is None else [interval.low, interval.high],
            "ci_method": None if interval is None else interval.method,
        }
    return found


def _summary(
    episodes: list[Episode], planned: int, began: float, kept: int, tally: Tally, complete: bool
) -> dict[str, Any]:
    rewards = [e.reward for e in episodes if math.isfinite(e.reward)]
    ok = sum(1 for e in episodes if e.ok)
    duration = time.monotonic() - began
    failures = [e for e in tally.recorded if not e.ok]
    by_type = Counter(e.errors[-1].type if e.errors else "unknown" for e in failures)
    first = next((e.errors[-1] for e in failures if e.errors), None)
    return {
        "planned": planned,
        "finished": len(episodes),
        "ok": ok,
        "failed": len(episodes) - ok,
        "kept_from_resume": kept,
        "reward_mean": mean_and_std(rewards)[0] if rewards else None,
        "reward_std": mean_and_std(rewards)[1] if rewards else None,
        "duration_s": duration,
        "rollouts_per_s": (len(episodes) - kept) / duration if duration > 0 else math.nan,
        "interrupted": not complete,
        "stopped": tally.stopped,
        "error": tally.error,
        "errors_by_type": dict(by_type.most_common()),
        "first_error": None if first is None else first_error(first),
        "usage": _usage(episodes),
        "waited_s": _waited(episodes),
        "metrics": metric_summary(episodes),
    }


def first_error(error: EpisodeError) -> dict[str, Any]:
    first: dict[str, Any] = {"type": error.type, "message": error.message}
    if error.status is not None:
        first["status"] = error.status  # the HTTP status the endpoint answered with
    if error.traceback is not None:
        first["traceback"] = error.traceback  # the user's frames (an error of their code)
    return first


def _make_dir(run_dir: Path) -> list[Path]:
    """Create `run_dir` (and its parents); the directories this created, innermost first."""
    created = [p for p in (run_dir, *run_dir.parents) if not p.exists()]
    run_dir.mkdir(parents=True, exist_ok=True)
    return created


def _remove_run(run_dir: Path, created: list[Path]) -> None:
    """Take back what a run that left no row wrote: its files, and the directories it made."""
    for name in (*_FILES, LOCK_NAME):
        (run_dir / name).unlink(missing_ok=True)
    for directory in created:
        try:
            directory.rmdir()  # only if empty: never anything this run did not write
        except OSError:
            break


def _record_of(
    env: Env[Any], ctx: ModelContext, config: EvalConfig, identity: dict[str, Any], run_dir: Path
) -> dict[str, Any]:
    """config.json: how to reproduce the run (and what it cost to start)."""
    urls = list(describe(ctx.client).endpoints)
    base_url = urls[0] if urls else None
    many = {"base_urls": urls} if len(urls) > 1 else {}
    skip = (*RECORD_FIELDS, *_BACKEND_FIELDS)
    settings = {k: v for k, v in parameter_values(config).items() if k not in skip}
    # (a URL's password is never recorded: --via redis://:pw@..., --base-url http://u:pw@...)
    settings.update({k: _shown(v) for k, v in _where(config.backend).items()})
    settings["max_concurrent"] = window_spec(config.max_concurrent)
    limits = endpoint_limits(ctx)
    connections = None if limits is None else limits.connections
    return {
        "version": __version__,
        "command": [
            redact_url(part) for part in (sys.argv if config.command is None else config.command)
        ],
        "started_at": datetime.now(UTC).isoformat(timespec="milliseconds"),
        "base_url": _shown(base_url) if isinstance(base_url, str) else None,
        **{key: [_shown(url) for url in urls] for key, urls in many.items()},
        "api_key_var": config.api_key_var,
        "identity": identity,
        "eval": settings,
        "limits": {
            "max_connections": None if connections is None else window_spec(connections.limit),
            "rpm": None if limits is None else limits.rpm,
            "tpm": None if limits is None else limits.tpm,
            "rollout_timeout": env.rollout_timeout,
            "working_limit": env.working_limit,
            "stall_timeout": env.stall_timeout,
        },
        **_sandbox_record(env),
        "run_dir": str(run_dir),
    }


def _sandbox_record(env: Env[Any]) -> dict[str, Any]:
    """config.json's ``sandbox``: the env's sandboxes (`--sandbox`'s form, or the env's
    own), their scope and admission window; nothing for an env without."""
    boxes = env.sandboxes
    if boxes is None:
        return {}
    named = getattr(boxes.spec, "text", None)
    backend = named if named is not None else f"the env's own ({type(boxes.factory).__name__})"
    window = window_spec(boxes.admission.window)
    return {"sandbox": {"backend": backend, "scope": boxes.scope, "max_sandboxes": window}}


# EvalConfig fields config.json records otherwise: where the slots run (`_where`).
_BACKEND_FIELDS = ("serve", "workers", "backend")


def _where(backend: SlotBackend) -> dict[str, Any]:
    """config.json's record of where the slots ran: the keys of the settings that name the
    built-in backends (as when they were the eval's own fields), each backend's own from its
    `settings`; a backend of one's own adds ``backend``, its repr."""
    where: dict[str, Any] = {"serve": False, "workers": 1, "server_url": None, "via": None,
                             "stream": None}  # fmt: skip
    if isinstance(backend, DescribedBackend):
        where.update(backend.settings)
    else:
        where["backend"] = repr(backend)
    return where


def _say_if_short(env: Env[Any], config: EvalConfig, slots: list[RunSlot[Any]]) -> None:
    n = config.num_examples
    tasks = len(slots) // config.rollouts_per_example
    if n is not None and tasks < n:
        warnings.warn(
            EvalWarning(
                f"{{num_examples}} {n} is more than taskset {type(env.taskset).__name__} "
                f"holds ({tasks} tasks): the eval runs all {tasks}",
                parameter="num_examples",
            ),
            stacklevel=3,
        )


async def run_eval(
    env: Env[Any], ctx: ModelContext, config: EvalConfig, *, handle_signals: bool = False
) -> EvalResult:
    """Run an eval of `env` against the model in `ctx`; see the package and module docstrings.

    With `handle_signals` (the command line), SIGINT and SIGTERM stop the eval and drain it
    (a second one interrupts the drain); it then returns with `summary["stopped"]` set to the
    signal's name. It must then run in the main thread. Awaited from asyncio it raises a
    RuntimeError naming `tt.aio.run_eval`.

    One eval at a time writes a run dir: another one meanwhile (a second resume) is refused
    with `EvalConfigError` naming the holder (`RunDirLock`).

    Raises:
        EvalConfigError: before any pull or file write, naming the parameter, for what needs
            the env, the model or the run dir as well as the config (a streaming taskset
            without ``num_examples``, a backend that cannot run this env or be reached, a
            run dir that holds another run, a resume whose saved config differs).
        EmptyEvalError: the eval plans no slot (``num_examples=0``, an empty taskset or
            data file: before any write; a stream that ends before its first task: once it
            has taken back what it wrote). A resume with nothing owed returns.
        RuntimeError: awaited from asyncio (it names `tt.aio.run_eval`).
        BaseException: what ended the run otherwise (the feed's error, a KeyboardInterrupt,
            a cancellation), after `summary.json` records it.
    """
    require_trio("run_eval")
    with RunDirLock() as lock:
        return await _run_eval(env, ctx, config, handle_signals, lock)


async def _run_eval(
    env: Env[Any], ctx: ModelContext, config: EvalConfig, handle_signals: bool, lock: RunDirLock
) -> EvalResult:
    backend = await preflight(env, ctx, config).reach()
    identity = run_identity(env, ctx, config)
    run_dir = run_dir_for(env, ctx, config)
    streaming = env.taskset.streaming
    slots: list[RunSlot[Any]] = [] if streaming else static_slots(env, config)
    planned = len(slots)
    if not streaming and not planned:
        raise _empty(env, "holds no task", "its load() gave none")
    if not streaming and not env.taskset.INFINITE:
        _say_if_short(env, config, slots)
    kept_rows: list[dict[str, Any]] = []
    default_name = config.run_name is None and not config.resume
    if config.resume:
        if run_dir.is_dir():
            lock.take(run_dir)  # before reading it: no other eval writes it meanwhile
        kept_rows, slots = keep_resumable(run_dir, identity, slots, groups=config.group)
    elif not default_name and run_dir.exists() and any(run_dir.iterdir()):
        raise EvalConfigError(
            f"{run_dir} already holds a run: pass {{resume}} to continue it, or choose another "
            f"{{run_name}} / {{output_dir}}",
            parameter=("resume", "run_name", "output_dir"),
        )
    if default_name:  # its own dir, even when another eval started in the same second
        run_dir, created = claim_run_dir(run_dir)
    else:
        created = _make_dir(run_dir)
    lock.take(run_dir)
    record = _record_of(env, ctx, config, identity, run_dir)
    write_atomic(run_dir / "config.json", text=json.dumps(record, indent=2, default=str))
    traces_path = run_dir / "traces.jsonl"
    if config.resume:
        write_atomic(traces_path, kept_rows)  # drop torn, failed and surplus rows, atomically

    kept = [Episode.from_row(row) for row in kept_rows]
    window = build_window(config.max_concurrent, parameter="max_concurrent")
    limits = endpoint_limits(ctx)
    progress = dashboard.Progress(
        title=run_dir.name,
        growing=streaming,
        window=window,
        connections=None if limits is None else limits.connections,
    )
    if env.sandboxes is not None and not config.backend.remote:  # boxes made in this process
        progress.sandboxes = env.sandboxes.admission.window
    progress.planned(planned)
    tally = Tally(config.max_failures, config.max_consecutive_failures,
                  planned=None if streaming else planned)  # fmt: skip
    for episode in kept:
        progress.started()
        progress.finished(episode.ok, episode.reward)
        if episode.metrics:
            tally.named.add(episode)
    progress.carried = len(kept)
    progress.metrics = tally.named.figures  # named metrics: a line of their means and intervals
    health = Health()
    progress.health = health.dashboard_text
    progress.endpoints = describe(ctx.client).endpoint_stats  # many --base-url: a row each
    named = list(describe(ctx.client).endpoints)  # many --base-url: every one
    tally.unproven = named if named and not kept else None
    tally.model = ctx.model
    new: list[Episode] | None = None
    empty = False  # a stream that ended before its first task
    began = time.monotonic()
    t0 = trio.current_time()
    try:
        new = await _execute(
            env, ctx, config, slots, traces_path, progress, tally, handle_signals,
            window, backend, health,
        )  # fmt: skip
    except BaseException as exc:
        tally.ended_by(exc)
        raise
    finally:
        complete = new is not None
        empty = complete and streaming and not new
        done = kept + (new if new is not None else tally.recorded)
        summary = _summary(done, progress.total, began, len(kept), tally, complete)
        summary.update(_histories(window, ctx, t0))
        summary["health"] = health.snapshot()
        if env.sandboxes is not None and not backend.remote:  # the boxes made in this process
            summary["sandboxes"] = env.sandboxes.report(t0)
        summary.update(identity)
        if empty or (not complete and not tally.recorded and not config.resume):
            _remove_run(run_dir, created)  # nothing finished: a rerun starts afresh
        else:
            try:
                text = json.dumps(summary, indent=2, default=str)
                write_atomic(run_dir / "summary.json", text=text)
            except Exception as exc:  # never in place of what ended the run (Ctrl-C, a failure)
                if not complete:
                    print(f"trio_tasksets: could not write summary.json: {exc}", file=sys.stderr)
                else:
                    raise
    if empty:
        raise _empty(env, "ended before its first task", "its feed closed without one")
    return EvalResult(episodes=done, run_dir=run_dir, summary=summary)


def _empty(env: Env[Any], what: str, why: str) -> EmptyEvalError:
    """The `EmptyEvalError` of a taskset that planned no slot: `what` it did, and `why` in
    the fix (a data file: which file, and what it must hold)."""
    taskset = env.taskset
    own = getattr(taskset, "taskset_id", None)
    if isinstance(own, str) and Path(own).suffix.lower() in DATA_SUFFIXES:
        holds = "one JSON object a line" if own.endswith(".jsonl") else "a header, then rows"
        return EmptyEvalError(
            f"data file {own} {what}: there is nothing to evaluate (no run dir is written)",
            fix=f"check that {own} holds records ({holds})",
        )
    label = own if isinstance(own, str) and own else type(taskset).__name__
    return EmptyEvalError(
        f"taskset {label} {what}: there is nothing to evaluate (no run dir is written)",
        fix=f"check taskset {label}: {why}",
    )


async def _start_metrics(nursery: trio.Nursery, metrics: Any, port: int | None) -> None:
    """`config.metrics_port`: serve `metrics` in `nursery`, and say where (on stderr)."""
    from .._monitor.metrics import serve_metrics

    bound = await nursery.start(serve_metrics, metrics, port or 0)
    print(f"trio-tasksets: metrics on http://127.0.0.1:{bound}/metrics", file=sys.stderr)


async def _execute(
    env: Env[Any],
    ctx: ModelContext,
    config: EvalConfig,
    slots: list[RunSlot[Any]],
    traces_path: Path,
    progress: dashboard.Progress,
    tally: Tally,
    handle_signals: bool,
    window: Window,
    backend: SlotBackend,
    health: Health,
) -> list[Episode] | None:
    """Run the planned (static) or streamed slots through `run_stream` under `window`,
    recording each episode; the episodes in plan order, or None when the eval was stopped
    early."""
    deadline = math.inf if config.time_limit is None else trio.current_time() + config.time_limit
    # In this process the model calls' 429s reach an adaptive window as they come; elsewhere
    # (an env server, workers) only through the episodes' errors.
    feed = WindowFeed(window, remote=backend.remote)
    metrics = None
    if config.metrics_port is not None:
        from .._monitor.metrics import Metrics

        metrics = Metrics(health, window=window, endpoints=progress.endpoints)
    try:
        async with (
            backend.open(env, ctx, window=window, progress=progress) as run_slot,
            open_traces(traces_path) as writer,
            dashboard.show(progress, live=config.dashboard),
        ):

            def record(episode: Episode) -> None:
                writer.write(episode.to_row())
                counted(episode)

            def counted(episode: Episode) -> None:  # its row written: the dashboard, the tally
                progress.finished(episode.ok, episode.reward)
                if episode.errors:
                    progress.stalled += sum(e.type == "StalledError" for e in episode.errors)
                if metrics is not None:
                    last = episode.errors[-1].type if episode.errors else None
                    metrics.record(episode.ok, last, episode.usage)
                tally.record(episode)

            async def run(slot: RunSlot[Any]) -> Episode:
                progress.started()
                health.started()
                try:
                    if feed.window is None:
                        return await run_slot(slot, on_complete=record)
                    with observe_calls(feed):
                        episode = await run_slot(slot, on_complete=record)
                    feed.ended(episode)  # the run still holds its place in the window
                    return episode
                finally:
                    health.finished()

            async def rollout(slot: RunSlot[Any]) -> Episode:  # of a group: no row yet
                progress.started()
                health.started()
                try:
                    if feed.window is None:
                        return await run_slot(slot)
                    with observe_calls(feed):
                        episode = await run_slot(slot)
                    feed.ended(episode)
                    return episode
                finally:
                    health.finished()

            async def tracked(
                slot: RunSlot[Any], wait: Callable[[], Awaitable[Episode]]
            ) -> Episode:
                progress.started()  # a rollout of a group that runs elsewhere (--via)
                health.started()
                try:
                    episode = await wait()
                    feed.ended(episode)
                    return episode
                finally:
                    health.finished()

            # --via: the whole group on one worker. Asked once: a runtime-checkable
            # Protocol's isinstance costs ~60 µs (8 µs a rollout of a group of 8).
            remote_groups = run_slot if isinstance(run_slot, GroupRunner) else None

            async def run_one_group(group: Group) -> list[Episode]:
                if remote_groups is not None:
                    done = await remote_groups.run_group(group, tracked)
                else:
                    done = await run_group(env, group, rollout)
                ordered = cause_first(done)
                writer.write_rows([episode.to_row() for episode in ordered])  # together
                for episode in ordered:
                    counted(episode)
                return done

            episodes: list[Episode] | None = None
            # time_limit is this scope's deadline: every rollout sees it as its effective
            # deadline (it travels with a remote episode), so nothing outlives it.
            with trio.CancelScope(deadline=deadline) as tally.scope:
                async with trio.open_nursery() as nursery:
                    if handle_signals or config.time_limit is not None:
                        # The first SIGINT/SIGTERM stops the eval (a second interrupts the
                        # drain); --time-limit counts from the start (the backend's too).
                        await nursery.start(functools.partial(
                            stop_on, tally.stop, signals=handle_signals, once=True,
                            time_limit=None if config.time_limit is None
                            else max(0.0, deadline - trio.current_time()),
                        ))  # fmt: skip
                    nursery.start_soon(health.probe)
                    if config.engine_metrics is not None and isinstance(window, AdaptiveWindow):
                        nursery.start_soon(EngineMetrics(config.engine_metrics).feed, window)
                    elif (engines := describe(ctx.client).engine_metrics) is not None:
                        # The client's own (--engine-metrics with many --base-url): each
                        # endpoint's engine into its window, its readings into its figures.
                        nursery.start_soon(engines, window)
                    if metrics is not None:
                        await _start_metrics(nursery, metrics, config.metrics_port)
                    opened = OpenGroups(window)  # a group's rollouts before a new task
                    r = config.rollouts_per_example
                    with observe_calls(health):  # the waits and model calls of every run
                        if config.group and not env.taskset.streaming:
                            planned_groups = group_slots(slots, config.advantage)
                            grouped = opened.gate(from_groups(planned_groups))
                            done = await run_stream(grouped, run_one_group, window=window)
                            episodes = [episode for group in done for episode in group]
                        elif not env.taskset.streaming:
                            source = from_list(slots)
                            episodes = await run_stream(source, run, window=window)
                        else:
                            assert config.num_examples is not None
                            async with env.taskset.head(config.num_examples).channel() as tasks:
                                if config.group:
                                    arriving = plan_groups(tasks, r, progress, config.advantage)
                                    groups = opened.gate(arriving)
                                    done = await run_stream(groups, run_one_group, window=window)
                                    episodes = [episode for group in done for episode in group]
                                else:
                                    planned = plan_stream(tasks, r, progress)
                                    episodes = await run_stream(planned, run, window=window)
                    nursery.cancel_scope.cancel()  # the signal watcher, the probe, the metrics
            if tally.scope.cancelled_caught and tally.stopped is None:
                tally.stopped = "time_limit"  # the scope's deadline passed first
            return None if tally.stopped is not None else episodes
    except BaseExceptionGroup as group:
        # The context managers' nurseries wrap what passes through them: hand on the one
        # exception (a KeyboardInterrupt, a Cancelled, the runner's failure) bare.
        error = pick_one(group)
    raise error
