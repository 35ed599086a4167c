"""The command line turns its arguments into the library's objects at its edge: each
command's `*_command(args)` builds them, checked, and a bad value is a usage error (exit 2)
naming the flag, found before any work; below it, no function sees an `argparse.Namespace`."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import attrs
import pytest

import trio_tasksets as tt
from trio_tasksets._cli import main
from trio_tasksets._cli.eval import eval_command
from trio_tasksets._cli.main import _parse
from trio_tasksets._cli.rescore import rescore_command
from trio_tasksets._cli.serve import serve_command
from trio_tasksets._core.exceptions import ConfigError

CLI = Path(tt.__file__).parent / "_cli"


def cli(*words: str) -> int:
    try:
        return main(list(words))
    except SystemExit as exc:
        return int(exc.code or 0)


def parsed(*words: str) -> object:
    args = _parse(list(words))
    args.argv = list(words)
    args.tt_own_process = False
    return args


# duplicates: a table of bad flags and their messages; its rows are alike by design
@pytest.mark.parametrize(
    ("words", "message"),
    [
        (["worker", "--feed", "http://x", "echo"], "--feed: 'http://x' is not a Redis URL"),
        (["worker", "--feed", "redis://127.0.0.1:1", "--results", "tasks", "echo"],
         "--results must differ from --stream (both 'tasks')"),
        (["worker", "--feed", "redis://127.0.0.1:1", "--claim-idle", "0", "echo"],
         "--claim-idle must be a number of seconds > 0, got 0.0"),
        (["worker", "--feed", "redis://127.0.0.1:1", "--grace", "-1", "echo"],
         "--grace must be a number of seconds >= 0, got -1.0"),
        (["worker", "--feed", "redis://127.0.0.1:1", "--group", "", "echo"],
         "--group must be a non-empty name, got ''"),
        (["worker", "--feed", "redis://127.0.0.1:1", "--metrics-port", "70000", "echo"],
         "--metrics-port must be a port number 0-65535"),
        (["enqueue", "--feed", "redis://127.0.0.1:1", "-n", "-1", "echo"],
         "-n/--num-examples must be >= 0, got -1"),
        (["rescore", "nothing", "--reward", "x.py:f", "-c", "0"], "-c/--max-concurrent must be"),
        (["serve", "echo", "--workers", "0"], "--workers must be >= 1, got 0"),
        (["serve", "echo", "--host", "0.0.0.0", "--token-var", "TT_EDGE_UNSET"],
         "--token-var: environment variable TT_EDGE_UNSET is not set"),
        (["report", "nothing"], "report: error: "),
    ],
)  # fmt: skip
def test_a_bad_value_is_a_usage_error_naming_its_flag(
    words: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli(*words) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "usage: trio-tasksets" in err


def test_the_report_names_its_output_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        cli("eval", "echo", "-n", "1", "--no-dashboard", "-o", str(tmp_path), "--run-name", "r")
        == 0
    )
    capsys.readouterr()
    assert cli("report", str(tmp_path / "r"), "-o", str(tmp_path / "no" / "x.html")) == 2
    err = capsys.readouterr().err
    assert f"error: -o/--output '{tmp_path / 'no' / 'x.html'}': its directory" in err
    assert "fix: pass a run dir" not in err  # the run dir was fine


def test_each_command_builds_the_library_objects(tmp_path: Path) -> None:
    (tmp_path / "rewards.py").write_text("def one(task, completion):\n    return 1.0\n")
    command = rescore_command(parsed(
        "rescore", "run", "--reward", f"{tmp_path}/rewards.py:one", "-c", "3", "--run-name", "x"
    ))  # type: ignore[arg-type]  # fmt: skip
    assert isinstance(command.window, tt.Window)
    assert command.window.size == 3
    assert command.reward(None, "") == 1.0
    assert command.run_name == "x"
    served = serve_command(parsed(
        "serve", "echo", "--port", "0", "--max-runs-per-connection", "7", "--allow-host", "a.b"
    ))  # type: ignore[arg-type]  # fmt: skip
    assert served.limits.max_runs == 7
    assert served.allow_hosts == ("a.b",)
    assert isinstance(served.env, tt.Env)
    assert served.token is None
    cmd = served.worker_cmd(1234)
    assert cmd[cmd.index("--port") + 1] == "1234"
    assert "--allow-host" in cmd


# The readers of an option group that several commands share: each command's edge calls them.
READERS = {"taskset_options", "env_options", "endpoints", "model_options", "window_arg"}
EDGES = {"run", "run_worker_command", "run_enqueue"}


def _functions(name: str) -> list[ast.FunctionDef]:
    tree = ast.parse((CLI / name).read_text())
    return [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)]


@pytest.mark.parametrize("name", sorted(p.name for p in CLI.glob("*.py")))
def test_no_namespace_below_a_commands_edge(name: str) -> None:
    """Only `run`-like entry points, the `*_command` builders and the option groups' readers
    take the Namespace; nothing reads it with a default (`getattr(args, ...)`)."""
    takers = {
        node.name
        for node in _functions(name)
        if any(
            "Namespace" in ast.unparse(arg.annotation or ast.Constant(None))
            for arg in node.args.args
        )
    }
    assert {t for t in takers if not t.endswith("_command")} <= EDGES | READERS, takers
    assert "getattr(args" not in (CLI / name).read_text()


@pytest.mark.parametrize("name", sorted(p.name for p in CLI.glob("*.py")))
def test_the_readers_are_called_at_the_edge_only(name: str) -> None:
    """A shared group's reader is called by a command's `*_command` builder (or another
    reader), never deeper."""
    for node in _functions(name):
        called = {
            call.func.id
            for call in ast.walk(node)
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
        }
        if called & READERS:
            assert node.name.endswith("_command") or node.name in READERS, node.name


def test_eval_builds_the_library_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    command = eval_command(parsed(
        "eval", "echo", "-m", "m", "--base-url", "http://127.0.0.1:9/v1", "--rpm", "60",
        "--rollout-timeout", "5", "--retries", "2", "-c", "4", "--temperature", "0.5",
    ))  # type: ignore[arg-type]  # fmt: skip
    assert isinstance(command.ctx.client, tt.OpenAIClient)
    assert command.ctx.sampling.temperature == 0.5
    assert command.env.rollout_limits == tt.RolloutLimits(rollout_timeout=5)
    assert command.env.retries.max_retries == 2
    assert command.config.max_concurrent == 4
    assert command.model.endpoints.base_urls == ("http://127.0.0.1:9/v1",)
    assert command.argv[:2] == ("eval", "echo")
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        command.env = command.env  # type: ignore[misc]


def test_serve_spells_the_servers_real_parameters_as_its_flags() -> None:
    """`serve`'s FLAGS names parameters that exist (`ModelPolicy`'s, `Limits`',
    `Access.for_bind`'s), so each error of the model policy and each refusal is spelled as
    the flag that sets it."""
    from trio_tasksets._cli.options import PARAMETER_FLAGS
    from trio_tasksets._cli.serve import FLAGS
    from trio_tasksets._serve.policy import SETTINGS, Access, Limits, ModelPolicy

    real = (
        {field.name for field in attrs.fields(ModelPolicy)}
        | {field.name for field in attrs.fields(Limits)}
        | set(inspect.signature(Access.for_bind).parameters)
    )
    assert FLAGS.keys() - PARAMETER_FLAGS.keys() <= real
    assert FLAGS.keys() >= SETTINGS
    cases: list[tuple[dict[str, Any], str]] = [
             ({"max_retries": -1}, "--max-model-retries must be >= 0"),
             ({"min_backoff": -1.0}, "--min-model-backoff must be >= 0"),
             ({"base_urls": ["ftp://x/v1"]}, "--allow-base-url: expected http://"),
             ({"engine_metrics": [("http://h/v1", "ftp://m")]}, "--engine-metrics: "),
             ({"api_key_var": "TT_EDGE_UNSET"}, "--api-key-var: environment variable")]  # fmt: skip
    for given, said in cases:
        settings: dict[str, Any] = {"base_urls": [], "api_key_var": None, **given}
        with pytest.raises(ConfigError) as caught:
            ModelPolicy.from_flags(environ={}, **settings)
        assert caught.value.parameter in FLAGS
        assert caught.value.spelled(FLAGS).startswith(said)
