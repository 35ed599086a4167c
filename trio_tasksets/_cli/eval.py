"""`trio-tasksets eval TASKSET`: the eval's command (exit codes: see `trio_tasksets._cli.main`).

What it prints: the one-line summary on stdout (its reward mean counts a failed row as 0, and
says so when one failed), a line of the named metrics' means and 95% intervals when the rows
carry any, and, when episodes failed, the failures by type with the first error's message.
When the run did not succeed, one error line on stderr with the fix the first error
suggests; when it stopped early, where its rows are and the exact command that resumes it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import sys
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TextIO

import attrs
import trio

from .._core.exceptions import EmptyEvalError
from .._env.backend import DescribedBackend, InProcess
from .._env.env import Env
from .._env.groups import ADVANTAGES
from .._eval import EvalConfig, EvalConfigError, EvalResult, EvalWarning, run_eval
from .._eval.config import check_max_failures, claim_run_dir, preflight, run_dir_for
from .._models import ModelContext, ModelHTTPError
from .._models.calls import over_whole_budget
from .._monitor.dashboard import FAILED_COUNT_0, MetricFigures, metrics_text
from .._serve.errors import EnvServerError
from .._serve.slots import ServedBackend
from .._serve.wire import TOKEN_VAR
from .env_options import EnvOptions, add_env_options, build_env, check_retry_flags, env_options
from .heap import settle_heap
from .model_options import (
    ModelOptions,
    add_model_options,
    api_key,
    api_key_var,
    check_engine_metrics,
    engine_metrics_urls,
    limit_flags,
    model_context,
    model_options,
    offered_models,
)
from .options import (
    DEFAULT_API_KEY_VAR,
    PARAMETER_FLAGS,
    PROG,
    CommandError,
    HelpFormatter,
    UsageError,
    add_flags,
    add_metrics_option,
    add_output_options,
    add_reward_option,
    add_time_limit_option,
    add_window_option,
    debug_fix,
    flag_message,
    warn,
    window_arg,
)

if TYPE_CHECKING:
    from .options import Commands

EXIT_ON_SIGNAL = {"SIGINT": 130, "SIGTERM": 143}


def _max_failures(text: str) -> int | float:
    value: int | float
    try:
        value = int(text)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"takes N (an integer >= 1) or a FRACTION between 0 and 1, got {text!r}"
            ) from None
    try:
        check_max_failures(value)
    except EvalConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("max_failures ")) from None
    return value


def add_parser(commands: Commands) -> argparse.ArgumentParser:
    """Add `eval` to the CLI's subcommands."""
    ev = commands.add_parser(
        "eval",
        help="evaluate a taskset against a model",
        description="Evaluate a taskset against a model; traces go to <output-dir>/<run-name>/.",
        formatter_class=HelpFormatter,
        allow_abbrev=False,  # the resume command rewrites --run-name and --resume by name
    )
    env = add_env_options(ev)
    add_reward_option(
        env, help="score with this reward (file.py:function or pkg.mod:function: (task, "
        "completion) -> a number or {'reward': ..., name: metric}) (default: the taskset's, "
        "else answer match)",
    )  # fmt: skip
    run = ev.add_argument_group("the run")
    add_flags(run, {
        "-n --num-examples N": "take N tasks; required on a streaming or INFINITE taskset "
        "(default: every task of a static taskset)",
    }, type=int)  # fmt: skip
    add_flags(run, {"-r --rollouts-per-example R": "slots per task"}, type=int, default=1)
    add_window_option(run, help="the window: most rollouts in flight")
    add_flags(run, {
        "--group": "a task's -r rollouts are one group: they run together, Env.score_group "
        "scores them (without one: --advantage), their rows are written together (with `group` "
        "and `advantage`), and one that fails after its retries fails the group",
        "--shuffle": "shuffle a static taskset before taking N",
    }, action="store_true")  # fmt: skip
    add_flags(run, {
        "--advantage mean|std|none": "with --group, each row's `advantage` when the env has no "
        "score_group of its own: mean (GRPO's: reward minus the group mean), std (that divided "
        "by the group's standard deviation; 0 when the rewards are all equal) or none (null)",
    }, choices=ADVANTAGES, default="mean")  # fmt: skip
    add_flags(run, {"--seed S": "the seed of --shuffle (default: 0)"}, type=int)
    add_flags(run, {
        "--resume": "finish the owed rollouts of a run dir: --run-name's, or else the latest "
        "run of this taskset and model in -o",
    }, action="store_true")  # fmt: skip
    add_output_options(
        run, output_dir="outputs", output_help="where run dirs go",
        run_name_help="the run dir's name (default: <Taskset>-<model>-<YYYYmmdd-HHMMSS>, then "
        "-2, -3, ... when evals start in the same second: each gets its own)",
    )  # fmt: skip
    add_flags(run, {
        "--max-failures N|FRACTION": "stop (exit 1) once N episodes failed, or once more than "
        "FRACTION of the planned slots (of a stream: of the finished ones) failed (default: "
        "never stop early; exit 1 only when no episode succeeded)",
    }, type=_max_failures)  # fmt: skip
    add_flags(run, {
        "--max-consecutive-failures N": "stop (exit 1) after N failed episodes in a row: a dead "
        "service fails every one (default: never)",
    }, type=int)  # fmt: skip
    add_time_limit_option(
        run, what="stop pulling, cancel the rollouts in flight and keep the finished rows "
        "(summary.json: stopped \"time_limit\"; exit 0 if any episode succeeded)",
    )  # fmt: skip
    run.add_argument("--no-dashboard", action="store_true", help="plain log lines, no live view")
    add_metrics_option(run)
    served = ev.add_argument_group("the served path")
    served.add_argument("--serve", action="store_true", help="run the env in a server process")
    add_flags(served, {"--workers K": "server processes, with --serve"}, type=int, default=1)
    add_flags(served, {
        "--server-url URL": "use a running `trio-tasksets serve` (default: none: run in this "
        "process)",
        "--token-var NAME": f"with --server-url: the environment variable holding its token "
        f"(default: {TOKEN_VAR})",
    })  # fmt: skip
    add_flags(ev.add_argument_group("over workers (trio-tasksets worker)"), {
        "--via URL": "run the slots on `trio-tasksets worker`s through this Redis, e.g. "
        "redis://127.0.0.1:6379/0 (the eval enqueues and collects; -c spans all workers; "
        "default: none: run in this process)",
        "--stream S": "with --via: the workers' task stream (default: tasks)",
    })  # fmt: skip
    add_model_options(ev)
    return ev


