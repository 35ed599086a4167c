"""`trio-tasksets COMMAND ...`: the parser, and one way of ending for every command.

Every error is one line, `trio-tasksets COMMAND: error: MESSAGE` (and `; fix: ...` where
there is one), with the command's usage above it for a usage error; `--debug` adds the
traceback. Exit codes: 0 done, 1 a runtime failure (for `eval`: also no episode succeeded,
or `--max-failures` reached), 2 a usage error (found before any task is pulled or file
written), 130 SIGINT, 143 SIGTERM (`eval` drains on both first).
"""

from __future__ import annotations

import argparse
import difflib
import sys
import traceback
from collections.abc import Callable, Sequence

from .._core.datasets import DatasetError
from .._core.exceptions import ConfigError
from .._core.version import __version__
from .._transport import redact_url
from . import eval as eval_command
from . import report as report_command
from . import rescore as rescore_command
from . import serve as serve_command
from . import worker as worker_command
from .heap import OWN_PROCESS
from .options import PROG, CommandError, HelpFormatter, UsageError, debug_fix, flag_message

__all__ = ["main"]


def parser() -> argparse.ArgumentParser:
    """The whole command line: `eval`, `serve`, `worker`, `enqueue`, `report`, `rescore`."""
    top = argparse.ArgumentParser(
        prog=PROG,
        description="Streaming tasksets and a windowed runner on Trio.",
        formatter_class=HelpFormatter,
    )
    top.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    # What `main` sets after parsing (the words, whose process this is), for a parse without
    # it; and the parser whose usage an error shows (each command's own, set below).
    top.set_defaults(argv=[], tt_subparser=top, **{OWN_PROCESS: False})
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    eval_command.add_parser(commands)
    serve_command.add_parser(commands)
    worker_command.add_parsers(commands)
    report_command.add_parser(commands)
    rescore_command.add_parser(commands)
    for sub in commands.choices.values():
        sub.formatter_class = HelpFormatter
        sub.add_argument("--debug", action="store_true", help="show the traceback of an error")
        sub.set_defaults(tt_subparser=sub)  # a usage error prints the command's own usage
    return top


RUNNERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "eval": eval_command.run,
    "serve": serve_command.run,
    "worker": worker_command.run_worker_command,
    "enqueue": worker_command.run_enqueue,
    "report": report_command.run,
    "rescore": rescore_command.run,
}


# The data file's settings that a `DatasetError` may name, as the command line spells them.
DATA_FLAGS = {"prompt_field": "--prompt-field NAME", "answer_field": "--answer-field NAME"}


def _data_fix(error: CommandError) -> None:
    """A command that failed on a data file's record that names the setting to fix (a
    `DatasetError` with its `parameter`) gets that setting's flag as its fix."""
    cause = error.__cause__
    if isinstance(cause, DatasetError) and cause.parameter in DATA_FLAGS:
        error.fix = f"give {DATA_FLAGS[cause.parameter]}"


def _traceback(debug: bool, exc: BaseException) -> None:
    if debug:
        traceback.print_exception(exc, file=sys.stderr)


INSPECT, VF_EVAL, VF_V1 = "inspect eval's", "vf-eval's", "verifiers' eval command's"

SAVED = "every run is saved here, to -o/--output-dir DIR/<run-name>/traces.jsonl: drop it"
SCORED_ALONE = (
    "each rollout is scored alone by default here, and --group scores a task's -r rollouts together"
)

