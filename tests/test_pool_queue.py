"""The queue in front of many endpoints (issue 36, F14) and a hung endpoint (F15).

F14: with every endpoint's window full, calls wait in the pool in one first-come
first-served queue, and that wait is a wait of the runner's own (`parked("connection")`):
not working time, not a stall, counted per kind in `summary.json["health"]`. Two URLs to
one engine (2 x 8 connections) behave as one URL with 16.

F15: an endpoint that accepts and then says nothing is taken out after the first call that
timed out there while another endpoint answers, and probed back later.

The engine is the suite's fake server (`tests/fixtures/chat_server.py`) with the simulated
continuous-batching engine as its policy (`tests/fixtures/engine.py`), on 127.0.0.1 in the
test's own trio run: every test runs on `MockClock(autojump_threshold=0)`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

import trio_tasksets as tt
from trio_tasksets._core.health import Health
from trio_tasksets._core.limits import observe_calls
from trio_tasksets._models.base import ModelConnectionError
from trio_tasksets._models.engine import EngineMetrics
from trio_tasksets._models.pool import EndpointPool, sticky

FIXTURES = Path(__file__).resolve().parent / "fixtures"
if str(FIXTURES) not in sys.path:
    sys.path.insert(0, str(FIXTURES))

from chat_server import ChatServer  # noqa: E402
from engine import ContinuousBatching  # noqa: E402
from test_engines import SAY, Calls  # noqa: E402


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[int(0.99 * (len(ordered) - 1))]


def _rank_correlation(order: list[int]) -> float:
    """Spearman's rho between the finish order (the list's) and the start order (its
    values, every one distinct)."""
    n = len(order)
    ranks = {value: rank for rank, value in enumerate(sorted(order))}
    d2 = sum((i - ranks[value]) ** 2 for i, value in enumerate(order))
    return 1 - 6 * d2 / (n * (n * n - 1))


async def _eval_against_one_engine(
    urls: list[str], connections: int, n: int, out: Path, name: str
) -> tt.EvalResult:
    limits = tt.EndpointLimits(connections=connections)
    async with tt.OpenAIClient(urls if len(urls) > 1 else urls[0], limits=limits) as model:
        env = tt.Env(Calls(n), stall_timeout=0.6, working_limit=0.6)
        config = tt.EvalConfig(
            max_concurrent=64, output_dir=str(out), run_name=name, dashboard=False
        )
        return await tt.run_eval(env, tt.ModelContext(model, "sim"), config)


async def test_two_urls_to_one_engine_queue_as_one_url_with_their_connections(
    autojump_clock: Any, tmp_path: Path
) -> None:
    """-c 64 over an engine of 16 places: 48 rollouts wait at any time. Through one URL with
    16 connections they wait in its window; through two URLs of 8 each, in the pool's queue:
    the same p99, no stall, no rollout cut by its working limit, finished in start order."""
    figures: dict[str, tuple[float, float, tt.EvalResult]] = {}
    for name, connections in (("one", 16), ("two", 8)):
        engine = ContinuousBatching(capacity=16, kv_budget=10_000)
        async with ChatServer(policy=engine) as server:
            urls = [server.url] if name == "one" else [server.url, server.url + "/"]
            result = await _eval_against_one_engine(urls, connections, 400, tmp_path, name)
        durations = [e.timing["duration"] for e in result.episodes]
        rows = (result.run_dir / "traces.jsonl").read_text().splitlines()
        order = [int(json.loads(row)["task"]["key"]) for row in rows]  # as they finished
        figures[name] = (_p99(durations), _rank_correlation(order), result)

    (one_p99, one_rho, one), (two_p99, two_rho, two) = figures["one"], figures["two"]
    for result in (one, two):
        assert result.summary["ok"] == 400
        assert result.summary["errors_by_type"] == {}  # no StalledError, retried or not
        assert not [e for e in result.episodes if e.stop_reason == "working_limit"]
        assert not [e for e in result.episodes if e.errors]
    assert two_p99 <= 1.5 * one_p99
    assert two_rho >= one_rho - 0.05
    waited = two.summary["health"]["waited_s"]
    assert waited["connection"] >= 0.5 * one.summary["health"]["waited_s"]["connection"]
    row_waits = sum(e.timing["waited_connection"] for e in two.episodes)
    assert row_waits >= 0.5 * sum(e.timing["waited_connection"] for e in one.episodes)


# --- the queue, on the clock alone -------------------------------------------------------------


@attrs.define(eq=False)
class Endpoint:
    """An endpoint's client as the pool sees it (`EndpointClient`), with a window of one."""

    base_url: str
    limits: tt.EndpointLimits | None
    limits_key: Hashable = attrs.field(default=attrs.Factory(lambda e: e.base_url, True))
    engine_metrics: EngineMetrics | None = None

    @property
    def throttled(self) -> int:
        return 0

    async def aclose(self) -> None:
        pass