# --- checks and building ----------------------------------------------------------------------


@attrs.frozen
class SlotOptions:
    """Where the slots run, as given: `--serve`, `--workers`, `--server-url` (`--token-var`),
    `--via`, `--stream`."""

    serve: bool = False
    workers: int = 1
    server_url: str | None = None
    token_var: str | None = None
    via: str | None = None
    stream: str | None = None


def _refuse_idle_options(seed: int | None, shuffle: bool, slots: SlotOptions) -> None:
    """An option that would do nothing in this combination is a usage error."""
    if seed is not None and not shuffle:
        raise UsageError(
            "--seed does nothing without --shuffle",
            fix="add --shuffle, or drop --seed (it seeds the shuffle; the model's seed, "
            "inspect eval's --seed, is --sampling-seed N)",
        )
    if slots.token_var is not None and slots.server_url is None:
        raise UsageError(
            "--token-var applies to --server-url only",
            fix="add --server-url URL, or drop --token-var",
        )


def _backend(slots: SlotOptions) -> DescribedBackend:
    """Where the slots run, built from --serve, --workers, --server-url (its token), --via
    and --stream; options that contradict each other are usage errors, and a backend's own
    bad value (a `ConfigError`) names its flag."""
    named = (("--via", slots.via is not None), ("--serve", slots.serve),
             ("--server-url", slots.server_url is not None))  # fmt: skip
    chosen = [flag for flag, given in named if given]
    if len(chosen) > 1:
        why = (
            "spawn a server, or use one"
            if "--via" not in chosen
            else "workers over Redis, or a server"
        )
        raise UsageError(f"{chosen[0]} and {chosen[1]}: choose one ({why})")
    if slots.stream is not None and slots.via is None:
        raise UsageError("--stream names the workers' stream: it needs --via")
    if slots.via is not None:
        if slots.workers != 1:
            raise UsageError("--workers applies to a server spawned with --serve, not to --via")
        try:
            from ..redis import ViaBackend
            from ..redis._entries import stderr_log
        except ImportError as exc:
            raise UsageError(
                f"--via needs hiredis ({exc})", fix="pip install 'trio-tasksets[redis]'"
            ) from None
        log = stderr_log("trio-tasksets eval --via")  # its lines, as this command's
        if slots.stream is None:
            return ViaBackend(slots.via, log=log)
        return ViaBackend(slots.via, stream=slots.stream, log=log)
    if slots.serve or slots.server_url is not None:
        return ServedBackend(
            server_url=slots.server_url, workers=slots.workers, token=_server_token(slots)
        )
    if slots.workers < 1:
        raise UsageError(f"--workers must be an integer >= 1, got {slots.workers}")
    if slots.workers != 1:
        raise UsageError("--workers applies to a spawned server: add --serve")
    return InProcess()


