"""Per-endpoint figures (issue 23): the dashboard's row per endpoint, and
`--engine-metrics` with repeated `--base-url` on `worker` and `serve`.

The engines are the fake OpenAI server (`tests/fixtures/chat_server.py`) with
`tests/fixtures/engine.py`'s simulated continuous-batching engine as its policy, on
127.0.0.1: in this trio run (on the `autojump_clock`) for the dashboard, as processes of their
own for the real worker and served server. Every wait polls real state under a deadline.
"""

from __future__ import annotations

import io
import json
import os
import re
import select
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import forkserver
import httpx
import pytest
import trio
from chat_server import ChatServer
from engine import ContinuousBatching
from env_server import start_env_server
from helpers import until
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from trio.testing import MockClock

import trio_tasksets as tt
from trio_tasksets._core.exceptions import EvalWarning
from trio_tasksets._models.pool import sticky
from trio_tasksets._monitor.dashboard import Progress, show

ENGINE = str(Path(__file__).resolve().parent / "fixtures" / "engine.py")
ANSI = re.compile(r"\x1b(\[[0-9;?]*[A-Za-z]|\][^\x07\x1b]*(\x07|\x1b\\))")
TOP = "╭─ "  # a frame's top-left corner


def metrics_of(url: str) -> str:
    return url.removesuffix("/v1") + "/metrics"


def name_of(url: str) -> str:
    return url.removeprefix("http://").removesuffix("/v1")


# --- the dashboard ---------------------------------------------------------------------------


async def test_the_dashboard_shows_a_row_per_endpoint_and_which_one_is_ejected(
    autojump_clock: MockClock, recwarn: pytest.WarningsRecorder
) -> None:
    sampling = tt.Sampling(max_tokens=200)  # about 2 s a call: the engines are busy when read
    async with (
        ChatServer(policy=ContinuousBatching(capacity=4, kv_budget=1000, seed=1)) as a,
        ChatServer(policy=ContinuousBatching(capacity=4, kv_budget=1000, seed=2)) as b,
        tt.OpenAIClient([a.url, b.url], max_retries=0, timeout=30,
                        engine_metrics=[metrics_of(a.url), metrics_of(b.url)]) as client,
    ):  # fmt: skip

        async def call(key: int, sampling: tt.Sampling = sampling) -> None:
            with sticky(key):
                await client.chat([{"role": "user", "content": "hi"}], model="sim",
                                  sampling=sampling)  # fmt: skip

        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.feed_engine_metrics)
            async with trio.open_nursery() as calls:
                for key in range(8):
                    calls.start_soon(call, key)
                await trio.sleep(1.5)  # a reading while 4 calls run on each engine
                busy = client.endpoint_stats()
                assert busy is not None
                running = {url: figures["engine"]["running"] for url, figures in busy.items()}
            b.kill()
            for key in range(8, 12):  # b's call fails to connect: b is ejected, a answers
                await call(key, tt.Sampling(max_tokens=4))  # (well within b's ejection)
            stats = client.endpoint_stats()
            progress = Progress(endpoints=client.endpoint_stats)
            progress.planned(12)
            console = Console(file=io.StringIO(), force_terminal=True, width=120)
            async with show(progress, live=True, console=console):
                pass
            line = progress.line()
            await trio.sleep(1.1)  # b is due back (probing) and its engine cannot be read
            later = client.endpoint_stats()
            nursery.cancel_scope.cancel()

    assert running == {a.url: 4.0, b.url: 4.0}  # each engine's own reading, per endpoint
    assert stats is not None
    assert (stats[a.url]["state"], stats[b.url]["state"]) == ("live", "ejected")
    assert stats[b.url]["errors"] == 1
    assert stats[b.url]["ejections"] == 1
    assert stats[a.url]["calls"] + stats[b.url]["calls"] == 13  # 12, and b's one retried on a
    assert stats[a.url]["in_flight"] == stats[b.url]["in_flight"] == 0
    assert stats[a.url]["engine"]["readings"] >= 2
    assert later is not None
    assert later[b.url]["state"] == "probing"
    assert later[b.url]["engine"]["errors"] >= 1
    assert later[a.url]["engine"]["errors"] == 0
    said = [str(w.message) for w in recwarn if issubclass(w.category, EvalWarning)]
    assert len(said) == 1, said  # b's engine, said once
    assert metrics_of(b.url) in said[0]
    output = console.file.getvalue()  # type: ignore[attr-defined]
    frame = ANSI.sub("", output).rsplit(TOP, 1)[-1]
    header = next(row for row in frame.splitlines() if "endpoint" in row)
    assert header.strip("│ ").split() == ["endpoint", "state", "flight", "win", "calls", "err", "429", "p50",
                              "run", "wait", "kv", "pre"]  # fmt: skip
    (row_a,) = [row for row in frame.splitlines() if name_of(a.url) in row]
    (row_b,) = [row for row in frame.splitlines() if name_of(b.url) in row]
    assert " live " in row_a
    assert " ejected " in row_b
    cells_a = row_a.strip("│ ").split()
    assert cells_a[:7] == [name_of(a.url), "live", "0", str(stats[a.url]["window"]),
                           str(stats[a.url]["calls"]), "0", "0"]  # fmt: skip
    assert line.endswith(f"; endpoints 1/2 live, {name_of(b.url)} ejected")


