"""`trio-tasksets serve TASKSET`: the env server's command."""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from typing import TYPE_CHECKING, Any

import attrs
import trio

from .._core.backoff import FIRST, MOST
from .._core.exceptions import ConfigError
from .._env.env import Env
from .._env.spec import EnvSpec
from .._eval.config import check_metrics_port
from .._serve.app import ServerApp
from .._serve.policy import MAX_MODEL_RETRIES, MIN_MODEL_BACKOFF, Access, Limits, ModelPolicy
from .._serve.process import bind_socket, is_loopback, serve_worker, supervise, url_of
from .._serve.wire import MAX_BODY_BYTES, READY_PREFIX

if TYPE_CHECKING:
    from .options import Commands

from .env_options import add_env_options, build_env, env_options, env_spec
from .heap import settle_heap
from .model_options import add_endpoint_options, endpoints, engine_metrics_urls
from .options import (
    PARAMETER_FLAGS,
    CommandError,
    HelpFormatter,
    UsageError,
    add_flags,
    add_metrics_option,
    add_reward_option,
)

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
    add_flags(sv, {"--workers K": "worker processes"}, type=int, default=1)
    add_metrics_option(sv)
    add_flags(sv, {
        "--token-var NAME": "environment variable holding the bearer token every request must "
        "carry (default: none: no token, loopback only)",
    })  # fmt: skip
    add_flags(sv, {"--max-body-bytes N": "larger request bodies get 413 (default 1 MiB)"},
              type=int, default=MAX_BODY_BYTES)  # fmt: skip
    add_flags(sv.add_argument_group("who may talk to the server (docs/security.md)"), {
        "--allow-host NAME": "Host names (NAME or NAME:PORT) served besides the bound one; "
        "required for a wildcard --host; '*' serves any (behind a proxy that checks Host) "
        "(default: none)",
        "--allow-origin ORIGIN": "browser Origins served (default none: a request from a web "
        "page is refused)",
    }, action="extend", nargs="+", default=[])  # fmt: skip
    models = sv.add_argument_group("what a run may reach (docs/security.md)")
    add_flags(models, {
        "--api-key-var NAME": "the environment variable holding the model API key (read once "
        "at start); a run may use this key or none, never another variable (default: none)",
    })  # fmt: skip
    add_flags(models, {
        "--allow-base-url URL": "the OpenAI-compatible endpoints a run may reach (default none: "
        "echo only)",
    }, action="extend", nargs="+", default=[])  # fmt: skip
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
    add_flags(models, {
        "--max-model-retries N": "the most retries a run's model client may ask for; a run "
        f"asking more is refused with 403 (default {MAX_MODEL_RETRIES})",
    }, type=int, default=MAX_MODEL_RETRIES)  # fmt: skip
    add_flags(models, {
        "--min-model-backoff S": "seconds: a run's model client backoff below this is raised "
        f"to it (default {MIN_MODEL_BACKOFF:g})",
    }, type=float, default=MIN_MODEL_BACKOFF)  # fmt: skip
    limits = sv.add_argument_group("limits per connection (docs/security.md)")
    add_flags(limits, {
        "--max-runs-per-connection N": f"runs in flight on one WebSocket (default "
        f"{DEFAULTS.max_runs})",
    }, type=int, default=DEFAULTS.max_runs)  # fmt: skip
    add_flags(limits, {
        "--header-timeout S": "seconds for a request head (and then its body) to arrive; also "
        f"the keep-alive idle time (default {DEFAULTS.header_timeout:g})",
    }, type=float, default=DEFAULTS.header_timeout)  # fmt: skip
    add_flags(limits, {
        "--idle-timeout S": "seconds a WebSocket may stay idle (nothing in flight, sent or "
        f"received) before it is closed (default {DEFAULTS.idle_timeout:g})",
    }, type=float, default=DEFAULTS.idle_timeout)  # fmt: skip
    add_flags(limits, {
        "--max-model-clients N": f"model clients kept open, least recently used closed "
        f"(default {DEFAULTS.model_clients})",
    }, type=int, default=DEFAULTS.model_clients)  # fmt: skip
    add_reward_option(env, help="a reward function (default: the taskset's, else answer match)")
    add_flags(env, {"--retry-backoff S": "first retry's backoff cap"}, type=float, default=FIRST)
    add_flags(env, {"--retry-max-backoff S": "largest backoff"}, type=float, default=MOST)
    sv.add_argument(
        "--die-with-parent",
        action="store_true",
        help="exit when stdin reaches EOF (the spawning parent's death pipe)",
    )
    sv.add_argument("--listen-fd", type=int, default=None, help=argparse.SUPPRESS)
    return sv


