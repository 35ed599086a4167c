"""What the commands share: their errors and help format, the env options (`eval`, `serve`,
`worker`), the model options (`eval`, `worker`) and the run's limits (`eval`, `worker`).

`add_env_options` / `build_env`: TASKSET, `-a/--taskset-args`, `--env-class`, the system
prompt, the retry policy and `--rollout-timeout`, built into the user's `Env`.
`add_model_options` / `model_context`: the model client, its endpoint and key, the sampling
settings, and the limits on its calls (`--max-connections`, `--rpm`, `--tpm`).
`add_window_option` (`-c/--max-concurrent N|MIN-START-MAX`) and `add_time_limit_option`
(`--time-limit S`). Each builder checks its values and raises `UsageError` naming the flag
and the fix; a value argparse cannot parse is refused by argparse, naming the flag.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import attrs

from ..env import Env, RetryPolicy
from ..envspec import EnvSpec, config_from_json
from ..limits import EndpointLimits
from ..loading import LoadError, import_failure, load_object, resolve_target
from ..models import EchoClient, ModelClient, ModelContext, OpenAIClient, Sampling, api_key_from_env
from ..tasksets import Taskset, TasksetConfig
from ..window import AdaptiveBounds, WindowArgumentError, parse_window

__all__ = [
    "DEFAULT_API_KEY_VAR",
    "PROG",
    "CommandError",
    "HelpFormatter",
    "UsageError",
    "add_env_options",
    "add_model_options",
    "add_taskset_options",
    "add_time_limit_option",
    "add_window_option",
    "api_key_var",
    "build_env",
    "build_taskset",
    "check_retry_flags",
    "endpoint_limits",
    "env_spec",
    "limit_flags",
    "model_context",
    "names",
    "seconds",
    "warn",
    "window_option",
]

if TYPE_CHECKING:
    Commands = argparse._SubParsersAction[argparse.ArgumentParser]  # the subcommands of `main`

PROG = "trio-tasksets"
DEFAULT_API_KEY_VAR = "OPENAI_API_KEY"
TASKSET_HELP = "echo, echo-stream, path/to/file.py:Class or package.module:Class"


# --- errors and help ------------------------------------------------------------------------


class CommandError(Exception):
    """A failure the user can act on, shown as one line (exit 1):
    ``trio-tasksets COMMAND: error: MESSAGE; fix: FIX``, then any `details` lines."""

    exit_code = 1

    def __init__(
        self, message: str, *, fix: str | None = None, details: tuple[str, ...] = ()
    ) -> None:
        super().__init__(message)
        self.fix = fix
        self.details = details

    def line(self, command: str) -> str:
        text = f"{PROG} {command}: error: {self}"
        return f"{text}; fix: {self.fix}" if self.fix else text


class UsageError(CommandError):
    """A bad command line, found before any work: the command's usage, then the line (exit 2)."""

    exit_code = 2


def warn(command: str, message: str) -> None:
    """One warning line on stderr, in the style of the error lines."""
    print(f"{PROG} {command}: warning: {message}", file=sys.stderr)


class HelpFormatter(argparse.HelpFormatter):
    """`--help` shows every option's default: `(default: X)` is added to an option whose
    default is a value, unless its help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            "default" in text
            or not action.option_strings
            or action.required
            or any(action.default is nothing for nothing in (None, False, argparse.SUPPRESS))
        ):
            return text
        return f"{text} (default: %(default)s)"


def names(text: str) -> tuple[str, ...]:
    """The comma-separated names of an option such as `--retry-on A,B`."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _given(args: argparse.Namespace, dest: str) -> bool:
    """Whether an option whose default is None (a 'not given' sentinel) was given."""
    return getattr(args, dest, None) is not None


# --- argparse types (argparse names the flag: "argument --rpm: must be ...") ------------------


def window_option(text: str) -> int | AdaptiveBounds:
    """`N` or `MIN-START-MAX` (`-c/--max-concurrent`, `--max-connections`)."""
    try:
        return parse_window(text, flag="")
    except WindowArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix(": ")) from None