async def test_one_endpoint_keeps_the_compact_view(autojump_clock: MockClock) -> None:
    async with (
        ChatServer(policy=ContinuousBatching(capacity=4)) as engine,
        tt.OpenAIClient(engine.url) as client,
    ):
        await client.chat([{"role": "user", "content": "hi"}], model="sim",
                          sampling=tt.Sampling())  # fmt: skip
        progress = Progress(endpoints=client.endpoint_stats)
        console = Console(file=io.StringIO(), force_terminal=True, width=120)
        async with show(progress, live=True, console=console):
            pass
    frame = ANSI.sub("", console.file.getvalue())  # type: ignore[attr-defined]
    assert "endpoint" not in frame
    assert "flight" not in frame
    assert "endpoints" not in progress.line()


class _Calls(tt.Taskset[tt.Task, tt.TasksetConfig]):
    def load(self) -> list[tt.Task]:
        return [tt.Task("say 7", answer="7", key=str(i)) for i in range(150)]


async def test_an_eval_reads_each_engine_into_its_endpoints_window_and_summary(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    queued = ContinuousBatching(capacity=4, kv_budget=1000, seed=1)
    async with (
        ChatServer(policy=queued) as a,
        ChatServer(policy=ContinuousBatching(capacity=4, kv_budget=1000, seed=2)) as b,
        tt.OpenAIClient([a.url, b.url], engine_metrics=[metrics_of(a.url), metrics_of(b.url)]) as client,
    ):  # fmt: skip
        config = tt.EvalConfig(max_concurrent=64, output_dir=str(tmp_path), run_name="two",
                               dashboard=False)  # fmt: skip
        result = await tt.run_eval(tt.Env(_Calls()), tt.ModelContext(client, "sim"), config)
    summary = result.summary
    assert summary["ok"] == 150
    for url in (a.url, b.url):
        figures = summary["endpoints"][url]
        assert figures["engine"]["readings"] >= 1  # this endpoint's own engine, read
        assert figures["state"] == "live"
        # the engine's queue (capacity 4, window 8 at the start) cut this endpoint's window
        reasons = {reason for _, _, reason in summary["connection_history"][url]}
        assert "engine queue" in reasons, summary["connection_history"][url]
    assert queued.peak_waiting > 0  # (so there was a queue to read)


async def test_one_endpoints_engine_is_read_into_the_window_it_is_given(
    autojump_clock: MockClock,
) -> None:
    """One endpoint (worker's `--engine-metrics` with one `--base-url`): its engine moves the
    rollout window the caller gives `feed_engine_metrics`."""
    window = tt.AdaptiveWindow(1, 8, 64)
    async with (
        ChatServer(policy=ContinuousBatching(capacity=2, kv_budget=1000)) as engine,
        tt.OpenAIClient(engine.url, engine_metrics=metrics_of(engine.url)) as client,
    ):
        assert client.has_engine_metrics
        assert client.endpoint_stats() is None  # one endpoint: no per-endpoint figures

        async def call() -> None:
            me = object()
            await window.acquire(me)
            try:
                await client.chat([{"role": "user", "content": "hi"}], model="sim",
                                  sampling=tt.Sampling(max_tokens=400))  # fmt: skip
            finally:
                window.release(me)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.feed_engine_metrics, window)
            for _ in range(8):
                nursery.start_soon(call)
            await trio.sleep(3.5)
            nursery.cancel_scope.cancel()
    assert client.engine_metrics is not None
    assert client.engine_metrics.readings >= 3
    assert client.engine_metrics.figures()["waiting"] == 6  # 8 calls, 2 running
    assert "engine queue" in {reason for _, _, reason in window.history}
    assert window.size < 8


