"""`trio-tasksets serve TASKSET`: the env server's command."""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from typing import TYPE_CHECKING

import trio

from .._env.spec import EnvSpec
from .._serve.app import ServerApp
from .._serve.policy import MAX_MODEL_RETRIES, MIN_MODEL_BACKOFF, Access, Limits, ModelPolicy
from .._serve.process import bind_socket, is_loopback, serve_worker, supervise, url_of
from .._serve.wire import MAX_BODY_BYTES, READY_PREFIX

if TYPE_CHECKING:
    from .options import Commands

from .env_options import add_env_options, build_env, env_spec
from .heap import settle_heap
from .model_options import add_endpoint_options, base_urls, engine_metrics_urls
from .options import CommandError, HelpFormatter, UsageError, add_metrics_option, flag_message

DEFAULTS = Limits()


def add_parser(commands: Commands) -> argparse.ArgumentParser:
    """Add `serve` to the CLI's subcommands."""
    sv: argparse.ArgumentParser = commands.add_parser(
        "serve",
        help="serve a taskset's env over HTTP (for --server-url or remote use)",
        description="Run a taskset's env behind HTTP: GET /health, POST /run and the "
        "WebSocket /ws (docs/serve.md, docs/security.md).",
        formatter_class=HelpFormatter,
    )
    env = add_env_options(sv)
    # How a spawned server (and a pool's workers) get their env: the EnvSpec as data.
    sv.add_argument("--env-spec", default=None, metavar="JSON", help=argparse.SUPPRESS)
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
    add_metrics_option(sv)
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
    access = sv.add_argument_group("who may talk to the server (docs/security.md)")
    access.add_argument(
        "--allow-host",
        action="extend",
        nargs="+",
        default=[],
        metavar="NAME",
        help="Host names (NAME or NAME:PORT) served besides the bound one; required for a "
        "wildcard --host; '*' serves any (behind a proxy that checks Host) (default: none)",
    )
    access.add_argument(
        "--allow-origin",
        action="extend",
        nargs="+",
        default=[],
        metavar="ORIGIN",
        help="browser Origins served (default none: a request from a web page is refused)",
    )
    models = sv.add_argument_group("what a run may reach (docs/security.md)")
    models.add_argument(
        "--api-key-var",
        default=None,
        metavar="NAME",
        help="the environment variable holding the model API key (read once at start); a "
        "run may use this key or none, never another variable (default: none)",
    )
    models.add_argument(
        "--allow-base-url",
        action="extend",
        nargs="+",
        default=[],
        metavar="URL",
        help="the OpenAI-compatible endpoints a run may reach (default none: echo only)",
    )
    add_endpoint_options(
        models,
        base_url_help="an endpoint runs may reach, as --allow-base-url; repeat it for many "
        "(default: none)",
        engine_metrics_help="the Prometheus /metrics (vLLM, SGLang) of the engine behind each "
        "--base-url, in the same order, e.g. http://127.0.0.1:8000/metrics: the server reads "
        "it every second into that endpoint's window (the runs over many endpoints share one "
        "per endpoint) and /health shows it (default: none)",
    )  # fmt: skip
    # How a pool's workers get the model policy: as data (the key: from --api-key-var's
    # variable, read by each worker), never as flags.
    sv.add_argument("--model-policy", default=None, metavar="JSON", help=argparse.SUPPRESS)
    models.add_argument(
        "--max-model-retries",
        type=int,
        default=MAX_MODEL_RETRIES,
        metavar="N",
        help="the most retries a run's model client may ask for; a run asking more is refused "
        f"with 403 (default {MAX_MODEL_RETRIES})",
    )
    models.add_argument(
        "--min-model-backoff",
        type=float,
        default=MIN_MODEL_BACKOFF,
        metavar="S",
        help="seconds: a run's model client backoff below this is raised to it (default "
        f"{MIN_MODEL_BACKOFF:g})",
    )
    limits = sv.add_argument_group("limits per connection (docs/security.md)")
    limits.add_argument(
        "--max-runs-per-connection",
        type=int,
        default=DEFAULTS.max_runs,
        metavar="N",
        help=f"runs in flight on one WebSocket (default {DEFAULTS.max_runs})",
    )
    limits.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULTS.header_timeout,
        metavar="S",
        help="seconds for a request head (and then its body) to arrive; also the keep-alive "
        f"idle time (default {DEFAULTS.header_timeout:g})",
    )
    limits.add_argument(
        "--idle-timeout",
        type=float,
        default=DEFAULTS.idle_timeout,
        metavar="S",
        help="seconds a WebSocket may stay idle (nothing in flight, sent or received) "
        f"before it is closed (default {DEFAULTS.idle_timeout:g})",
    )
    limits.add_argument(
        "--max-model-clients",
        type=int,
        default=DEFAULTS.model_clients,
        metavar="N",
        help=f"model clients kept open, least recently used closed (default "
        f"{DEFAULTS.model_clients})",
    )
    env.add_argument(
        "--reward", default=None, metavar="TARGET",
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


def _access(args: argparse.Namespace, port: int, token: str | None) -> Access:
    return Access.for_bind(
        args.host, port, loopback=is_loopback(args.host), allow_hosts=args.allow_host,
        allow_origins=args.allow_origin, token=token,
    )  # fmt: skip


def _models(args: argparse.Namespace) -> ModelPolicy:
    """The model policy of the flags (a pool's worker: of its parent's `--model-policy`)."""
    if args.model_policy is not None:
        try:
            return ModelPolicy.from_json(args.model_policy, os.environ)
        except (ValueError, KeyError, TypeError) as exc:
            raise UsageError(f"--model-policy: {exc}") from None
    urls = base_urls(args)
    metrics = engine_metrics_urls(args)
    if metrics and len(metrics) != len(urls):
        raise UsageError(
            f"--engine-metrics given {len(metrics)} times for {len(urls)} --base-url: give "
            f"one per --base-url, in the same order",
            fix="e.g. --base-url http://127.0.0.1:8000/v1 --engine-metrics "
            "http://127.0.0.1:8000/metrics",
        )
    try:
        return ModelPolicy.from_flags(
            [*args.allow_base_url, *urls], args.api_key_var, os.environ,
            max_retries=args.max_model_retries, min_backoff=args.min_model_backoff,
            engine_metrics=list(zip(urls, metrics, strict=True)) if metrics else (),
        )  # fmt: skip
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _limits(args: argparse.Namespace) -> Limits:
    return Limits(
        max_body=args.max_body_bytes, max_runs=args.max_runs_per_connection,
        header_timeout=args.header_timeout, idle_timeout=args.idle_timeout,
        model_clients=args.max_model_clients,
    )  # fmt: skip


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


def _check_wildcard(args: argparse.Namespace) -> None:
    if args.host.strip("[]") in ("0.0.0.0", "::", "") and not args.allow_host:
        raise UsageError(
            f"--host {args.host or repr('')} listens on every address, so no name is the "
            f"bound one: name the host names clients use with --allow-host NAME (or '*' "
            f"behind a proxy that checks Host)"
        )


def _check_args(args: argparse.Namespace) -> None:
    if args.workers < 1:
        raise UsageError(f"--workers must be >= 1, got {args.workers}")
    if args.metrics_port is not None:
        if args.workers > 1:
            raise UsageError(
                "--metrics-port with --workers K: each worker process has its own counts",
                fix="run K servers of --workers 1, each with its own --metrics-port",
            )
        from .._eval.config import EvalConfigError, check_metrics_port

        try:
            check_metrics_port(args.metrics_port)
        except EvalConfigError as exc:
            raise UsageError(flag_message(exc)) from None
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in 0..65535, got {args.port}")
    if args.max_body_bytes < 1:
        raise UsageError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    for flag, value in (("--max-runs-per-connection", args.max_runs_per_connection),
                        ("--max-model-clients", args.max_model_clients)):  # fmt: skip
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    for flag, seconds in (("--header-timeout", args.header_timeout),
                          ("--idle-timeout", args.idle_timeout)):  # fmt: skip
        if not seconds > 0:
            raise UsageError(f"{flag} must be > 0 seconds, got {seconds}")


def _worker_cmd(
    args: argparse.Namespace, spec: EnvSpec, port: int, models: ModelPolicy
) -> list[str]:
    """A pool worker's command: the same env and model policy (as data), flags and bound
    name (its socket by fd)."""
    cmd = [sys.executable, "-m", "trio_tasksets", "serve", spec.taskset,
           "--env-spec", spec.to_json(), "--model-policy", models.to_json(),
           "--host", args.host, "--port", str(port), "--workers", str(args.workers),
           "--max-body-bytes", str(args.max_body_bytes),
           "--max-runs-per-connection", str(args.max_runs_per_connection),
           "--header-timeout", repr(args.header_timeout),
           "--idle-timeout", repr(args.idle_timeout),
           "--max-model-clients", str(args.max_model_clients),
           "--die-with-parent"]  # fmt: skip
    for flag, values in (("--allow-host", args.allow_host),
                         ("--allow-origin", args.allow_origin)):  # fmt: skip
        if values:
            cmd += [flag, *values]
    return [*cmd, "--token-var", args.token_var] if args.token_var else cmd


def run(args: argparse.Namespace) -> int:
    """`trio-tasksets serve`: exit 0 when stopped by a signal, 1 on an error; a bad command
    line raises `UsageError` (exit 2)."""
    _check_args(args)
    token = _token(args)
    _check_wildcard(args)
    models = _models(args)
    limits = _limits(args)
    spec = env_spec(args)
    env = build_env(args, check_retry_names=not args.die_with_parent)
    settle_heap(args)  # the set-up is done: full collections no longer walk it
    if args.listen_fd is not None:  # a worker of a pool
        access = _access(args, args.port, token)
        app = ServerApp(env, access=access, models=models, limits=limits, workers=args.workers)
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
    port = sock.getsockname()[1]
    url = url_of(args.host, port)
    if args.workers > 1:
        with sock:
            cmd = _worker_cmd(args, spec, port, models)
            return trio.run(supervise, cmd, sock, args.workers, url, args.die_with_parent)
    app = ServerApp(env, access=_access(args, port, token), models=models, limits=limits)
    serve = partial(serve_worker, url=url, die_with_parent=args.die_with_parent,
                    metrics_port=args.metrics_port)  # fmt: skip
    trio.run(serve, app, sock.detach())
    return 0
