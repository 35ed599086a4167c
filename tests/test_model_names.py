"""The model's name, said before the slots are spent (issue 35, items 2 and 8).

- `--base-url` without `-m` is a usage error (exit 2, no run dir, no model call) that names
  `-m/--model` and lists the models the server offers at `GET {base_url}/models`, or says it
  could not list them (within a short timeout), for `eval` and `worker` alike;
- a 404 that names the model (vLLM's and OpenAI's wording) ends the eval like a dead
  endpoint: within seconds, exit 1, at most `-c` failed rows, `stopped: "dead_endpoint"`, and
  the fix lists the server's models; a 404 that does not name it (a wrong path) does not;
- a `--base-url` that ends in `/chat/completions` is a usage error naming the URL to give.

The model server is the suite's fake (`tests/fixtures/chat_server.py`, real sockets on
127.0.0.1), told which models it serves and how to answer a request for another one.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import forkserver
import pytest
import trio
import trio.testing
from chat_server import ChatServer
from helpers import free_port

import trio_tasksets as tt
from trio_tasksets._cli.model_options import offered_models
from trio_tasksets._env.env import EpisodeError, EpisodeTask
from trio_tasksets._eval.run import dead_endpoint

KEY_VAR = "OPENAI_API_KEY"
MODELS = ("sim", "sim-large")
LIMIT = 60  # seconds: real sockets, so the real clock; a hang fails the test


@pytest.fixture
def strict() -> Iterator[ChatServer]:
    """A server that serves `MODELS` only: another name gets vLLM's 404."""
    with ChatServer(models=MODELS, unknown_model="vllm") as server:
        yield server


def environ(**changes: str) -> dict[str, str]:
    """This process's environment without an API key, with `changes`."""
    return {**{k: v for k, v in os.environ.items() if k != KEY_VAR}, **changes}


def cli(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "trio_tasksets", *args]
    return forkserver.run(argv, capture_output=True, text=True, timeout=LIMIT, cwd=tmp_path,
                          env=environ() if env is None else env)  # fmt: skip


def eval_args(tmp_path: Path, *args: str) -> list[str]:
    return ["eval", "echo", *args, "-o", str(tmp_path / "out"), "--no-dashboard"]


def error_line(stderr: str) -> str:
    """The one `trio-tasksets CMD: error:` line (there must be exactly one)."""
    lines = [line for line in stderr.splitlines() if ": error: " in line]
    assert len(lines) == 1, stderr
    return lines[0]


def chat_calls(server: ChatServer) -> list[str]:
    return [r.path for r in server.received if r.path.endswith("/chat/completions")]


# --- item 2: --base-url without -m --------------------------------------------------------------


def test_base_url_without_a_model_is_a_usage_error_listing_the_servers_models(
    strict: ChatServer, tmp_path: Path
) -> None:
    done = cli(tmp_path, *eval_args(tmp_path, "--base-url", strict.url, "-n", "3"),
               env=environ(OPENAI_API_KEY="sk-mine"))  # fmt: skip
    assert done.returncode == 2, done.stderr
    line = error_line(done.stderr)
    assert "-m/--model" in line
    assert "sim, sim-large" in line  # what the server offers, from GET /v1/models
    assert "-m sim" in line  # the fix, ready to paste
    assert not (tmp_path / "out").exists()  # no run dir
    assert chat_calls(strict) == []  # no model call: no "model": "echo" sent anywhere
    # The listing went where the model calls would go, with the key they would carry.
    (listing,) = strict.listed
    assert listing.path == "/v1/models"
    assert listing.headers.get("authorization") == "Bearer sk-mine"


