"""The command line when things go wrong (SPEC 4b), in subprocesses, as a user meets it.

Exit codes and the lines that explain them, the drain on SIGTERM/SIGINT with the command
that resumes, what config.json and summary.json record, the checks made before any work,
and the shared env options (`-a`, a taskset file's sibling imports, `--env-class`). The
model is a real OpenAI-compatible HTTP server on 127.0.0.1 that each test starts and tells
what to answer (200, 401, 404, 500, ...): the suite's fake (the `chat` fixture).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import uuid
from functools import partial
from pathlib import Path
from typing import Any, cast

import forkserver
import pytest
import trio
from chat_server import ChatServer
from helpers import until
from redis_server import RedisServer

import trio_tasksets as tt
from trio_tasksets._cli.main import parser
from trio_tasksets._cli.options import HelpFormatter

ROOT = Path(__file__).resolve().parent.parent
FEEDS = str(ROOT / "tests" / "fixtures" / "feeds.py")
KEY_VAR = "OPENAI_API_KEY"


# --- an OpenAI-compatible model server the tests start ----------------------------------------


def echo(text: str) -> str:
    return text


@pytest.fixture
def model(chat: ChatServer) -> ChatServer:
    """The suite's fake model server, echoing the last user message (so an echo taskset's
    episodes score 1), `usage` as below; tests set `status` (and `fail_on`) to fail calls."""
    chat.answer = echo
    chat.usage = {"prompt_tokens": 5, "completion_tokens": 2}
    return chat


# --- running the command ------------------------------------------------------------------------


def environ(**changes: str | None) -> dict[str, str]:
    """This process's environment without an API key, with `changes` (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != KEY_VAR}
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "trio_tasksets", *args]


def eval_args(tmp_path: Path, *args: str) -> list[str]:
    return ["eval", *args, "-o", str(tmp_path / "out"), "--no-dashboard"]


async def acli(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`cli` from a trio test: in a thread, while this test's trio loop goes on."""
    with trio.fail_after(120):
        return await trio.to_thread.run_sync(partial(cli, tmp_path, *args, env=env))


def cli(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return forkserver.run(
        command(*args), capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env=environ() if env is None else env,
    )  # fmt: skip


def error_line(stderr: str) -> str:
    """The one `trio-tasksets CMD: error:` line (there must be exactly one)."""
    lines = [line for line in stderr.splitlines() if ": error: " in line]
    assert len(lines) == 1, stderr
    return lines[0]


def rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "traces.jsonl").read_text().splitlines()]


def summary_of(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())  # type: ignore[no-any-return]


