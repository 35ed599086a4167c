"""The command line turns its arguments into the library's objects at its edge: each
command's `*_command(args)` builds them, checked, and a bad value is a usage error (exit 2)
naming the flag, found before any work; below it, no function sees an `argparse.Namespace`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import trio_tasksets as tt
from trio_tasksets._cli import main
from trio_tasksets._cli.main import _parse
from trio_tasksets._cli.rescore import rescore_command
from trio_tasksets._cli.serve import serve_command

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


@pytest.mark.parametrize("name", ["serve.py", "worker.py", "report.py", "rescore.py", "heap.py"])
def test_no_namespace_below_a_commands_edge(name: str) -> None:
    """Only `run`-like entry points and the `*_command` builders take the Namespace."""
    tree = ast.parse((CLI / name).read_text())
    takers = {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
        and any(
            "Namespace" in ast.unparse(arg.annotation or ast.Constant(None))
            for arg in node.args.args
        )
    }
    edges = {"run", "run_worker_command", "run_enqueue"}
    assert {t for t in takers if not t.endswith("_command")} <= edges, takers
    assert "getattr(args" not in (CLI / name).read_text()
