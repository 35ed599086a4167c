"""The command line: `trio-tasksets eval TASKSET [options]` (also `python -m trio_tasksets`).

Exit codes: 0 done (failed episodes are data), 1 an error stopped the run or no episode succeeded,
2 a usage error (found before any task is pulled or file written), 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import attrs
import trio

from .builtin import BUILTIN
from .distributed import COMMANDS as DISTRIBUTED_COMMANDS
from .distributed import add_commands as add_distributed_commands
from .distributed import run_command as run_distributed_command
from .env import Env, RetryPolicy
from .eval import EvalConfig, EvalConfigError, run_eval
from .models import ModelContext
from .options import UsageError, add_model_options, model_context
from .serve import TOKEN_VAR, ServeUsageError, add_serve_command, serve_main
from .tasksets import Taskset
from .wire import load_object

__all__ = ["main", "resolve_target", "resolve_taskset"]


def resolve_taskset(spec: str) -> type[Taskset[Any, Any]]:
    """A taskset class from a built-in id, `path/to/file.py:Class` or `package.module:Class`."""
    return resolve_target(spec)[0]


def resolve_target(spec: str) -> tuple[type[Taskset[Any, Any]], type[Env[Any]] | None]:
    """The taskset class TASKSET names, and the env class when it names an Env subclass with
    a `taskset_class` (e.g. a `tt.aio.BridgedEnv` around an asyncio env), else None.
    `vf:TASKSET_ID` names a verifiers v1 env (`trio_tasksets.aio_verifiers`)."""
    if spec.startswith("vf:"):
        from .aio_verifiers import VerifiersEnv, VerifiersTaskset

        return VerifiersTaskset, VerifiersEnv
    if spec in BUILTIN:
        return BUILTIN[spec], None
    if ":" not in spec:
        known = ", ".join(sorted(BUILTIN))
        raise UsageError(
            f"TASKSET {spec!r} is not a built-in id ({known}), nor path/to/file.py:Class, "
            f"nor package.module:Class"
        )
    where, _, name = spec.rpartition(":")
    if where.endswith(".py") and not Path(where).is_file():
        raise UsageError(f"TASKSET {spec!r}: no file {where}")
    try:
        cls = load_object(spec)
    except (ImportError, ValueError) as exc:
        raise UsageError(f"TASKSET {spec!r}: cannot load it: {exc}") from exc
    if isinstance(cls, type) and issubclass(cls, Env):
        taskset_cls = getattr(cls, "taskset_class", None)
        if isinstance(taskset_cls, type) and issubclass(taskset_cls, Taskset):
            return taskset_cls, cls
        raise UsageError(
            f"TASKSET {spec!r}: {name} is an Env class without a `taskset_class` (a Taskset "
            f"subclass) to build it around"
        )
    if not (isinstance(cls, type) and issubclass(cls, Taskset)):
        raise UsageError(f"TASKSET {spec!r}: {where} has no Taskset subclass named {name!r}")
    return cls, None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trio-tasksets", description="Streaming tasksets and a windowed runner on Trio."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
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
    run.add_argument(
        "--env-args",
        default=None,
        metavar="JSON",
        help="with vf:TASKSET_ID: verifiers' env config keys (agent, taskset, retries...)",
    )
    run.add_argument("--no-dashboard", action="store_true", help="plain log lines, no live view")
    run.add_argument("--serve", action="store_true", help="run the env in a server process")
    run.add_argument("--workers", type=int, default=1, metavar="K", help="server processes")
    run.add_argument("--server-url", default=None, metavar="URL", help="use a running server")
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
    add_serve_command(commands)
    add_distributed_commands(commands)
    return parser  # fmt: skip


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


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
    retries = RetryPolicy(args.retries, _names(args.retry_on), _names(args.no_retry_on))
    env: Env[Any]
    if args.taskset.startswith("vf:"):
        env = _verifiers_env(args, config.system_prompt, retries)
    elif args.env_args is not None:
        raise UsageError("--env-args applies to a verifiers env: TASKSET vf:TASKSET_ID")
    else:
        env = (env_cls or Env)(cls(config), retries=retries)
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
    )
    return env, ctx, eval_config


def _verifiers_env(
    args: argparse.Namespace, system_prompt: str | None, retries: RetryPolicy
) -> Env[Any]:
    """`vf:TASKSET_ID [--env-args JSON]`: a verifiers v1 env; its errors are usage errors."""
    from .aio_verifiers import VerifiersEnv, VerifiersTaskset, env_from_cli

    if args.base_url is None:
        raise UsageError(
            f"TASKSET {args.taskset}: verifiers' harness calls the model itself over HTTP: give "
            f"-m MODEL --base-url URL (an OpenAI-compatible endpoint)"
        )
    try:
        config = attrs.evolve(
            env_from_cli(args.taskset, args.env_args), system_prompt=system_prompt
        )
        return VerifiersEnv(VerifiersTaskset(config), retries=retries)
    except (ImportError, ValueError, TypeError) as exc:
        raise UsageError(f"TASKSET {args.taskset}: {type(exc).__name__}: {exc}") from exc


async def _eval(env: Env[Any], ctx: ModelContext, config: EvalConfig) -> dict[str, Any]:
    try:
        result = await run_eval(env, ctx, config)
    finally:
        with trio.CancelScope(shield=True):
            await ctx.client.aclose()
    errors = [e for episode in result.episodes for e in episode.errors]
    first = f"{errors[0].type}: {errors[0].message}" if errors else None
    return {"run_dir": str(result.run_dir), **result.summary, "first_error": first}


def _usage_exit(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    parser.print_usage(sys.stderr)
    print(f"trio-tasksets: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command in DISTRIBUTED_COMMANDS:
        return run_distributed_command(args, parser)
    if args.command == "serve":
        try:
            return serve_main(args)
        except (UsageError, ServeUsageError) as exc:
            _usage_exit(parser, str(exc))
    try:
        env, ctx, config = _build(args)
    except UsageError as exc:
        _usage_exit(parser, str(exc))
    try:
        summary = trio.run(_eval, env, ctx, config)
    except EvalConfigError as exc:
        _usage_exit(parser, str(exc))
    except KeyboardInterrupt:
        print("trio-tasksets: interrupted; finished episodes are on disk", file=sys.stderr)
        return 130
    except Exception as exc:
        print(f"trio-tasksets: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    mean = summary["reward_mean"]
    print(
        f"{summary['ok']}/{summary['finished']} ok, reward mean "
        f"{'-' if mean is None else f'{mean:.3f}'}, {summary['rollouts_per_s']:.1f} rollouts/s; "
        f"traces in {summary['run_dir']}/traces.jsonl"
    )
    if summary["finished"] and not summary["ok"]:
        # SPEC 4b: no episode succeeded is a failed run, never a quiet 0/N with exit 0.
        print(
            f"trio-tasksets: error: no episode succeeded; first error: {summary['first_error']}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
