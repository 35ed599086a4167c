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


async def _scrape(port: int, path: str = "/metrics", host: str | None = None) -> tuple[int, str]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    named = f"host: {host or f'127.0.0.1:{port}'}\r\n" if host != "" else ""
    async with stream:
        await stream.send_all(f"GET {path} HTTP/1.1\r\n{named}\r\n".encode())
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


async def test_the_metrics_server_answers_only_its_own_host() -> None:
    """F11 (issue 36): against DNS rebinding, a Host other than a loopback name or the bound
    address with the bound port is refused (403), a request without one too (400)."""
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_metrics, Metrics(Health()), 0)
        with trio.fail_after(10):
            got = {
                host: (await _scrape(port, host=host))[0]
                for host in (
                    f"127.0.0.1:{port}", f"LOCALHOST:{port}", f"[::1]:{port}", "",
                    f"evil.example:{port}", "evil.example", f"127.0.0.1:{port + 1}",
                    "127.0.0.1", f"127.0.0.1.evil.example:{port}",
                )
            }  # fmt: skip
        nursery.cancel_scope.cancel()
    assert got == {
        f"127.0.0.1:{port}": 200, f"LOCALHOST:{port}": 200, f"[::1]:{port}": 200, "": 400,
        f"evil.example:{port}": 403, "evil.example": 403, f"127.0.0.1:{port + 1}": 403,
        "127.0.0.1": 403, f"127.0.0.1.evil.example:{port}": 403,
    }  # fmt: skip


async def test_the_metrics_server_holds_few_connections_and_drops_idle_ones(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """F4 (issue 36): at most MAX_CONNECTIONS held at once (the rest wait in the kernel's
    queue, holding no descriptor of the run), an idle one dropped after READ_WITHIN."""
    from trio_tasksets._monitor.metrics import MAX_CONNECTIONS, READ_WITHIN

    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_metrics, Metrics(Health()), 0)
        idle = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(3 * MAX_CONNECTIONS)]
        dropped: list[float] = []

        async def watch(stream: trio.SocketStream) -> None:
            assert await stream.receive_some(100) == b""  # closed unanswered: it sent nothing
            dropped.append(trio.current_time())

        start = trio.current_time()
        with trio.fail_after(60):
            async with trio.open_nursery() as watching:
                for stream in idle:
                    watching.start_soon(watch, stream)
            status, _ = await _scrape(port)
        nursery.cancel_scope.cancel()
    assert status == 200
    # in waves of MAX_CONNECTIONS, each held READ_WITHIN: never more at once
    waves = [round((t - start) / READ_WITHIN) for t in sorted(dropped)]
    assert waves == [1] * MAX_CONNECTIONS + [2] * MAX_CONNECTIONS + [3] * MAX_CONNECTIONS


METRICS_FLOOD = """
import resource, sys
import trio
import trio_tasksets as tt

resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
url, out = sys.argv[1], sys.argv[2]


class Sums(tt.Taskset[tt.Task, tt.TasksetConfig]):
    def load(self):
        return [tt.Task(f"What is {a} + 1?", answer=str(a + 1)) for a in range(60)]


class Gated(tt.Env[tt.Task]):
    # The model calls start once the test says so (a line on stdin): after the flood.

    go = None

    async def rollout(self, task, ctx):
        if Gated.go is None:
            Gated.go = trio.Event()
            await trio.to_thread.run_sync(sys.stdin.readline)
            Gated.go.set()
        await Gated.go.wait()
        return await super().rollout(task, ctx)


async def main():
    async with tt.OpenAIClient(url, max_retries=0) as client:
        config = tt.EvalConfig(output_dir=out, run_name="run", dashboard=False, metrics_port=0,
                               max_concurrent=6)
        await tt.run_eval(Gated(Sums()), tt.ModelContext(client, "sim"), config)


trio.run(main)
"""


def test_idle_connections_to_the_metrics_port_never_starve_the_model_calls(
    tmp_path: Path,
) -> None:
    """F4 (issue 36): 300 idle connections to the metrics port of an eval whose descriptors
    are limited to 128, made before its model calls start (each on a new connection: the
    server closes each): every row is ok. Before, the idle connections took every
    descriptor and the calls failed with `Too many open files`."""
    import socket

    from chat_server import ChatServer, Reply
    from helpers import until

    from trio_tasksets._monitor.metrics import MAX_CONNECTIONS

    body = {"choices": [{"message": {"role": "assistant", "content": "1"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1}}  # fmt: skip
    script = tmp_path / "flood.py"
    script.write_text(METRICS_FLOOD)
    held: list[socket.socket] = []
    with ChatServer() as server:
        server.script(*[Reply(body=body, headers={"connection": "close"}, delay=0.25)] * 60)
        argv = [sys.executable, str(script), server.url, str(tmp_path)]
        go_read, go = os.pipe()  # the child's stdin: a line once the flood is in place
        proc = forkserver.popen(argv, stdin=go_read, stderr=subprocess.PIPE, text=True)
        os.close(go_read)
        try:
            port = int(_read_until(proc, r"metrics on http://127\.0\.0\.1:(\d+)/metrics").group(1))
            before = _descriptors(proc.pid)
            for _ in range(300):
                held.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            # Until the metrics server has taken what it takes (the count holds still).
            seen: list[int] = []
            until(
                lambda: _settled(seen, _descriptors(proc.pid), before + MAX_CONNECTIONS),
                "the metrics server to take the idle connections",
            )
            os.write(go, b"go\n")  # now the model calls start
            _, stderr = proc.communicate(timeout=120)
        finally:
            os.close(go)
            for sock in held:
                sock.close()
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 0, stderr
        assert len(server.requests) == 60
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    rows = [json.loads(line) for line in (tmp_path / "run" / "traces.jsonl").open()]
    assert [row["errors"] for row in rows if not row["ok"]] == []
    assert (len(rows), summary["failed"]) == (60, 0)


def _descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _settled(seen: list[int], count: int, least: int) -> bool:
    """Whether `count` is at least `least` and the same as at the last four polls."""
    seen.append(count)
    return count >= least and seen[-5:] == [count] * 5


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
