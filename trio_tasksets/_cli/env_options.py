"""The env options of `eval`, `serve` and `worker`: TASKSET, `-a/--taskset-args`, `--env-class`,
the system prompt, the retry policy, the rollout limits (`--rollout-timeout`,
`--working-limit`, `--stall-timeout`: one `tt.RolloutLimits`, `rollout_limits_of`) (and
`vf:TASKSET_ID --env-args`), built by `build_env` into the user's `Env`; each value checked,
naming its flag."""

from __future__ import annotations

import argparse
import difflib
import json
from pathlib import Path
from typing import Any

import attrs

from .._core.backoff import FIRST, MOST
from .._core.datasets import JsonlTaskset, data_target
from .._core.exceptions import ConfigError
from .._core.tasksets import Taskset, TasksetConfig
from .._env.env import Env, RetryPolicy, RolloutLimits
from .._env.loading import LoadError, TravelError, import_failure, load_object, resolve_target
from .._env.spec import EnvSpec, config_from_json
from .options import (
    PARAMETER_FLAGS,
    TASKSET_HELP,
    UsageError,
    flag_message,
    names,
    seconds,
    warn,
)

__all__ = [
    "add_env_options",
    "add_taskset_options",
    "build_env",
    "build_taskset",
    "check_retry_flags",
    "env_spec",
    "load_reward",
    "rollout_limits_of",
]


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
    data = parser.add_argument_group("a data file TASKSET (data.jsonl, data.csv, hf:NAME)")
    data.add_argument(
        "--prompt-field", default=None, metavar="NAME",
        help="the record field that is the prompt (default: prompt, else question)",
    )  # fmt: skip
    data.add_argument(
        "--answer-field", default=None, metavar="NAME",
        help="the record field that is the answer (default: answer); the other fields go to "
        "the task's info",
    )  # fmt: skip
    data.add_argument(
        "--follow", action="store_true",
        help="with data.jsonl: a feed that follows the file as lines are appended (needs -n)",
    )  # fmt: skip