# Flags of inspect_ai's `inspect eval`, verifiers' `vf-eval` and verifiers' newer `eval`
# that this tool spells otherwise: (whose, this tool's spelling or None, a note). Checked
# against their own sources (inspect_ai `_cli/eval.py`; verifiers `scripts/eval.py`,
# `v1/configs/cli/eval.py`). A hint names a flag of ours only where the command has it.
# Spelt alike and meant alike, so taken as they are: -n/--num-examples, -r, -c/
# --max-concurrent, -m/--model, --max-tokens, --temperature, --top-p, --max-connections,
# -S/--sampling-args, --api-key-var, -o/--output-dir, --shuffle, --resume. Spelt alike but
# meant otherwise: inspect's --seed (the model's: --sampling-seed here; the usage error of a
# --seed without --shuffle says so), inspect's --time-limit (one sample's: --rollout-timeout
# here), vf-eval's --timeout (one rollout's: --rollout-timeout here) and --env-args (its
# env's arguments: a taskset's own are -a here; --env-args without vf: says so).
# duplicates: a table of other tools' flags: its rows are alike by design
FOREIGN_FLAGS: dict[str, tuple[str, str | None, str]] = {
    "--limit": (INSPECT, "-n/--num-examples N", "the first N tasks, no M-N range"),
    "--epochs": (INSPECT, "-r/--rollouts-per-example R", "each rollout is a row of its own"),
    "--max-samples": (INSPECT, "-c/--max-concurrent N", "the rollouts in flight"),
    "--max-tasks": (INSPECT, None, "one eval runs one taskset here: start an eval per taskset, "
                    "evals started at once each get their own run dir"),
    "--model-base-url": (INSPECT, "--base-url URL", ""),
    "--log-dir": (INSPECT, "-o/--output-dir DIR", "the run dir is DIR/<run-name>/"),
    "--fail-on-error": (INSPECT, "--max-failures N|FRACTION", ""),
    "--retry-on-error": (INSPECT, "--retries K", "whole episodes"),
    "--sample-shuffle": (INSPECT, "--shuffle", "with --seed S"),
    "--display": (INSPECT, "--no-dashboard", "plain log lines"),
    "--system-message": (INSPECT, "--system-prompt TEXT", ""),
    "--max-retries": ("inspect eval's and vf-eval's", None, "a model call is retried on 429, "
                      "5xx and timeouts without a flag here, and --retries K retries whole "
                      "episodes"),
    "-T": ("vf-eval's and inspect eval's", None, "vf-eval's temperature is --temperature T "
           "here, inspect eval's task arguments are -a/--taskset-args JSON"),
    "--temp": ("", "--temperature T", ""),
    "--rollouts": (VF_EVAL, "-r/--rollouts-per-example R", ""),
    "--max-concurrent-requests": (VF_EVAL, "-c/--max-concurrent N", ""),
    "--api-base-url": (VF_EVAL, "--base-url URL", ""),
    "-b": (VF_EVAL, "--base-url URL", ""),
    "-k": (VF_EVAL, "--api-key-var VAR", ""),
    "-t": (VF_EVAL, "--max-tokens N", ""),
    "--save-dataset": (VF_EVAL, None, SAVED),
    "--save-results": (VF_EVAL, None, SAVED),
    "-s": (VF_EVAL, None, SAVED),
    "--save-path": (VF_EVAL, "-o/--output-dir DIR", ""),
    "--shuffle-seed": (VF_EVAL, "--seed S", "with --shuffle"),
    "-R": (VF_EVAL, "--resume", ""),
    "--independent-scoring": (VF_EVAL, None, SCORED_ALONE),
    "-i": (VF_EVAL, None, SCORED_ALONE),
    "--num-tasks": (VF_V1, "-n/--num-examples N", ""),
    "--num-rollouts": (VF_V1, "-r/--rollouts-per-example R", ""),
    "--group-size": (VF_V1, "-r/--rollouts-per-example R", "with --group to score them together"),
    "--client.base-url": (VF_V1, "--base-url URL", ""),
    "--client.api-key-var": (VF_V1, "--api-key-var VAR", ""),
    "--sampling.temperature": (VF_V1, "--temperature T", ""),
    "--sampling.max-tokens": (VF_V1, "--max-tokens N", ""),
    "--sampling.top-p": (VF_V1, "--top-p P", ""),
    "--run.name": (VF_V1, "--run-name NAME", ""),
    "--env.": (VF_V1, "--env-args JSON", "verifiers' env config as one JSON object, with "
               "TASKSET vf:ID"),
}  # fmt: skip


def foreign_hint(word: str, known: set[str]) -> str | None:
    """What to say about `word`, a flag this command does not take, when inspect eval or
    vf-eval spells one of ours that way (None: it is no flag of theirs we know, or ours is
    not a flag of this command)."""
    name = word.partition("=")[0]
    if name.startswith("--"):
        name = name.replace("_", "-")
    key = "--env." if name.startswith("--env.") else name
    if key not in FOREIGN_FLAGS:
        return None
    whose, ours, note = FOREIGN_FLAGS[key]
    said = f"{whose} {name}" if whose and key != "-T" else name
    if ours is None:
        return f"{said}: {note}"
    if not known.intersection(ours.split()[0].split("/")):
        return None
    return f"{said}: this tool spells it {ours}" + (f", {note}" if note else "")


def _parse(words: list[str]) -> argparse.Namespace:
    """The parsed command line; an unknown option is refused by its command's parser (its
    usage, exit 2) naming the option it is closest to (`--num-example` -> `--num-examples`),
    or how this tool spells a flag of inspect eval or vf-eval (`FOREIGN_FLAGS`): the
    commands do not take abbreviations, so that a resume command stays exact."""
    top = parser()
    args, extras = top.parse_known_args(words)
    if extras:
        sub: argparse.ArgumentParser = args.tt_subparser
        known = {flag for action in sub._actions for flag in action.option_strings}
        hints: list[str] = []
        for word in extras:
            if not word.startswith("-"):
                continue
            hint = foreign_hint(word, known)
            if hint is None:
                name = word.partition("=")[0]
                close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
                hint = f"did you mean {close[0]}?" if close else None
            if hint is not None:
                hints.append(hint)
        said = f" ({'; '.join(hints)})" if hints else ""
        sub.error(f"unrecognized arguments: {' '.join(extras)}{said}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command `argv` names (default: this process's arguments) and return its exit
    code. Each command turns its arguments into the library's objects first (its
    ``*_command(args)`` function); a bad one ends it with its usage and the error line (exit
    2, as argparse does: a `SystemExit`), any other failure with the error line (exit 1)."""
    words = list(sys.argv[1:] if argv is None else argv)
    args = _parse(words)
    args.argv = words
    setattr(args, OWN_PROCESS, argv is None)  # the console script's process: settle_heap
    command: str = args.command
    debug: bool = args.debug  # every command has --debug
    try:
        return RUNNERS[command](args)
    except (UsageError, ConfigError) as exc:  # a TASKSET that does not resolve is one too
        _traceback(debug, exc)
        args.tt_subparser.print_usage(sys.stderr)
        error = exc if isinstance(exc, UsageError) else UsageError(flag_message(exc))
        print(error.line(command), file=sys.stderr)
        raise SystemExit(2) from None  # as argparse ends on a usage error
    except CommandError as exc:
        _traceback(debug, exc)
        _data_fix(exc)
        print(exc.line(command), file=sys.stderr)
        for line in exc.details:
            print(redact_url(line), file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{PROG} {command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        _traceback(debug, exc)
        message = f"{type(exc).__name__}: {exc}"
        print(CommandError(message, fix=debug_fix(message, debug=debug)).line(command),
              file=sys.stderr)  # fmt: skip
        return 1


if __name__ == "__main__":
    sys.exit(main())