async def test_a_newcomer_never_takes_a_place_ahead_of_a_waiting_call(
    autojump_clock: Any,
) -> None:
    """Two endpoints of one place each; B's calls take 1.5 s, the others' 1 s. A and B hold
    both places, W1-W4 queue behind them; as A's and B's first calls end they call again at
    once (a rollout's next turn), in the very step their place frees: they queue behind
    W1-W4, who go first, in their order, one place at a time. The wait is a connection wait:
    counted, and never working time."""
    limits = tt.EndpointLimits(connections=1)
    pool = EndpointPool([Endpoint("http://a/v1", limits), Endpoint("http://b/v1", limits)])
    started: list[tuple[float, str]] = []
    health = Health()

    async def rollout(name: str, turns: int) -> None:
        for turn in range(1, turns + 1):

            async def work(client: Endpoint, label: str = f"{name}.{turn}") -> None:
                started.append((trio.current_time(), label))
                async with limits.call(client.limits_key):
                    await trio.sleep(1.5 if name == "B" else 1.0)

            await pool.run(work)

    with trio.fail_after(60), observe_calls(health):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rollout, "A", 2)
            nursery.start_soon(rollout, "B", 2)
            for name in ("W1", "W2", "W3", "W4"):
                await trio.sleep(0.1)
                nursery.start_soon(rollout, name, 1)
            await trio.sleep(0.5)
            assert pool.queued == 4

    assert sorted(started[:2]) == [(0.0, "A.1"), (0.0, "B.1")]
    assert started[2:] == [(1.0, "W1.1"), (1.5, "W2.1"), (2.0, "W3.1"), (2.5, "W4.1"),
                           (3.0, "A.2"), (3.5, "B.2")]  # fmt: skip
    # W1-W4 waited 0.9, 1.3, 1.7, 2.1 s; A.2 and B.2 2 s each: all of it a connection wait
    assert health.waited == {"connection": pytest.approx(10.0)}


async def test_a_call_cancelled_in_the_queue_leaves_no_place_taken(autojump_clock: Any) -> None:
    """A waiting call cancelled gives up its turn; one cancelled in the step it was served
    gives its place back: the next waiter takes it, and nothing stays counted in flight."""
    limits = tt.EndpointLimits(connections=1)
    pool = EndpointPool([Endpoint("http://a/v1", limits), Endpoint("http://b/v1", limits)])
    started: list[tuple[float, str]] = []

    async def call(label: str, scope: trio.CancelScope | None = None) -> None:
        async def work(client: Endpoint) -> None:
            started.append((trio.current_time(), label))
            await trio.sleep(2.0 if label == "B" else 1.0)
            if scope is not None:  # the served waiter is cancelled in this very step
                scope.cancel()

        await pool.run(work)

    served = trio.CancelScope()

    async def cancelled_when_served() -> None:
        with served:
            await call("C")

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, "A", served)
            nursery.start_soon(call, "B")
            await trio.sleep(0.1)
            nursery.start_soon(cancelled_when_served)
            await trio.sleep(0.1)
            with trio.move_on_after(0.3):
                await call("gone")
            nursery.start_soon(call, "D")
    assert sorted(started) == [(0.0, "A"), (0.0, "B"), (1.0, "D")]
    assert served.cancelled_caught
    assert pool.queued == 0
    assert [e.pending for e in pool.endpoints] == [0, 0]


