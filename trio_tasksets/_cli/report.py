"""`trio-tasksets report RUN_DIR [RUN_DIR ...] [-o FILE]`: a run dir as one HTML page."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from .._report import ReportError, report
from .options import UsageError

if TYPE_CHECKING:
    from .options import Commands


def add_parser(commands: Commands) -> argparse.ArgumentParser:
    """Add `report` to the CLI's subcommands."""
    parser = commands.add_parser(
        "report",
        help="write a run dir's HTML report",
        description=(
            "Write one self-contained HTML report (no network needed to view it) of a run "
            "dir, or of several side by side. It reads a run still being written."
        ),
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="<output-dir>/<run-name>")
    parser.add_argument(
        "-o",
        "--output",
        default=None,
        metavar="FILE",
        help="where to write it (default RUN_DIR/report.html; several runs: the first "
        "RUN_DIR/compare.html)",
    )
    return parser


# The report's parameters, as this command spells them.
FLAGS = {"run_dirs": "RUN_DIR", "output": "-o/--output"}


def run(args: argparse.Namespace) -> int:
    """Write the page and print its path; a missing or unreadable run dir is a usage error."""
    run_dirs: list[str] = args.run_dirs
    output: str | None = args.output
    try:
        print(report(run_dirs, output))
    except ReportError as exc:
        fix = None if exc.parameter == "output" else "pass a run dir, <output-dir>/<run-name>"
        raise UsageError(exc.spelled(FLAGS), fix=fix) from None
    return 0
