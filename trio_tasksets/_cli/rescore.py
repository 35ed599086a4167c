"""`trio-tasksets rescore RUN_DIR --reward TARGET`: a run's rows scored again, into a new run dir."""

from __future__ import annotations

import argparse
import sys
from functools import partial
from typing import TYPE_CHECKING

import attrs
import trio

from .._core.adaptive import build_window
from .._core.window import Window
from .._env.env import Reward
from .._eval.rescore import rescore
from .env_options import load_reward
from .options import HelpFormatter, add_flags, add_output_options, add_reward_option

if TYPE_CHECKING:
    from .options import Commands


def add_parser(commands: Commands) -> argparse.ArgumentParser:
    """Add `rescore` to the CLI's subcommands."""
    parser = commands.add_parser(
        "rescore",
        help="score a run's rows again with another reward, without calling the model",
        description="Score each row of RUN_DIR that has a completion with --reward, into a new "
        "run dir (traces.jsonl, summary.json, config.json); the model is not called. A reward "
        "that raises on a row fails that row, as in an eval.",
        formatter_class=HelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="<output-dir>/<run-name>")
    add_reward_option(
        parser, required=True, help="the reward: file.py:function or package.module:function, "
        "(task, completion) -> a number or {'reward': ..., name: metric}",
    )  # fmt: skip
    add_output_options(
        parser, output_dir=None, output_help="where the new run dir goes (default: next to "
        "RUN_DIR)", run_name_help="the new run dir's name (default: <RUN_DIR's "
        "name>-rescored-<YYYYmmdd-HHMMSS>)",
    )  # fmt: skip
    add_flags(parser, {
        "-c --max-concurrent N": "rewards scored at once (an LLM judge is a reward too)",
    }, type=int, default=32)  # fmt: skip
    return parser


@attrs.frozen
class RescoreCommand:
    """What `trio-tasksets rescore` does, built from its command line and checked."""

    run_dir: str
    reward: Reward
    reward_name: str  # as given (--reward), recorded in config.json
    output_dir: str | None
    run_name: str | None
    window: Window  # rewards scored at once
    command: list[str]  # the command line, recorded in config.json


def rescore_command(args: argparse.Namespace) -> RescoreCommand:
    """The rescore's objects from its command line; a bad value is a `UsageError` naming its
    flag (the only function of `rescore` that reads `args`)."""
    from .eval import program

    window = build_window(args.max_concurrent, parameter="max_concurrent")  # a ConfigError
    reward = load_reward(args.reward)
    return RescoreCommand(
        run_dir=args.run_dir, reward=reward, reward_name=args.reward, output_dir=args.output_dir,
        run_name=args.run_name, window=window, command=[*program(), *args.argv],
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Rescore and print the new run dir with its one-line summary."""
    from .eval import print_summary

    command = rescore_command(args)
    result = trio.run(
        partial(
            rescore, command.run_dir, command.reward, reward_name=command.reward_name,
            output_dir=command.output_dir, run_name=command.run_name, window=command.window,
            command=command.command, keep_episodes=False,
        )
    )  # fmt: skip
    print_summary(result.summary, result.run_dir)
    if result.summary.get("skipped"):  # lines of the old traces that are not rows
        print(f"rescore: {result.summary['skipped']}", file=sys.stderr)
    print(
        f"rescored {command.run_dir} with {command.reward_name} into {result.run_dir}",
        file=sys.stderr,
    )
    return 0
