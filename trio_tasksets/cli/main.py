"""`trio-tasksets COMMAND ...`: the parser, and one way of ending for every command.

Exit codes: 0 done (failed episodes are data, not errors), 1 an error stopped the run,
2 a usage error (found before any task is pulled or file written; the command's usage and
one line naming the flag), 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from ..eval import EvalConfigError
from ..loading import TargetError
from . import eval as eval_command
from . import serve as serve_command
from . import worker as worker_command
from .options import UsageError

__all__ = ["main"]

PROG = "trio-tasksets"


def parser() -> argparse.ArgumentParser:
    """The whole command line: `eval`, `serve`, `worker`, `enqueue`."""
    top = argparse.ArgumentParser(
        prog=PROG, description="Streaming tasksets and a windowed runner on Trio."
    )
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    eval_command.add_parser(commands)
    serve_command.add_parser(commands)
    worker_command.add_parsers(commands)
    for sub in commands.choices.values():
        sub.set_defaults(tt_subparser=sub)  # a usage error prints the command's own usage
    return top


RUNNERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "eval": eval_command.run,
    "serve": serve_command.run,
    "worker": worker_command.run_worker_command,
    "enqueue": worker_command.run_enqueue,
}


def main(argv: Sequence[str] | None = None) -> int:
    top = parser()
    args = top.parse_args(argv)
    name = "" if args.command == "eval" else f" {args.command}"
    try:
        return RUNNERS[args.command](args)
    except (UsageError, TargetError, EvalConfigError) as exc:
        args.tt_subparser.print_usage(sys.stderr)
        print(f"{PROG}{name}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None  # as argparse ends on a usage error
    except KeyboardInterrupt:
        print(f"{PROG}{name}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        print(f"{PROG}{name}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