# The server's settings, as this command spells them: a `ConfigError` from the model policy
# or the env names them, and so does a refusal the server answers (`ServerApp(spelling=)`).
FLAGS = {
    **PARAMETER_FLAGS,
    # Access.for_bind's parameters
    "allow_hosts": "--allow-host",
    "allow_origins": "--allow-origin",
    # ModelPolicy's (its fields, and from_flags' parameters)
    "base_urls": "--allow-base-url",
    "api_key_var": "--api-key-var",
    "max_retries": "--max-model-retries",
    "min_backoff": "--min-model-backoff",
    "engine_metrics": "--engine-metrics",
    # Limits' fields
    "max_body": "--max-body-bytes",
    "max_runs": "--max-runs-per-connection",
    "header_timeout": "--header-timeout",
    "idle_timeout": "--idle-timeout",
    "model_clients": "--max-model-clients",
}


def _usage(error: ValueError) -> UsageError:
    """A library error about a setting, as this command's usage error (flags, not names)."""
    if isinstance(error, ConfigError):
        return UsageError(error.spelled(FLAGS), fix=error.spelled_fix(FLAGS))
    return UsageError(str(error))


@attrs.frozen
class ServeCommand:
    """What `trio-tasksets serve` runs, built from its command line and checked."""

    host: str
    port: int  # 0: the OS picks one
    workers: int
    token_var: str | None  # the variable holding `token`, for a pool's workers
    token: str | None
    allow_hosts: tuple[str, ...]
    allow_origins: tuple[str, ...]
    models: ModelPolicy
    limits: Limits
    spec: EnvSpec
    env: Env[Any]
    metrics_port: int | None
    die_with_parent: bool
    listen_fd: int | None  # a pool's worker: the bound socket's fd
    own_process: bool  # the CLI's own process: `settle_heap` may freeze its set-up

    def access(self, port: int) -> Access:
        """Who may talk to the server once bound to `port`."""
        return Access.for_bind(
            self.host, port, loopback=is_loopback(self.host), allow_hosts=self.allow_hosts,
            allow_origins=self.allow_origins, token=self.token,
        )  # fmt: skip

    def worker_cmd(self, port: int) -> list[str]:
        """A pool worker's command: the same env and model policy (as data), flags and bound
        name (its socket by fd)."""
        limits = self.limits
        cmd = [sys.executable, "-m", "trio_tasksets", "serve", self.spec.taskset,
               "--env-spec", self.spec.to_json(), "--model-policy", self.models.to_json(),
               "--host", self.host, "--port", str(port), "--workers", str(self.workers),
               "--max-body-bytes", str(limits.max_body),
               "--max-runs-per-connection", str(limits.max_runs),
               "--header-timeout", repr(limits.header_timeout),
               "--idle-timeout", repr(limits.idle_timeout),
               "--max-model-clients", str(limits.model_clients),
               "--die-with-parent"]  # fmt: skip
        for flag, values in (("--allow-host", self.allow_hosts),
                             ("--allow-origin", self.allow_origins)):  # fmt: skip
            if values:
                cmd += [flag, *values]
        return [*cmd, "--token-var", self.token_var] if self.token_var else cmd


def serve_command(args: argparse.Namespace) -> ServeCommand:
    """The server's objects from its command line; a bad value is a `UsageError` naming its
    flag (the only function of `serve` that reads `args`)."""
    _check_numbers(workers=args.workers, port=args.port)
    try:  # each a count >= 1 or a timeout > 0: a ConfigError naming it
        limits = Limits(
            max_body=args.max_body_bytes, max_runs=args.max_runs_per_connection,
            header_timeout=args.header_timeout, idle_timeout=args.idle_timeout,
            model_clients=args.max_model_clients,
        )  # fmt: skip
    except ConfigError as exc:
        raise _usage(exc) from None
    _check_metrics_port(args.metrics_port, args.workers)
    host: str = args.host
    token = _token(args.token_var, host)
    allow_hosts = tuple[str, ...](args.allow_host)
    _check_wildcard(host, allow_hosts)
    given = endpoints(args)
    if args.model_policy is not None:  # a worker of a pool: its parent's policy, as data
        models = _policy_of_json(args.model_policy)
    else:
        models = _policy(
            [*args.allow_base_url], list(given.base_urls), engine_metrics_urls(given),
            args.api_key_var, max_retries=args.max_model_retries,
            min_backoff=args.min_model_backoff,
        )  # fmt: skip
    env_given = env_options(
        args, reward=args.reward, backoff=(args.retry_backoff, args.retry_max_backoff),
        env_spec=args.env_spec,
    )  # fmt: skip
    spec = env_spec(env_given)
    env = build_env(
        env_given, endpoint=given.base_url is not None, check_retry_names=not args.die_with_parent
    )
    return ServeCommand(
        host=host, port=args.port, workers=args.workers, token_var=args.token_var, token=token,
        allow_hosts=allow_hosts, allow_origins=tuple(args.allow_origin), models=models,
        limits=limits, spec=spec, env=env, metrics_port=args.metrics_port,
        die_with_parent=args.die_with_parent, listen_fd=args.listen_fd,
        own_process=args.tt_own_process,
    )  # fmt: skip