async def test_a_call_that_cannot_use_the_free_place_does_not_hold_up_those_behind(
    autojump_clock: Any,
) -> None:
    """X fails on A (ejected for 1 s) and waits for B, which Y holds for 10 s. Once A is due
    back, N (who came later) takes A's place at once: X could not use it, so X keeps its
    turn for B and N overtakes no one who could have gone."""
    limits = tt.EndpointLimits(connections=1)
    pool = EndpointPool([Endpoint("http://a/v1", limits), Endpoint("http://b/v1", limits)])
    started: list[tuple[float, str, str]] = []

    async def call(label: str, seconds: float) -> None:
        async def work(client: Endpoint) -> None:
            started.append((trio.current_time(), label, client.base_url))
            if label == "X" and client.base_url == "http://a/v1":
                await trio.sleep(0.1)
                raise ModelConnectionError("refused", url=client.base_url)
            await trio.sleep(seconds)

        await pool.run(work)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, "X", 1.0)
            await trio.lowlevel.checkpoint()
            nursery.start_soon(call, "Y", 10.0)
            await trio.sleep(2.0)  # A is due back (probing); X still waits for B
            assert pool.queued == 1
            nursery.start_soon(call, "N", 1.0)
    assert started == [(0.0, "X", "http://a/v1"), (0.0, "Y", "http://b/v1"),
                       (2.0, "N", "http://a/v1"), (10.0, "X", "http://b/v1")]  # fmt: skip


async def test_an_endpoint_due_back_gets_one_probe_however_many_calls_wait(
    autojump_clock: Any,
) -> None:
    """A refuses; X's failure ejects it for 1 s. B's four places are held until t=3 while
    W1-W6 queue. At t=3, as B's places free in one step, A is due back: W1 alone probes it
    (and fails, going back to the head of the queue), the others wait for B."""
    limits = tt.EndpointLimits(connections=4)
    a, b = "http://a/v1", "http://b/v1"
    pool = EndpointPool([Endpoint(a, limits), Endpoint(b, limits)])
    started: list[tuple[float, str, str]] = []

    async def call(label: str) -> None:
        async def work(client: Endpoint) -> None:
            started.append((trio.current_time(), label, client.base_url))
            if client.base_url == a:
                await trio.sleep(0.1)
                raise ModelConnectionError("refused", url=a)
            if label.startswith("W"):
                await trio.sleep(1.0)
            else:
                await trio.sleep_until(3.0)

        await pool.run(work)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, "X")
            await trio.sleep(0.5)
            for label in ("H1", "H2", "H3"):
                nursery.start_soon(call, label)
            await trio.sleep(0.5)
            for i in range(1, 7):
                nursery.start_soon(call, f"W{i}")
                await trio.sleep(0.01)  # they queue in their order
            await trio.sleep(0.5)
            assert pool.queued == 6
    on_a = [(at, label) for at, label, url in started if url == a]
    assert on_a == [(0.0, "X"), (3.0, "W1")]
    stats = pool.stats()
    assert stats[a]["errors"] == 2
    assert stats[a]["ejections"] == 2
    assert [e.pending for e in pool.endpoints] == [0, 0]
    assert not pool.endpoints[0].probing


# --- a hung endpoint (F15) ---------------------------------------------------------------------


