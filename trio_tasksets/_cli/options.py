"""What the commands share: their errors and help format, small argparse types, the option
groups several commands take, and how the library's parameters are spelled as flags
(`PARAMETER_FLAGS`). The env options are `env_options`, the model options `model_options`.

Each command turns its arguments into the library's objects at its edge: its
`*_command(args)` reads them once (the shared groups through `env_options(args)`,
`model_options(args)`, ...: frozen objects) and nothing below sees the `Namespace`.

`add_flags` declares the options of a group that differ only in name and help;
`add_window_option` (`-c/--max-concurrent N|MIN-START-MAX`), `add_time_limit_option`
(`--time-limit S`), `add_metrics_option`, `add_reward_option` and `add_output_options` are
the groups several commands share. Each builder checks its values and raises `UsageError`
naming the flag and the fix; a value argparse cannot parse is refused by argparse, naming
the flag.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .._core.adaptive import AdaptiveBounds, WindowArgumentError, check_objective, parse_window
from .._core.exceptions import ConfigError, EmptyEvalError, EvalWarning, TrioTasksetsError
from .._transport import redact_url

__all__ = [
    "DEFAULT_API_KEY_VAR",
    "PARAMETER_FLAGS",
    "PROG",
    "TASKSET_HELP",
    "CommandError",
    "HelpFormatter",
    "UsageError",
    "add_flags",
    "add_metrics_option",
    "add_output_options",
    "add_reward_option",
    "add_time_limit_option",
    "add_window_option",
    "debug_fix",
    "flag_message",
    "json_object",
    "names",
    "objective_option",
    "per_minute",
    "seconds",
    "warn",
    "window_arg",
    "window_option",
]

if TYPE_CHECKING:
    Commands = argparse._SubParsersAction[argparse.ArgumentParser]  # the subcommands of `main`

PROG = "trio-tasksets"
DEFAULT_API_KEY_VAR = "OPENAI_API_KEY"
TASKSET_HELP = (
    "echo, echo-stream, path/to/file.py:Class, package.module:Class, a data file (data.jsonl, "
    "data.csv, hf:NAME[:SPLIT]) or vf:TASKSET_ID"
)


# --- errors and help ------------------------------------------------------------------------


class CommandError(TrioTasksetsError):
    """A failure the user can act on, shown as one line (exit 1):
    ``trio-tasksets COMMAND: error: MESSAGE; fix: FIX``, then any `details` lines."""

    exit_code = 1

    def __init__(
        self, message: str, *, fix: str | None = None, details: tuple[str, ...] = ()
    ) -> None:
        super().__init__(message)
        self.fix = fix
        self.details = details

    def line(self, command: str) -> str:
        """The error line (a URL's password in it redacted, `redact_url`)."""
        text = f"{PROG} {command}: error: {self}"
        return redact_url(f"{text}; fix: {self.fix}" if self.fix else text)


class UsageError(CommandError):
    """A bad command line, found before any work: the command's usage, then the line (exit 2)."""

    exit_code = 2


# A message that gives its own fix: a clause that starts with what to do (the library's
# messages say "...: give them a with_system_prompt(text) method", "...; install it with ...").
_GIVES_FIX = re.compile(
    r"(?:[;:]|, or) (?:add|call|check|choose|create|define|drop|export|fix|give|install|leave"
    r"|lower|name|pass|raise|remove|rename|run|serve|set|shorten|start|use|wrap)\b"
)


def debug_fix(message: str, *, debug: bool) -> str | None:
    """The fix of an error nothing else fixes: "run again with --debug for the traceback",
    unless --debug is given already or `message` gives a fix of its own (then it is the
    fix: a second one would only send the user away from it)."""
    if debug or _GIVES_FIX.search(message):
        return None
    return "run again with --debug for the traceback"


# The library's parameter names, as the command line spells them: a ConfigError names its
# parameters, and the CLI shows their flags instead.
PARAMETER_FLAGS = {
    "num_examples": "-n/--num-examples",
    "rollouts_per_example": "-r/--rollouts-per-example",
    "max_concurrent": "-c/--max-concurrent",
    "output_dir": "-o/--output-dir",
    "run_name": "--run-name",
    "time_limit": "--time-limit",
    "max_failures": "--max-failures",
    "rollout_timeout": "--rollout-timeout",
    "working_limit": "--working-limit",
    "stall_timeout": "--stall-timeout",
    "max_consecutive_failures": "--max-consecutive-failures",
    "metrics_port": "--metrics-port",
    "engine_metrics": "--engine-metrics",
    "serve": "--serve",
    "workers": "--workers",
    "server_url": "--server-url",
    "via": "--via",
    "stream": "--stream",
    "shuffle": "--shuffle",
    "resume": "--resume",
    "config": "-a/--taskset-args",
    "env_class": "--env-class",
    "reward": "--reward",
    "group": "--group",
    "advantage": "--advantage",
    "retries": "--retries",
    "env_args": "--env-args",
    "sandbox": "--sandbox",
    "max_sandboxes": "--max-sandboxes",
}


def flag_message(error: BaseException | Warning) -> str:
    """A library error's (or warning's) message as the command line says it: a
    `ConfigError` (an `EvalWarning`) with each parameter it names (``num_examples``) spelled
    as its flag (``-n/--num-examples``)."""
    if isinstance(error, ConfigError | EmptyEvalError | EvalWarning):
        return error.spelled(PARAMETER_FLAGS)
    return str(error)


def warn(command: str, message: str) -> None:
    """One warning line on stderr, in the style of the error lines."""
    print(redact_url(f"{PROG} {command}: warning: {message}"), file=sys.stderr)


class HelpFormatter(argparse.HelpFormatter):
    """`--help` shows every option's default: `(default: X)` is added to an option whose
    default is a value, unless its help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            "default" in text
            or not action.option_strings
            or action.required
            or any(action.default is nothing for nothing in (None, False, argparse.SUPPRESS))
        ):
            return text
        return f"{text} (default: %(default)s)"


def names(text: str) -> tuple[str, ...]:
    """The comma-separated names of an option such as `--retry-on A,B`."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def json_object(
    text: str, flag: str, *, quoted: str, example: str, what: str = "a JSON object"
) -> dict[str, Any]:
    """A flag's JSON value (`-a`, `-S`) as a dict: a `UsageError` naming `flag` if it is not
    JSON (fix: `quoted`, the value quoted for a shell) or not `what` (fix: `example`)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"{flag} is not JSON ({exc})", fix=f"quote it: {quoted}") from None
    if not isinstance(value, dict):
        raise UsageError(f"{flag} must be {what}, got {text!r}", fix=example)
    return value


# --- argparse types (argparse names the flag: "argument --rpm: must be ...") ------------------


def window_option(text: str) -> int | AdaptiveBounds:
    """`N` or `MIN-START-MAX` (`-c/--max-concurrent`, `--max-connections`): `parse_window`,
    whose message argparse shows after the flag it names."""
    try:
        return parse_window(text, parameter="value")
    except WindowArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("value: ")) from None


def _positive(text: str, unit: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {unit} (a number > 0), got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number of {unit} > 0, got {text!r}")
    return value


def seconds(text: str) -> float:
    """A duration in seconds, > 0 (`--rollout-timeout`, `--time-limit`)."""
    return _positive(text, "seconds")


def per_minute(text: str) -> float:
    return _positive(text, "units per minute")


def add_flags(
    group: argparse._ActionsContainer, options: Mapping[str, str], **settings: Any
) -> None:
    """Add each of `options`, written as its usage (``"-o --output-dir DIR"``: its flags, then
    its metavar when it takes a value) with its help; each takes the same argparse `settings`
    (`type`, `default`, `action`): the options of a group that differ only in name and help."""
    for usage, text in options.items():
        words = usage.split()
        flags = [word for word in words if word.startswith("-")]
        metavar: dict[str, Any] = {} if words[-1].startswith("-") else {"metavar": words[-1]}
        group.add_argument(*flags, help=text, **settings, **metavar)


def add_window_option(group: argparse._ActionsContainer, *, help: str) -> None:
    """`-c/--max-concurrent N|MIN-START-MAX` (default 32): an int or `AdaptiveBounds`; and
    `--window-objective knee|throughput|p99=SECONDS` (read together by `window_arg`)."""
    group.add_argument(
        "-c", "--max-concurrent", type=window_option, default=32, metavar="N|MIN-START-MAX",
        help=f"{help}; MIN-START-MAX (e.g. 1-8-512) adapts it to what the endpoint does: "
        "a request-rate limit's 429s pace the calls, a concurrency limit's cap the window, "
        "and against an engine that queues it settles per --window-objective",
    )  # fmt: skip
    group.add_argument(
        "--window-objective", type=objective_option, default=None,
        metavar="knee|throughput|p99=SECONDS",
        help="what an adaptive -c serves: knee (the default: the most throughput at the "
        "least queueing), throughput (grow while throughput still rises at all), or "
        "p99=SECONDS (the most throughput whose p99 latency stays under SECONDS)",
    )  # fmt: skip


def objective_option(text: str) -> str:
    """`--window-objective`: `check_objective`, whose message argparse shows after the flag."""
    try:
        return check_objective(text, parameter="value")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("value: ")) from None


def window_arg(args: argparse.Namespace) -> int | AdaptiveBounds:
    """`-c` with `--window-objective` in it. Raises `UsageError` for an objective given with a
    fixed `-c N` (nothing to adapt)."""
    window, objective = args.max_concurrent, args.window_objective
    if objective is None:
        return window  # type: ignore[no-any-return]
    if not isinstance(window, AdaptiveBounds):
        raise UsageError(
            f"--window-objective {objective} moves an adaptive window, but -c/--max-concurrent "
            f"{window} is fixed: give -c MIN-START-MAX (e.g. -c 1-8-512)"
        )
    return window._replace(objective=objective)


def add_metrics_option(parser: argparse._ActionsContainer) -> None:
    """`--metrics-port N` (eval, worker, serve): Prometheus text at 127.0.0.1:N/metrics."""
    add_flags(parser, {
        "--metrics-port N": "serve the run's counters and health (scheduler lag, in flight, "
        "waits) as Prometheus text at http://127.0.0.1:N/metrics while it runs; 0 picks a free "
        "port (printed) (default: none; needs the metrics extra)",
    }, type=int)  # fmt: skip


def add_time_limit_option(group: argparse._ActionsContainer, *, what: str) -> None:
    """`--time-limit S` (default: none)."""
    add_flags(group, {"--time-limit S": f"after S seconds, {what} (default: no limit)"},
              type=seconds)  # fmt: skip


def add_reward_option(
    group: argparse._ActionsContainer, *, help: str, required: bool = False
) -> None:
    """`--reward TARGET` (eval, serve, rescore): a reward function, file.py:function or
    pkg.mod:function."""
    group.add_argument("--reward", required=required, metavar="TARGET", help=help)


def add_output_options(
    group: argparse._ActionsContainer, *, output_dir: str | None, output_help: str,
    run_name_help: str,
) -> None:  # fmt: skip
    """`-o/--output-dir DIR` (default `output_dir`) and `--run-name NAME` (eval, rescore):
    where the run dir goes, and its name."""
    add_flags(group, {"-o --output-dir DIR": output_help}, default=output_dir)
    add_flags(group, {"--run-name NAME": run_name_help})
