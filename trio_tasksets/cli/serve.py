"""`trio-tasksets serve TASKSET`: the env server's command."""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from typing import TYPE_CHECKING

import trio

from ..envspec import EnvSpec
from ..serve.app import ServerApp
from ..serve.process import bind_socket, is_loopback, serve_worker, supervise, url_of
from ..serve.wire import MAX_BODY_BYTES, READY_PREFIX

if TYPE_CHECKING:
    from .options import Commands

from .options import CommandError, HelpFormatter, UsageError, add_env_options, build_env, env_spec


def add_parser(commands: Commands) -> argparse.ArgumentParser:
    """Add `serve` to the CLI's subcommands."""
    sv: argparse.ArgumentParser = commands.add_parser(
        "serve",
        help="serve a taskset's env over HTTP (for --server-url or remote use)",
        description="Run a taskset's env behind HTTP: GET /health and POST /run (docs/serve.md).",
        formatter_class=HelpFormatter,
    )
    env = add_env_options(sv)
    sv.add_argument(
        "--host",
        default="127.0.0.1",
        help="bind address (default 127.0.0.1; any non-loopback address needs --token-var)",
    )
    sv.add_argument(
        "--port",
        type=int,
        default=8000,
        help=f"port (0: the OS picks one; the '{READY_PREFIX}URL' line on stdout tells it)",
    )
    sv.add_argument("--workers", type=int, default=1, metavar="K", help="worker processes")
    sv.add_argument(
        "--token-var",
        default=None,
        metavar="NAME",
        help="environment variable holding the bearer token every request must carry "
        "(default: none: no token, loopback only)",
    )
    sv.add_argument(
        "--max-body-bytes",
        type=int,
        default=MAX_BODY_BYTES,
        metavar="N",
        help="larger request bodies get 413 (default 1 MiB)",
    )
    env.add_argument(
        "--reward", default=None, metavar="SPEC",
        help="a reward function (default: the taskset's, else answer match)",
    )  # fmt: skip
    env.add_argument(
        "--retry-backoff", type=float, default=0.5, metavar="S", help="first retry's backoff cap"
    )
    env.add_argument(
        "--retry-max-backoff", type=float, default=30.0, metavar="S", help="largest backoff"
    )
    sv.add_argument(
        "--die-with-parent",
        action="store_true",
        help="exit when stdin reaches EOF (the spawning parent's death pipe)",
    )
    sv.add_argument("--listen-fd", type=int, default=None, help=argparse.SUPPRESS)
    return sv


def _token(args: argparse.Namespace) -> str | None:
    if args.token_var is None:
        if not is_loopback(args.host):
            raise UsageError(
                f"--host {args.host} is not a loopback address: name the environment variable "
                f"holding a bearer token with --token-var NAME (or bind 127.0.0.1)"
            )
        return None
    token = os.environ.get(args.token_var, "").strip()
    if not token:
        raise UsageError(
            f"--token-var: environment variable {args.token_var} is not set",
            fix=f"export {args.token_var}=<a long random token>",
        )
    return token


def _check_args(args: argparse.Namespace) -> None:
    if args.workers < 1:
        raise UsageError(f"--workers must be >= 1, got {args.workers}")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in 0..65535, got {args.port}")
    if args.max_body_bytes < 1:
        raise UsageError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")


def _worker_cmd(args: argparse.Namespace, spec: EnvSpec) -> list[str]:
    cmd = [sys.executable, "-m", "trio_tasksets", "serve", *spec.argv(),
           "--workers", str(args.workers), "--max-body-bytes", str(args.max_body_bytes),
           "--die-with-parent"]  # fmt: skip
    return [*cmd, "--token-var", args.token_var] if args.token_var else cmd


def run(args: argparse.Namespace) -> int:
    """`trio-tasksets serve`: exit 0 when stopped by a signal, 1 on an error; a bad command
    line raises `UsageError` (exit 2)."""
    _check_args(args)
    token = _token(args)
    spec = env_spec(args)
    env = build_env(args, check_retry_names=not args.die_with_parent)
    if args.listen_fd is not None:  # a worker of a pool
        app = ServerApp(env, token=token, max_body=args.max_body_bytes, workers=args.workers)
        worker = partial(serve_worker, url=None, die_with_parent=args.die_with_parent)
        trio.run(worker, app, args.listen_fd)
        return 0
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        raise CommandError(
            f"cannot listen on {args.host}:{args.port}: {exc.strerror}",
            fix="choose another --port (0: any free one)",
        ) from exc
    url = url_of(args.host, sock.getsockname()[1])
    if args.workers > 1:
        with sock:
            cmd = _worker_cmd(args, spec)
            return trio.run(supervise, cmd, sock, args.workers, url, args.die_with_parent)
    app = ServerApp(env, token=token, max_body=args.max_body_bytes)
    trio.run(
        partial(serve_worker, url=url, die_with_parent=args.die_with_parent), app, sock.detach()
    )
    return 0