class _Place(NamedTuple):
    """How this command speaks of the place where a remote backend runs the slots."""

    who: str  # who makes the model calls and scores the episodes there
    scores: str  # its verb, agreeing
    its: str
    command: str | None = None  # what starts it (None: the eval spawns it)

    @property
    def how(self) -> str:
        it = "them" if self.its == "their" else "it"
        return "" if self.command is None else f" (start {it} with {self.command})"


# By the setting that chose the backend (`DescribedBackend.parameter`).
_PLACES = {
    "serve": _Place("the env server child", "scores", "its"),
    "server_url": _Place("the env server", "scores", "its", "trio-tasksets serve"),
    "via": _Place("the workers", "score", "their", "trio-tasksets worker"),
}


def _refuse_remote_limits(model: ModelOptions, env: EnvOptions, backend: DescribedBackend) -> None:
    """What acts only where the slots run is refused when the backend runs them elsewhere:
    the model-call limits act in the process that makes the calls (`remote`); the reward and
    the per-rollout limits (`--rollout-timeout`, ...) only where the eval's own env runs the
    slots (`uses_env`: a spawned server, not a running one nor the workers); the endpoint
    flags are unused where the slots run with another model client (`uses_client`)."""
    if not backend.remote or backend.parameter not in _PLACES:
        return
    flag = PARAMETER_FLAGS[backend.parameter]
    place = _PLACES[backend.parameter]
    who, how = place.who, place.how
    limits = limit_flags(model)
    if len(model.endpoints.engine_metrics) > 1:
        limits.append("--engine-metrics (one per --base-url)")
    if limits:
        flags = ", ".join(limits)
        raise UsageError(
            f"{flags} with {flag}: the model calls are made by {who}, where this eval's "
            f"limits cannot act",
            fix=f"drop {flags}, or run in-process (without {flag})"
            if backend.uses_client
            else f"drop {flags} here and give them to {who} ({place.command})",
        )
    if not backend.uses_client:
        # The model is called with the place's own endpoint: this eval needs only the model's
        # name and sampling (which its entries declare).
        unused = model.given(("--base-url", "base_url"), ("--api-key-var", "api_key_var"),
                             ("--timeout", "timeout"), ("--max-model-retries", "max_retries"),
                             ("--echo-delay", "echo_delay"))  # fmt: skip
        if unused:  # said, not refused: commands written when --via required them still run
            flags = ", ".join(unused)
            warn(
                "eval",
                f"{flags} with {flag}: {who} call the model with their own, so this eval "
                f"does not use {'them' if len(unused) > 1 else 'it'} (drop {flags} here; give "
                f"{who} -m MODEL --base-url URL)",
            )
    if backend.uses_env:
        return
    if env.reward is not None:
        raise UsageError(
            f"--reward with {flag}: {who} {place.scores} the episodes, with {place.its} own "
            f"TASKSET's reward",
            fix="drop --reward here (or rescore the run: trio-tasksets rescore RUN_DIR "
            "--reward TARGET)",
        )
    for name in ("rollout_timeout", "working_limit", "stall_timeout"):
        if getattr(env.limits, name) is not None:
            limit = PARAMETER_FLAGS[name]
            raise UsageError(
                f"{limit} with {flag}: the episodes run in {who}, whose own {limit} bounds them",
                fix=f"drop {limit} here{how}",
            )