def _positive(text: str, unit: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {unit} (a number > 0), got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number of {unit} > 0, got {text!r}")
    return value


def seconds(text: str) -> float:
    """A duration in seconds, > 0 (`--rollout-timeout`, `--time-limit`)."""
    return _positive(text, "seconds")


def _per_minute(text: str) -> float:
    return _positive(text, "units per minute")


def add_window_option(group: argparse._ActionsContainer, *, help: str) -> None:
    """`-c/--max-concurrent N|MIN-START-MAX` (default 32): an int or `AdaptiveBounds`."""
    group.add_argument(
        "-c", "--max-concurrent", type=window_option, default=32, metavar="N|MIN-START-MAX",
        help=f"{help}; MIN-START-MAX (e.g. 1-8-512) adapts it: it grows while runs succeed, "
        "is cut on HTTP 429 and pauses on 5xx and timeouts",
    )  # fmt: skip


def add_time_limit_option(group: argparse._ActionsContainer, *, what: str) -> None:
    """`--time-limit S` (default: none)."""
    group.add_argument(
        "--time-limit", type=seconds, default=None, metavar="S",
        help=f"after S seconds, {what} (default: no limit)",
    )  # fmt: skip


# --- the env: TASKSET and how each slot of it runs --------------------------------------------


def add_taskset_options(parser: argparse.ArgumentParser, *, optional: bool = False) -> None:
    """TASKSET and `-a/--taskset-args JSON` (its config's fields)."""
    if optional:
        parser.add_argument(
            "taskset", metavar="TASKSET", nargs="?", default=None,
            help=f"{TASKSET_HELP}: its reward, system prompt and env class score each task "
            f"(default: none: the answer-match reward)",
        )  # fmt: skip
    else:
        parser.add_argument("taskset", metavar="TASKSET", help=TASKSET_HELP)
    parser.add_argument(
        "-a", "--taskset-args", default=None, metavar="JSON",
        help="the taskset config's fields as a JSON object, e.g. '{\"gap\": 0.5}' "
        "(default: the config's own defaults)",
    )  # fmt: skip
    # The name `--serve` has passed to its server child since before -a existed.
    parser.add_argument("--taskset-config", dest="taskset_args", help=argparse.SUPPRESS)


def _names_verifiers(args: argparse.Namespace) -> bool:
    return str(getattr(args, "taskset", None) or "").startswith("vf:")


def add_env_options(
    parser: argparse.ArgumentParser, *, optional_taskset: bool = False
) -> argparse._ArgumentGroup:
    """TASKSET, `-a/--taskset-args`, `--env-class`, `--system-prompt[-file]`, `--retries`,
    `--retry-on`, `--no-retry-on`: what `build_env` builds the env from."""
    add_taskset_options(parser, optional=optional_taskset)
    env = parser.add_argument_group("the env")
    env.add_argument(
        "--env-args", default=None, metavar="JSON",
        help="with TASKSET vf:TASKSET_ID: verifiers' own env config keys (agent, taskset, "
        "retries...) as a JSON object (default: none)",
    )  # fmt: skip
    env.add_argument(
        "--env-class", default=None, metavar="SPEC",
        help="an Env subclass (file.py:Class or pkg.mod:Class) that runs each slot "
        "(default: tt.Env, or the Env class TASKSET names)",
    )  # fmt: skip
    prompt = env.add_mutually_exclusive_group()
    prompt.add_argument(
        "--system-prompt", default=None, metavar="TEXT",
        help="the system prompt of every task (default: the taskset's own)",
    )  # fmt: skip
    prompt.add_argument(
        "--system-prompt-file", default=None, metavar="PATH",
        help="read the system prompt from PATH (default: the taskset's own)",
    )  # fmt: skip
    env.add_argument(
        "--retries", type=int, default=0, metavar="K", help="retry a failed episode up to K times"
    )
    env.add_argument(
        "--retry-on", default="", metavar="TYPES",
        help="comma-separated exception type names to retry; base classes match too "
        "(default: every type)",
    )  # fmt: skip
    env.add_argument(
        "--no-retry-on", default="", metavar="TYPES",
        help="comma-separated exception type names never to retry (default: none)",
    )  # fmt: skip
    env.add_argument(
        "--rollout-timeout", type=seconds, default=None, metavar="S",
        help="bound each attempt of an episode (rollout and scoring) to S seconds: a slower "
        "one is cancelled and becomes an episode error, RolloutTimeoutError, retried per "
        "--retries (default: no bound)",
    )  # fmt: skip
    return env


def _taskset_fields(args: argparse.Namespace) -> dict[str, Any]:
    text = args.taskset_args
    if text is None:
        return {}
    try:
        fields = json.loads(text)
    except ValueError as exc:
        raise UsageError(
            f"-a/--taskset-args is not JSON ({exc})", fix="""quote it: -a '{"field": 1}'"""
        ) from None
    if not isinstance(fields, dict):
        raise UsageError(
            f"-a/--taskset-args must be a JSON object, got {text!r}", fix="""-a '{"field": 1}'"""
        )
    return fields


def _system_prompt(args: argparse.Namespace) -> str | None:
    path = getattr(args, "system_prompt_file", None)
    if path is None:
        return getattr(args, "system_prompt", None)
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise UsageError(f"--system-prompt-file: cannot read {path}: {exc.strerror}") from None


def env_spec(args: argparse.Namespace) -> EnvSpec:
    """The env the options describe, by names and JSON (what `serve` hands its workers)."""
    fields = _taskset_fields(args)
    prompt = _system_prompt(args)
    if prompt is not None:
        if "system_prompt" in fields:
            raise UsageError(
                "the system prompt is given twice (-a/--taskset-args and --system-prompt)",
                fix="drop one",
            )
        fields["system_prompt"] = prompt
    count: int = getattr(args, "retries", 0)
    if count < 0:
        raise UsageError(f"--retries must be >= 0, got {count}")
    try:
        retries = RetryPolicy(
            count, names(getattr(args, "retry_on", "")), names(getattr(args, "no_retry_on", "")),
            getattr(args, "retry_backoff", 0.5), getattr(args, "retry_max_backoff", 30.0),
        )  # fmt: skip
    except ValueError as exc:
        raise UsageError(f"--retries/--retry-backoff: {exc}") from None
    env_class = getattr(args, "env_class", None)
    return EnvSpec(
        args.taskset or "", fields, env_class, getattr(args, "reward", None), retries,
        rollout_timeout=getattr(args, "rollout_timeout", None),
    )  # fmt: skip


def check_retry_flags(args: argparse.Namespace) -> None:
    """`--retry-on` / `--no-retry-on` choose which errors `--retries` retries: alone, they do
    nothing (a usage error)."""
    if args.retries == 0:
        for flag, value in (("--retry-on", args.retry_on), ("--no-retry-on", args.no_retry_on)):
            if value:
                raise UsageError(
                    f"{flag} does nothing without --retries", fix="add --retries K (K >= 1)"
                )


def _load(spec: str, flag: str) -> Any:
    try:
        return load_object(spec)
    except LoadError as exc:
        raise UsageError(f"{flag} {spec}: {exc}") from exc
    except Exception as exc:
        where = spec.rpartition(":")[0]
        raise UsageError(f"{flag} {spec}: {import_failure(exc, where)}") from exc


def _check_fields(cls: type[Taskset[Any, Any]], fields: dict[str, Any]) -> None:
    """Each -a field names a field of the taskset's config, with a value of its default's
    JSON type (an int for a float is fine; a None default takes anything)."""
    config = cls._default_config()
    if not attrs.has(type(config)):
        if fields:
            raise UsageError(
                f"-a/--taskset-args: taskset {cls.__name__}'s config "
                f"({type(config).__name__}) is not an attrs class, so -a cannot set it"
            )
        return
    known = {field.name: getattr(config, field.name) for field in attrs.fields(type(config))}
    for name, value in fields.items():
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise UsageError(
                f"-a/--taskset-args: {type(config).__name__} (the config of taskset "
                f"{cls.__name__}) has no field {name!r}; {hint}its fields: {', '.join(known)}"
            )
        default = known[name]
        if not _fits(value, default):
            shown = repr(default) if len(repr(default)) <= 40 else repr(default)[:37] + "..."
            raise UsageError(
                f"-a/--taskset-args: field {name!r} takes a {_json_kind(default)} (its "
                f"default is {shown}), got {json.dumps(value)}"
            )


def _json_kind(value: object) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "list"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _fits(value: object, default: object) -> bool:
    if default is None or value is None:
        return True
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(default, bool)
    if isinstance(default, float):
        return isinstance(value, int | float)
    for kind in (int, str, dict):
        if isinstance(default, kind):
            return isinstance(value, kind)
    if isinstance(default, list | tuple):
        return isinstance(value, list)
    return True  # a type JSON has no name for: the config class decides


def build_taskset(args: argparse.Namespace) -> tuple[Taskset[Any, Any], type[Env[Any]] | None]:
    """The taskset TASKSET names, built with the config `-a` and the system prompt give, and
    the env class TASKSET names (None unless it names an Env subclass)."""
    return _build_taskset(args, env_spec(args))


def _build_taskset(
    args: argparse.Namespace, spec: EnvSpec
) -> tuple[Taskset[Any, Any], type[Env[Any]] | None]:
    if args.taskset is None:  # `worker` without TASKSET: a plain config, tasks from the stream
        if spec.config.keys() - {"system_prompt"}:
            raise UsageError("-a/--taskset-args needs a TASKSET to configure")
        return Taskset(TasksetConfig(**spec.config)), None
    cls, env_cls = resolve_target(args.taskset)
    _check_fields(cls, spec.config)
    try:
        config = config_from_json(cls, spec.config)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"-a/--taskset-args: {exc}") from exc
    try:
        return cls(config), env_cls
    except Exception as exc:
        raise UsageError(
            f"taskset {cls.__name__} cannot be built: {type(exc).__name__}: {exc}"
        ) from exc