def _data_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields a data file TASKSET and its flags set (`--prompt-field`,
    `--answer-field`, `--follow`); those flags on another TASKSET are a usage error."""
    target = getattr(args, "taskset", None)
    found = None if target is None else data_target(target)
    flags = {"prompt_field": getattr(args, "prompt_field", None),
             "answer_field": getattr(args, "answer_field", None)}  # fmt: skip
    follow = bool(getattr(args, "follow", False))
    given_flags = [f"--{k.replace('_', '-')}" for k, v in flags.items() if v is not None]
    if follow:
        given_flags.append("--follow")
    if found is None:
        if given_flags:
            raise UsageError(
                f"{', '.join(given_flags)} applies to a data file TASKSET (data.jsonl, "
                f"data.csv, hf:NAME[:SPLIT])",
                fix=f"drop {', '.join(given_flags)}, or name a data file as TASKSET",
            )
        return {}
    cls, fields = found
    if follow and cls is not JsonlTaskset:
        raise UsageError(
            f"--follow follows a growing JSONL file; TASKSET {target} is not one",
            fix="drop --follow, or name a .jsonl file",
        )
    fields.update({k: v for k, v in flags.items() if v is not None})
    if follow:
        fields["follow"] = True
    return fields


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
        "--env-class", default=None, metavar="TARGET",
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
    env.add_argument(
        "--working-limit", type=seconds, default=None, metavar="S",
        help="bound each attempt's working time to S seconds: wall time less its waits on "
        "the limiters (--max-connections, --rpm, --tpm), Retry-After and retry backoff; "
        "an attempt that reaches it is cut and scored, stop_reason \"working_limit\" "
        "(default: no bound)",
    )  # fmt: skip
    env.add_argument(
        "--stall-timeout", type=seconds, default=None, metavar="S",
        help="cancel an attempt in which no model or tool call finished for S seconds of "
        "working time: it becomes an episode error, StalledError, retried per --retries "
        "(default: no bound)",
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


def rollout_limits_of(args: argparse.Namespace) -> RolloutLimits:
    """The rollout limits the flags give (`--rollout-timeout`, `--working-limit`,
    `--stall-timeout`; a command without them: none), as one `tt.RolloutLimits`: the
    library below the command line takes the object. A bad value is a usage error naming
    its flag."""
    try:
        return RolloutLimits(
            rollout_timeout=getattr(args, "rollout_timeout", None),
            working_limit=getattr(args, "working_limit", None),
            stall_timeout=getattr(args, "stall_timeout", None),
        )
    except ConfigError as exc:
        raise UsageError(flag_message(exc)) from None


def env_spec(args: argparse.Namespace) -> EnvSpec:
    """The env the options describe, by names and JSON (what `serve` hands its workers); a
    spawned server's `--env-spec JSON` (`EnvSpec.to_json`) is that spec whole."""
    given = getattr(args, "env_spec", None)
    if given is not None:
        try:
            spec = EnvSpec.from_json(given)
        except TravelError as exc:
            raise UsageError(f"--env-spec: {exc}") from None
        if spec.taskset != args.taskset:
            raise UsageError(
                f"--env-spec describes taskset {spec.taskset}, not TASKSET {args.taskset}"
            )
        return spec
    fields = {**_data_fields(args), **_taskset_fields(args)}
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
            getattr(args, "retry_backoff", FIRST), getattr(args, "retry_max_backoff", MOST),
        )  # fmt: skip
    except ValueError as exc:
        raise UsageError(f"--retries/--retry-backoff: {exc}") from None
    env_class = getattr(args, "env_class", None)
    return EnvSpec(
        args.taskset or "", fields, env_class, getattr(args, "reward", None), retries,
        rollout_limits_of(args),
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


def load_reward(spec: str, flag: str = "--reward") -> Any:
    """The reward function `spec` names (`file.py:function`, `pkg.mod:function`); a usage
    error naming `flag` if it names nothing callable (`rescore`'s --reward)."""
    try:
        reward = load_object(spec)
    except LoadError as exc:
        raise UsageError(f"{flag} {spec}: {exc}") from exc
    except Exception as exc:
        raise UsageError(f"{flag} {spec}: {import_failure(exc, spec.rpartition(':')[0])}") from exc
    if not callable(reward) and not isinstance(reward, dict):
        raise UsageError(
            f"{flag} {spec}: not a function (task, completion) -> reward, got "
            f"{type(reward).__name__}"
        )
    return reward


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
        if getattr(args, "reward", None) is not None:
            raise UsageError(
                f"TASKSET {args.taskset} is a verifiers env: it scores its episodes itself "
                f"(its @vf.reward methods), so --reward does not apply",
                fix="drop --reward (rescore its rows with trio-tasksets rescore RUN_DIR "
                "--reward TARGET)",
            )
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
    try:
        env = spec.build(taskset, target_env=target_env)  # the one env builder
    except ConfigError as exc:
        raise UsageError(flag_message(exc), fix=exc.spelled_fix(PARAMETER_FLAGS)) from exc
    if check_retry_names:
        _check_retry_names(args.command, spec.retries)
    return env


def _verifiers_env(
    args: argparse.Namespace, system_prompt: str | None, retries: RetryPolicy
) -> Env[Any]:
    """The verifiers env `vf:TASKSET_ID [--env-args JSON]` names; its errors are usage errors.

    verifiers' harness calls the model itself over HTTP, so `--base-url` is required (but
    with `--via`, where the workers call it with their own)."""
    from ..aio._verifiers import VerifiersEnv, VerifiersTaskset, env_from_cli  # imports verifiers

    if args.base_url is None and getattr(args, "via", None) is None:  # --via: the workers'
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
        raise UsageError(
            f"TASKSET {args.taskset}: {type(exc).__name__}: {flag_message(exc)}"
        ) from exc


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