def program() -> list[str]:
    """How this process was started, as a user would type it again."""
    if Path(sys.argv[0]).name != "__main__.py":
        return [PROG]
    python = shutil.which("python")
    same = python is not None and os.path.realpath(python) == os.path.realpath(sys.executable)
    return ["python" if same else sys.executable, "-m", "trio_tasksets"]


@attrs.frozen
class EvalCommand:
    """What `trio-tasksets eval` runs, built from its command line and checked, with what
    its messages name (the model options, the token's variable, the words to resume it)."""

    env: Env[Any]
    ctx: ModelContext
    config: EvalConfig
    model: ModelOptions
    token_var: str | None  # `--token-var`: the variable holding a --server-url's token
    argv: tuple[str, ...]  # the command line as given, for the resume command
    debug: bool
    own_process: bool  # the CLI's own process: `settle_heap` may freeze its set-up


def eval_command(args: argparse.Namespace) -> EvalCommand:
    """The eval's objects from its command line; a bad value is a `UsageError` naming its
    flag (the only function of `eval` that reads `args`)."""
    slots = SlotOptions(
        serve=args.serve, workers=args.workers, server_url=args.server_url,
        token_var=args.token_var, via=args.via, stream=args.stream,
    )  # fmt: skip
    env_given = env_options(args, reward=args.reward)
    model = model_options(args)
    _refuse_idle_options(args.seed, args.shuffle, slots)
    check_retry_flags(env_given)
    backend = _backend(slots)
    _refuse_remote_limits(model, env_given, backend)
    env = build_env(env_given, endpoint=model.base_url is not None or slots.via is not None)
    # One endpoint's --engine-metrics moves this eval's -c window (EvalConfig.engine_metrics,
    # wherever the calls are made); many endpoints' each move their endpoint's own window,
    # in the process that makes the calls (the client's).
    metrics = engine_metrics_urls(model.endpoints)
    one_engine = len(metrics) == 1 and len(model.endpoints.base_urls) <= 1
    if metrics and not one_engine:
        check_engine_metrics(model, args.max_concurrent)
    ctx = model_context(
        model, remote=not backend.uses_client, engine_metrics_on_client=not one_engine
    )
    config = EvalConfig(
        num_examples=args.num_examples,
        rollouts_per_example=args.rollouts_per_example,
        max_concurrent=window_arg(args),
        shuffle=args.shuffle,
        seed=0 if args.seed is None else args.seed,
        resume=args.resume,
        output_dir=args.output_dir,
        run_name=args.run_name,
        dashboard=not args.no_dashboard,
        backend=backend,
        max_failures=args.max_failures,
        max_consecutive_failures=args.max_consecutive_failures,
        metrics_port=args.metrics_port,
        command=[*program(), *args.argv],
        api_key_var=api_key_var(model),
        time_limit=args.time_limit,
        engine_metrics=metrics[0] if one_engine else None,
        group=args.group,
        advantage=args.advantage,
    )
    return EvalCommand(
        env, ctx, config, model, slots.token_var, tuple(args.argv), debug=args.debug,
        own_process=args.tt_own_process,
    )  # fmt: skip