def build_env(args: argparse.Namespace, *, check_retry_names: bool = True) -> Env[Any]:
    """The env the options describe: the user's Env subclass (or tt.Env) around the taskset,
    with the reward (`serve`'s `--reward`) and the retry policy. With `check_retry_names`, a
    `--retry-on`/`--no-retry-on` name that no loaded exception type has is warned about."""
    if getattr(args, "env_args", None) is not None and not _names_verifiers(args):
        raise UsageError(
            "--env-args applies to a verifiers env", fix="name it as TASKSET vf:TASKSET_ID"
        )
    if _names_verifiers(args):
        if args.taskset_args is not None or getattr(args, "env_class", None) is not None:
            raise UsageError(
                f"TASKSET {args.taskset} is a verifiers env: -a and --env-class do not apply",
                fix="give verifiers' own config keys with --env-args JSON",
            )
        check_retry_flags(args)
        policy = RetryPolicy(args.retries, names(args.retry_on), names(args.no_retry_on))
        return _verifiers_env(args, _system_prompt(args), policy)
    spec = env_spec(args)
    taskset, target_env = _build_taskset(args, spec)
    env_cls: Any = target_env or Env
    if spec.env_class is not None:
        if target_env is not None:
            raise UsageError(
                f"TASKSET {args.taskset} names an Env class already; --env-class "
                f"{spec.env_class} would replace it",
                fix="drop --env-class, or name the taskset class as TASKSET",
            )
        env_cls = _load(spec.env_class, "--env-class")
        if not (isinstance(env_cls, type) and issubclass(env_cls, Env)):
            raise UsageError(f"--env-class {spec.env_class}: not a subclass of tt.Env")
    kwargs: dict[str, Any] = {"retries": spec.retries}
    if spec.reward is not None:
        kwargs["reward"] = _load(spec.reward, "--reward")
    try:
        env: Env[Any] = env_cls(taskset, **kwargs)
    except Exception as exc:
        raise UsageError(
            f"{env_cls.__name__}(taskset, ...) failed: {type(exc).__name__}: {exc}"
        ) from exc
    if spec.rollout_timeout is not None:
        env.rollout_timeout = spec.rollout_timeout  # an attribute: any Env subclass takes it
    if check_retry_names:
        _check_retry_names(args.command, spec.retries)
    return env


