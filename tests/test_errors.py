"""One exception root, its tree written down, and errors that name parameters (not flags)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import forkserver
import pytest

import trio_tasksets as tt
from trio_tasksets._cli.options import PARAMETER_FLAGS, flag_message
from trio_tasksets._core import exceptions as _exceptions


def _exception_classes() -> dict[str, type[BaseException]]:
    """Every exception class a module of the package defines (not a private one)."""
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(tt.__path__, "trio_tasksets."):
        if info.name.endswith("__main__"):
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an optional extra that is not installed
            continue
        for name, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == module.__name__
                and not name.startswith("_")
            ):
                found[f"{module.__name__}.{name}"] = value
    return found


def test_every_exception_has_the_one_root_and_is_in_the_tree() -> None:
    classes = _exception_classes()
    assert len(classes) > 40  # the walk found the package's classes
    doc = _exceptions.__doc__ or ""
    for where, cls in classes.items():
        if issubclass(cls, Warning):
            assert cls is tt._eval.EvalWarning, where
        else:
            assert issubclass(cls, tt.TrioTasksetsError), f"{where} is not a TrioTasksetsError"
        assert cls.__name__ in doc, f"{where} is missing from the tree in _exceptions"


def test_config_errors_share_one_class_and_stay_value_errors() -> None:
    from trio_tasksets._core.adaptive import WindowArgumentError
    from trio_tasksets._env.loading import TargetError, TravelError
    from trio_tasksets.aio._verifiers import VerifiersUsageError

    for cls in (tt.EvalConfigError, WindowArgumentError, TargetError, TravelError,
                VerifiersUsageError):  # fmt: skip
        assert issubclass(cls, tt.ConfigError)
        assert issubclass(cls, ValueError)
    assert issubclass(tt.RolloutTimeoutError, TimeoutError)


def test_the_three_refusals_have_distinct_names() -> None:
    names = [cls.__name__ for cls in _exception_classes().values()]
    assert "Refused" not in names
    assert {"RequestRefused", "HandshakeRefused", "EntryRefused"} <= set(names)
    assert len(names) == len(set(names))  # no two exception classes share a name


def test_a_config_error_names_parameters_and_the_cli_spells_flags() -> None:
    error = tt.EvalConfigError("{num_examples} must be >= 0; {workers} {x}", parameter=(
        "num_examples", "workers"))  # fmt: skip
    assert str(error) == "num_examples must be >= 0; workers {x}"  # {x} is no parameter
    assert error.parameter == "num_examples"
    assert flag_message(error) == "-n/--num-examples must be >= 0; --workers {x}"
    assert flag_message(ValueError("{num_examples}")) == "{num_examples}"  # not a ConfigError
    # Every parameter the CLI spells is a field of EvalConfig, of EnvSpec (the env's) or of
    # its RolloutLimits.
    from trio_tasksets._env.spec import EnvSpec
    from trio_tasksets.aio._verifiers import env_from_cli

    fields = (
        {f.alias for f in tt.EvalConfig.__attrs_attrs__}
        | {f.name for f in (*EnvSpec.__attrs_attrs__, *tt.ServedBackend.__attrs_attrs__)}
        | {f.name for f in tt.RolloutLimits.__attrs_attrs__}
    )
    fields |= set(inspect.signature(env_from_cli).parameters)  # a vf: TASKSET's --env-args
    # ViaBackend's errors name its url ``via``, as the eval's setting, and its ``stream``.
    assert set(PARAMETER_FLAGS) <= fields | {"via", "stream"}


async def test_eval_config_errors_name_the_parameter(tmp_path: Path) -> None:
    env = tt.Env(tt._core.builtin.EchoTaskset())
    ctx = tt.ModelContext(tt.EchoClient(), "echo")
    with pytest.raises(tt.EvalConfigError) as raised:  # raised as it is built
        await tt.run_eval(env, ctx, tt.EvalConfig(num_examples=-1, output_dir=str(tmp_path)))
    assert str(raised.value) == "num_examples must be an integer >= 0, got -1"
    assert raised.value.parameter == "num_examples"


def test_the_cli_shows_the_flag_of_the_same_error(tmp_path: Path) -> None:
    done = forkserver.run(
        [sys.executable, "-m", "trio_tasksets", "eval", "echo", "-n", "-1", "--no-dashboard",
         "-o", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert "error: -n/--num-examples must be an integer >= 0, got -1" in done.stderr
    assert not any(tmp_path.iterdir())


# --- bad input across the public API: a ConfigError naming the parameter ----------------------


def bad(value: object) -> Any:
    """`value`, typed as anything: the bad argument a type checker would refuse."""
    return value


async def _items() -> AsyncIterator[int]:
    yield 1  # pragma: no cover (never pulled: the arguments are refused first)


async def _double(item: int) -> int:
    return 2 * item  # pragma: no cover


def _with_var_args(*args: int) -> int:
    """Adds."""
    return sum(args)  # pragma: no cover


def _adds(a: int, b: int) -> int:
    """Adds."""
    return a + b  # pragma: no cover


def _no_hint(a) -> int:  # type: ignore[no-untyped-def]
    """Adds."""
    return 1  # pragma: no cover


def _worker_config(**fields: Any) -> object:
    from trio_tasksets.redis._worker import WorkerConfig

    given = {"feed": "redis://127.0.0.1:1", "stream": "t", "group": "g", "results": "r"}
    return WorkerConfig(**{**given, **fields})


def _redis() -> Any:
    import trio_tasksets.redis

    return trio_tasksets.redis


URL = "redis://127.0.0.1:1"


def _answer(task: object, completion: str) -> float:
    return 1.0  # pragma: no cover (never called: the env is refused first)


def _thread_bridged(**given: Any) -> object:
    """A `BridgedEnv` on a thread loop (no trio-asyncio needed), built with `given`."""

    class ThreadBridged(tt.aio.BridgedEnv[tt.Task]):
        asyncio_loop = "thread"

    return ThreadBridged(**given)


class _AsyncioEnv:
    taskset = tt.EchoTaskset()


BAD_CALLS: list[tuple[str, Callable[[], object], str]] = [
    ("Window(0)", lambda: tt.Window(0), "size"),
    ("Window('3')", lambda: tt.Window(bad("3")), "size"),
    ("AdaptiveWindow(4, 2, 8)", lambda: tt.AdaptiveWindow(4, 2, 8), "min"),
    ("AdaptiveWindow(0, 2, 8)", lambda: tt.AdaptiveWindow(0, 2, 8), "min"),
    ("AdaptiveWindow(cut=2)", lambda: tt.AdaptiveWindow(1, 2, 8, cut=2), "cut"),
    ("AdaptiveWindow.resize(9)", lambda: tt.AdaptiveWindow(1, 2, 8).resize(9), "size"),
    ("build_window(0)", lambda: tt.build_window(0, parameter="max_concurrent"), "max_concurrent"),
    ("EndpointLimits(rpm=-1)", lambda: tt.EndpointLimits(rpm=-1), "rpm"),
    ("EndpointLimits(tpm=nan)", lambda: tt.EndpointLimits(tpm=float("nan")), "tpm"),
    ("EndpointLimits(connections=0)", lambda: tt.EndpointLimits(connections=0), "connections"),
    (
        "EndpointLimits(connections=(4, 2, 8))",
        lambda: tt.EndpointLimits(connections=tt.AdaptiveBounds(4, 2, 8)),
        "connections",
    ),
    ("RateLimiter(0)", lambda: tt.RateLimiter(0), "per_minute"),
    ("RateLimiter(burst=0)", lambda: tt.RateLimiter(60, burst=0), "burst"),
    ("Staleness(-1)", lambda: tt.Staleness(-1), "max_lag"),
    ("Staleness(1.5)", lambda: tt.Staleness(bad(1.5)), "max_lag"),
    ("Staleness(withhold=1)", lambda: tt.Staleness(1, withhold=bad(1)), "withhold"),
    ("Staleness.run(5)", lambda: tt.Staleness(1).run(bad(5)), "fn"),
    ("take(source, -1)", lambda: tt.take(_items(), -1), "n"),
    ("take([1], 1)", lambda: tt.take(bad([1]), 1), "source"),
    ("until(source, 5)", lambda: tt.until(_items(), bad(5)), "stop"),
    ("as_completed(window=0)", lambda: tt.as_completed(_items(), _double, window=0), "window"),
    ("as_completed(run=5)", lambda: tt.as_completed(_items(), bad(5), window=1), "run"),
    ("Taskset.head(-1)", lambda: tt.EchoTaskset().head(-1), "n"),
    ("Taskset.view(5)", lambda: tt.EchoTaskset().view(bad(5)), "transform"),
    ("EchoStreamTaskset().shuffle()", lambda: tt.EchoStreamTaskset().shuffle(), "shuffle"),
    ("JsonlTaskset('')", lambda: list(tt.JsonlTaskset("")), "path"),
    ("JsonlTaskset(poll=0)", lambda: tt.JsonlTaskset("d.jsonl", poll=0), "poll"),
    ("CsvTaskset('')", lambda: list(tt.CsvTaskset("")), "path"),
    ("tool(5)", lambda: tt.tool(bad(5)), "fn"),
    ("tool(*args)", lambda: tt.tool(_with_var_args), "fn"),
    ("tool(no hint)", lambda: tt.tool(_no_hint), "fn"),
    ("tool(name='a b')", lambda: tt.tool(name="a b")(_adds), "name"),
    ("EnvClient('ftp://x')", lambda: tt.EnvClient("ftp://x"), "url"),
    ("EnvClient(transport=)", lambda: tt.EnvClient("http://h:1", transport="udp"), "transport"),
    ("EnvClient(connections=0)", lambda: tt.EnvClient("http://h:1", connections=0), "connections"),
    ("WorkerConfig(feed=http)", lambda: _worker_config(feed="http://x"), "feed"),
    ("WorkerConfig(results=stream)", lambda: _worker_config(results="t"), "results"),
    ("WorkerConfig(claim_idle=0)", lambda: _worker_config(claim_idle=0), "claim_idle"),
    ("WorkerConfig(max_concurrent=0)", lambda: _worker_config(max_concurrent=0), "max_concurrent"),
    ("WorkerConfig(time_limit=-1)", lambda: _worker_config(time_limit=-1), "time_limit"),
    (
        "RedisStreamTaskset(stream='')",
        lambda: _redis().RedisStreamTaskset(URL, "", "g", "c"),
        "stream",
    ),
    (
        "RedisStreamTaskset(block=0)",
        lambda: _redis().RedisStreamTaskset(URL, "s", "g", "c", block=0),
        "block",
    ),
    ("RedisResults(url=http)", lambda: _redis().RedisResults("http://x", "r"), "url"),
    (
        "RedisStreamTaskset(url=http)",
        lambda: _redis().RedisStreamTaskset("http://x", "s", "g", "c"),
        "url",
    ),
    ("RedisResults(stream='')", lambda: _redis().RedisResults(URL, ""), "stream"),
    (
        "TaskEntry(rollout=-1)",
        lambda: tt.worker.TaskEntry(None, "1-0", "k", {}, rollout=-1),
        "rollout",
    ),
    (
        "TaskEntry(rollouts=0)",
        lambda: tt.worker.TaskEntry(None, "1-0", "k", {}, rollouts=0),
        "rollouts",
    ),
    ("ScriptedClient(delay=-1)", lambda: tt.testing.ScriptedClient("hi", delay=-1), "delay"),
    ("Sampling(return_tokens=1)", lambda: tt.Sampling(return_tokens=bad(1)), "return_tokens"),
    ("Tokens(prompt_ids=['a'])", lambda: tt.Tokens(prompt_ids=bad(["a"])), "prompt_ids"),
    (
        "Tokens(completion_logprobs=[0.5])",
        lambda: tt.Tokens(completion_logprobs=bad([0.5, "x"])),
        "completion_logprobs",
    ),
    (
        "Tokens(2 ids, 1 logprob)",
        lambda: tt.Tokens(completion_ids=[1, 2], completion_logprobs=[-0.5]),
        "completion_logprobs",
    ),
    ("Env(reward={})", lambda: tt.Env(tt.EchoTaskset(), reward={}), "reward"),
    ("Env(retries=0)", lambda: tt.Env(tt.EchoTaskset(), retries=0), "retries"),  # type: ignore[arg-type]
    (
        "Env(reward={x: not a function})",
        lambda: tt.Env(tt.EchoTaskset(), reward={"x": bad(5)}),
        "reward",
    ),
    (
        "Env(reward={x: (fn, 'heavy')})",
        lambda: tt.Env(tt.EchoTaskset(), reward={"x": (_answer, bad("heavy"))}),
        "reward",
    ),
    (
        "Env(reward={reward: fn})",
        lambda: tt.Env(tt.EchoTaskset(), reward={"reward": _answer}),
        "reward",
    ),
    ("BridgedEnv(aio_env=object())", lambda: _thread_bridged(aio_env=object()), "aio_env"),
    ("BridgedEnv(aio_env=Env)", lambda: _thread_bridged(aio_env=tt.Env()), "aio_env"),
    ("BridgedEnv()", lambda: _thread_bridged(), "aio_env"),
    (
        "BridgedEnv(taskset, aio_env=)",
        lambda: _thread_bridged(taskset=tt.EchoTaskset(), aio_env=_AsyncioEnv()),
        "taskset",
    ),
]


@pytest.mark.parametrize(("call", "parameter"), [c[1:] for c in BAD_CALLS],
                         ids=[c[0] for c in BAD_CALLS])  # fmt: skip
def test_bad_input_is_a_config_error_naming_its_parameter(
    call: Callable[[], object], parameter: str
) -> None:
    with pytest.raises(tt.ConfigError) as raised:
        call()
    assert parameter in raised.value.parameters, raised.value.parameters
    assert isinstance(raised.value, ValueError)  # `except ValueError` keeps working


async def test_bad_input_to_the_async_api_is_a_config_error_naming_its_parameter() -> None:
    calls: list[tuple[Callable[[], Awaitable[object]], str]] = [
        (lambda: tt.run_stream(_items(), _double, window=0), "window"),
        (lambda: tt.run_stream(_items(), _double, window=bad(True)), "window"),
        (lambda: tt.first(-1, _items(), _double, window=1), "n"),
        (lambda: tt.first(1, _items(), _double, window=1, accept=bad(5)), "accept"),
        (lambda: tt.fan_out(bad(5)), "thunks"),
        (lambda: tt.fan_out(bad([5])), "thunks"),
        (lambda: tt.RateLimiter(60).acquire(-1), "cost"),
        (lambda: tt.HTTPClient().request("GET", "ftp://x"), "url"),
        (lambda: tt.HTTPClient().request("GET", "http://h:x/"), "url"),
        (lambda: tt.HTTPClient().request("G T", "http://127.0.0.1:1/"), "method"),
        (
            lambda: tt.HTTPClient().request("GET", "http://127.0.0.1:1/", headers={"a b": "c"}),
            "headers",
        ),
        (lambda: tt.ModelContext(tt.EchoClient(), "m").chat([], extra={}), "extra"),
    ]
    for call, parameter in calls:
        with pytest.raises(tt.ConfigError) as raised:
            await call()
        assert raised.value.parameter == parameter


def test_a_wrong_kind_of_argument_is_still_a_type_error() -> None:
    from trio_tasksets._core.exceptions import ConfigTypeError

    calls: list[Callable[[], object]] = [
        lambda: tt.tool(bad(5)),
        lambda: tt.take(_items(), bad("2")),
        lambda: tt.Staleness(1).run(bad(5)),
        lambda: tt.Tokens(prompt_ids=bad(["a"])),
        lambda: _thread_bridged(aio_env=object()),
    ]
    for call in calls:
        with pytest.raises(TypeError) as raised:
            call()
        assert isinstance(raised.value, ConfigTypeError)
        assert isinstance(raised.value, tt.ConfigError)
