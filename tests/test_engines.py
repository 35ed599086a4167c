"""Engines that queue, rate limits that are not concurrency limits, many endpoints (issue 23).

The servers are the suite's fake (`tests/fixtures/chat_server.py`) with the policies of an
engine that queues (`tests/fixtures/engine.py`) or of a rate limit: real sockets on 127.0.0.1
in the test's own trio run, so every test runs on `MockClock(autojump_threshold=0)`: exact
and quick.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import trio

import trio_tasksets as tt
from trio_tasksets._core.adaptive import (
    AdaptiveBounds,
    AdaptiveController,
    AdaptiveWindow,
    EngineLoad,
    Outcome,
    Pacer,
)
from trio_tasksets._core.exceptions import EvalWarning
from trio_tasksets._core.limits import says_request_rate
from trio_tasksets._models.engine import EngineMetrics, EngineMetricsError, parse_engine_metrics
from trio_tasksets._models.pool import sticky
from trio_tasksets._transport import HTTPClient

FIXTURES = Path(__file__).resolve().parent / "fixtures"
if str(FIXTURES) not in sys.path:
    sys.path.insert(0, str(FIXTURES))

from chat_server import ChatServer, RateLimit  # noqa: E402
from engine import ContinuousBatching  # noqa: E402

SAY = [{"role": "user", "content": "say 7"}]


async def _calls(client: tt.OpenAIClient, n: int, *, window: int) -> list[tt.Completion]:
    async def one(_: int) -> tt.Completion:
        return await client.chat(SAY, model="sim", sampling=tt.Sampling())

    async def numbers() -> Any:
        for i in range(n):
            yield i

    return await tt.run_stream(numbers(), one, window=window)


# --- the simulated engine ---------------------------------------------------------------------


async def test_a_call_alone_is_faster_than_one_in_a_full_batch(autojump_clock: Any) -> None:
    engine = ContinuousBatching(capacity=48, kv_budget=10_000, spread=0)
    async with ChatServer(policy=engine) as server, tt.OpenAIClient(server.url) as client:
        await _calls(client, 1, window=1)
        alone = engine.latencies[-1]
        await _calls(client, 48, window=48)
        batched = max(engine.latencies[-48:])
    # 16 steps of 10 ms + 0.2 ms per running call, and a 2 ms prefill
    assert alone == pytest.approx(16 * 0.0102 + 0.002, rel=0.01)
    assert batched > 1.7 * alone
    assert engine.peak_running == 48
    assert engine.preemptions == 0


async def test_calls_past_the_capacity_wait_and_never_get_a_429(autojump_clock: Any) -> None:
    engine = ContinuousBatching(capacity=8, kv_budget=10_000, spread=0)
    async with (
        ChatServer(policy=engine) as server,
        tt.OpenAIClient(server.url, max_retries=0) as client,
    ):
        results = await _calls(client, 64, window=64)
    assert len(results) == 64  # max_retries=0: any 429 would have raised
    assert engine.peak_running == 8
    assert engine.peak_waiting >= 56  # all but the first batch, at least
    ordered = sorted(engine.latencies)
    assert ordered[-1] > 7 * ordered[0]  # the last waited for seven batches before it


async def test_past_the_kv_budget_the_youngest_running_call_is_preempted(
    autojump_clock: Any,
) -> None:
    engine = ContinuousBatching(capacity=48, kv_budget=64, spread=0)
    async with ChatServer(policy=engine) as server, tt.OpenAIClient(server.url) as client:
        await _calls(client, 200, window=48)
        assert engine.preemptions > 0
        assert engine.wasted_tokens > 0
        assert engine.calls == 200
        assert len(engine.latencies) == 200
    engine = ContinuousBatching(capacity=48, kv_budget=64, spread=0)
    async with ChatServer(policy=engine) as server, tt.OpenAIClient(server.url) as client:
        await _calls(client, 200, window=30)  # 30 calls hold at most 60 units
        assert engine.preemptions == 0


async def test_metrics_are_vllm_prometheus_text_read_by_prometheus_client(
    autojump_clock: Any,
) -> None:
    engine = ContinuousBatching(capacity=4, kv_budget=100)
    async with (
        ChatServer(policy=engine) as server,
        tt.OpenAIClient(server.url) as client,
        HTTPClient() as http,
    ):
        metrics = EngineMetrics(server.url.removesuffix("/v1") + "/metrics", http_client=http)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: _calls(client, 10, window=10))
            await trio.sleep(0.05)  # a few engine steps in: 4 run, 6 wait
            load = await metrics.read()
            assert load.running == 4
            assert load.waiting == 6
            assert load.kv_usage is not None
            assert 0 < load.kv_usage < 1
        done = await metrics.read()
    assert done.running == 0
    assert done.waiting == 0
    assert done.preemptions == 0


def test_engine_metrics_by_sglang_names_and_bad_text() -> None:
    text = (
        "# TYPE sglang:num_running_reqs gauge\n"
        'sglang:num_running_reqs{model_name="m",tp_rank="0"} 3\n'
        'sglang:num_running_reqs{model_name="m",tp_rank="1"} 4\n'
        "# TYPE sglang:num_queue_reqs gauge\n"
        'sglang:num_queue_reqs{model_name="m"} 2\n'
        "# TYPE sglang:token_usage gauge\n"
        'sglang:token_usage{tp_rank="0"} 0.5\nsglang:token_usage{tp_rank="1"} 0.7\n'
        "# TYPE sglang:num_retracted_requests counter\n"
        "sglang:num_retracted_requests_total 9\n"
    )
    assert parse_engine_metrics(text) == EngineLoad(7, 2, 0.7, 9)
    with pytest.raises(EngineMetricsError, match="no engine load metrics"):
        parse_engine_metrics("# TYPE up gauge\nup 1\n")
    with pytest.raises(EngineMetricsError, match="not Prometheus text"):
        parse_engine_metrics("vllm:num_requests_running{ 1\n")
    with pytest.raises(ValueError, match="http:// or https://"):
        EngineMetrics("127.0.0.1:8000/metrics")


# --- what a 429 says ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "rate"),
    [
        ([("x-ratelimit-remaining-requests", "0")], True),
        ([("X-RateLimit-Remaining-Tokens", "0")], True),
        ([("anthropic-ratelimit-requests-remaining", "0")], True),
        ([("RateLimit", "limit=100, remaining=0, reset=5")], True),
        ([("x-ratelimit-remaining-requests", "12")], False),
        # a token budget refuses a call that needs more than what remains: spent under 5 %
        ([("ratelimit-remaining", "7"), ("ratelimit-limit", "494")], True),
        ([("x-ratelimit-limit-tokens", "3000"), ("x-ratelimit-remaining-tokens", "40")], True),
        # a gateway's rate headers on a concurrency 429: the budget is far from spent
        (
            [("x-ratelimit-remaining-requests", "990"), ("x-ratelimit-limit-requests", "1000")],
            False,
        ),
        ([("x-ratelimit-remaining-tokens", "40"), ("x-ratelimit-limit-requests", "60")], False),
        ([("retry-after", "1")], False),  # a concurrency limit sends it too
        ([("RateLimit", "limit=100, remaining=05")], False),
        ([], False),
    ],
)
def test_a_429_is_a_request_rate_limit_when_its_headers_say_a_budget_is_spent(
    headers: list[tuple[str, str]], rate: bool
) -> None:
    assert says_request_rate(headers) is rate


async def test_the_rate_limited_server_answers_429_with_headers_above_its_rate(
    autojump_clock: Any,
) -> None:
    async with ChatServer(0.01, policy=RateLimit(50, burst=1)) as server, HTTPClient() as http:
        statuses = []
        for _ in range(20):
            response = await http.request("POST", server.url + "/chat/completions", body=b"{}")
            statuses.append(response.status)
            if response.status == 429:
                assert response.retry_after == 1.0
                assert response.header("x-ratelimit-remaining-requests") == "0"
                await trio.sleep(0.01)  # a call starts every 10 ms: every other one fits
        await trio.sleep(1)
        fresh = await http.request("POST", server.url + "/chat/completions", body=b"{}")
    # one call every 20 ms passes
    assert statuses.count(200) == 10
    assert statuses.count(429) == 10
    assert fresh.status == 200


# --- the latency signal ---------------------------------------------------------------------


class Calls(tt.Taskset[tt.Task, tt.TasksetConfig]):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def load(self) -> Iterable[tt.Task]:
        return [tt.Task("say 7", answer="7", key=str(i)) for i in range(self.n)]


async def _eval(
    url: str | list[str],
    window: int | AdaptiveBounds | tt.Window,
    n: int,
    out: Path,
    **client: Any,
) -> tuple[float, dict[str, Any]]:
    async with tt.OpenAIClient(url, **client) as model:
        ctx = tt.ModelContext(model, "sim")
        config = tt.EvalConfig(
            max_concurrent=window, output_dir=str(out), run_name=f"run{id(window)}-{n}",
            dashboard=False,
        )  # fmt: skip
        start = trio.current_time()
        result = await tt.run_eval(tt.Env(Calls(n)), ctx, config)
        return n / (trio.current_time() - start), result.summary


async def test_against_an_engine_that_queues_the_window_stops_where_throughput_does(
    autojump_clock: Any, tmp_path: Path
) -> None:
    """Without a 429 ever, `-c 1-8-1024` would grow to 1024; here it stops near the capacity
    (48), and its throughput matches a fixed window of the capacity."""
    async with ChatServer(policy=ContinuousBatching(capacity=48, kv_budget=10_000)) as server:
        fixed, _ = await _eval(server.url, 48, 600, tmp_path)
    async with ChatServer(policy=ContinuousBatching(capacity=48, kv_budget=10_000)) as server:
        window = AdaptiveWindow(1, 8, 1024)
        adaptive, summary = await _eval(server.url, window, 1500, tmp_path)
    reasons = {reason for _, _, reason in summary["window_history"]}
    assert "no gain" in reasons
    assert 32 <= window.size <= 96
    assert adaptive >= 0.9 * fixed


def test_a_probe_that_does_not_pay_is_undone_and_growth_waits() -> None:
    """The controller on a model of a full engine: 40 calls at most, 0.2 s each alone."""
    c = AdaptiveController(1, 1024, 32, slow_start=False, probe_above=1.0)  # probe at once
    now = 0.0

    def round_at(size: int) -> Any:
        nonlocal now
        latency = 0.2 * max(1.0, size / 40)  # past 40 the calls queue
        change = None
        for _ in range(size):
            now += latency / size
            found = c.record(Outcome.SUCCESS, now, size, latency=latency)
            change = found or change
        return change

    assert round_at(32) == tt._core.adaptive.Change(40, "grow")  # measured, and room to grow
    assert round_at(40) is None  # settles: its calls started at 32
    # measures: 25 % more calls, 25 % more throughput: kept, and the next probe
    assert round_at(40) == tt._core.adaptive.Change(50, "grow")
    assert round_at(50) is None
    assert round_at(50) == tt._core.adaptive.Change(40, "no gain")  # latency rose with the size
    assert round_at(40) is None
    assert round_at(40) is None
    assert c.size == 40  # held for a cooldown
    now += 15
    assert round_at(40) == tt._core.adaptive.Change(50, "grow")


def test_queueing_at_a_steady_size_backs_off() -> None:
    c = AdaptiveController(1, 40, 40, slow_start=False)  # at its max: no probes
    for latency in (0.2, 0.2, 0.35, 0.35):  # two slow rounds: one could be noise
        change = None
        for i in range(40):
            change = c.record(Outcome.SUCCESS, float(i), 40, latency=latency) or change
    assert change == tt._core.adaptive.Change(32, "latency")


async def test_a_dead_metrics_url_is_said_once_naming_engine_metrics() -> None:
    """A metrics URL that never answers left the window on its latency signal, and nothing
    on screen said so. Its first failed reading is an `EvalWarning` naming `engine_metrics`
    (the CLI's --engine-metrics), once; the failures are counted."""
    import socket
    import warnings

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    reader = EngineMetrics(f"http://127.0.0.1:{port}/metrics", interval=0.01, timeout=1.0)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with trio.move_on_after(5.0):
            while reader.errors < 3:
                with trio.move_on_after(0.05):
                    await reader.feed(None)
    found = [w.message for w in said if isinstance(w.message, EvalWarning)]
    assert reader.errors >= 3
    assert len(found) == 1, found
    assert found[0].parameter == "engine_metrics"
    assert f"127.0.0.1:{port}/metrics" in str(found[0])


def test_engine_metrics_cut_on_a_queue_preemptions_and_a_full_cache_and_freeze_when_stale() -> None:
    c = AdaptiveController(1, 1024, 64)
    assert c.engine(EngineLoad(48, 16, 0.5, 0), 0.0) is None  # one reading is not a queue
    assert c.engine(EngineLoad(48, 16, 0.5, 0), 1.0) == tt._core.adaptive.Change(
        51, "engine queue"
    )  # 16 waiting; at most x0.8
    assert c.engine(EngineLoad(48, 0, 0.7, 3), 2.0) == tt._core.adaptive.Change(
        45, "preemption"
    )  # a tenth
    # a full cache with nothing waiting is a full batch (issue 32: the zoo's engine without
    # a KV budget reports running / capacity as its usage): no cut; with calls waiting, a cut
    assert c.engine(EngineLoad(46, 0, 0.99, 3), 2.5) is None
    assert c.engine(EngineLoad(46, 2, 0.99, 3), 3.0) == tt._core.adaptive.Change(43, "kv cache")
    # (by the two waiting, not a tenth: the zoo's engine of 18 read 17, then 0.94x, issue 32)
    assert c.engine(EngineLoad(40, 0, 0.5, 3), 4.0) is None

    def full_round(now: float) -> Any:
        change = None
        for _ in range(c.size):
            change = c.record(Outcome.SUCCESS, now, c.size, latency=1.0) or change
        return change

    assert full_round(4.5) is None  # settles: its calls started before the cut
    c.engine(EngineLoad(40, 0, 0.5, 3), 10.0)
    assert full_round(10.5) is None  # held for a cooldown after the engine's last cut (3.0)
    c.engine(EngineLoad(40, 0, 0.5, 3), 18.5)
    assert full_round(19.0) == tt._core.adaptive.Change(53, "grow")  # room: a measured step of 25 %
    c.engine(EngineLoad(42, 0, 0.5, 3), 19.5)
    assert full_round(30.0) is None  # the last reading is 10.5 s old: frozen
    c.engine(EngineLoad(42, 0, 0.95, 3), 31.0)  # KV over kv_grow: no growth, no cut
    assert full_round(31.5) is None
    # counting the requests finished, a preemption now and then (<= 1 %) cuts nothing
    c = AdaptiveController(1, 1024, 40)
    c.engine(EngineLoad(40, 0, 0.9, 0, finished=0), 0.0)
    assert c.engine(EngineLoad(40, 0, 0.9, 1, finished=200), 1.0) is None
    assert c.engine(EngineLoad(40, 0, 0.9, 5, finished=400), 2.0) == tt._core.adaptive.Change(
        36, "preemption"
    )


# --- rate limits pace, they do not cut ------------------------------------------------------


async def test_a_request_rate_limit_paces_the_calls_instead_of_cutting_the_window(
    autojump_clock: Any, tmp_path: Path
) -> None:
    async with ChatServer(0.05, policy=RateLimit(200)) as server:
        rate, summary = await _eval(server.url, AdaptiveBounds(1, 8, 64), 2000, tmp_path,
                                    max_retries=20)  # fmt: skip
        share = server.limited / (server.ok + server.limited)
    # the first seconds find the rate, each 429's Retry-After (1 s) holding every call (the
    # server's true wait is milliseconds: the hold's cost); then about 200/s
    assert rate >= 0.75 * 200
    assert share < 0.05
    assert min(size for _, size, _ in summary["window_history"]) >= 8  # never cut


async def test_429s_whatever_the_concurrency_do_not_collapse_the_window(
    autojump_clock: Any,
) -> None:
    """The issue's case: every third call is refused, at any concurrency. The window dips to
    its minimum once, then stops counting them as a concurrency limit and goes back."""
    window = AdaptiveWindow(1, 8, 64)
    calls = 0

    async def rollout(_: int) -> None:
        nonlocal calls
        while True:
            calls += 1
            await trio.sleep(0.05)
            if calls % 3 == 0:
                window.rate_limited(retry_after=1.0)
                async with window.rest():
                    await trio.sleep(1.0)
                continue
            window.record(Outcome.SUCCESS, latency=0.05)
            return

    async def numbers() -> Any:
        for i in range(3000):
            yield i

    start = trio.current_time()
    await tt.run_stream(numbers(), rollout, window=window)
    reasons = [reason for _, _, reason in window.history]
    assert "429 not concurrency" in reasons
    assert window.size >= 8
    assert 3000 / (trio.current_time() - start) > 8 / 0.05 * 0.5  # 36x slower before


async def test_the_pacer_gives_up_on_429s_that_pacing_does_not_lower(autojump_clock: Any) -> None:
    pacer = Pacer()
    for i in range(300):  # every third call refused, however the calls are held and paced
        await pacer.wait()
        await trio.sleep(0.01)
        if i % 3 == 2:
            pacer.limited(trio.current_time(), latency=0.01)
        else:
            pacer.success(trio.current_time(), 0.01)
    assert pacer.rate is None
    assert pacer.held_until <= trio.current_time()  # and the calls go on unheld


# --- many endpoints ----------------------------------------------------------------------


async def test_calls_go_to_the_least_loaded_endpoint_and_a_rollout_sticks_to_one(
    autojump_clock: Any,
) -> None:
    a, b = (ContinuousBatching(capacity=64, kv_budget=10_000) for _ in range(2))
    async with (
        ChatServer(policy=a) as server_a,
        ChatServer(policy=b) as server_b,
        tt.OpenAIClient([server_a.url, server_b.url]) as client,
    ):
        await _calls(client, 64, window=16)
        assert abs(a.calls - b.calls) <= 2  # least loaded: an even share
        before = (a.calls, b.calls)
        with sticky("rollout-1"):
            for _ in range(10):
                await client.chat(SAY, model="sim", sampling=tt.Sampling())
        assert {a.calls - before[0], b.calls - before[1]} == {0, 10}
        stats = client.endpoint_stats()
    assert stats is not None
    assert sorted(stats) == sorted([server_a.url, server_b.url])
    assert sum(s["calls"] for s in stats.values()) == 74
    assert all(s["latency_p99_s"] is not None for s in stats.values())


async def test_a_sticky_binding_holds_for_every_call_of_its_block(autojump_clock: Any) -> None:
    a, b = (ContinuousBatching(capacity=64, kv_budget=10_000) for _ in range(2))
    async with (
        ChatServer(policy=a) as server_a,
        ChatServer(policy=b) as server_b,
        tt.OpenAIClient([server_a.url, server_b.url]) as client,
    ):

        async def rollout(key: int) -> set[int]:
            with sticky(key):
                before = (a.calls, b.calls)
                for _ in range(5):
                    await client.chat(SAY, model="sim", sampling=tt.Sampling())
                return {a.calls - before[0], b.calls - before[1]}

        seen = await rollout(1)
    assert seen == {0, 5}


async def test_an_engine_killed_mid_run_is_ejected_and_its_calls_answered_elsewhere(
    autojump_clock: Any, tmp_path: Path
) -> None:
    a, b = (ContinuousBatching(capacity=16, kv_budget=10_000) for _ in range(2))
    async with ChatServer(policy=a) as server_a, ChatServer(policy=b) as server_b:

        async def kill_later() -> None:
            await trio.sleep(1.0)
            server_b.kill()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(kill_later)
            urls = [server_a.url, server_b.url]
            _, summary = await _eval(urls, 32, 600, tmp_path, backoff=0.05)
    assert summary["ok"] == 600
    endpoints = summary["endpoints"]
    assert endpoints[server_b.url]["ejections"] >= 1
    assert endpoints[server_b.url]["errors"] >= 1
    assert endpoints[server_a.url]["calls"] > endpoints[server_b.url]["calls"]
    assert len(a.latencies) + len(b.latencies) >= 600


async def test_an_ejected_endpoint_is_probed_back(autojump_clock: Any) -> None:
    async with ChatServer(policy=ContinuousBatching(capacity=8, kv_budget=10_000)) as a:
        async with ChatServer(policy=ContinuousBatching(capacity=8, kv_budget=10_000)) as b:
            port = b.port
        async with tt.OpenAIClient([a.url, b.url], max_retries=0) as client:
            await _calls(client, 8, window=4)  # b refuses: ejected, its calls go to a
            stats = client.endpoint_stats()
            assert stats is not None
            assert stats[b.url]["ejected"]
            back = ContinuousBatching(capacity=8, kv_budget=10_000)
            async with ChatServer(port=port, policy=back):
                await trio.sleep(2.0)
                await _calls(client, 32, window=8)
                stats = client.endpoint_stats()
                assert stats is not None
                assert not stats[b.url]["ejected"]
                assert back.calls > 0
    assert math.isfinite(stats[a.url]["latency_mean_s"])


# --- the command line ----------------------------------------------------------------------


def test_base_url_repeats_into_one_client_over_every_endpoint() -> None:
    from trio_tasksets._cli.main import parser
    from trio_tasksets._cli.model_options import model_context, model_options
    from trio_tasksets._cli.options import UsageError

    urls = ["http://127.0.0.1:8001/v1", "http://127.0.0.1:8002/v1"]
    args = parser().parse_args(
        ["eval", "echo", "-m", "m", "--base-url", urls[0], "--base-url", urls[1]]
    )
    client = model_context(model_options(args)).client
    assert isinstance(client, tt.OpenAIClient)
    assert client.base_urls == urls
    assert client.pool is not None
    assert client.pool.urls == urls
    one = parser().parse_args(["eval", "echo", "-m", "m", "--base-url", urls[0]])
    single = model_context(model_options(one))
    assert isinstance(single.client, tt.OpenAIClient)
    assert single.client.pool is None  # one endpoint: the client as before
    twice = parser().parse_args(
        ["eval", "echo", "-m", "m", "--base-url", urls[0], "--base-url", urls[0]]
    )
    with pytest.raises(UsageError, match="twice"):
        model_context(model_options(twice))
    bad = parser().parse_args(["eval", "echo", "-m", "m", "--base-url", urls[0], "--base-url", "x"])
    with pytest.raises(UsageError, match="--base-url must be an http"):
        model_context(model_options(bad))


def test_engine_metrics_needs_an_adaptive_window(tmp_path: Path) -> None:
    from trio_tasksets._eval import EvalConfigError
    from trio_tasksets._eval.config import preflight

    env = tt.Env(Calls(1))
    ctx = tt.ModelContext(tt.EchoClient(), "echo")
    with pytest.raises(EvalConfigError, match="MIN-START-MAX"):
        preflight(env, ctx, tt.EvalConfig(max_concurrent=8, engine_metrics="http://h/metrics"))
    with pytest.raises(EvalConfigError, match="http:// or https://"):
        preflight(env, ctx, tt.EvalConfig(max_concurrent=AdaptiveBounds(1, 8, 64),
                                          engine_metrics="h:1/metrics"))  # fmt: skip


async def test_an_eval_reads_the_engines_metrics_into_its_window(
    autojump_clock: Any, tmp_path: Path
) -> None:
    engine = ContinuousBatching(capacity=48, kv_budget=64)
    async with ChatServer(policy=engine) as server:
        metrics = server.url.removesuffix("/v1") + "/metrics"
        window = AdaptiveWindow(1, 8, 1024)
        async with tt.OpenAIClient(server.url) as model:
            config = tt.EvalConfig(max_concurrent=window, output_dir=str(tmp_path),
                                   run_name="m", dashboard=False, engine_metrics=metrics)  # fmt: skip
            result = await tt.run_eval(tt.Env(Calls(2000)), tt.ModelContext(model, "sim"), config)
        share = engine.preemptions / engine.calls
    assert result.summary["ok"] == 2000
    reasons = {reason for _, _, reason in window.history}
    assert reasons & {"preemption", "kv cache", "engine queue"}
    assert window.size <= 48
    assert share < 0.05


# --- the served path -----------------------------------------------------------------------


def test_many_endpoints_travel_to_an_env_server_and_each_must_be_allowed() -> None:
    from trio_tasksets._serve.policy import ModelPolicy
    from trio_tasksets._serve.wire import (
        Forbidden,
        decode_json,
        encode_run_request,
        parse_run_request,
    )

    urls = ["http://127.0.0.1:8001/v1", "http://127.0.0.1:8002/v1"]
    slot = tt.RunSlot(tt.Task("say 7", answer="7", key="k"), 0)
    ctx = tt.ModelContext(tt.OpenAIClient(urls), "m")
    request = parse_run_request(decode_json(encode_run_request(slot, ctx)))
    assert request.client.base_urls == tuple(urls)  # type: ignore[union-attr]
    one = parse_run_request(decode_json(encode_run_request(slot, tt.ModelContext(
        tt.OpenAIClient(urls[0]), "m"))))  # fmt: skip
    assert "base_urls" not in encode_run_request(slot, tt.ModelContext(
        tt.OpenAIClient(urls[0]), "m")).decode()  # fmt: skip
    assert one.client.base_urls == ()  # type: ignore[union-attr]
    with pytest.raises(Forbidden, match="8002"):
        ModelPolicy.from_flags(urls[:1], None, {}).check(request.client)
    policy = ModelPolicy.from_flags(urls, None, {})
    policy.check(request.client)
    client = policy.build(request.client)
    assert isinstance(client, tt.OpenAIClient)
    assert client.base_urls == urls
    assert client.pool is not None


def test_an_enclosing_sticky_block_a_groups_wins_over_its_rollouts() -> None:
    from trio_tasksets._models.pool import sticky_key

    with sticky(("group", "g")):
        with sticky("rollout-1"):
            assert sticky_key() == ("group", "g")
        with sticky("rollout-2", replace=True):
            assert sticky_key() == "rollout-2"
    assert sticky_key() is None
