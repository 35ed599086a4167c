"""Deadlines that travel to an env server: a served run carries its time left
(`time_left`, seconds) and the server runs the episode under it, over `POST /run` and the
WebSocket, even when the caller's own cancel never arrives. Real `trio-tasksets serve`
processes; the episodes sleep on the echo model's delay, so every wait here is real time,
bounded by `trio.fail_after`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import trio
from raw_ws import RawWS, run_item
from test_serve_security import TOKEN, Server, post_run, start

import trio_tasksets as tt
from trio_tasksets._serve.wire import RunRequestEncoder, parse_run_request

MARGIN = 1.5  # seconds an answer may come after the deadline, on a loaded machine


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    served = start(tmp_path_factory.mktemp("deadlines") / "stderr", token=True)
    try:
        yield served
    finally:
        served.stop()


def slow_request(time_left: float | None, delay: float = 60.0) -> dict[str, Any]:
    body: dict[str, Any] = {
        "slot": {"task": {"key": "k1", "data": {"prompt": "hi", "answer": "hi"}}, "rollout": 0},
        "ctx": {"model": "echo", "sampling": {}, "client": {"type": "echo", "delay": delay}},
    }
    if time_left is not None:
        body["time_left"] = time_left
    return body


async def test_post_run_is_cut_at_its_time_left(server: Server) -> None:
    start_at = time.monotonic()
    with trio.fail_after(20):
        response = await post_run(server, slow_request(time_left=1.0))
    took = time.monotonic() - start_at
    assert response.status_code == 504, response.text
    assert "time_left" in response.json()["error"]
    assert 1.0 <= took < 1.0 + MARGIN


async def test_a_websocket_run_is_cut_at_its_time_left_without_a_cancel(server: Server) -> None:
    """The caller never sends `cancel` (it died, or its cancel was lost): the server stops
    the episode at the time left all the same, and answers 504."""
    ws = await RawWS.connect(server.url, TOKEN)
    try:
        start_at = time.monotonic()
        await ws.send(orjson.dumps(run_item(1, slow_request(time_left=1.0))))
        with trio.fail_after(20):
            answers = await ws.answers(1)
        took = time.monotonic() - start_at
    finally:
        await ws.aclose()
    assert isinstance(answers, list)
    assert (answers[0]["id"], answers[0]["status"]) == (1, 504), answers
    assert 1.0 <= took < 1.0 + MARGIN


async def test_a_run_with_time_left_in_hand_finishes(server: Server) -> None:
    with trio.fail_after(20):
        response = await post_run(server, slow_request(time_left=30.0, delay=0.0))
    assert response.status_code == 200, response.text
    assert response.json()["ok"] is True


@pytest.mark.parametrize("bad", [-1, "2", True, None])
async def test_a_bad_time_left_is_a_422_naming_it(server: Server, bad: object) -> None:
    body = slow_request(time_left=None, delay=0.0)
    body["time_left"] = bad
    with trio.fail_after(20):
        response = await post_run(server, body)
    if bad is None:  # null: no deadline
        assert response.status_code == 200, response.text
    else:
        assert response.status_code == 422, response.text
        assert response.json()["error"].startswith("time_left:")


async def test_env_client_sends_its_deadline_and_the_episode_ends_with_it(
    server: Server,
) -> None:
    """A rollout with 2 s left on the eval side: its remote episode does not outlive it."""
    ctx = tt.ModelContext(tt.EchoClient(delay=60.0), "echo")
    async with tt.EnvClient(server.url, token=TOKEN) as client:
        start_at = time.monotonic()
        with trio.move_on_after(2.0) as scope:
            await client.run(tt.RunSlot(tt.Task("hi", answer="hi")), ctx)
        assert scope.cancelled_caught
        with trio.fail_after(20):  # the server is idle again within the margin
            while True:
                health = await client.health()
                if health["running"] == 0:
                    break
                await trio.sleep(0.05)
    assert time.monotonic() - start_at < 2.0 + MARGIN


async def test_the_encoder_carries_the_time_left_only_under_a_deadline() -> None:
    encoder = RunRequestEncoder()
    ctx = tt.ModelContext(tt.EchoClient(), "echo")
    slot = tt.RunSlot(tt.Task("hi", answer="hi"))
    assert "time_left" not in orjson.loads(encoder.encode(slot, ctx))
    with trio.move_on_after(2.5):  # noqa: ASYNC100  (the encoder reads its deadline)
        body = orjson.loads(encoder.encode(slot, ctx))
    assert 2.4 < body["time_left"] <= 2.5
    parse_run_request(body)  # the server's parser takes it


# --- the caller's rollout limits, carried whole ------------------------------------------------


async def test_the_encoder_carries_a_slots_limits_whole_and_the_server_rebuilds_them() -> None:
    encoder = RunRequestEncoder()
    ctx = tt.ModelContext(tt.EchoClient(), "echo")
    plain = tt.RunSlot(tt.Task("hi", answer="hi"))
    assert "limits" not in orjson.loads(encoder.encode(plain, ctx))  # the wire as before
    limits = tt.RolloutLimits(working_limit=2.0, stall_timeout=3.0, max_turns=4)
    body = orjson.loads(encoder.encode(tt.RunSlot(plain.task, limits=limits), ctx))
    assert body["limits"] == {"working_limit": 2.0, "stall_timeout": 3.0, "max_turns": 4}
    assert parse_run_request(body).limits == limits
    with trio.move_on_after(2.5):  # noqa: ASYNC100  (with a deadline too)
        body = orjson.loads(encoder.encode(tt.RunSlot(plain.task, limits=limits), ctx))
    assert parse_run_request(body).limits == limits
    assert parse_run_request(slow_request(time_left=None)).limits is None


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ([1], "limits:"),
        ({"rollout": 1}, "limits:"),
        ({"stall_timeout": -1}, "limits.stall_timeout:"),
    ],
)
async def test_bad_limits_are_a_422_naming_the_field(
    server: Server, bad: object, field: str
) -> None:
    body = slow_request(time_left=None, delay=0.0)
    body["limits"] = bad
    with trio.fail_after(20):
        response = await post_run(server, body)
    assert response.status_code == 422, response.text
    assert response.json()["error"].startswith(field)


async def test_a_runs_limits_hold_on_the_server_over_post_and_the_websocket(
    server: Server,
) -> None:
    """The server's env has no limits; a request's own (a 1 s rollout timeout) bound its
    episode: a failed row with a RolloutTimeoutError, not a 60 s wait. Over the WebSocket
    the second run of one context takes the fast path."""
    body = slow_request(time_left=None)
    body["limits"] = {"rollout_timeout": 1.0}
    start_at = time.monotonic()
    with trio.fail_after(20):
        response = await post_run(server, body)
    assert response.status_code == 200, response.text
    row = response.json()
    assert (row["ok"], [e["type"] for e in row["errors"]]) == (False, ["RolloutTimeoutError"])
    assert time.monotonic() - start_at < 1.0 + MARGIN
    ws = await RawWS.connect(server.url, TOKEN)
    try:
        start_at = time.monotonic()
        await ws.send(orjson.dumps([run_item(1, body), run_item(2, body)]))
        with trio.fail_after(20):
            answers = await ws.answers(2)
    finally:
        await ws.aclose()
    assert isinstance(answers, list)
    assert sorted((a["id"], a["status"]) for a in answers) == [(1, 200), (2, 200)]
    for answer in answers:
        assert [e["type"] for e in answer["row"]["errors"]] == ["RolloutTimeoutError"]
    assert time.monotonic() - start_at < 1.0 + MARGIN


async def test_the_limits_an_eval_sets_hold_on_a_running_server(
    server: Server, tmp_path: Path
) -> None:
    """`run_eval` against a running server (`--server-url`) whose env has no limits: the
    eval's env's rollout limits travel with every run."""
    env = tt.Env(tt.EchoTaskset(), rollout_limits=tt.RolloutLimits(rollout_timeout=1.0))
    ctx = tt.ModelContext(tt.EchoClient(delay=60.0), "echo")
    config = tt.EvalConfig(
        num_examples=2, output_dir=str(tmp_path), dashboard=False,
        backend=tt.ServedBackend(server.url, token=TOKEN),
    )  # fmt: skip
    start_at = time.monotonic()
    with trio.fail_after(30):
        result = await tt.run_eval(env, ctx, config)
    rows = [
        orjson.loads(line) for line in (result.run_dir / "traces.jsonl").read_bytes().splitlines()
    ]
    assert [[e["type"] for e in row["errors"]] for row in rows] == [["RolloutTimeoutError"]] * 2
    assert time.monotonic() - start_at < 1.0 + MARGIN + 3.0  # + the eval's own start