def _verifiers_env(
    args: argparse.Namespace, system_prompt: str | None, retries: RetryPolicy
) -> Env[Any]:
    """The verifiers env `vf:TASKSET_ID [--env-args JSON]` names; its errors are usage errors.

    verifiers' harness calls the model itself over HTTP, so `--base-url` is required."""
    from ..aio.verifiers import VerifiersEnv, VerifiersTaskset, env_from_cli  # imports verifiers

    if args.base_url is None:
        raise UsageError(
            f"TASKSET {args.taskset}: verifiers' harness calls the model itself over HTTP",
            fix="give -m MODEL --base-url URL (an OpenAI-compatible endpoint)",
        )
    try:
        config = attrs.evolve(
            env_from_cli(args.taskset, args.env_args), system_prompt=system_prompt
        )
        return VerifiersEnv(VerifiersTaskset(config), retries=retries)
    except (ImportError, ValueError, TypeError) as exc:
        raise UsageError(f"TASKSET {args.taskset}: {type(exc).__name__}: {exc}") from exc


def _exception_names() -> set[str]:
    """The names of every exception class loaded now (the taskset's module included)."""
    seen: set[type[BaseException]] = set()
    todo: list[type[BaseException]] = [BaseException]
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen.add(cls)
            todo.extend(cls.__subclasses__())
    return {cls.__name__ for cls in seen}