def _server_token(slots: SlotOptions) -> str | None:
    """A --server-url's bearer token, read here from $TT_SERVE_TOKEN or the variable
    --token-var names; it goes to the eval as the served backend's `token`."""
    if slots.server_url is None:
        return None
    var = slots.token_var or TOKEN_VAR
    token = os.environ.get(var, "").strip()
    if not token and slots.token_var is not None:
        raise UsageError(
            f"--token-var: environment variable {var} is not set",
            fix=f"export {var}=<the server's token>",
        )
    return token or None


def _name_the_run(env: Env[Any], ctx: ModelContext, config: EvalConfig) -> tuple[Path, list[Path]]:
    """Fix the run dir before the run (so that every way of ending can point at it): the
    run dir, and the directories made to claim a default name (`claim_run_dir`: evals
    started in the same second each get their own), which `run` takes back if the run
    keeps nothing. A `--resume` without `--run-name` says which run it picked."""
    preflight(env, ctx, config)
    run_dir = run_dir_for(env, ctx, config)
    claimed: list[Path] = []
    if config.resume and config.run_name is None:
        print(
            f"{PROG} eval: resuming {run_dir}, the latest run of taskset "
            f"{type(env.taskset).__name__} with model {ctx.model!r} in {config.output_dir}",
            file=sys.stderr,
        )
    elif config.run_name is None:
        run_dir, claimed = claim_run_dir(run_dir)
    config.run_name = run_dir.name
    return run_dir, claimed


def _release(claimed: list[Path]) -> None:
    """Take back the directories claimed for a run that kept nothing (only empty ones: a run
    that kept rows keeps its dir)."""
    for directory in claimed:
        try:
            directory.rmdir()
        except OSError:
            break


# --- what is printed --------------------------------------------------------------------------


def _excerpt(text: str, limit: int = 300) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _print_summary(summary: dict[str, Any], run_dir: Path) -> None:
    mean = summary["reward_mean"]
    usage = summary.get("usage") or {}
    finished, planned = summary["finished"], summary.get("planned")
    # A run stopped early says how much of its plan it did: "28/28 ok" alone reads as done.
    of = (
        f" ({finished} of {planned} planned)"
        if summary.get("interrupted") and isinstance(planned, int) and planned > finished
        else ""
    )
    where = (
        f"traces in {run_dir}/traces.jsonl"
        if (run_dir / "traces.jsonl").is_file()
        else "no run dir was kept"
    )
    counted = f" ({FAILED_COUNT_0})" if mean is not None and summary.get("failed") else ""
    print(
        f"{summary['ok']}/{finished} ok{of}, reward mean "
        f"{'-' if mean is None else f'{mean:.3f}'}{counted}, "
        f"{summary['rollouts_per_s']:.1f} rollouts/s, "
        f"{usage.get('prompt_tokens', 0)} tokens in / {usage.get('completion_tokens', 0)} out; "
        f"{where}"
    )
    metrics = metrics_text(_metric_figures(summary.get("metrics")))
    if metrics is not None:
        print(metrics)
    by_type = summary.get("errors_by_type") or {}
    first = summary.get("first_error")
    if by_type and first:
        counts = ", ".join(f"{name} {count}" for name, count in by_type.items())
        print(
            f"{sum(by_type.values())} failed: {counts}; first error: {first['type']}: "
            f"{_excerpt(first['message'])}"
        )


def _metric_figures(metrics: object) -> MetricFigures:
    """`summary.json`'s `metrics` as the dashboard's line takes them (mean, interval)."""
    found: MetricFigures = {}
    for name, figures in metrics.items() if isinstance(metrics, dict) else ():
        if isinstance(figures, dict) and isinstance(figures.get("mean"), int | float):
            ci = figures.get("ci")
            found[str(name)] = (float(figures["mean"]), (ci[0], ci[1]) if ci else None)
    return found


def print_summary(summary: dict[str, Any], run_dir: Path) -> None:
    """The one-line summary (the named metrics' line, the failures by type) of a run, as
    `eval` prints it."""
    _print_summary(summary, run_dir)


