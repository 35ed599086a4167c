"""A dead endpoint is found before the run spends its slots: against a refused
port, a name that does not resolve, a TLS server it cannot trust, or a 401/403 on the first
calls, the eval ends within 5 s with at most `-c` failed rows, exit 1 and the fix; a
transient failure of an endpoint that has answered does not end it. The fake model server
(`chat_server.ChatServer`) on 127.0.0.1; the in-process runs are on the autojump clock
(backoff sleeps are virtual)."""

from __future__ import annotations

import json
import ssl
import sys
from pathlib import Path
from typing import Any

import forkserver
import pytest
import trio
import trio.testing
import trustme
from chat_server import ChatServer
from helpers import free_port

import trio_tasksets as tt


class Many(tt.Taskset[tt.Task, tt.TasksetConfig]):
    def load(self) -> list[tt.Task]:
        return [tt.Task(f"q{i}", answer="ok") for i in range(200)]


def refused_url() -> str:
    return f"http://127.0.0.1:{free_port()}/v1"  # closed: nothing listens there now


def answering_ok(**options: Any) -> ChatServer:
    """The fake model server, answering "ok" (each task's answer) unless scripted."""
    return ChatServer(answer=lambda _: "ok", **options)


def _config(tmp_path: Path, **kw: Any) -> tt.EvalConfig:
    return tt.EvalConfig(output_dir=str(tmp_path), run_name="run", dashboard=False,
                         max_concurrent=8, **kw)  # fmt: skip


def _rows(tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "run" / "traces.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


async def _dead(tmp_path: Path, url: str, **client: Any) -> tt.EvalResult:
    ctx = tt.ModelContext(tt.OpenAIClient(url, **client), "m")
    start = trio.current_time()
    result = await tt.run_eval(tt.Env(Many()), ctx, _config(tmp_path))
    assert trio.current_time() - start < 5.0
    assert result.summary["stopped"] == "dead_endpoint"
    assert 1 <= result.summary["failed"] <= 8  # at most -c rows
    assert len(_rows(tmp_path)) == result.summary["finished"] <= 8
    await ctx.client.aclose()
    return result


async def test_a_refused_port_ends_the_eval_at_once(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    url = refused_url()
    result = await _dead(tmp_path, url)
    assert result.summary["error"].startswith(f"the model endpoint {url} is dead:")
    assert "ModelConnectionError" in result.summary["error"]


async def test_a_401_on_the_first_calls_ends_the_eval(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with answering_ok(status=401) as server:
        result = await _dead(tmp_path, server.url)
    assert "HTTP 401" in result.summary["error"]


async def test_a_tls_server_it_cannot_trust_ends_the_eval(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    trustme.CA().issue_cert("127.0.0.1").configure_cert(context)  # a CA the client lacks
    async with answering_ok(tls=context) as server:
        assert server.url.startswith("https://")
        result = await _dead(tmp_path, server.url)
    assert "certificate" in result.summary["error"]


async def test_a_name_that_does_not_resolve_ends_the_eval(tmp_path: Path) -> None:
    """On the real clock: the lookups run in threads, which the autojump clock would race."""
    await _dead(tmp_path, "http://no-such-host.invalid/v1")


async def test_a_transient_failure_of_a_live_endpoint_does_not_end_the_eval(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """The endpoint answers, then refuses one request with 401 and fails a few with 503
    past the client's retries: those rows fail, the eval goes on to the end."""
    async with answering_ok() as server:
        server.script(200, 200, 401, *([503] * 8))
        ctx = tt.ModelContext(tt.OpenAIClient(server.url, max_retries=1), "m")
        config = _config(tmp_path, num_examples=40)
        config.max_concurrent = 1
        result = await tt.run_eval(tt.Env(Many()), ctx, config)
        await ctx.client.aclose()
    assert result.summary["stopped"] is None
    assert result.summary["finished"] == 40
    assert 1 <= result.summary["failed"] <= 6


def test_the_cli_exits_1_with_the_fix_and_few_rows(tmp_path: Path) -> None:
    url = refused_url()
    argv = [sys.executable, "-m", "trio_tasksets", "eval", "echo", "-m", "m", "--base-url",
            url, "-n", "300", "-c", "4", "-o", str(tmp_path), "--run-name", "run",
            "--no-dashboard"]  # fmt: skip
    done = forkserver.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert f"nothing answers at --base-url {url}" in done.stderr
    assert "is dead" in done.stderr
    assert len(_rows(tmp_path)) <= 4


async def test_many_dead_endpoints_are_all_named(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    urls = [refused_url() for _ in range(2)]
    result = await _dead(tmp_path, urls)  # type: ignore[arg-type]
    assert result.summary["error"].startswith(f"the model endpoints {urls[0]}, {urls[1]} are dead:")


def test_the_cli_fix_line_names_every_base_url(tmp_path: Path) -> None:
    urls = [refused_url() for _ in range(2)]
    argv = [sys.executable, "-m", "trio_tasksets", "eval", "echo", "-m", "m", "--base-url",
            urls[0], "--base-url", urls[1], "-n", "300", "-c", "4", "-o", str(tmp_path),
            "--run-name", "run", "--no-dashboard"]  # fmt: skip
    done = forkserver.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert f"nothing answers at --base-url {urls[0]} --base-url {urls[1]}" in done.stderr


@pytest.mark.parametrize("status", [403])
async def test_a_403_is_dead_too(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, status: int
) -> None:
    async with answering_ok(status=status) as server:
        result = await _dead(tmp_path, server.url)
    assert f"HTTP {status}" in result.summary["error"]