def _check_retry_names(command: str, policy: RetryPolicy) -> None:
    if not (policy.include or policy.exclude):
        return
    known = _exception_names()
    for flag, listed in (("--retry-on", policy.include), ("--no-retry-on", policy.exclude)):
        for name in listed:
            if name in known:
                continue
            close = difflib.get_close_matches(name, known, n=1)
            because = f"did you mean {close[0]}?" if close else "check the spelling"
            warn(
                command,
                f"{flag} {name}: no exception type of that name is loaded ({because}); it "
                f"matches only an error of exactly that name",
            )


# --- the model --------------------------------------------------------------------------------


def add_model_options(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Add the model options (`-m`, `--base-url`, `--api-key-var`, sampling, ...)."""
    model = parser.add_argument_group("the model")
    model.add_argument(
        "-m", "--model", default="echo",
        help="model name; 'echo' is the built-in offline model (replies with the prompt)",
    )  # fmt: skip
    model.add_argument(
        "--base-url", default=None, metavar="URL",
        help="an OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1 (default: none; "
        "needed by every model but echo)",
    )  # fmt: skip
    model.add_argument(
        "--api-key-var", default=None, metavar="VAR",
        help=f"the environment variable holding the API key (default: {DEFAULT_API_KEY_VAR}; "
        f"no key is sent when it is unset)",
    )  # fmt: skip
    model.add_argument(
        "--timeout", type=float, default=None, metavar="S",
        help="per-request timeout in seconds, for --base-url (default: 120)",
    )  # fmt: skip
    model.add_argument(
        "--temperature", type=float, default=None, metavar="T", help="sampling temperature >= 0 "
        "(default: the server's)",
    )  # fmt: skip
    model.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        metavar="N",
        help="most tokens per reply (default: the server's)",
    )
    model.add_argument(
        "--top-p", type=float, default=None, metavar="P", help="nucleus sampling, in (0, 1] (default: the "
        "server's)",
    )  # fmt: skip
    model.add_argument(
        "--sampling-seed", type=int, default=None, metavar="N", help="the seed sent with each request "
        "(default: none)",
    )  # fmt: skip
    model.add_argument(
        "--echo-delay", type=float, default=None, metavar="S",
        help="latency of the echo model, to watch the window work (default: 0)",
    )  # fmt: skip
    model.add_argument(
        "--max-connections", type=window_option, default=None, metavar="N|MIN-START-MAX",
        help="most model calls in flight to the endpoint (--base-url and its key variable), "
        "across every rollout of this process: a rollout's every call counts; MIN-START-MAX "
        "adapts it on the calls' 429s (default: no bound)",
    )  # fmt: skip
    model.add_argument(
        "--rpm", type=_per_minute, default=None, metavar="N",
        help="most model calls started per minute, spread evenly (GCRA) (default: no limit)",
    )  # fmt: skip
    model.add_argument(
        "--tpm", type=_per_minute, default=None, metavar="N",
        help="most tokens per minute, metered from the replies' usage; --max-tokens is "
        "reserved before each call (default: no limit)",
    )  # fmt: skip
    return model


def _is_echo(args: argparse.Namespace) -> bool:
    return bool(args.model == "echo" and args.base_url is None)


def _check_base_url(url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        example = f"http://{url}" if "://" not in url else "http://127.0.0.1:8000/v1"
        raise UsageError(
            f"--base-url must be an http:// or https:// URL, got {url!r}", fix=f"e.g. {example}"
        )


def _sampling(args: argparse.Namespace) -> Sampling:
    temperature, top_p, max_tokens = args.temperature, args.top_p, args.max_tokens
    if temperature is not None and not (math.isfinite(temperature) and temperature >= 0):
        raise UsageError(f"--temperature must be >= 0, got {temperature}")
    if top_p is not None and not 0 < top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {top_p}")
    if max_tokens is not None and max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {max_tokens}")
    return Sampling(temperature=temperature, max_tokens=max_tokens, top_p=top_p,
                    seed=args.sampling_seed)  # fmt: skip


def api_key_var(args: argparse.Namespace) -> str | None:
    """The variable the model's API key is read from, when a key is sent (never the key)."""
    if _is_echo(args):
        return None
    var: str = args.api_key_var or DEFAULT_API_KEY_VAR
    return var if os.environ.get(var, "").strip() else None


def model_context(args: argparse.Namespace) -> ModelContext:
    """The model the options name; a bad value, or an option that would do nothing with this
    model, is a `UsageError` naming its flag."""
    client: ModelClient
    sampling = _sampling(args)
    if _is_echo(args):
        idle = (("--timeout", "timeout"), ("--api-key-var", "api_key_var"),
                ("--max-connections", "max_connections"), ("--rpm", "rpm"), ("--tpm", "tpm"))  # fmt: skip
        for flag, dest in idle:
            if _given(args, dest):
                raise UsageError(
                    f"{flag} does nothing with the echo model",
                    fix=f"drop {flag}, or name an HTTP model with -m MODEL --base-url URL",
                )
        delay = 0.0 if args.echo_delay is None else args.echo_delay
        if not delay >= 0:
            raise UsageError(f"--echo-delay must be >= 0, got {delay}")
        client = EchoClient(delay=delay)
        return ModelContext(client, args.model, sampling)
    if args.base_url is None:
        raise UsageError(
            f"-m/--model {args.model!r} needs --base-url (an OpenAI-compatible endpoint)",
            fix="add --base-url http://127.0.0.1:8000/v1 (or https://api.openai.com/v1), "
            "or use -m echo",
        )
    _check_base_url(args.base_url)
    if _given(args, "echo_delay"):
        raise UsageError(
            "--echo-delay applies to the echo model only", fix="drop it (or drop --base-url)"
        )
    timeout = 120.0 if args.timeout is None else args.timeout
    if not timeout > 0:
        raise UsageError(f"--timeout must be > 0, got {timeout}")
    key = None
    if args.api_key_var is not None:  # named: it must hold a key
        try:
            key = api_key_from_env(args.api_key_var)
        except ValueError as exc:
            raise UsageError(f"--api-key-var: {exc}") from None
    else:
        key = os.environ.get(DEFAULT_API_KEY_VAR, "").strip() or None
    limits = endpoint_limits(args)
    client = OpenAIClient(
        args.base_url, key, timeout=timeout, limits=limits,
        limits_key=(args.base_url, args.api_key_var or DEFAULT_API_KEY_VAR),
    )  # fmt: skip
    return ModelContext(client, args.model, sampling)


def endpoint_limits(args: argparse.Namespace) -> EndpointLimits | None:
    """The limits `--max-connections`, `--rpm` and `--tpm` set on the model's calls (one
    `EndpointLimits` for the process: every rollout's calls share it), or None."""
    connections = getattr(args, "max_connections", None)
    rpm, tpm = getattr(args, "rpm", None), getattr(args, "tpm", None)
    if connections is None and rpm is None and tpm is None:
        return None
    return EndpointLimits(connections=connections, rpm=rpm, tpm=tpm)


def limit_flags(args: argparse.Namespace) -> list[str]:
    """The model-call limit flags given (`--max-connections`, `--rpm`, `--tpm`)."""
    flags = (("--max-connections", "max_connections"), ("--rpm", "rpm"), ("--tpm", "tpm"))
    return [flag for flag, dest in flags if _given(args, dest)]
