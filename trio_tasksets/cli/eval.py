"""`trio-tasksets eval TASKSET`: the eval's command (exit codes: see `trio_tasksets.cli.main`)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import trio

from ..env import Env, RetryPolicy
from ..eval import EvalConfig, run_eval
from ..loading import resolve_target
from ..models import ModelContext
from ..serve.wire import TOKEN_VAR

if TYPE_CHECKING:
    from .options import Commands

from .options import UsageError, add_model_options, model_context, names


def add_parser(commands: Commands) -> argparse.ArgumentParser:
    """Add `eval` to the CLI's subcommands."""
    ev = commands.add_parser(
        "eval",
        help="evaluate a taskset against a model",
        description="Evaluate a taskset against a model; traces go to <output-dir>/<run-name>/.",
    )
    ev.add_argument(
        "taskset", metavar="TASKSET", help="echo, echo-stream, file.py:Class or pkg.mod:Class"
    )
    run = ev.add_argument_group("the run")
    run.add_argument(
        "-n",
        "--num-examples",
        type=int,
        default=None,
        metavar="N",
        help="take N tasks (required on a streaming or INFINITE taskset)",
    )
    run.add_argument("-r", "--rollouts-per-example", type=int, default=1, metavar="R")
    run.add_argument(
        "-c",
        "--max-concurrent",
        type=int,
        default=32,
        metavar="C",
        help="the window: most rollouts in flight (default 32)",
    )
    run.add_argument(
        "--shuffle", action="store_true", help="shuffle a static taskset (with --seed)"
    )
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--resume", action="store_true", help="finish a run dir's owed rollouts")
    run.add_argument("-o", "--output-dir", default="outputs", metavar="DIR")
    run.add_argument("--run-name", default=None, metavar="NAME")
    run.add_argument(
        "--retries", type=int, default=0, metavar="K", help="retry a failed episode up to K times"
    )
    run.add_argument(
        "--retry-on",
        default="",
        metavar="TYPES",
        help="comma-separated exception type names to retry (default: any)",
    )
    run.add_argument(
        "--no-retry-on",
        default="",
        metavar="TYPES",
        help="comma-separated exception type names never to retry",
    )
    run.add_argument("--no-dashboard", action="store_true", help="plain log lines, no live view")
    run.add_argument("--serve", action="store_true", help="run the env in a server process")
    run.add_argument("--workers", type=int, default=1, metavar="K", help="server processes")
    run.add_argument("--server-url", default=None, metavar="URL", help="use a running server")
    run.add_argument(
        "--via",
        default=None,
        metavar="URL",
        help="run the slots on `trio-tasksets worker`s through this Redis, e.g. "
        "redis://127.0.0.1:6379/0 (the eval enqueues and collects; -c spans all workers)",
    )
    run.add_argument(
        "--stream",
        default=None,
        metavar="S",
        help="with --via: the workers' task stream (default tasks)",
    )
    run.add_argument(
        "--token-var",
        default=None,
        metavar="NAME",
        help=f"with --server-url: the environment variable holding its token (default {TOKEN_VAR})",
    )
    model = add_model_options(ev)
    prompt = model.add_mutually_exclusive_group()
    prompt.add_argument("--system-prompt", default=None, metavar="TEXT")
    prompt.add_argument("--system-prompt-file", default=None, metavar="PATH")
    return ev


def _build(args: argparse.Namespace) -> tuple[Env[Any], ModelContext, EvalConfig]:
    cls, env_cls = resolve_target(args.taskset)
    system_prompt = args.system_prompt
    if args.system_prompt_file is not None:
        try:
            system_prompt = Path(args.system_prompt_file).read_text()
        except OSError as exc:
            raise UsageError(f"--system-prompt-file: cannot read it: {exc}") from exc
    config = cls._default_config()
    if system_prompt is not None:
        config = attrs.evolve(config, system_prompt=system_prompt)
    if args.retries < 0:
        raise UsageError(f"--retries must be >= 0, got {args.retries}")
    retries = RetryPolicy(args.retries, names(args.retry_on), names(args.no_retry_on))
    env: Env[Any] = (env_cls or Env)(cls(config), retries=retries)
    ctx = model_context(args)
    if args.token_var is not None:
        # The eval reads a --server-url's token from $TT_SERVE_TOKEN: point it at NAME.
        token = os.environ.get(args.token_var, "").strip()
        if not token:
            raise UsageError(f"--token-var: environment variable {args.token_var} is not set")
        os.environ[TOKEN_VAR] = token
    eval_config = EvalConfig(
        num_examples=args.num_examples,
        rollouts_per_example=args.rollouts_per_example,
        max_concurrent=args.max_concurrent,
        shuffle=args.shuffle,
        seed=args.seed,
        resume=args.resume,
        output_dir=args.output_dir,
        run_name=args.run_name,
        serve=args.serve,
        workers=args.workers,
        dashboard=not args.no_dashboard,
        server_url=args.server_url,
        via=args.via,
        stream=args.stream,
    )
    return env, ctx, eval_config


async def _eval(env: Env[Any], ctx: ModelContext, config: EvalConfig) -> dict[str, Any]:
    try:
        result = await run_eval(env, ctx, config)
    finally:
        with trio.CancelScope(shield=True):
            await ctx.client.aclose()
    return {"run_dir": str(result.run_dir), **result.summary}


def run(args: argparse.Namespace) -> int:
    """Run the eval the options describe; print the one-line summary."""
    env, ctx, config = _build(args)
    try:
        summary = trio.run(_eval, env, ctx, config)
    except KeyboardInterrupt:
        print("trio-tasksets: interrupted; finished episodes are on disk", file=sys.stderr)
        return 130
    mean = summary["reward_mean"]
    print(
        f"{summary['ok']}/{summary['finished']} ok, reward mean "
        f"{'-' if mean is None else f'{mean:.3f}'}, {summary['rollouts_per_s']:.1f} rollouts/s; "
        f"traces in {summary['run_dir']}/traces.jsonl"
    )
    return 0
