"""The env options of `eval`, `serve` and `worker`: TASKSET, `-a/--taskset-args`, `--env-class`,
the system prompt, the retry policy, the rollout limits (`--rollout-timeout`,
`--working-limit`, `--stall-timeout`: one `tt.RolloutLimits`) (and `vf:TASKSET_ID
--env-args`), built by `build_env` into the user's `Env`; each value checked, naming its flag.

A command reads them once at its edge (`env_options(args)`, `taskset_options(args)`: the only
functions here that see the parsed arguments) into a frozen `EnvOptions`; every builder below
takes that object."""

from __future__ import annotations

import argparse
import difflib
import json
from pathlib import Path
from typing import Any

import attrs

from .._core.adaptive import AdaptiveBounds, parse_window
from .._core.backoff import FIRST, MOST
from .._core.datasets import JsonlTaskset, data_target
from .._core.exceptions import ConfigError
from .._core.tasksets import Taskset, TasksetConfig
from .._env.env import Env, RetryPolicy, RolloutLimits
from .._env.loading import LoadError, TravelError, import_failure, load_object, resolve_target
from .._env.spec import EnvSpec, SandboxSpec, config_from_json
from .options import (
    PARAMETER_FLAGS,
    TASKSET_HELP,
    UsageError,
    add_flags,
    flag_message,
    json_object,
    names,
    seconds,
    warn,
)

