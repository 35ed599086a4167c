"""`trio-tasksets rescore RUN_DIR --reward TARGET`: a run's rows scored again, into a new run dir."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

import trio

from .._eval.rescore import rescore
from .env_options import load_reward
from .options import HelpFormatter

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
    parser.add_argument(
        "--reward", required=True, metavar="TARGET",
        help="the reward: file.py:function or package.module:function, (task, completion) -> "
        "a number or {'reward': ..., name: metric}",
    )  # fmt: skip
    parser.add_argument(
        "-o", "--output-dir", default=None, metavar="DIR",
        help="where the new run dir goes (default: next to RUN_DIR)",
    )  # fmt: skip
    parser.add_argument(
        "--run-name", default=None, metavar="NAME",
        help="the new run dir's name (default: <RUN_DIR's name>-rescored-<YYYYmmdd-HHMMSS>)",
    )  # fmt: skip
    parser.add_argument(
        "-c", "--max-concurrent", type=int, default=32, metavar="N",
        help="rewards scored at once (an LLM judge is a reward too)",
    )  # fmt: skip
    return parser


def run(args: argparse.Namespace) -> int:
    """Rescore and print the new run dir with its one-line summary."""
    from .eval import print_summary, program

    reward = load_reward(args.reward)
    result: Any = trio.run(
        lambda: rescore(
            args.run_dir, reward, reward_name=args.reward, output_dir=args.output_dir,
            run_name=args.run_name, window=args.max_concurrent,
            command=[*program(), *getattr(args, "argv", [])],
        )
    )  # fmt: skip
    print_summary(result.summary, result.run_dir)
    print(f"rescored {args.run_dir} with {args.reward} into {result.run_dir}", file=sys.stderr)
    return 0