def _print_tracebacks(summary: dict[str, Any], run_dir: Path, *, debug: bool) -> None:
    """On stderr: the first error's traceback (the user's frames, when the error came from
    their code); with `--debug`, every failed attempt's that has one, from the rows."""
    if not debug:
        first = summary.get("first_error") or {}
        if first.get("traceback"):
            print(f"first error ({first['type']}), in your code:", file=sys.stderr)
            print(first["traceback"].rstrip(), file=sys.stderr)
        return
    try:
        lines = (run_dir / "traces.jsonl").read_text().splitlines()
    except OSError:
        return
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a torn last line
        for error in row.get("errors") or ():
            if isinstance(error, dict) and error.get("traceback"):
                key = row.get("task", {}).get("key")
                print(f"task {key!r}, rollout {row.get('rollout')}, attempt "
                      f"{error.get('attempt')}: {error['type']}", file=sys.stderr)  # fmt: skip
                print(str(error["traceback"]).rstrip(), file=sys.stderr)


def _fix_for(
    error_type: str, message: str, status: int | None, command: EvalCommand, run_dir: Path
) -> str | None:
    """What the user can do about an error, from its type and HTTP `status` (the endpoint's,
    or an env server's); where the rows are only when a run dir holds them."""
    model = command.model
    if error_type == "ModelHTTPError" and status in (401, 403):
        var = model.api_key_var or DEFAULT_API_KEY_VAR
        if api_key_var(model):
            return (
                f"the server refused the API key in ${var}: check it (or name another "
                "variable with --api-key-var)"
            )
        return (
            f"no API key was sent (${var} is not set): export {var}=... (or name the "
            "variable with --api-key-var)"
        )
    if error_type == "ModelHTTPError" and status == 400:
        context = _context_fix(message, model.max_tokens)
        if context is not None:
            return context
    if error_type == "ModelHTTPError" and status == 404:
        return _not_found_fix(model)
    if error_type == "ModelHTTPError" and status == 429 and over_whole_budget(message):
        return (
            "one call needs more tokens than the server's limit allows at all: a lower "
            "--max-tokens or shorter prompts, or a larger limit"
        )
    if error_type == "ModelHTTPError" and status == 429:
        return "the server is rate-limiting: lower -c/--max-concurrent, or add --retries K"
    if error_type == "ModelHTTPError" and status is not None and status >= 500:
        return "the model server failed: see its log (--retries K retries whole episodes)"
    if error_type == "ModelConnectionError":
        urls = " ".join(f"--base-url {url}" for url in model.endpoints.base_urls)
        return f"nothing answers at {urls}: start the server, or fix the URL"
    if error_type == "ModelTimeoutError":
        return "raise --timeout S, or lower -c/--max-concurrent"
    if error_type == "StalledError":
        return (
            "a rollout waited on something that never finished: see the row's messages; "
            "raise --stall-timeout S, or retry stalls with --retries K"
        )
    if error_type == "RolloutTimeoutError":
        return "raise --rollout-timeout S (or retry slow episodes with --retries K)"
    if error_type == "ModelResponseError":
        return "the endpoint does not answer as an OpenAI /chat/completions does: check --base-url"
    if error_type == "EnvServerError" and status == 401:
        var = command.token_var or TOKEN_VAR
        if os.environ.get(var):
            return (
                f"the env server refused the token in ${var}: check it (or name another "
                "variable with --token-var)"
            )
        return (
            f"the env server wants a bearer token: export {var}=<its token> (or name the "
            "variable with --token-var)"
        )
    if (run_dir / "traces.jsonl").is_file() and (_summary_on_disk(run_dir) or {}).get("failed"):
        return f"every failed row's errors are in {run_dir}/traces.jsonl"
    # No failed row was kept (a run that failed before its first one leaves no run dir).
    return debug_fix(message, debug=command.debug)