@pytest.mark.parametrize("server", ["refused", "silent"])
def test_base_url_without_a_model_says_when_the_models_could_not_be_listed(
    tmp_path: Path, server: Literal["refused", "silent"]
) -> None:
    """A port nothing listens on, or one that accepts and never answers: the usage error
    comes at once (a short timeout), saying the models could not be listed."""
    with socket.socket() as silent:
        if server == "silent":  # the kernel completes connections; nothing reads them
            silent.bind(("127.0.0.1", 0))
            silent.listen(8)
            port = silent.getsockname()[1]
        else:
            port = free_port()
        url = f"http://127.0.0.1:{port}/v1"
        started = time.monotonic()
        done = cli(tmp_path, *eval_args(tmp_path, "--base-url", url, "-n", "3"))
        took = time.monotonic() - started
    assert done.returncode == 2, done.stderr
    line = error_line(done.stderr)
    assert "-m/--model" in line
    assert f"could not list the models at {url}/models" in line
    assert not (tmp_path / "out").exists()
    assert took < 15  # a listing that hangs is given up after a second or two


def test_a_worker_with_base_url_and_no_model_is_a_usage_error_too(
    strict: ChatServer, tmp_path: Path
) -> None:
    pytest.importorskip("hiredis")
    feed = f"redis://127.0.0.1:{free_port()}/0"  # never reached: the usage error comes first
    done = cli(tmp_path, "worker", "--feed", feed, "--base-url", strict.url, "--no-dashboard")
    assert done.returncode == 2, done.stderr
    line = error_line(done.stderr)
    assert line.startswith("trio-tasksets worker: error: ")
    assert "-m/--model" in line
    assert "sim, sim-large" in line
    assert chat_calls(strict) == []


def test_the_echo_model_named_with_a_base_url_is_still_sent(
    strict: ChatServer, tmp_path: Path
) -> None:
    """`-m echo` given: the user named it, so it is the model sent (here refused: a 404)."""
    done = cli(tmp_path, *eval_args(tmp_path, "-m", "echo", "--base-url", strict.url, "-n", "1"))
    assert done.returncode == 1, done.stderr
    assert [r.json()["model"] for r in strict.received if r.path.endswith("/completions")] == [
        "echo"
    ]


# --- item 8: a 404 that names the model is a dead endpoint ------------------------------------


@pytest.mark.parametrize("wording", ["vllm", "openai"])
def test_a_404_naming_the_model_ends_the_eval_at_once_listing_the_models(
    tmp_path: Path, wording: Literal["vllm", "openai"]
) -> None:
    with ChatServer(models=MODELS, unknown_model=wording) as server:
        started = time.monotonic()
        done = cli(tmp_path, *eval_args(tmp_path, "-m", "Qwen/Qwen3-8b", "--base-url",
                                        server.url, "-n", "200", "-c", "4", "--run-name", "r"))  # fmt: skip
        took = time.monotonic() - started
    assert done.returncode == 1, done.stderr
    assert took < 15
    summary = json.loads((tmp_path / "out" / "r" / "summary.json").read_text())
    assert summary["stopped"] == "dead_endpoint"
    assert 1 <= summary["failed"] <= 4  # at most -c rows
    rows = (tmp_path / "out" / "r" / "traces.jsonl").read_text().splitlines()
    assert len(rows) == summary["finished"] <= 4
    assert summary["error"].startswith(
        f"the model endpoint {server.url} does not serve model 'Qwen/Qwen3-8b': ModelHTTPError"
    )
    line = error_line(done.stderr)
    assert "does not serve model 'Qwen/Qwen3-8b'" in line
    fix = line.split("; fix: ", 1)[1]
    assert "sim, sim-large" in fix
    assert "-m sim" in fix