def line_count(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def http_model(model: ChatServer) -> tuple[str, ...]:
    return ("-m", "test-model", "--base-url", model.url)


# --- exit 1: every episode failed, and why ------------------------------------------------------


async def test_a_401_on_every_call_exits_1_naming_the_key_variable(
    model: ChatServer, tmp_path: Path
) -> None:
    model.status = 401
    done = await acli(tmp_path, *eval_args(tmp_path, "echo", *http_model(model), "--run-name", "a"))
    assert done.returncode == 1, done.stderr
    summary_line, failures = done.stdout.splitlines()
    # A 401 on the first calls is a dead endpoint (SPEC 12): the eval stops at the first
    # failed row instead of spending every slot on it.
    summary = summary_of(tmp_path / "out" / "a")
    n = summary["failed"]
    assert 1 <= n <= 8  # at most the rows in flight (-c) when the first one failed
    assert summary_line.startswith(f"0/{n} ok")
    assert failures.startswith(f"{n} failed: ModelHTTPError {n}; first error: ModelHTTPError: ")
    assert "returned HTTP 401" in failures
    line = error_line(done.stderr)
    assert line.startswith(f"trio-tasksets eval: error: the model endpoint {model.url} is dead: ")
    assert line.endswith(
        "; fix: no API key was sent ($OPENAI_API_KEY is not set): export OPENAI_API_KEY=... "
        "(or name the variable with --api-key-var)"
    )
    assert summary["stopped"] == "dead_endpoint"
    assert summary["errors_by_type"] == {"ModelHTTPError": n}
    assert summary["first_error"]["type"] == "ModelHTTPError"
    assert summary["ok"] == 0
    assert summary["error"].startswith(f"the model endpoint {model.url} is dead: ModelHTTPError")

    # With a key that the server refuses, the fix says so.
    done = await acli(tmp_path, *eval_args(tmp_path, "echo", *http_model(model)),
                      env=environ(OPENAI_API_KEY="sk-wrong"))  # fmt: skip
    assert done.returncode == 1
    assert "fix: the server refused the API key in $OPENAI_API_KEY" in error_line(done.stderr)


@pytest.mark.parametrize(
    ("status", "fix"),
    [(404, "fix: check -m/--model 'test-model': the server offers sim (e.g. -m sim)"),
     (500, "fix: the model server failed: see its log"),
     (429, "fix: the server is rate-limiting")],
)  # fmt: skip
async def test_every_call_failing_exits_1_with_the_fix_for_its_status(
    model: ChatServer, tmp_path: Path, status: int, fix: str
) -> None:
    model.status = status
    done = await acli(tmp_path, *eval_args(tmp_path, "echo", "-n", "1", *http_model(model)))
    assert done.returncode == 1, done.stderr
    assert f"returned HTTP {status}" in done.stdout
    assert fix in error_line(done.stderr)


async def test_nothing_answering_at_the_base_url_is_explained(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    done = await acli(tmp_path, *eval_args(tmp_path, "echo", "-n", "1", "--timeout", "5",
                                           "-m", "m", "--base-url", url))  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "ModelConnectionError 1" in done.stdout
    assert f"fix: nothing answers at --base-url {url}" in error_line(done.stderr)


async def test_some_failures_exit_0_and_are_counted_next_to_the_summary(
    model: ChatServer, tmp_path: Path
) -> None:
    model.status, model.fail_on = 400, "ping"
    done = await acli(tmp_path, *eval_args(tmp_path, "echo", *http_model(model)))
    assert done.returncode == 0, done.stderr
    summary_line, failures = done.stdout.splitlines()
    assert summary_line.startswith("7/8 ok")
    assert failures.startswith("1 failed: ModelHTTPError 1; first error: ModelHTTPError: ")
    assert "returned HTTP 400" in failures
    assert ": error: " not in done.stderr


# --- the key, the usage, the record ---------------------------------------------------------


async def test_the_key_reaches_the_server_and_usage_is_summed_from_its_answers(
    model: ChatServer, tmp_path: Path
) -> None:
    model.usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    model.finish_reason = "length"
    args = eval_args(tmp_path, "echo", "-n", "3", *http_model(model), "--run-name", "k")
    done = await acli(tmp_path, *args, env=environ(OPENAI_API_KEY="sk-secret-1"))
    assert done.returncode == 0, done.stderr
    assert [r.headers.get("authorization") for r in model.received] == ["Bearer sk-secret-1"] * 3
    run_dir = tmp_path / "out" / "k"
    assert summary_of(run_dir)["usage"] == {"prompt_tokens": 15, "completion_tokens": 6}
    assert "15 tokens in / 6 out" in done.stdout
    assert [(r["usage"]["prompt_tokens"], r["finish_reason"]) for r in rows(run_dir)] == [
        (5, "length")
    ] * 3
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["api_key_var"] == KEY_VAR
    assert saved["base_url"] == model.url
    assert saved["version"] == tt.__version__
    assert saved["command"][-len(args) :] == args
    assert saved["started_at"]
    for path in run_dir.iterdir():  # the variable's name is recorded, never its value
        assert "sk-secret-1" not in path.read_text()


async def test_without_the_key_variable_no_header_is_sent(
    model: ChatServer, tmp_path: Path
) -> None:
    args = eval_args(tmp_path, "echo", "-n", "1", *http_model(model), "--run-name", "n")
    done = await acli(tmp_path, *args)
    assert done.returncode == 0, done.stderr
    assert "authorization" not in model.received[0].headers
    saved = json.loads((tmp_path / "out" / "n" / "config.json").read_text())
    assert saved["api_key_var"] is None
    # A variable named with --api-key-var is used instead of OPENAI_API_KEY.
    done = await acli(tmp_path, *eval_args(tmp_path, "echo", "-n", "1", *http_model(model),
                                           "--api-key-var", "MY_KEY"),
                      env=environ(MY_KEY="sk-mine", OPENAI_API_KEY="sk-other"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert model.received[-1].headers["authorization"] == "Bearer sk-mine"


# --- stopping early: --max-failures, SIGTERM, SIGINT ------------------------------------------


async def test_max_failures_stops_exits_1_and_prints_the_resume_command(
    model: ChatServer, tmp_path: Path
) -> None:
    model.status = 404  # not 401: that, on the first calls, is a dead endpoint (SPEC 12)
    args = eval_args(tmp_path, "echo", "-c", "1", "--max-failures", "2", *http_model(model),
                     "--run-name", "m")  # fmt: skip
    done = await acli(tmp_path, *args)
    assert done.returncode == 1, done.stderr
    assert error_line(done.stderr).startswith(
        "trio-tasksets eval: error: --max-failures 2: 2 episodes failed; fix: check -m/--model"
    )
    summary = summary_of(tmp_path / "out" / "m")
    assert (summary["stopped"], summary["finished"]) == ("max_failures", 2)
    assert "resume: " in done.stderr


def _resume_command(stderr: str) -> list[str]:
    lines = [line for line in stderr.splitlines() if line.startswith("resume: ")]
    assert len(lines) == 1, stderr
    return shlex.split(lines[0].removeprefix("resume: "))


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_drains_writes_the_summary_and_the_printed_command_resumes(
    tmp_path: Path, sig: signal.Signals, code: int
) -> None:
    args = eval_args(tmp_path, FEEDS + ":Numbers", "-n", "60", "-r", "2", "-c", "4",
                     "--echo-delay", "0.05", "--run-name", "t")  # fmt: skip
    traces = tmp_path / "out" / "t" / "traces.jsonl"
    proc = forkserver.popen(command(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path, env=environ())  # fmt: skip
    until(lambda: line_count(traces) >= 8, "8 rows", timeout=30)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == code, err
    summary = summary_of(tmp_path / "out" / "t")
    assert summary["stopped"] == sig.name
    assert summary["interrupted"] is True
    assert traces.read_text().endswith("\n")
    assert summary["finished"] == len(rows(tmp_path / "out" / "t")) < 120
    # a stopped run says how much of its plan it did: not "28/28 ok" alone (issue 25)
    assert out.startswith(
        f"{summary['ok']}/{summary['finished']} ok ({summary['finished']} of 120 planned)"
    )
    assert f"trio-tasksets eval: stopped by {sig.name}" in err
    resume = _resume_command(err)
    assert resume[-3:] == ["--run-name", "t", "--resume"]

    again = forkserver.run(resume, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                           env=environ())  # fmt: skip
    assert again.returncode == 0, again.stderr
    written = rows(tmp_path / "out" / "t")
    assert len(written) == len({(r["task"]["key"], r["rollout"]) for r in written}) == 120


def test_sigterm_on_a_stream_says_it_cannot_be_resumed(tmp_path: Path) -> None:
    args = eval_args(tmp_path, "echo-stream", "-n", "1000", "-a", '{"gap": 0.01}',
                     "--run-name", "s")  # fmt: skip
    traces = tmp_path / "out" / "s" / "traces.jsonl"
    proc = forkserver.popen(command(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path, env=environ())  # fmt: skip
    until(lambda: line_count(traces) >= 3, "3 rows", timeout=30)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143, err
    assert summary_of(tmp_path / "out" / "s")["stopped"] == "SIGTERM"
    assert "a stream cannot be resumed" in err
    assert "resume: " not in err


# --- a run that fails before its first slot ---------------------------------------------------


def test_a_run_that_fails_before_its_first_slot_leaves_no_run_dir(tmp_path: Path) -> None:
    (tmp_path / "envs.py").write_text(
        textwrap.dedent("""
        import trio_tasksets as tt

        class NoSandbox(tt.Env):
            def serving(self):
                raise RuntimeError("no sandbox today")
    """)
    )
    done = cli(tmp_path, *eval_args(tmp_path, "echo", "--env-class", "envs.py:NoSandbox",
                                    "--run-name", "r"))  # fmt: skip
    assert done.returncode == 1
    assert error_line(done.stderr).startswith(
        "trio-tasksets eval: error: RuntimeError: no sandbox today"
    )
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()
    assert cli(tmp_path, *eval_args(tmp_path, "echo", "--run-name", "r")).returncode == 0


# --- the taskset file: import errors, siblings, -a ----------------------------------------------


@pytest.mark.parametrize(
    ("source", "expected"),
    [("import trio_tasksets as tt\n\nclass T(tt.Taskset:\n    pass\n",
      ["lib/tasks.py:3: SyntaxError: "]),
     ("import trio_tasksets as tt\nlimit = undefined_name + 1\n",
      ["lib/tasks.py:2: NameError: name 'undefined_name' is not defined"]),
     ("import trio_tasksets as tt\nimport helper\n",  # a sibling: its own line is named
      ["lib/helper.py:2: ZeroDivisionError: division by zero"]),
     ("import json\njson.loads('{')\n",  # raised in a library: both places are named
      ["lib/tasks.py:2: JSONDecodeError: ", "(raised at ", "json/decoder.py:"]),
     ("import no_such_module_here\n",
      ["lib/tasks.py:1: ModuleNotFoundError: No module named 'no_such_module_here'"])],
)  # fmt: skip
def test_a_taskset_file_that_fails_to_import_is_one_line_and_exit_2(
    tmp_path: Path, source: str, expected: list[str]
) -> None:
    folder = tmp_path / "lib"
    folder.mkdir()
    (folder / "tasks.py").write_text(source)
    (folder / "helper.py").write_text("x = 1\ny = x / 0\n")
    done = cli(tmp_path, *eval_args(tmp_path, "lib/tasks.py:T"))
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    line = error_line(done.stderr)
    assert line.startswith("trio-tasksets eval: error: TASKSET 'lib/tasks.py:T': lib/"), line
    assert all(part in line for part in expected), line
    debug = cli(tmp_path, *eval_args(tmp_path, "lib/tasks.py:T", "--debug"))
    assert debug.returncode == 2
    assert "Traceback (most recent call last)" in debug.stderr


def test_a_taskset_file_imports_its_sibling_modules(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "phrases.py").write_text("PHRASES = ('alpha', 'beta', 'gamma')\n")
    (project / "tasks.py").write_text(
        textwrap.dedent("""
        import trio_tasksets as tt
        from phrases import PHRASES

        class Greek(tt.Taskset[tt.Task, tt.TasksetConfig]):
            def load(self):
                return [tt.Task(p, answer=p) for p in PHRASES]
    """)
    )
    done = cli(tmp_path, *eval_args(tmp_path, "project/tasks.py:Greek", "--run-name", "g"))
    assert done.returncode == 0, done.stderr
    assert sorted(r["completion"] for r in rows(tmp_path / "out" / "g")) == [
        "alpha", "beta", "gamma",
    ]  # fmt: skip


def test_taskset_args_set_the_config(tmp_path: Path) -> None:
    done = cli(tmp_path, *eval_args(tmp_path, "echo", "-a", '{"phrases": ["one", "two"]}',
                                    "--system-prompt", "be brief", "--run-name", "a"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    written = rows(tmp_path / "out" / "a")
    assert sorted(r["task"]["data"]["prompt"] for r in written) == [
        "Repeat exactly: one", "Repeat exactly: two",
    ]  # fmt: skip
    assert {r["messages"][0]["content"] for r in written} == {"be brief"}
    saved = json.loads((tmp_path / "out" / "a" / "config.json").read_text())
    assert saved["identity"]["taskset_config"]["phrases"] == ["one", "two"]


@pytest.mark.parametrize(
    ("args", "message"),
    [(["-a", '{"phrasez": ["x"]}'], "has no field 'phrasez'; did you mean 'phrases'?"),
     (["-a", '{"phrases": "x"}'], "field 'phrases' takes a list"),
     (["-a", "{phrases: 1}"], "-a/--taskset-args is not JSON"),
     (["-a", "[1]"], "-a/--taskset-args must be a JSON object"),
     (["-a", '{"system_prompt": "a"}', "--system-prompt", "b"], "the system prompt is given twice")],
)  # fmt: skip
def test_bad_taskset_args_are_usage_errors(tmp_path: Path, args: list[str], message: str) -> None:
    done = cli(tmp_path, *eval_args(tmp_path, "echo", *args))
    assert done.returncode == 2
    assert message in error_line(done.stderr)
    assert not (tmp_path / "out").exists()


# --- checks before any work -------------------------------------------------------------------


# duplicates: a table of bad flags and their messages; its rows are alike by design
@pytest.mark.parametrize(
    ("args", "message"),
    [(["--base-url", "localhost:8000/v1", "-m", "x"],
      "--base-url must be an http:// or https:// URL, got 'localhost:8000/v1'; fix: e.g. "
      "http://localhost:8000/v1"),
     (["--base-url", "ftp://h/v1", "-m", "x"], "--base-url must be an http:// or https:// URL"),
     (["--seed", "3"], "--seed does nothing without --shuffle; fix: add --shuffle"),
     (["--token-var", "T"], "--token-var applies to --server-url only"),
     (["--retry-on", "ModelHTTPError"], "--retry-on does nothing without --retries"),
     (["--timeout", "5"], "--timeout does nothing with the echo model"),
     (["--api-key-var", "K"], "--api-key-var does nothing with the echo model"),
     (["--echo-delay", "1", "-m", "x", "--base-url", "http://127.0.0.1:9/v1"],
      "--echo-delay applies to the echo model only"),
     (["--temperature", "-1"], "--temperature must be >= 0"),
     (["--top-p", "0"], "--top-p must be in (0, 1]"),
     (["--max-tokens", "0"], "--max-tokens must be >= 1"),
     (["--max-failures", "0"], "argument --max-failures: takes N"),
     (["--max-failures", "1.5"], "argument --max-failures: takes N"),
     (["--max-failures", "some"], "argument --max-failures: takes N"),
     (["-m", "gpt-x"], "-m/--model 'gpt-x' needs --base-url"),
     (["-c", "8-4-16"],
      "argument -c/--max-concurrent: MIN-START-MAX needs 1 <= MIN <= START <= MAX, got '8-4-16'"),
     (["-c", "fast"], "argument -c/--max-concurrent: expected N or MIN-START-MAX"),
     (["--window-objective", "p99=soon"],
      "argument --window-objective: expected knee, throughput or p99=SECONDS (e.g. p99=2), "
      "got 'p99=soon'"),
     (["-c", "8", "--window-objective", "knee"],
      "--window-objective knee moves an adaptive window, but -c/--max-concurrent 8 is fixed"),
     (["--max-connections", "0", "-m", "x", "--base-url", "http://127.0.0.1:9/v1"],
      "argument --max-connections: N must be >= 1"),
     (["--rpm", "0"], "argument --rpm: must be a number of units per minute > 0, got '0'"),
     (["--tpm", "lots"], "argument --tpm: expected units per minute (a number > 0), got 'lots'"),
     (["--rollout-timeout", "0"], "argument --rollout-timeout: must be a number of seconds > 0"),
     (["--time-limit", "nan"], "argument --time-limit: must be a number of seconds > 0"),
     (["--rpm", "60"], "--rpm does nothing with the echo model"),
     (["--max-connections", "1-4-16"], "--max-connections does nothing with the echo model"),
     (["--serve", "--tpm", "1000", "--max-connections", "4", "-m", "x",
       "--base-url", "http://127.0.0.1:9/v1"],
      "--max-connections, --tpm with --serve: the model calls are made by the env server child"),
     (["--via", "redis://127.0.0.1:9/0", "--rpm", "60", "-m", "x",
       "--base-url", "http://127.0.0.1:9/v1"],
      "fix: drop --rpm here and give them to the workers (trio-tasksets worker)"),
     (["--server-url", "http://127.0.0.1:9", "--rollout-timeout", "5"],
      "--rollout-timeout with --server-url: the episodes run in the env server")],
)  # fmt: skip
def test_a_bad_or_idle_option_is_refused_before_any_work(
    tmp_path: Path, args: list[str], message: str
) -> None:
    done = cli(tmp_path, *eval_args(tmp_path, "echo", *args))
    assert done.returncode == 2, done.stderr
    assert message in error_line(done.stderr)
    assert done.stderr.startswith("usage: trio-tasksets eval")
    assert not (tmp_path / "out").exists()


def test_warnings_name_the_close_match_and_a_short_taskset(tmp_path: Path) -> None:
    done = cli(tmp_path, *eval_args(tmp_path, "echo", "-n", "20", "--retries", "1",
                                    "--retry-on", "ModelHTTPErorr"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (
        "trio-tasksets eval: warning: --retry-on ModelHTTPErorr: no exception type of that name "
        "is loaded (did you mean ModelHTTPError?)"
    ) in done.stderr
    assert (
        "trio-tasksets eval: warning: -n/--num-examples 20 is more than taskset EchoTaskset "
        "holds (8 tasks): the eval runs all 8"
    ) in done.stderr
    assert done.stdout.startswith("8/8 ok")


def test_a_time_limit_drains_writes_the_summary_and_exits_0(tmp_path: Path) -> None:
    run_dir = tmp_path / "out" / "t"
    done = cli(tmp_path, *eval_args(tmp_path, FEEDS + ":Numbers", "-r", "10", "--echo-delay",
                                    "0.25", "-c", "4", "--time-limit", "1", "--run-name", "t"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = summary_of(run_dir)
    assert (summary["stopped"], summary["error"], summary["interrupted"]) == (
        "time_limit",
        None,
        True,
    )
    assert 0 < summary["finished"] == summary["ok"] == len(rows(run_dir)) < 2000
    assert summary["window_history"] == [[0.0, 4, "start"]]
    assert "trio-tasksets eval: stopped at --time-limit 1s: " in done.stderr
    assert "resume: " in done.stderr
    assert done.stdout.startswith(f"{summary['ok']}/{summary['finished']} ok")


def test_a_time_limit_before_any_success_exits_1(tmp_path: Path) -> None:
    done = cli(tmp_path, *eval_args(tmp_path, "echo", "--echo-delay", "30", "--time-limit", "0.5"))
    assert done.returncode == 1, done.stderr
    assert "no episode succeeded within --time-limit 0.5s" in error_line(done.stderr)


def test_resume_without_a_run_name_says_which_run_it_picked(tmp_path: Path) -> None:
    base = eval_args(tmp_path, "echo")
    assert cli(tmp_path, *base, "--run-name", "first").returncode == 0
    assert cli(tmp_path, *base, "--run-name", "second").returncode == 0
    other = eval_args(tmp_path, FEEDS + ":Numbers", "-n", "2", "--run-name", "other")
    assert cli(tmp_path, *other).returncode == 0  # the latest run, of another taskset
    (tmp_path / "out" / "second" / "traces.jsonl").write_text("")
    done = cli(tmp_path, *base, "--resume")
    assert done.returncode == 0, done.stderr
    assert (
        f"trio-tasksets eval: resuming {tmp_path / 'out' / 'second'}, the latest run of taskset "
        f"EchoTaskset with model 'echo' in {tmp_path / 'out'}"
    ) in done.stderr
    assert len(rows(tmp_path / "out" / "second")) == 8


def test_version_and_help_show_every_default(tmp_path: Path) -> None:
    done = cli(tmp_path, "--version")
    assert done.returncode == 0
    assert done.stdout.strip() == f"trio-tasksets {tt.__version__}"
    from importlib.metadata import version

    assert tt.__version__ == version("trio-tasksets")
    commands = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in commands.choices.items():
        assert sub.formatter_class is HelpFormatter
        formatter = HelpFormatter(name)
        for action in sub._actions:  # every option that takes a value and may be left out
            if action.nargs == 0 or not action.option_strings or action.required:
                continue
            if action.help == argparse.SUPPRESS:
                continue
            shown = formatter._get_help_string(action) or ""
            assert action.help, f"{name} {action.option_strings[-1]} has no help line"
            assert "default" in shown, f"{name} {action.option_strings[-1]}: {shown!r}"
    help_text = " ".join(cli(tmp_path, "eval", "--help").stdout.split())
    assert (
        "the window: most rollouts in flight; MIN-START-MAX (e.g. 1-8-512) adapts it" in help_text
    )
    assert "--window-objective (default: 32)" in help_text


# --- serve, worker, enqueue: the same error lines -----------------------------------------------


def test_serve_errors_are_one_line_exit_2_for_usage_and_1_at_runtime(tmp_path: Path) -> None:
    done = cli(tmp_path, "serve", "echo", "--port", "70000")
    assert done.returncode == 2
    assert error_line(done.stderr) == (
        "trio-tasksets serve: error: --port must be in 0..65535, got 70000"
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = cli(tmp_path, "serve", "echo", "--port", str(port))
    assert done.returncode == 1
    line = error_line(done.stderr)
    assert line.startswith(f"trio-tasksets serve: error: cannot listen on 127.0.0.1:{port}: ")
    assert line.endswith("; fix: choose another --port (0: any free one)")
    done = cli(tmp_path, "serve", "echo", "-a", '{"nope": 1}')
    assert done.returncode == 2
    assert "has no field 'nope'" in error_line(done.stderr)


def test_enqueue_and_worker_errors_are_one_line(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"redis://127.0.0.1:{s.getsockname()[1]}/0"
    done = cli(tmp_path, "enqueue", "--feed", url, "--stream", "s", "echo")
    assert done.returncode == 2
    line = error_line(done.stderr)
    assert line.startswith(f"trio-tasksets enqueue: error: --feed {url}: cannot reach Redis")
    assert line.endswith("; fix: start redis-server there, or fix the URL")
    worker = ["worker", "--feed", url, "--stream", "s", "--group", "g", "--results", "r"]
    done = cli(tmp_path, *worker, "-a", '{"x": 1}')
    assert done.returncode == 2
    assert error_line(done.stderr) == (
        "trio-tasksets worker: error: -a/--taskset-args needs a TASKSET to configure"
    )
    done = cli(tmp_path, *worker, "--retry-on", "X")
    assert done.returncode == 2
    assert "--retry-on does nothing without --retries" in error_line(done.stderr)


def _serve(token_var: str, token: str) -> tuple[subprocess.Popen[str], str]:
    proc = forkserver.popen(
        command("serve", "echo", "--port", "0", "--token-var", token_var),
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env=environ(**{token_var: token}),
    )  # fmt: skip
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    assert ready, "the server printed no line in time"
    return proc, proc.stdout.readline().strip().removeprefix("serving on ")


def test_a_401_from_an_env_server_names_the_token_variable(tmp_path: Path) -> None:
    proc, url = _serve("TT_TEST_SERVER_TOKEN", "right-token")
    try:
        done = cli(tmp_path, *eval_args(tmp_path, "echo", "--server-url", url))
        assert done.returncode == 1
        line = error_line(done.stderr)
        assert "answered GET /health with HTTP 401" in line
        assert line.endswith(
            "fix: the env server wants a bearer token: export TT_SERVE_TOKEN=<its token> (or "
            "name the variable with --token-var)"
        )
        done = cli(tmp_path, *eval_args(tmp_path, "echo", "--server-url", url, "--token-var",
                                        "MY_TOKEN"), env=environ(MY_TOKEN="wrong"))  # fmt: skip
        assert done.returncode == 1
        assert "fix: the env server refused the token in $MY_TOKEN" in error_line(done.stderr)
        assert not (tmp_path / "out").exists()  # stopped before any slot: no run dir
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()


# --- the worker takes the shared env options ----------------------------------------------------


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session's redis-server (tests/conftest.py); this test's streams have a uuid tag."""
    return redis_server.url


def test_the_worker_scores_with_the_taskset_its_env_class_and_system_prompt(
    tmp_path: Path, redis_url: str
) -> None:
    import redis

    (tmp_path / "scored.py").write_text(
        textwrap.dedent("""
        import trio_tasksets as tt

        class Scored(tt.Taskset[tt.Task, tt.TasksetConfig]):
            def load(self):
                return [tt.Task(f"Repeat exactly: {word}", answer=word) for word in ("a", "b", "c")]

            def reward(self, task, completion):
                return 0.25

        class Tagged(tt.Env):
            async def rollout(self, task, ctx):
                messages, completion = await super().rollout(task, ctx)
                return messages, "tagged " + completion
    """)
    )
    tag = uuid.uuid4().hex[:8]
    stream, results = f"{tag}:tasks", f"{tag}:results"
    feed = ["--feed", redis_url, "--stream", stream]
    assert cli(tmp_path, "enqueue", *feed, "scored.py:Scored").returncode == 0
    worker = forkserver.popen(
        command("worker", "scored.py:Scored", *feed, "--group", "g", "--results", results,
                "--env-class", "scored.py:Tagged", "--system-prompt", "be brief",
                "--no-dashboard"),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        env=environ(),
    )  # fmt: skip
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        until(lambda: client.xlen(results) >= 3, "3 results", timeout=30)
    finally:
        worker.send_signal(signal.SIGTERM)
        _, err = worker.communicate(timeout=30)
    assert worker.returncode == 0, err
    entries = cast(list[tuple[str, dict[str, str]]], client.xrange(results))
    published = [json.loads(fields["row"]) for _, fields in entries]
    client.close()
    assert len(published) == 3
    assert {row["reward"] for row in published} == {0.25}
    assert all(row["completion"].startswith("tagged Repeat exactly: ") for row in published)
    assert {row["messages"][0]["content"] for row in published} == {"be brief"}