def _not_found_fix(model: ModelOptions) -> str:
    """The fix for a 404 of the model calls: the model's name when the server does not list
    it (with the names it lists), else the URL."""
    url_fix = (
        f"--base-url {model.base_url} (the URL stops before /chat/completions, e.g. "
        f"http://127.0.0.1:8000/v1)"
    )
    if model.base_url is None:
        return f"check -m/--model {model.name!r} and {url_fix}"
    offered = offered_models(model.base_url, api_key(model))
    if offered.names is None:
        return (
            f"check -m/--model {model.name!r} and {url_fix}; could not list the server's "
            f"models at {offered.url}: {offered.problem}"
        )
    if model.name in offered.names:
        return f"the server lists model {model.name!r}: check {url_fix}"
    if not offered.names:
        return f"check -m/--model {model.name!r}: {offered.url} lists no model"
    return (
        f"check -m/--model {model.name!r}: the server offers {offered.shown()} (e.g. -m "
        f"{shlex.quote(offered.closest(model.name) or '')})"
    )


def _status(exc: BaseException) -> int | None:
    """The HTTP status an error that ended the run carries (a model endpoint's or an env
    server's), if any."""
    return exc.status if isinstance(exc, ModelHTTPError | EnvServerError) else None


_CONTEXT = re.compile(r"maximum context length is (\d+)", re.IGNORECASE)
_PROMPT_TOKENS = re.compile(
    r"(\d+) in the messages|request has (\d+) input tokens|messages resulted in (\d+) tokens",
    re.IGNORECASE,
)
_REPLY_TOKENS = re.compile(r"(\d+) in the completion|too large: (\d+)", re.IGNORECASE)


def _first_number(pattern: re.Pattern[str], text: str) -> int | None:
    found = pattern.search(text)
    if found is None:
        return None
    return int(next(group for group in found.groups() if group is not None))


def _context_fix(message: str, max_tokens: int | None) -> str | None:
    """The fix for a 400 whose body says the request is longer than the model's context
    (vLLM's and OpenAI's wording): the prompt's own length, or `--max-tokens` on top of it.
    None for another 400."""
    context = _first_number(_CONTEXT, message)
    if context is None:
        return None
    prompt = _first_number(_PROMPT_TOKENS, message)
    reply = _first_number(_REPLY_TOKENS, message)
    if prompt is not None and prompt >= context:
        return (
            f"the prompt alone ({prompt} tokens) is longer than the server's context of "
            f"{context} tokens: shorten the prompts (or the system prompt), or serve the model "
            f"with a longer context (vLLM: --max-model-len)"
        )
    if max_tokens is not None and (reply is None or reply == max_tokens):
        room = f" (at most {context - prompt} for these prompts)" if prompt is not None else ""
        return (
            f"--max-tokens {max_tokens} plus the prompt is more than the server's context of "
            f"{context} tokens: lower --max-tokens{room}"
        )
    return (
        f"the prompt plus the reply are longer than the server's context of {context} tokens: "
        f"shorten the prompts, or set a lower --max-tokens"
    )


def _resume_lines(command: EvalCommand, run_dir: Path) -> tuple[str, ...]:
    if not run_dir.is_dir():
        return ("no episode had finished: no run dir was kept",)
    if command.env.taskset.streaming:
        return (
            f"finished episodes are in {run_dir}; a stream cannot be resumed: run again "
            f"(with another --run-name) to take more tasks",
        )
    return (
        f"finished episodes are in {run_dir}",
        f"resume: {shlex.join(resume_command(command.argv, run_dir.name))}",
    )


def resume_command(argv: Iterable[str], run_name: str) -> list[str]:
    """The command that resumes this run: the same words `argv` with `--run-name NAME
    --resume`."""
    words: list[str] = []
    skip = False
    for word in argv:
        if skip:
            skip = False
        elif word == "--run-name":
            skip = True
        elif not (word.startswith("--run-name=") or word == "--resume"):
            words.append(word)
    return [*program(), *words, "--run-name", run_name, "--resume"]


@contextmanager
def _warnings_as_lines() -> Iterator[None]:
    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        warn("eval", flag_message(message) if isinstance(message, Warning) else message)

    with warnings.catch_warnings():
        warnings.simplefilter("always", EvalWarning)
        warnings.showwarning = show
        yield


