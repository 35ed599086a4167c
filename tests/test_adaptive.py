"""Issue 13 at the eval level: the adaptive rollout window, the limits on model calls
(`--max-connections`, `--rpm`, `--tpm`), `--rollout-timeout` and `--time-limit`, through
`run_eval` and `OpenAIClient`.

The model server is the suite's fake on 127.0.0.1 (`tests/fixtures/chat_server.py`): in one
test the `chat` fixture, on the real clock; in the others it serves in the test's own trio
run, on virtual time, where the spacing of calls can be asserted exactly. Everything from
`OpenAIClient.chat` down to the socket is the real code.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import trio
from chat_server import Capacity, ChatServer
from trio.testing import MockClock

import trio_tasksets as tt
from trio_tasksets._core.adaptive import AdaptiveBounds, AdaptiveWindow
from trio_tasksets._core.limits import EndpointLimits


class Calls(tt.Taskset[tt.Task, tt.TasksetConfig]):
    size = 100

    def load(self) -> Iterable[tt.Task]:
        return [tt.Task(f"say {i}", answer="7", key=str(i)) for i in range(self.size)]


def calls(n: int) -> Calls:
    taskset = Calls()
    taskset.size = n
    return taskset


def config(tmp_path: Path, **kw: Any) -> tt.EvalConfig:
    kw.setdefault("dashboard", False)
    return tt.EvalConfig(output_dir=str(tmp_path / "out"), run_name="run", **kw)


def rows(tmp_path: Path) -> list[dict[str, Any]]:
    text = (tmp_path / "out" / "run" / "traces.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def summary(tmp_path: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((tmp_path / "out" / "run" / "summary.json").read_text())
    return loaded


# --- a real model server with a hidden capacity ----------------------------------------------


@pytest.fixture
def capacity_5(chat: ChatServer) -> ChatServer:
    """The suite's fake with a hidden capacity: a completion takes 0.05 s holding one of 5
    places; a request above that is answered 429 at once, `Retry-After: 0.05`."""
    chat.policy, chat.delay, chat.retry_after = Capacity(5), 0.05, "0.05"
    chat.answer = lambda _: "7"
    chat.usage = {"prompt_tokens": 3, "completion_tokens": 1}
    return chat


async def test_the_adaptive_window_converges_on_a_real_servers_capacity(
    capacity_5: ChatServer, tmp_path: Path
) -> None:
    """`-c 1-2-64` against a server that answers 429 above 5 calls at once: slow start
    overshoots (to 8, unless the machine is slow enough to hide that), the first 429 cuts by
    the factor and the 429s of that burst cap the window at the calls the server took; every
    episode ends ok (the client retries its 429s, after their Retry-After). A completion
    takes long enough (0.05 s) for a busy machine to fill the window; the cap counts the
    calls that succeeded while a 429 was in transit, so it never lands below 5."""
    server = capacity_5
    async with tt.OpenAIClient(server.url, max_retries=100, backoff=0.01) as client:
        ctx = tt.ModelContext(client, "fake")
        window = AdaptiveWindow(1, 2, 64)
        result = await tt.run_eval(tt.Env(calls(100)), ctx, config(tmp_path, max_concurrent=window))
    assert result.summary["ok"] == 100
    assert server.peak == 5
    assert 0 < server.limited < 0.1 * (server.ok + server.limited)
    sizes = [size for _, size, _ in window.history]
    assert sizes[:3] == [2, 4, 8]  # slow start
    assert "429" in [reason for _, _, reason in window.history]
    assert 5 <= window.size <= 6  # near the capacity, never below it
    recorded = summary(tmp_path)["window_history"]
    assert [entry[1:] for entry in recorded] == [[size, why] for _, size, why in window.history]
    assert all(0 <= entry[0] < 60 for entry in recorded)  # seconds since the eval began


# --- the model server in the test's run, on virtual time --------------------------------------


def model_server(
    latency: float = 0.0, capacity: int | None = None, usage: dict[str, int] | None = None
) -> ChatServer:
    """The suite's fake, to serve in the test's run (``async with``: its clock is the
    test's): answers "7" after `latency` seconds, 429 at once above `capacity` calls in
    flight (``Retry-After: 1``), `usage` as given."""
    return ChatServer(
        latency,
        policy=None if capacity is None else Capacity(capacity),
        retry_after=1,
        answer=lambda _: "7",
        usage=usage if usage is not None else {"prompt_tokens": 3, "completion_tokens": 1},
    )


def arrivals(server: ChatServer) -> list[float]:
    """When each request arrived, in seconds since the first."""
    return [request.at - server.received[0].at for request in server.received]


async def test_rpm_600_spreads_an_evals_calls_one_per_100_ms(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    async with (
        model_server() as server,
        tt.OpenAIClient(server.url, limits=EndpointLimits(rpm=600)) as client,
    ):
        await tt.run_eval(tt.Env(calls(10)), tt.ModelContext(client, "m"), config(tmp_path))
    assert arrivals(server) == pytest.approx([0.1 * k for k in range(10)])
    waited = sorted(row["timing"]["waited_rate"] for row in rows(tmp_path))
    assert waited == pytest.approx([0.1 * k for k in range(10)])
    assert all(row["timing"]["waited_connection"] == 0.0 for row in rows(tmp_path))
    assert summary(tmp_path)["waited_s"] == pytest.approx({"connection": 0.0, "rate": 4.5})


async def test_tpm_reserves_max_tokens_and_meters_the_replies_usage(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    """6,000 tokens a minute is 100 a second. Each call reserves its max_tokens (100) before
    it goes and is charged its usage (150) after: the calls go 1.5 s apart once the first
    one's debt is known, whatever their concurrency."""
    async with (
        model_server(usage={"prompt_tokens": 50, "completion_tokens": 100}) as server,
        tt.OpenAIClient(server.url, limits=EndpointLimits(tpm=6000)) as client,
    ):
        ctx = tt.ModelContext(client, "m", tt.Sampling(max_tokens=100))
        await tt.run_eval(tt.Env(calls(4)), ctx, config(tmp_path, max_concurrent=1))
    assert arrivals(server) == pytest.approx([0.0, 1.5, 3.0, 4.5])


async def test_max_connections_bounds_every_call_of_multi_call_rollouts(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    class ThreeCalls(tt.Env[tt.Task]):
        async def rollout(self, task: tt.Task, ctx: tt.ModelContext) -> Any:
            messages = tt.chat_messages(task)
            for _ in range(3):
                await ctx.chat(messages)
            return messages, "7"

    async with (
        model_server(latency=1.0) as server,
        tt.OpenAIClient(server.url, limits=EndpointLimits(connections=2)) as client,
    ):
        await tt.run_eval(ThreeCalls(calls(4)), tt.ModelContext(client, "m"),
                          config(tmp_path, max_concurrent=4))  # fmt: skip
    assert server.peak == 2  # 4 rollouts in flight, 2 calls at once
    assert len(server.received) == 12
    written = rows(tmp_path)
    assert all(row["ok"] for row in written)
    # 12 one-second calls, 2 at a time, in 6 s: two rollouts wait 2 s for their places and
    # end at 5 s, the two that waited first wait 3 s and end at 6 s.
    waited = sorted(row["timing"]["waited_connection"] for row in written)
    assert waited == pytest.approx([2.0, 2.0, 3.0, 3.0])


async def test_adaptive_connections_find_the_capacity_and_are_recorded(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    limits = EndpointLimits(connections=AdaptiveBounds(1, 4, 64))
    async with (
        model_server(latency=0.05, capacity=10) as server,
        tt.OpenAIClient(server.url, limits=limits, max_retries=50,
                        limits_key=("URL", "KEY")) as client,
    ):  # fmt: skip
        result = await tt.run_eval(tt.Env(calls(300)), tt.ModelContext(client, "m"),
                                   config(tmp_path, max_concurrent=100))  # fmt: skip
    assert result.summary["ok"] == 300
    assert limits.connections is not None
    assert limits.connections.window(("URL", "KEY")).size == 10
    history = summary(tmp_path)["connection_history"]["URL (KEY)"]
    assert [size for _, size, _ in history][:4] == [4, 8, 16, 12]
    assert history[-1][1:] == [10, "429 cap"]
    assert server.limited <= 6  # the overshoot of slow start, each refused call once


async def test_an_adaptive_rollout_window_is_fed_by_its_model_calls(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    """`-c 1-8-512` in process: each 429 reaches the window as it comes (not when its
    episode ends) and the rollout waiting out its Retry-After lends its place, so the window
    settles on the capacity exactly and the endpoint stays full."""
    window = AdaptiveWindow(1, 8, 512)
    async with (
        model_server(latency=0.05, capacity=40) as server,
        tt.OpenAIClient(server.url, max_retries=50) as client,
    ):
        t0 = trio.current_time()
        result = await tt.run_eval(tt.Env(calls(2000)), tt.ModelContext(client, "m"),
                                   config(tmp_path, max_concurrent=window))  # fmt: skip
        elapsed = trio.current_time() - t0
    assert result.summary["ok"] == 2000
    assert window.size == 40
    assert window.resting == window.in_flight == 0
    assert server.limited / len(server.received) < 0.015
    assert 2000 / elapsed > 0.9 * 40 / 0.05


# --- --rollout-timeout and --time-limit ------------------------------------------------------


class SlowFirst(tt.Env[tt.Task]):
    """The first attempt of each episode takes 10 s, the next ones 1 s."""

    attempts: dict[str, int]

    async def rollout(self, task: tt.Task, ctx: tt.ModelContext) -> Any:
        counts = self.__dict__.setdefault("attempts", {})
        counts[task.key] = counts.get(task.key, 0) + 1
        await trio.sleep(10 if counts[task.key] == 1 else 1)
        return tt.chat_messages(task), "7"


async def test_a_rollout_timeout_makes_a_slow_attempt_an_error_retried_per_policy(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    env = SlowFirst(calls(3), retries=tt.RetryPolicy(1, backoff=0), rollout_timeout=5)
    t0 = trio.current_time()
    result = await tt.run_eval(env, tt.ModelContext(tt.EchoClient(), "echo"), config(tmp_path))
    assert trio.current_time() - t0 == pytest.approx(6.0)
    for row in rows(tmp_path):
        assert (row["ok"], row["attempts"]) == (True, 2)
        assert [e["type"] for e in row["errors"]] == ["RolloutTimeoutError"]
        assert "rollout_timeout of 5s" in row["errors"][0]["message"]
    assert result.summary["errors_by_type"] == {}
    record = json.loads((tmp_path / "out" / "run" / "config.json").read_text())
    assert record["limits"]["rollout_timeout"] == 5.0


async def test_a_time_limit_drains_the_eval_and_says_so(
    autojump_clock: MockClock, tmp_path: Path
) -> None:
    ctx = tt.ModelContext(tt.EchoClient(delay=1.0), "echo")
    t0 = trio.current_time()
    result = await tt.run_eval(tt.Env(calls(100)), ctx,
                               config(tmp_path, max_concurrent=2, time_limit=3.5))  # fmt: skip
    assert trio.current_time() - t0 == pytest.approx(3.5)
    written = summary(tmp_path)
    assert (written["stopped"], written["error"], written["interrupted"]) == (
        "time_limit",
        None,
        True,
    )
    assert written["finished"] == 6 == len(rows(tmp_path)) == len(result.episodes)
    assert all(row["ok"] for row in rows(tmp_path))


async def test_limits_on_model_calls_cannot_travel_to_an_env_server(tmp_path: Path) -> None:
    client = tt.OpenAIClient("http://model.invalid/v1", limits=EndpointLimits(rpm=60))
    with pytest.raises(tt.EvalConfigError, match="serve: the model client's limits"):
        await tt.run_eval(tt.Env(calls(3)), tt.ModelContext(client, "m"),
                          config(tmp_path, serve=True))  # fmt: skip
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("kw", "match"),
    [({"time_limit": 0}, "time_limit"), ({"time_limit": float("nan")}, "time_limit"),
     ({"max_concurrent": AdaptiveBounds(4, 2, 8)}, "max_concurrent"),
     ({"max_concurrent": (0, 1, 2)}, "max_concurrent")],
)  # fmt: skip
async def test_bad_limits_are_refused_before_any_work(
    tmp_path: Path, kw: dict[str, Any], match: str
) -> None:
    with pytest.raises(tt.EvalConfigError, match=match):
        await tt.run_eval(tt.Env(calls(3)), tt.ModelContext(tt.EchoClient(), "echo"),
                          config(tmp_path, **kw))  # fmt: skip
    assert not (tmp_path / "out").exists()
