"""Health (SPEC 12): `summary.json["health"]` (the scheduler's lag, peak in flight, seconds
waited per kind of limit), the dashboard's lag, and `--metrics-port` serving Prometheus text,
scraped over HTTP."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import forkserver
import pytest
import trio
import trio.testing
from helpers import needs

import trio_tasksets as tt
from trio_tasksets._core.health import Health
from trio_tasksets._core.limits import EndpointLimits
from trio_tasksets._models import ModelContext
from trio_tasksets._monitor.dashboard import Progress
from trio_tasksets._monitor.metrics import Metrics, serve_metrics


class Some(tt.Taskset[tt.Task, tt.TasksetConfig]):
    def load(self) -> list[tt.Task]:
        return [tt.Task(f"say {i}", answer=f"say {i}") for i in range(12)]


class Limited(tt.Env[tt.Task]):
    """Each rollout takes a connection slot (2 for everyone) and an rpm token (60/min)."""

    limits = EndpointLimits(connections=2, rpm=60)

    async def rollout(self, task: tt.Task, ctx: ModelContext) -> tuple[list[Any], str]:
        async with self.limits.call("endpoint"):
            reply = await ctx.chat([{"role": "user", "content": task.prompt}])
            await trio.sleep(3.0)
        return [], reply.content


async def test_the_summary_holds_the_health(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    Limited.limits = EndpointLimits(connections=2, rpm=60)
    config = tt.EvalConfig(output_dir=str(tmp_path), run_name="run", dashboard=False,
                           max_concurrent=4)  # fmt: skip
    result = await tt.run_eval(Limited(Some()), ModelContext(tt.EchoClient(), "echo"), config)
    health = result.summary["health"]
    assert health["peak_in_flight"] == 4
    assert health["model_calls"] == 12
    assert set(health["waited_s"]) == {"connection", "rpm"}
    assert health["waited_s"]["connection"] > 0
    assert health["waited_s"]["rpm"] > 0
    lag = health["lag_s"]
    assert lag["samples"] > 0
    assert lag["probe_interval"] == 0.1
    assert (lag["p50"], lag["p99"], lag["max"]) == (0.0, 0.0, 0.0)  # a MockClock has no lag
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["health"] == health


async def test_the_probe_sees_a_blocked_scheduler() -> None:
    """On the real clock: a task that blocks the loop for 0.3 s shows as lag."""
    health = Health(interval=0.01)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(health.probe)
        await trio.sleep(0.05)
        time.sleep(0.3)  # noqa: ASYNC251  (the point: block the scheduler)
        await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    assert health.lag_max >= 0.25
    text = health.lag_text()
    assert text is not None
    assert text.startswith("lag ")
    assert re.search(r"max \d{3} ms\)$", text), text  # ~300 ms


def test_percentiles_of_the_lag() -> None:
    health = Health()
    for ms in range(1, 101):
        health.sample(ms / 1000)
    lag = health.snapshot()["lag_s"]
    assert (lag["p50"], lag["p99"], lag["max"]) == (0.05, 0.099, 0.1)
    assert Health().snapshot()["lag_s"]["p50"] is None


def test_the_dashboard_shows_the_lag() -> None:
    health = Health()
    progress = Progress(title="run", health=health.lag_text)
    assert "lag" not in progress.line()
    health.sample(0.002)
    assert progress.line().endswith("; lag 2.0 ms (p99 2.0 ms, max 2.0 ms)")


async def _scrape(port: int, path: str = "/metrics") -> tuple[int, str]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


def _value(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert found is not None, f"{name} not in\n{text}"
    return float(found.group(1))


async def test_metrics_served_over_http() -> None:
    health = Health()
    window = tt.Window(8)
    metrics = Metrics(health, window=window)
    health.started()
    health.started()
    health.finished()
    health.on_progress("model")
    health.on_unpark("rpm", 1.5)
    health.sample(0.004)
    metrics.record(True, None, {"prompt_tokens": 5, "completion_tokens": 2})
    metrics.record(False, "KeyError", {})
    metrics.record(False, "KeyError", {})
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_metrics, metrics, 0)
        with trio.fail_after(10):
            status, text = await _scrape(port)
            missing, _ = await _scrape(port, "/nope")
        nursery.cancel_scope.cancel()
    assert (status, missing) == (200, 404)
    assert _value(text, 'trio_tasksets_episodes_total{error_type="",outcome="ok"}') == 1
    assert _value(text, 'trio_tasksets_episodes_total{error_type="KeyError",outcome="failed"}') == 2
    assert _value(text, "trio_tasksets_model_calls_total") == 1
    assert _value(text, 'trio_tasksets_tokens_total{kind="prompt"}') == 5
    assert _value(text, 'trio_tasksets_tokens_total{kind="completion"}') == 2
    assert _value(text, 'trio_tasksets_waited_seconds_total{kind="rpm"}') == 1.5
    assert _value(text, "trio_tasksets_in_flight") == 1
    assert _value(text, "trio_tasksets_peak_in_flight") == 2
    assert _value(text, "trio_tasksets_window_size") == 8
    assert _value(text, "trio_tasksets_scheduler_lag_seconds") == 0.004


def _read_until(proc: subprocess.Popen[str], pattern: str, timeout: float = 60) -> re.Match[str]:
    assert proc.stderr is not None
    os.set_blocking(proc.stderr.fileno(), True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        found = re.search(pattern, line)
        if found is not None:
            return found
    raise AssertionError(f"no line matching {pattern!r}")


def test_eval_metrics_port_is_scraped_while_it_runs(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "trio_tasksets", "eval", "echo-stream", "-n", "100000",
            "--echo-delay", "0.01", "-c", "4", "--metrics-port", "0", "-o", str(tmp_path),
            "--run-name", "run", "--no-dashboard"]  # fmt: skip
    proc = forkserver.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = int(_read_until(proc, r"metrics on http://127\.0\.0\.1:(\d+)/metrics").group(1))
        text = ""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until some episodes have finished
            _, text = trio.run(_scrape, port)
            if 'outcome="ok"' in text:
                break
            time.sleep(0.2)
        assert _value(text, 'trio_tasksets_episodes_total{error_type="",outcome="ok"}') >= 1
        assert _value(text, "trio_tasksets_model_calls_total") >= 1
        assert _value(text, "trio_tasksets_window_size") == 4
        assert "trio_tasksets_scheduler_lag_seconds" in text
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["health"]["lag_s"]["samples"] > 0


@pytest.mark.parametrize("bad", ["-1", "70000"])
def test_a_bad_metrics_port_is_a_usage_error(tmp_path: Path, bad: str) -> None:
    argv = [sys.executable, "-m", "trio_tasksets", "eval", "echo", "--metrics-port", bad,
            "-o", str(tmp_path)]  # fmt: skip
    done = forkserver.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--metrics-port must be a port number" in done.stderr


@needs("redis-server", why="a worker's metrics port, the worker on a real Redis")
async def test_worker_metrics_port(tmp_path: Path) -> None:
    pytest.importorskip("hiredis")
    import redis
    from helpers import free_port
    from test_redis import Server as RedisServer
    from test_redis import make_tasks, push

    from trio_tasksets.redis._worker import WorkerConfig, run_worker

    server = RedisServer(free_port(), tmp_path)
    server.start()
    try:
        r = redis.Redis.from_url(server.url, decode_responses=True)
        push(r, "tasks", make_tasks(3))
        config = WorkerConfig(server.url, "tasks", "workers", "results", consumer="me",
                              dashboard=False, metrics_port=0)  # fmt: skip
        lines: list[str] = []
        ctx = tt.ModelContext(tt.EchoClient(), "echo")
        async with trio.open_nursery() as nursery:
            start = functools.partial(run_worker, config, ctx, handle_signals=False,
                                      log=lines.append)  # fmt: skip
            shut_down = await nursery.start(start)
            with trio.fail_after(20):
                while r.xlen("results") < 3:  # noqa: ASYNC110  (Redis state: polled)
                    await trio.sleep(0.02)
            (line,) = [line for line in lines if line.startswith("metrics on ")]
            port = int(line.rsplit(":", 1)[1].split("/")[0])
            with trio.fail_after(10):
                status, text = await _scrape(port)
            shut_down("told")
        r.close()
    finally:
        server.stop()
    assert status == 200
    assert _value(text, 'trio_tasksets_episodes_total{error_type="",outcome="ok"}') == 3
    assert _value(text, "trio_tasksets_model_calls_total") == 3


def test_serve_metrics_port(tmp_path: Path) -> None:
    from test_serve_security import good_request, start

    server = start(tmp_path / "stderr", "--metrics-port", "0")
    try:
        found = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", server.log.read_text())
        assert found is not None, server.log.read_text()
        port = int(found.group(1))
        import httpx

        response = httpx.post(server.url + "/run", json=good_request(), timeout=20)
        assert response.status_code == 200, response.text
        status, text = trio.run(_scrape, port)
    finally:
        server.stop()
    assert status == 200
    assert _value(text, 'trio_tasksets_served_total{outcome="served"}') == 1
    assert _value(text, 'trio_tasksets_episodes_total{error_type="",outcome="ok"}') == 1
    assert _value(text, "trio_tasksets_model_calls_total") == 1