async def test_an_endpoint_that_accepts_and_never_answers_is_out_after_one_timeout(
    autojump_clock: Any,
) -> None:
    """Beside a working endpoint, one that accepts connections and then says nothing: its
    calls move after one `timeout` (not one per retry: 4 x 5 s and backoff before), it is
    ejected once (not once per call), probed when due, and back once it answers."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    hung = f"http://127.0.0.1:{port}/v1"

    async def say_nothing(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    hanging = trio.CancelScope()

    async def serve_hung() -> None:
        with hanging:
            await trio.serve_listeners(say_nothing, listeners)

    async def chat(client: tt.OpenAIClient, key: int) -> None:
        with sticky(key):
            await client.chat(SAY, model="sim", sampling=tt.Sampling())

    async with trio.open_nursery() as servers:
        servers.start_soon(serve_hung)
        async with (
            ChatServer() as good,
            tt.OpenAIClient([hung, good.url], timeout=5.0, max_retries=3) as client,
        ):
            began = trio.current_time()
            with trio.fail_after(60):
                async with trio.open_nursery() as calls:
                    for key in range(8):
                        calls.start_soon(chat, client, key)
            took = trio.current_time() - began
            first = client.endpoint_stats()
            hanging.cancel()  # the hung server goes; a working one takes its port
            for listener in listeners:
                await listener.aclose()
            async with ChatServer(port=port):
                await trio.sleep(1.5)  # its ejection (1 s) is over: due back
                due = client.endpoint_stats()
                with trio.fail_after(60):
                    for key in range(8, 12):
                        await chat(client, key)
                back = client.endpoint_stats()

    assert 5.0 <= took < 6.0  # one timeout, then answered elsewhere at once
    assert first is not None
    assert due is not None
    assert back is not None
    assert first[hung]["errors"] == first[hung]["calls"] == 4  # least loaded: half went there
    assert first[hung]["ejections"] == 1
    assert first[hung]["state"] == "ejected"
    assert first[good.url]["calls"] == 8  # its own 4 and the 4 moved
    assert due[hung]["state"] == "probing"
    assert back[hung]["state"] == "live"
    assert back[hung]["calls"] > first[hung]["calls"]


def test_eval_and_worker_take_the_model_clients_retry_count() -> None:
    """`--max-model-retries N` (as `serve` spells it) sets the model client's retries on
    `eval` and `worker`, every endpoint's with many; a negative count is refused at the
    edge, naming the flag; the echo model refuses it (it makes no HTTP call)."""
    from trio_tasksets._cli.main import parser
    from trio_tasksets._cli.model_options import model_context, model_options
    from trio_tasksets._cli.options import UsageError

    urls = ["http://127.0.0.1:8001/v1", "http://127.0.0.1:8002/v1"]
    for command in (["eval", "echo"], ["worker", "--feed", "redis://127.0.0.1:1"]):
        model = [*command, "-m", "m", "--base-url", urls[0]]
        given = parser().parse_args([*model, "--max-model-retries", "0"])
        client = model_context(model_options(given)).client
        assert isinstance(client, tt.OpenAIClient)
        assert client.max_retries == 0
        default = model_context(model_options(parser().parse_args(model))).client
        assert isinstance(default, tt.OpenAIClient)
        assert default.max_retries == 3
        many = parser().parse_args([*model, "--base-url", urls[1], "--max-model-retries", "7"])
        pooled = model_context(model_options(many)).client
        assert isinstance(pooled, tt.OpenAIClient)
        assert pooled.pool is not None
        assert [e.client.max_retries for e in pooled.pool.endpoints] == [7, 7]
        bad = parser().parse_args([*model, "--max-model-retries", "-1"])
        with pytest.raises(UsageError, match="--max-model-retries must be >= 0, got -1"):
            model_context(model_options(bad))
        echo = parser().parse_args([*command, "--max-model-retries", "2"])
        with pytest.raises(UsageError, match="--max-model-retries does nothing with the echo"):
            model_context(model_options(echo))