__all__ = [
    "EnvOptions",
    "TasksetOptions",
    "add_env_options",
    "add_taskset_options",
    "build_env",
    "build_taskset",
    "check_retry_flags",
    "env_options",
    "env_spec",
    "load_reward",
    "taskset_options",
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
    add_flags(data, {
        "--prompt-field NAME": "the record field that is the prompt (default: prompt, else "
        "question)",
        "--answer-field NAME": "the record field that is the answer (default: answer); the "
        "other fields go to the task's info",
    })  # fmt: skip
    data.add_argument(
        "--follow", action="store_true",
        help="with data.jsonl: a feed that follows the file as lines are appended (needs -n)",
    )  # fmt: skip


@attrs.frozen
class TasksetOptions:
    """TASKSET and what configures it, as given: `-a/--taskset-args`, and a data file's
    `--prompt-field`, `--answer-field`, `--follow`."""

    taskset: str | None  # None: `worker` without TASKSET
    taskset_args: str | None = None
    prompt_field: str | None = None
    answer_field: str | None = None
    follow: bool = False


def taskset_options(args: argparse.Namespace) -> TasksetOptions:
    """The taskset options of a command that added them (`add_taskset_options`)."""
    return TasksetOptions(
        args.taskset, args.taskset_args, args.prompt_field, args.answer_field, args.follow
    )


def _data_fields(given: TasksetOptions) -> dict[str, Any]:
    """The config fields a data file TASKSET and its flags set (`--prompt-field`,
    `--answer-field`, `--follow`); those flags on another TASKSET are a usage error."""
    target = given.taskset
    found = None if target is None else data_target(target)
    flags = {"prompt_field": given.prompt_field, "answer_field": given.answer_field}
    given_flags = [f"--{k.replace('_', '-')}" for k, v in flags.items() if v is not None]
    if given.follow:
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
    if given.follow and cls is not JsonlTaskset:
        raise UsageError(
            f"--follow follows a growing JSONL file; TASKSET {target} is not one",
            fix="drop --follow, or name a .jsonl file",
        )
    fields.update({k: v for k, v in flags.items() if v is not None})
    if given.follow:
        fields["follow"] = True
    return fields


def add_env_options(
    parser: argparse.ArgumentParser, *, optional_taskset: bool = False
) -> argparse._ArgumentGroup:
    """TASKSET, `-a/--taskset-args`, `--env-class`, `--system-prompt[-file]`, `--retries`,
    `--retry-on`, `--no-retry-on`: what `build_env` builds the env from."""
    add_taskset_options(parser, optional=optional_taskset)
    env = parser.add_argument_group("the env")
    add_flags(env, {
        "--env-args JSON": "with TASKSET vf:TASKSET_ID: verifiers' own env config keys (agent, "
        "taskset, retries...) as a JSON object (default: none)",
        "--env-class TARGET": "an Env subclass (file.py:Class or pkg.mod:Class) that runs each "
        "slot (default: tt.Env, or the Env class TASKSET names)",
    })  # fmt: skip
    add_flags(env.add_mutually_exclusive_group(), {
        "--system-prompt TEXT": "the system prompt of every task (default: the taskset's own)",
        "--system-prompt-file PATH": "read the system prompt from PATH (default: the taskset's "
        "own)",
    })  # fmt: skip
    env.add_argument(
        "--retries", type=int, default=0, metavar="K", help="retry a failed episode up to K times"
    )
    add_flags(env, {
        "--retry-on TYPES": "comma-separated exception type names to retry; base classes match "
        "too (default: every type)",
        "--no-retry-on TYPES": "comma-separated exception type names never to retry (default: "
        "none)",
    }, default="")  # fmt: skip
    add_flags(env, {
        "--rollout-timeout S": "bound each attempt of an episode (rollout and scoring) to S "
        "seconds: a slower one is cancelled and becomes an episode error, RolloutTimeoutError, "
        "retried per --retries (default: no bound)",
        "--working-limit S": "bound each attempt's working time to S seconds: wall time less its "
        "waits on the limiters (--max-connections, --rpm, --tpm), Retry-After and retry "
        "backoff; an attempt that reaches it is cut and scored, stop_reason \"working_limit\" "
        "(default: no bound)",
        "--stall-timeout S": "cancel an attempt in which no model or tool call finished for S "
        "seconds of working time: it becomes an episode error, StalledError, retried per "
        "--retries (default: no bound)",
    }, type=seconds)  # fmt: skip
    boxes = parser.add_argument_group("sandboxes (docs/agents.md, docs/security.md)")
    add_flags(boxes, {
        "--sandbox BACKEND": "give each rollout a box of its own, made on first use (the "
        "shell and file tools run in it, tt.current_sandbox()) and destroyed when it ends: "
        "local, bwrap, docker:IMAGE or pkg.mod:factory; a server or worker makes it where "
        "it runs (default: none, the tools run on the host)",
        "--max-sandboxes N|MIN-START-MAX": "at most N sandboxes alive at once (a rollout waits "
        "for a place before its box is made; not working time), or adaptive between MIN and "
        "MAX on the host's CPU and memory pressure and the boxes' start-up (default with "
        "--sandbox: 1-CORES-256)",
    })  # fmt: skip
    return env


@attrs.frozen
class EnvOptions:
    """The env options as given (`env_options` reads them): what `build_env` and `env_spec`
    build the env from."""

    taskset: TasksetOptions
    command: str  # the command they were given to, for its warnings
    env_args: str | None = None
    env_class: str | None = None
    system_prompt: str | None = None
    system_prompt_file: str | None = None
    retries: int = 0
    retry_on: str = ""
    no_retry_on: str = ""
    backoff: tuple[float, float] = (FIRST, MOST)  # the retries' first and largest backoff
    limits: RolloutLimits = attrs.field(factory=RolloutLimits)
    reward: str | None = None  # `--reward`, where the command takes it
    env_spec: str | None = None  # a spawned server's `--env-spec JSON`
    sandbox: SandboxSpec | None = None  # `--sandbox`
    max_sandboxes: int | AdaptiveBounds | None = None  # `--max-sandboxes`

    @property
    def verifiers(self) -> bool:
        """Whether TASKSET names a verifiers env (`vf:TASKSET_ID`)."""
        return str(self.taskset.taskset or "").startswith("vf:")


def env_options(
    args: argparse.Namespace,
    *,
    reward: str | None = None,
    backoff: tuple[float, float] = (FIRST, MOST),
    env_spec: str | None = None,
) -> EnvOptions:
    """The env options of a command that added them (`add_env_options`); what only some
    commands take (`--reward`, `serve`'s `--retry-backoff`/`--retry-max-backoff` and
    `--env-spec`) the command passes. The rollout limits become one `tt.RolloutLimits`: a
    bad one is a `UsageError` naming its flag."""
    try:
        limits = RolloutLimits(
            rollout_timeout=args.rollout_timeout, working_limit=args.working_limit,
            stall_timeout=args.stall_timeout,
        )  # fmt: skip
    except ConfigError as exc:
        raise UsageError(flag_message(exc)) from None
    try:
        sandbox = None if args.sandbox is None else SandboxSpec.parse(args.sandbox)
        most = (
            None if args.max_sandboxes is None
            else parse_window(args.max_sandboxes, parameter="max_sandboxes")
        )  # fmt: skip
    except ConfigError as exc:
        raise UsageError(flag_message(exc)) from None
    return EnvOptions(
        taskset_options(args), args.command, env_args=args.env_args, env_class=args.env_class,
        system_prompt=args.system_prompt, system_prompt_file=args.system_prompt_file,
        retries=args.retries, retry_on=args.retry_on, no_retry_on=args.no_retry_on,
        backoff=backoff, limits=limits, reward=reward, env_spec=env_spec, sandbox=sandbox,
        max_sandboxes=most,
    )  # fmt: skip


def _taskset_fields(given: TasksetOptions) -> dict[str, Any]:
    if given.taskset_args is None:
        return {}
    example = """-a '{"field": 1}'"""
    return json_object(given.taskset_args, "-a/--taskset-args", quoted=example, example=example)


def _system_prompt(options: EnvOptions) -> str | None:
    path = options.system_prompt_file
    if path is None:
        return options.system_prompt
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise UsageError(f"--system-prompt-file: cannot read {path}: {exc.strerror}") from None


def env_spec(options: EnvOptions | TasksetOptions) -> EnvSpec:
    """The env the options describe, by names and JSON (what `serve` hands its workers); a
    spawned server's `--env-spec JSON` (`EnvSpec.to_json`) is that spec whole. Taskset
    options alone (`enqueue`) describe a plain env. A bad value is a `UsageError` naming its
    flag."""
    if isinstance(options, TasksetOptions):
        options = EnvOptions(options, "")
    target = options.taskset.taskset
    if options.env_spec is not None:
        try:
            spec = EnvSpec.from_json(options.env_spec)
        except TravelError as exc:
            raise UsageError(f"--env-spec: {exc}") from None
        if spec.taskset != target:
            raise UsageError(f"--env-spec describes taskset {spec.taskset}, not TASKSET {target}")
        return spec
    fields = {**_data_fields(options.taskset), **_taskset_fields(options.taskset)}
    prompt = _system_prompt(options)
    if prompt is not None:
        if "system_prompt" in fields:
            raise UsageError(
                "the system prompt is given twice (-a/--taskset-args and --system-prompt)",
                fix="drop one",
            )
        fields["system_prompt"] = prompt
    if options.retries < 0:
        raise UsageError(f"--retries must be >= 0, got {options.retries}")
    try:
        retries = RetryPolicy(
            options.retries, names(options.retry_on), names(options.no_retry_on),
            *options.backoff,
        )  # fmt: skip
    except ValueError as exc:
        raise UsageError(f"--retries/--retry-backoff: {exc}") from None
    return EnvSpec(
        target or "", fields, options.env_class, options.reward, retries, options.limits,
        options.sandbox, options.max_sandboxes,
    )  # fmt: skip


def check_retry_flags(options: EnvOptions) -> None:
    """`--retry-on` / `--no-retry-on` choose which errors `--retries` retries: alone, they do
    nothing (a `UsageError`)."""
    if options.retries == 0:
        for flag, value in (("--retry-on", options.retry_on),
                            ("--no-retry-on", options.no_retry_on)):  # fmt: skip
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


# A JSON value's kind, by its Python type (the first that matches).
_JSON_KINDS = ((bool, "boolean"), (int | float, "number"), (str, "string"),
               (list | tuple, "list"), (dict, "object"))  # fmt: skip


def _json_kind(value: object) -> str:
    return next((name for kind, name in _JSON_KINDS if isinstance(value, kind)),
                type(value).__name__)  # fmt: skip


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


def build_taskset(
    options: EnvOptions | TasksetOptions,
) -> tuple[Taskset[Any, Any], type[Env[Any]] | None]:
    """The taskset TASKSET names, built with the config `-a` and the system prompt give, and
    the env class TASKSET names (None unless it names an Env subclass); a bad one is a
    `UsageError` naming its flag."""
    return _build_taskset(options.taskset if isinstance(options, EnvOptions) else options,
                          env_spec(options))  # fmt: skip


def _build_taskset(
    given: TasksetOptions, spec: EnvSpec
) -> tuple[Taskset[Any, Any], type[Env[Any]] | None]:
    if given.taskset is None:  # `worker` without TASKSET: a plain config, tasks from the stream
        if spec.config.keys() - {"system_prompt"}:
            raise UsageError("-a/--taskset-args needs a TASKSET to configure")
        return Taskset(TasksetConfig(**spec.config)), None
    cls, env_cls = resolve_target(given.taskset)
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


def build_env(options: EnvOptions, *, endpoint: bool, check_retry_names: bool = True) -> Env[Any]:
    """The env the options describe: the user's Env subclass (or tt.Env) around the taskset,
    with the reward (`--reward`), the retry policy and the rollout limits. `endpoint`: the
    model's endpoint is known (`--base-url`, or the workers' own with `--via`), which a
    verifiers env needs. With `check_retry_names`, a `--retry-on`/`--no-retry-on` name that
    no loaded exception type has is warned about. A bad value is a `UsageError` naming its
    flag."""
    target = options.taskset.taskset
    if options.env_args is not None and not options.verifiers:
        raise UsageError(
            "--env-args applies to a verifiers env",
            fix="name it as TASKSET vf:TASKSET_ID (a taskset's own config fields, what "
            "vf-eval's --env-args sets, are -a/--taskset-args JSON)",
        )
    if options.verifiers:
        if options.reward is not None:
            raise UsageError(
                f"TASKSET {target} is a verifiers env: it scores its episodes itself "
                f"(its @vf.reward methods), so --reward does not apply",
                fix="drop --reward (rescore its rows with trio-tasksets rescore RUN_DIR "
                "--reward TARGET)",
            )
        if options.sandbox is not None or options.max_sandboxes is not None:
            raise UsageError(
                f"TASKSET {target} is a verifiers env: its harness runs in verifiers' own "
                f"runtime, so --sandbox and --max-sandboxes do not apply",
                fix='drop them, and choose its runtime with --env-args (e.g. \'{"agent": '
                '{"runtime": {"type": "subprocess"}}}\')',
            )
        if options.taskset.taskset_args is not None or options.env_class is not None:
            raise UsageError(
                f"TASKSET {target} is a verifiers env: -a and --env-class do not apply",
                fix="give verifiers' own config keys with --env-args JSON",
            )
        check_retry_flags(options)
        policy = RetryPolicy(options.retries, names(options.retry_on), names(options.no_retry_on))
        return _verifiers_env(options, policy, endpoint=endpoint)
    spec = env_spec(options)
    taskset, target_env = _build_taskset(options.taskset, spec)
    try:
        env = spec.build(taskset, target_env=target_env)  # the one env builder
    except ConfigError as exc:
        raise UsageError(flag_message(exc), fix=exc.spelled_fix(PARAMETER_FLAGS)) from exc
    if check_retry_names:
        _check_retry_names(options.command, spec.retries)
    return env


def _verifiers_env(options: EnvOptions, retries: RetryPolicy, *, endpoint: bool) -> Env[Any]:
    """The verifiers env `vf:TASKSET_ID [--env-args JSON]` names, with the rollout limits;
    its errors are usage errors.

    verifiers' harness calls the model itself over HTTP, so `--base-url` is required (but
    with `--via`, where the workers call it with their own)."""
    from ..aio._verifiers import VerifiersEnv, VerifiersTaskset, env_from_cli  # imports verifiers

    target = str(options.taskset.taskset)
    system_prompt = _system_prompt(options)
    if not endpoint:
        raise UsageError(
            f"TASKSET {target}: verifiers' harness calls the model itself over HTTP",
            fix="give -m MODEL --base-url URL (an OpenAI-compatible endpoint)",
        )
    try:
        config = attrs.evolve(env_from_cli(target, options.env_args), system_prompt=system_prompt)
        return VerifiersEnv(
            VerifiersTaskset(config), retries=retries, rollout_limits=options.limits
        )
    except (ImportError, ValueError, TypeError) as exc:
        raise UsageError(f"TASKSET {target}: {type(exc).__name__}: {flag_message(exc)}") from exc


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