async def test_a_404_naming_the_model_stops_run_eval(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """The library's eval, on the virtual clock: the first episode's 404 stops it."""

    class Many(tt.Taskset[tt.Task, tt.TasksetConfig]):
        def load(self) -> list[tt.Task]:
            return [tt.Task(f"q{i}", answer="ok") for i in range(200)]

    async with ChatServer(models=MODELS, unknown_model="openai") as server:
        ctx = tt.ModelContext(tt.OpenAIClient(server.url), "gpt-9")
        config = tt.EvalConfig(output_dir=str(tmp_path), run_name="run", dashboard=False,
                               max_concurrent=8)  # fmt: skip
        start = trio.current_time()
        result = await tt.run_eval(tt.Env(Many()), ctx, config)
        await ctx.client.aclose()
    assert trio.current_time() - start < 5.0
    assert result.summary["stopped"] == "dead_endpoint"
    assert 1 <= result.summary["failed"] <= 8
    assert "'gpt-9'" in result.summary["error"]


def _failed(message: str, status: int | None) -> tt.Episode:
    return tt.Episode(
        id="e", task=EpisodeTask("k", {}), rollout=0, ok=False, reward=0.0, completion="",
        messages=[], errors=[EpisodeError("ModelHTTPError", message, 1, status)],
    )  # fmt: skip


@pytest.mark.parametrize(
    ("message", "model", "dead"),
    [("The model `m` does not exist.", "m", True),  # vLLM
     ("The model `gpt-9` does not exist or you do not have access to it.", "gpt-9", True),
     ('model "llama3" not found, try pulling it first', "llama3", True),  # Ollama
     ("no such path", "m", False),  # a wrong path: the URL, not the model
     ("The model `other` does not exist.", "m", False),  # not the model sent
     ("http://h/v1/chat/completions returned HTTP 404: Not Found", "v1", False)],
)  # fmt: skip
def test_only_a_404_that_names_the_model_sent_is_dead(message: str, model: str, dead: bool) -> None:
    found = dead_endpoint(_failed(message, 404), model=model)
    assert (found is not None) is dead
    assert dead_endpoint(_failed(message, 400), model=model) is None  # a 404 only


# --- item 8: a --base-url that ends in /chat/completions --------------------------------------


@pytest.mark.parametrize("command", ["eval", "worker", "serve"])
def test_a_base_url_ending_in_chat_completions_is_a_usage_error_naming_the_fix(
    strict: ChatServer, tmp_path: Path, command: str
) -> None:
    given = f"{strict.url}/chat/completions/"
    args: dict[str, list[str]] = {
        "eval": eval_args(tmp_path, "-m", "sim", "--base-url", given, "-n", "3"),
        "worker": ["worker", "--feed", f"redis://127.0.0.1:{free_port()}/0", "-m", "sim",
                   "--base-url", given, "--no-dashboard"],
        "serve": ["serve", "echo", "--port", "0", "--base-url", given],
    }  # fmt: skip
    if command == "worker":
        pytest.importorskip("hiredis")
    done = cli(tmp_path, *args[command])
    assert done.returncode == 2, done.stderr
    line = error_line(done.stderr)
    assert line.startswith(f"trio-tasksets {command}: error: --base-url ")
    assert line.endswith(f"; fix: --base-url {strict.url}")  # the URL to give instead
    assert strict.received == []
    assert not (tmp_path / "out").exists()


async def test_the_listing_says_what_it_found_even_from_a_trio_run(strict: ChatServer) -> None:
    """`offered_models` runs a trio run of its own: from inside one (a command's edge driven
    by a trio test), in a thread. A URL without the API's prefix lists nothing: a 404."""
    assert offered_models(strict.url).names == MODELS
    wrong = offered_models(strict.url.removesuffix("/v1"))
    assert (wrong.names, wrong.problem) == (None, "HTTP 404")


def test_the_fake_server_answers_an_unknown_model_as_vllm_and_openai_do() -> None:
    """The fixture itself: what the tests above rely on."""

    async def main() -> list[Any]:
        found = []
        for wording in ("vllm", "openai"):
            async with (
                ChatServer(models=MODELS, unknown_model=wording) as server,
                tt.HTTPClient() as http,
            ):
                listed = await http.request("GET", f"{server.url}/models")
                body = json.dumps({"model": "x", "messages": [{"role": "user", "content": "hi"}]})
                url = f"{server.url}/chat/completions"
                refused = await http.request("POST", url, body=body.encode())
                served = await http.request("POST", url, body=body.replace('"x"', '"sim"').encode())
                found.append((listed.json(), refused.status, refused.json(), served.status))
        return found

    (vllm, openai) = trio.run(main)
    for listed, status, _, served in (vllm, openai):
        assert [m["id"] for m in listed["data"]] == list(MODELS)
        assert (status, served) == (404, 200)
    assert vllm[2]["error"]["message"] == "The model `x` does not exist."
    assert openai[2]["error"]["code"] == "model_not_found"