async def _eval(env: Env[Any], ctx: ModelContext, config: EvalConfig) -> EvalResult:
    try:
        return await run_eval(env, ctx, config, handle_signals=True)
    finally:
        with trio.CancelScope(shield=True):
            await ctx.client.aclose()


def _spell_limit(stopped: str, error: str) -> str:
    """A run's `error` as this command says it: a limit that stopped it is written as its
    parameter (``max_failures 2: ...``), here its flag (``--max-failures 2: ...``)."""
    flag = PARAMETER_FLAGS.get(stopped)
    if flag is None or not error.startswith(f"{stopped} "):
        return error
    return flag + error.removeprefix(stopped)


def _summary_on_disk(run_dir: Path) -> dict[str, Any] | None:
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def run(args: argparse.Namespace) -> int:
    """Run the eval the options describe; print the summary; the exit code (see `main`). An
    eval that plans no slot (`EmptyEvalError`) is a failure (exit 1) saying why."""
    command = eval_command(args)
    try:
        return _run(command)
    except EmptyEvalError as exc:
        raise CommandError(flag_message(exc), fix=exc.spelled_fix(PARAMETER_FLAGS)) from exc


def _run(command: EvalCommand) -> int:
    env, ctx, config = command.env, command.ctx, command.config
    run_dir, claimed = _name_the_run(env, ctx, config)
    try:
        return _run_named(command, run_dir)
    finally:
        _release(claimed)


def _run_named(command: EvalCommand, run_dir: Path) -> int:
    env, ctx, config = command.env, command.ctx, command.config
    settle_heap(command.own_process)  # the set-up is done: full collections no longer walk it
    try:
        with _warnings_as_lines():
            result = trio.run(_eval, env, ctx, config)
    except KeyboardInterrupt:  # a second Ctrl-C, during the drain
        summary = _summary_on_disk(run_dir)
        if summary is not None:
            _print_summary(summary, run_dir)
        print(f"{PROG} eval: interrupted", file=sys.stderr)
        for line in _resume_lines(command, run_dir):
            print(line, file=sys.stderr)
        return 130
    except (EvalConfigError, EmptyEvalError, CommandError):
        raise
    except Exception as exc:
        summary = _summary_on_disk(run_dir)
        if summary is not None:
            _print_summary(summary, run_dir)
        raise CommandError(
            f"{type(exc).__name__}: {exc}",
            fix=_fix_for(type(exc).__name__, str(exc), _status(exc), command, run_dir),
            details=_resume_lines(command, run_dir) if summary is not None else (),
        ) from exc
    summary = result.summary
    _print_summary(summary, run_dir)
    _print_tracebacks(summary, run_dir, debug=command.debug)
    stopped = summary["stopped"]
    first = summary.get("first_error") or {}
    fix = _fix_for(
        first.get("type", ""), first.get("message", ""), first.get("status"), command, run_dir
    )
    if stopped in EXIT_ON_SIGNAL:
        print(f"{PROG} eval: stopped by {stopped}", file=sys.stderr)
        for line in _resume_lines(command, run_dir):
            print(line, file=sys.stderr)
        return EXIT_ON_SIGNAL[stopped]
    if stopped == "time_limit":
        limit = config.time_limit
        print(
            f"{PROG} eval: stopped at --time-limit {limit:g}s: "
            f"{summary['finished']} of {summary['planned']} slots finished",
            file=sys.stderr,
        )
        for line in _resume_lines(command, run_dir):
            print(line, file=sys.stderr)
        if not summary["ok"]:
            raise CommandError(
                f"no episode succeeded within --time-limit {limit:g}s ({summary['failed']} failed)",
                fix="raise --time-limit, or lower the work (-n)",
            )
        return 0
    if stopped is not None:  # a limit (max_failures, ...), or a dead endpoint
        raise CommandError(
            _spell_limit(stopped, summary["error"]), fix=fix,
            details=_resume_lines(command, run_dir),
        )  # fmt: skip
    if summary["finished"] and not summary["ok"]:
        raise CommandError(f"no episode succeeded ({summary['failed']} failed)", fix=fix)
    return 0