def _policy_of_json(text: str) -> ModelPolicy:
    try:
        return ModelPolicy.from_json(text, os.environ)
    except (ValueError, KeyError, TypeError) as exc:
        said = exc.spelled(FLAGS) if isinstance(exc, ConfigError) else str(exc)
        raise UsageError(f"--model-policy: {said}") from None


def _policy(
    allowed: list[str],
    urls: list[str],
    metrics: list[str],
    api_key_var: str | None,
    *,
    max_retries: int,
    min_backoff: float,
) -> ModelPolicy:
    """The model policy of the flags: the endpoints runs may reach (`--allow-base-url` and
    `--base-url`), each `--base-url`'s engine metrics, the key's variable and the limits on
    a run's model client."""
    if metrics and len(metrics) != len(urls):
        raise UsageError(
            f"--engine-metrics given {len(metrics)} times for {len(urls)} --base-url: give "
            f"one per --base-url, in the same order",
            fix="e.g. --base-url http://127.0.0.1:8000/v1 --engine-metrics "
            "http://127.0.0.1:8000/metrics",
        )
    try:
        return ModelPolicy.from_flags(
            [*allowed, *urls], api_key_var, os.environ, max_retries=max_retries,
            min_backoff=min_backoff,
            engine_metrics=list(zip(urls, metrics, strict=True)) if metrics else (),
        )  # fmt: skip
    except ValueError as exc:
        raise _usage(exc) from None


def _token(token_var: str | None, host: str) -> str | None:
    if token_var is None:
        if not is_loopback(host):
            raise UsageError(
                f"--host {host} is not a loopback address: name the environment variable "
                f"holding a bearer token with --token-var NAME (or bind 127.0.0.1)"
            )
        return None
    token = os.environ.get(token_var, "").strip()
    if not token:
        raise UsageError(
            f"--token-var: environment variable {token_var} is not set",
            fix=f"export {token_var}=<a long random token>",
        )
    return token


def _check_wildcard(host: str, allow_hosts: tuple[str, ...]) -> None:
    if host.strip("[]") in ("0.0.0.0", "::", "") and not allow_hosts:
        raise UsageError(
            f"--host {host or repr('')} listens on every address, so no name is the "
            f"bound one: name the host names clients use with --allow-host NAME (or '*' "
            f"behind a proxy that checks Host)"
        )


def _check_metrics_port(port: int | None, workers: int) -> None:
    if port is None:
        return
    if workers > 1:
        raise UsageError(
            "--metrics-port with --workers K: each worker process has its own counts",
            fix="run K servers of --workers 1, each with its own --metrics-port",
        )
    try:
        check_metrics_port(port)
    except ConfigError as exc:
        raise _usage(exc) from None


def _check_numbers(*, workers: int, port: int) -> None:
    if workers < 1:
        raise UsageError(f"--workers must be >= 1, got {workers}")
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be in 0..65535, got {port}")


def run(args: argparse.Namespace) -> int:
    """`trio-tasksets serve`: exit 0 when stopped by a signal, 1 on an error; a bad command
    line raises `UsageError` (exit 2)."""
    command = serve_command(args)
    settle_heap(command.own_process)  # the set-up is done: full collections no longer walk it
    if command.listen_fd is not None:  # a worker of a pool
        app = ServerApp(command.env, access=command.access(command.port), models=command.models,
                        limits=command.limits, workers=command.workers,
                        spelling=FLAGS)  # fmt: skip
        worker = partial(serve_worker, url=None, die_with_parent=command.die_with_parent)
        trio.run(worker, app, command.listen_fd)
        return 0
    try:
        sock = bind_socket(command.host, command.port)
    except OSError as exc:
        raise CommandError(
            f"cannot listen on {command.host}:{command.port}: {exc.strerror}",
            fix="choose another --port (0: any free one)",
        ) from exc
    port = sock.getsockname()[1]
    url = url_of(command.host, port)
    if command.workers > 1:
        with sock:
            return trio.run(
                supervise, command.worker_cmd(port), sock, command.workers, url,
                command.die_with_parent,
            )  # fmt: skip
    app = ServerApp(command.env, access=command.access(port), models=command.models,
                    limits=command.limits, spelling=FLAGS)  # fmt: skip
    serve = partial(serve_worker, url=url, die_with_parent=command.die_with_parent,
                    metrics_port=command.metrics_port)  # fmt: skip
    trio.run(serve, app, sock.detach())
    return 0