# --- real engines, worker and served server --------------------------------------------------


def _engine_process() -> tuple[subprocess.Popen[str], str]:
    """A simulated engine (capacity 4) in a process of its own; its base URL."""
    proc = subprocess.Popen(
        [sys.executable, ENGINE, "engine", "--capacity", "4", "--kv", "1000"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    url = proc.stdout.readline().strip() if ready else ""
    if not url.startswith("http://127.0.0.1:"):
        proc.kill()
        raise AssertionError(f"the engine did not start: {url!r}")
    return proc, url


@pytest.fixture
def engines() -> Iterator[list[str]]:
    """Two simulated engines' base URLs (real processes on 127.0.0.1)."""
    started = [_engine_process() for _ in range(2)]
    try:
        yield [url for _, url in started]
    finally:
        for proc, _ in started:
            proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


def _until(predicate: Callable[[], bool], what: str) -> None:
    until(predicate, what, timeout=60.0, every=0.05)  # a worker or served server starting


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _endpoint_args(urls: list[str]) -> list[str]:
    args = []
    for url in urls:
        args += ["--base-url", url]
    for url in urls:
        args += ["--engine-metrics", metrics_of(url)]
    return args


def test_a_worker_splits_its_calls_over_two_endpoints_and_reads_both_engines(
    redis_server: Any, tmp_path: Path, engines: list[str]
) -> None:
    pytest.importorskip("hiredis")
    import redis
    from test_redis import make_tasks, push

    tag = uuid.uuid4().hex[:8]
    stream, group, results = f"{tag}:tasks", f"{tag}:workers", f"{tag}:results"
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    push(r, stream, make_tasks(40))
    log = tmp_path / "worker.log"
    with log.open("wb") as stderr:
        worker = forkserver.popen(
            [sys.executable, "-m", "trio_tasksets", "worker", "--no-dashboard",
             "--feed", redis_server.url, "--stream", stream, "--group", group,
             "--results", results, "--consumer", "w1", "-c", "16", "-m", "sim",
             "--metrics-port", "0", *_endpoint_args(engines)],
            stdout=subprocess.DEVNULL, stderr=stderr,
        )  # fmt: skip
    try:
        _until(lambda: "metrics on http://" in log.read_text(), "the metrics port")
        port = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/", log.read_text())
        assert port is not None
        _until(lambda: r.xlen(results) >= 40, "40 results")
        text = httpx.get(f"http://127.0.0.1:{port.group(1)}/metrics", timeout=10).text
    finally:
        worker.send_signal(signal.SIGTERM)
        code = worker.wait(timeout=60)
        r.close()
    assert code == 0, log.read_text()
    found = _samples(text)
    calls = [found["trio_tasksets_endpoint_calls_total", (("endpoint", url),)] for url in engines]
    assert sum(calls) == 40, calls
    assert min(calls) >= 5, calls  # split over both
    for url in engines:
        assert found["trio_tasksets_endpoint_up", (("endpoint", url), ("state", "live"))] == 1
        assert found["trio_tasksets_endpoint_errors_total", (("endpoint", url),)] == 0
        # each engine's own /metrics was read (a gauge only once there is a reading)
        assert ("trio_tasksets_engine_requests_running", (("endpoint", url),)) in found
        assert found["trio_tasksets_engine_kv_cache_usage", (("endpoint", url),)] >= 0


def _post_runs(url: str, engines: list[str], n: int) -> None:
    client = {"type": "openai", "base_url": engines[0], "base_urls": engines, "timeout": 30.0,
              "max_retries": 0, "api_key_var": None}  # fmt: skip
    with httpx.Client(timeout=60) as http:
        for i in range(n):
            body = {
                "slot": {"task": {"key": f"k{i}", "data": {"prompt": "hi", "answer": "x"}},
                         "rollout": 0},
                "ctx": {"model": "sim", "sampling": {}, "client": client},
            }  # fmt: skip
            response = http.post(url + "/run", json=body)
            assert response.status_code == 200, response.text
            assert response.json()["ok"], response.text


@pytest.mark.parametrize("workers", [1, 2])
def test_a_served_server_reads_both_engines_and_health_shows_each_endpoint(
    tmp_path: Path, engines: list[str], workers: int
) -> None:
    server = start_env_server(
        tmp_path / "stderr", "echo", "--workers", str(workers), *_endpoint_args(engines)
    )
    try:
        _post_runs(server.url, engines, 12)

        def health() -> dict[str, Any]:
            answer: dict[str, Any] = httpx.get(server.url + "/health", timeout=10).json()
            return answer

        # every worker process reads both engines (the policy crossed to it as data)
        _until(lambda: all(health()["endpoints"][url]["engine"]["readings"] >= 1
                           for _ in range(2 * workers) for url in engines),
               "both engines read")  # fmt: skip
        seen = [health() for _ in range(4 * workers)]
    finally:
        server.stop()
    assert {answer["pid"] for answer in seen}
    assert all("endpoints" in a for a in seen)
    if workers == 1:
        (figures,) = {json.dumps(a["endpoints"], sort_keys=True) for a in seen[-1:]}
        endpoints = json.loads(figures)
        calls = [endpoints[url]["calls"] for url in engines]
        assert sum(calls) == 12, calls
        assert min(calls) >= 1, calls  # split over both
        for url in engines:
            assert endpoints[url]["state"] == "live"
            assert endpoints[url]["errors"] == 0
            assert endpoints[url]["engine"]["running"] is not None
            assert endpoints[url]["window"] >= 1


# --- bad values name the flag before any work --------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["worker", "--feed", "redis://127.0.0.1:1/0", "-m", "sim", "-c", "1-8-64",
          "--base-url", "http://127.0.0.1:9/v1", "--engine-metrics", "127.0.0.1:9/metrics"],
         "--engine-metrics: url must be an http:// or https:// URL"),
        (["worker", "--feed", "redis://127.0.0.1:1/0", "-m", "sim",
          "--base-url", "http://127.0.0.1:9/v1", "--base-url", "http://127.0.0.1:8/v1",
          "--engine-metrics", "http://127.0.0.1:9/metrics"],
         "--engine-metrics given 1 times for 2 --base-url"),
        (["worker", "--feed", "redis://127.0.0.1:1/0", "-m", "sim", "-c", "8",
          "--base-url", "http://127.0.0.1:9/v1", "--engine-metrics", "http://127.0.0.1:9/metrics"],
         "-c/--max-concurrent 8 is fixed"),
        (["worker", "--feed", "redis://127.0.0.1:1/0", "--engine-metrics",
          "http://127.0.0.1:9/metrics"], "--engine-metrics does nothing with the echo model"),
        (["serve", "echo", "--engine-metrics", "http://127.0.0.1:9/metrics"],
         "--engine-metrics given 1 times for 0 --base-url"),
        (["serve", "echo", "--base-url", "http://127.0.0.1:9/v1", "--engine-metrics", "nope"],
         "--engine-metrics: url must be an http:// or https:// URL"),
        (["eval", "echo", "-m", "sim", "--max-connections", "8",
          "--base-url", "http://127.0.0.1:9/v1", "--base-url", "http://127.0.0.1:8/v1",
          "--engine-metrics", "http://127.0.0.1:9/metrics",
          "--engine-metrics", "http://127.0.0.1:8/metrics"],
         "--max-connections 8 fixes them"),
    ],
)  # fmt: skip
def test_a_bad_engine_metrics_value_names_the_flag_and_exits_2(
    tmp_path: Path, argv: list[str], named: str
) -> None:
    out = tmp_path / "out"
    done = forkserver.run(
        [sys.executable, "-m", "trio_tasksets", *argv, *(["-o", str(out)] if argv[0] == "eval"
                                                        else [])],
        capture_output=True, text=True, timeout=60, env={**os.environ},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert named in done.stderr
    assert not out.exists()  # no run dir: refused before any work
