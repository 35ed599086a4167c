"""One exception root, its tree written down, and errors that name parameters (not flags)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
from pathlib import Path

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

    fields = (
        {f.name for f in tt.EvalConfig.__attrs_attrs__}
        | {f.name for f in EnvSpec.__attrs_attrs__}
        | {f.name for f in tt.RolloutLimits.__attrs_attrs__}
    )
    assert set(PARAMETER_FLAGS) <= fields


async def test_eval_config_errors_name_the_parameter(tmp_path: Path) -> None:
    env = tt.Env(tt._core.builtin.EchoTaskset())
    ctx = tt.ModelContext(tt.EchoClient(), "echo")
    config = tt.EvalConfig(num_examples=-1, output_dir=str(tmp_path))
    with pytest.raises(tt.EvalConfigError) as raised:
        await tt.run_eval(env, ctx, config)
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
