"""The served path: wire validation (pure), real env servers, and `eval --serve` end to end.

Subprocess tests run on the real clock; every wait is bounded and synchronises on a line, a
health answer or a file, never on a fixed sleep.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import forkserver
import h11
import httpx
import orjson
import pytest
import trio
from helpers import HTTPCase, alive, http_cases
from raw_ws import RawWS, run_item, send_once
from wsproto.events import CloseConnection

import trio_tasksets as tt
from trio_tasksets._core.builtin import EchoConfig, EchoTaskset
from trio_tasksets._env.spec import EnvSpec, TravelError, config_from_json
from trio_tasksets._serve import EnvServerError, spawn_server
from trio_tasksets._serve.app import LINGER_BYTES
from trio_tasksets._serve.client import retry_server_error
from trio_tasksets._serve.transport import HandshakeRefused
from trio_tasksets._serve.wire import (
    EchoSpec,
    OpenAISpec,
    WireError,
    build_task,
    describe_client,
    encode_run_request,
    parse_run_request,
    quick_slot,
)

ROOT = Path(__file__).resolve().parent.parent
FEEDS = str(ROOT / "tests" / "fixtures" / "feeds.py")
TOKEN = "test-token-0123456789"
TOKEN_VAR = "TT_TEST_SERVE_TOKEN"


# --- helpers ---------------------------------------------------------------------------------


def wait_for(predicate: Callable[[], bool], timeout: float = 20, what: str = "it") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def read_line(proc: subprocess.Popen[str], timeout: float = 20) -> str:
    """The next stdout line of `proc`, waiting at most `timeout` seconds."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise AssertionError("the server printed no line in time")
    return proc.stdout.readline().strip()


def start_server(*args: str, token: bool = True) -> tuple[subprocess.Popen[str], str]:
    """A `trio-tasksets serve` process on a free port, and its URL. Its stderr (a line per
    refused request) goes to a file, which no test has to drain."""
    extra = ["--token-var", TOKEN_VAR] if token else []
    with tempfile.TemporaryFile() as stderr:  # the child keeps its own descriptor
        proc = forkserver.popen(
            [sys.executable, "-m", "trio_tasksets", "serve", *args, "--port", "0", *extra],
            stdout=subprocess.PIPE, stderr=stderr, text=True,
            env={**os.environ, TOKEN_VAR: TOKEN},
        )  # fmt: skip
    line = read_line(proc)
    assert line.startswith("serving on http://127.0.0.1:"), line
    return proc, line.removeprefix("serving on ")


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def eval_command(tmp_path: Path, *args: str) -> list[str]:
    out = str(tmp_path / "out")
    return [sys.executable, "-m", "trio_tasksets", "eval", *args, "-o", out, "--no-dashboard"]


def run_eval_cli(
    tmp_path: Path, *args: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TT_PULL_LOG": str(tmp_path / "pulls.log")}
    return forkserver.run(
        eval_command(tmp_path, *args), capture_output=True, text=True, timeout=timeout, env=env,
        cwd=tmp_path,
    )  # fmt: skip


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def line_count(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`, from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def good_request() -> dict[str, Any]:
    return {
        "slot": {"task": {"key": "k1", "data": {"prompt": "say hi", "answer": "hi"}}, "rollout": 0},
        "ctx": {"model": "echo", "sampling": {}, "client": {"type": "echo", "delay": 0}},
    }


# --- wire validation (pure) --------------------------------------------------------------------


def test_a_run_request_round_trips_through_the_wire() -> None:
    task = tt.Task("say 1", answer="1", info={"n": 1}, system_prompt="be brief", key="t1")
    ctx = tt.ModelContext(tt.EchoClient(delay=0.5), "echo", tt.Sampling(temperature=0.2, seed=3))
    body = json.loads(encode_run_request(tt.RunSlot(task, 2), ctx))
    request = parse_run_request(body)
    assert (request.key, request.rollout, request.model) == ("t1", 2, "echo")
    assert request.sampling == ctx.sampling
    assert request.client == EchoSpec(delay=0.5)
    assert build_task(EchoTaskset, request.key, request.data) == task


def test_an_openai_client_travels_as_a_description_without_its_key() -> None:
    client = tt.OpenAIClient("http://127.0.0.1:9/v1", "sk-secret", timeout=7.0)
    spec = describe_client(client, api_key_var="MY_KEY")
    assert spec == OpenAISpec("http://127.0.0.1:9/v1", 7.0, 3, 0.5, 30.0, "MY_KEY")
    body = encode_run_request(tt.RunSlot(tt.Task("x")), tt.ModelContext(client, "m"))
    assert b"sk-secret" not in body
    assert parse_run_request(json.loads(body)).client == attrs.evolve(spec, api_key_var=None)


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [(("slot", "task", "data", "prompt"), 3, "slot.task.data.prompt"),
     (("slot", "task", "key"), None, "slot.task.key"),
     (("slot", "rollout"), "0", "slot.rollout"),
     (("slot", "rollout"), -1, "slot.rollout"),
     (("ctx", "model"), [], "ctx.model"),
     (("ctx", "sampling", "max_tokens"), 1.5, "ctx.sampling.max_tokens"),
     (("ctx", "sampling", "temprature"), 0.1, "ctx.sampling.temprature"),
     (("ctx", "client", "type"), "pickle", "ctx.client.type"),
     (("ctx", "client", "delay"), -1, "ctx.client.delay"),
     (("slot", "task", "data", "info"), "x", "slot.task.data.info")],
)  # fmt: skip
def test_a_bad_field_is_named(path: tuple[str, ...], value: object, field: str) -> None:
    body = good_request()
    target = body
    for name in path[:-1]:
        target = target[name]
    target[path[-1]] = value
    with pytest.raises(WireError) as caught:
        parse_run_request(body)
    assert caught.value.field == field


@pytest.mark.parametrize(
    ("change", "accepted"),
    [({}, True),
     ({"rollout": 3}, True),
     ({"task": {"key": "k", "data": {"prompt": [{"role": "user", "content": "x"}],
                                      "info": {"a": 1}, "system_prompt": "s"}}}, True),
     ({"rollout": True}, False),
     ({"rollout": -1}, False),
     ({"rollout": 1.0}, False),
     ({"extra": 1}, False),
     ({"task": {"key": "k"}}, False),
     ({"task": {"key": "k", "data": {"prompt": "x"}, "more": 1}}, False),
     ({"task": {"key": 1, "data": {"prompt": "x"}}}, False),
     ({"task": {"key": "k", "data": {}}}, False),
     ({"task": {"key": "k", "data": {"prompt": ["x"]}}}, False),
     ({"task": {"key": "k", "data": {"prompt": "x", "answer": 1}}}, False),
     ({"task": {"key": "k", "data": {"prompt": "x", "info": []}}}, False),
     ({"task": {"key": "k", "data": {"prompt": "x", "system_prompt": 2}}}, False),
     ({"task": {"key": "k", "data": {"prompt": "x", "other": 2}}}, False)],
)  # fmt: skip
def test_the_quick_slot_check_accepts_only_what_the_full_check_accepts(
    change: dict[str, Any], accepted: bool
) -> None:
    body = good_request()
    body["slot"].update(change)
    quick = quick_slot(body["slot"])
    assert (quick is not None) == accepted
    if accepted:
        request = parse_run_request(body)
        assert quick == (request.key, request.data, request.rollout)
    else:
        with pytest.raises(WireError):
            parse_run_request(body)


def test_missing_fields_are_named() -> None:
    body = good_request()
    del body["ctx"]["client"]
    with pytest.raises(WireError, match=r"^ctx\.client: missing"):
        parse_run_request(body)
    with pytest.raises(WireError, match=r"^body: expected an object"):
        parse_run_request([1])


class Custom(tt.Taskset[Any, tt.TasksetConfig]):
    @staticmethod
    def task_from_data(data: dict[str, Any], key: str) -> tuple[str, Any]:
        return (key, data["anything"])


def test_task_from_data_builds_custom_tasks_and_skips_the_task_field_check() -> None:
    body = good_request()
    body["slot"]["task"]["data"] = {"anything": [1, 2]}
    request = parse_run_request(body, plain_tasks=False)
    assert build_task(Custom, request.key, request.data) == ("k1", [1, 2])
    with pytest.raises(WireError, match=r"slot\.task\.data"):
        build_task(tt.Taskset, "k", {"nonsense": 1})


def module_reward(task: Any, completion: str) -> float:
    return 1.0


def test_the_env_spec_rebuilds_the_same_env() -> None:
    config = EchoConfig(phrases=("a", "b"), system_prompt="sys")
    env = tt.Env(EchoTaskset(config), reward=module_reward, retries=tt.RetryPolicy(2, ["X"]))
    spec = EnvSpec.of(env)
    assert spec.taskset == "trio_tasksets:EchoTaskset"  # its public name
    assert spec.reward == f"{__name__}:module_reward"
    rebuilt = EnvSpec.of(spec.build())  # the taskset class resolved by its name
    assert rebuilt == spec
    assert EnvSpec.of(spec.build(EchoTaskset(config))) == spec  # or built already
    assert EnvSpec.from_json(spec.to_json()) == spec  # and it travels as data
    assert config_from_json(EchoTaskset, spec.config) == config  # the tuple comes back


def test_what_cannot_travel_is_refused_with_a_reason() -> None:
    class LocalEnv(tt.Env[Any]):
        pass

    with pytest.raises(TravelError, match="lambda"):
        EnvSpec.of(tt.Env(EchoTaskset(), reward=lambda task, completion: 1.0))
    with pytest.raises(TravelError, match="top level"):
        EnvSpec.of(LocalEnv(EchoTaskset()))

    class Client:
        async def chat(self, *a: Any, **k: Any) -> Any: ...
        async def aclose(self) -> None: ...

    with pytest.raises(TravelError, match="Client cannot travel"):
        describe_client(Client())


async def test_run_eval_refuses_what_cannot_travel_before_any_file(tmp_path: Path) -> None:
    env = tt.Env(EchoTaskset(), reward=lambda task, completion: 1.0)
    ctx = tt.ModelContext(tt.EchoClient(), "echo")
    config = tt.EvalConfig(serve=True, output_dir=str(tmp_path / "out"), dashboard=False)
    with pytest.raises(tt.EvalConfigError, match=r"serve: .*lambda"):
        await tt.run_eval(env, ctx, config)
    assert not (tmp_path / "out").exists()


def test_the_client_retries_a_server_error_only_when_the_policy_names_it() -> None:
    gone = EnvServerError("gone", url="http://x")
    refused = EnvServerError("422", url="http://x", status=422)
    assert not retry_server_error(tt.RetryPolicy(3), gone, 1)  # "any" means any episode error
    assert retry_server_error(tt.RetryPolicy(3, ["EnvServerError"]), gone, 1)
    assert not retry_server_error(tt.RetryPolicy(3, ["EnvServerError"]), gone, 4)
    assert not retry_server_error(tt.RetryPolicy(3, ["EnvServerError"]), refused, 1)


async def test_a_server_that_is_gone_is_named() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    async with tt.EnvClient(url) as client:
        with pytest.raises(EnvServerError, match=f"env server {url} is gone") as caught:
            await client.health()
    assert caught.value.url == url
    assert caught.value.retryable


# --- a running server ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """One token-protected echo server for the tests that do not kill it."""
    proc, url = start_server("echo", "--max-body-bytes", "65536")
    try:
        yield url
    finally:
        stop(proc)


@pytest.mark.parametrize("transport", ["websocket", "http"])
async def test_cancelling_client_run_cancels_the_episode_on_the_server(
    server: str, transport: str
) -> None:
    """WebSocket: by a cancel message for the run's id; HTTP: by closing the connection."""
    slot = tt.RunSlot(tt.Task("wait", key="slow"))
    ctx = tt.ModelContext(tt.EchoClient(delay=60), "echo")
    async with tt.EnvClient(server, token=TOKEN, transport=transport) as client:
        before = await client.health()
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.run, slot, ctx)
                await health_until(client, lambda h: h["running"] == before["running"] + 1)
                nursery.cancel_scope.cancel()  # cancels the in-flight client.run
            after = await health_until(
                client, lambda h: h["cancelled"] == before["cancelled"] + 1 and h["running"] == 0
            )
        assert after["served"] == before["served"]
        quick = tt.ModelContext(tt.EchoClient(), "echo")
        episode = await client.run(tt.RunSlot(tt.Task("say ok", answer="ok"), 1), quick)
        assert episode.ok
        assert (episode.reward, episode.rollout) == (1.0, 1)


async def health_until(
    client: tt.EnvClient, predicate: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    while True:
        health = await client.health()
        if predicate(health):
            return health
        await trio.sleep(0.02)


BAD_REQUESTS = [
    ("missing token", "POST", "/run", {}, json.dumps(good_request()), 401, "missing"),
    ("wrong token", "POST", "/run", {"Authorization": "Bearer nope"}, "{}", 401, "wrong"),
    ("token on health", "GET", "/health", {"Authorization": "Bearer nope"}, None, 401, "wrong"),
    ("malformed JSON", "POST", "/run", None, "{not json", 400, "not JSON"),
    ("wrong type", "POST", "/run", None, json.dumps({**good_request(), "slot": {
        "task": {"key": 5, "data": {"prompt": "x"}}}}), 422, "slot.task.key"),
    ("missing field", "POST", "/run", None, json.dumps({"slot": good_request()["slot"]}), 422,
     "ctx: missing"),
    ("oversize", "POST", "/run", None, "x" * 100_000, 413, "limit"),
    ("unknown path", "GET", "/nope", None, None, 404, "/nope"),
    ("wrong method", "GET", "/run", None, None, 405, "POST"),
]  # fmt: skip


@http_cases(BAD_REQUESTS)
async def test_a_bad_request_gets_its_4xx_and_the_server_goes_on(
    server: str, case: HTTPCase
) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    json_type = {"Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=server, timeout=10) as http:
        response = await http.request(
            case.method,
            case.path,
            content=case.body,
            headers={**json_type, **(auth if case.headers is None else case.headers)},
        )
        assert response.status_code == case.status, response.text
        assert case.needle in response.json()["error"]
        good = await http.post("/run", json=good_request(), headers=auth)
    assert good.status_code == 200, good.text
    episode = tt.Episode.from_row(good.json())
    assert episode.ok
    assert (episode.completion, episode.task.key) == ("say hi", "k1")


async def _answer(stream: trio.SocketStream, conn: h11.Connection) -> h11.Response:
    """The next whole answer on a raw connection (its body read and dropped)."""
    response: h11.Response | None = None
    with trio.fail_after(10):
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                response = event
            elif isinstance(event, h11.EndOfMessage):
                assert response is not None
                return response


def _post(conn: h11.Connection, port: int, token: str, body: bytes, length: int) -> bytes:
    head = h11.Request(method="POST", target="/run", headers=[
        ("Host", f"127.0.0.1:{port}"), ("Authorization", f"Bearer {token}"),
        ("Content-Type", "application/json"), ("Content-Length", str(length))])  # fmt: skip
    return conn.send(head) + (conn.send(h11.Data(data=body)) if body else b"")


async def test_a_request_refused_on_its_head_keeps_its_connection_once_its_body_came(
    server: str,
) -> None:
    """A 401 decided on the head alone reads the (small) body first and keeps the connection:
    the next request on it is served. Answered before the body came, the connection was
    closed without a word, and a client reusing it (httpx does) saw "server disconnected".
    A body over `LINGER_BYTES` is not read: its answer says ``Connection: close``."""
    port = httpx.URL(server).port
    assert port is not None
    async with tt.EnvClient(server, token=TOKEN) as client:
        before = (await client.health())["rejected"]
        async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
            conn = h11.Connection(h11.CLIENT)
            await stream.send_all(_post(conn, port, "nope", b"", 2))
            with trio.fail_after(10):  # the server has refused the head, the body is not sent
                await health_until(client, lambda h: h["rejected"] > before)
            await stream.send_all(conn.send(h11.Data(data=b"{}")) + conn.send(h11.EndOfMessage()))
            refused = await _answer(stream, conn)
            assert refused.status_code == 401
            assert (b"connection", b"close") not in refused.headers
            conn.start_next_cycle()
            good = orjson.dumps(good_request())
            await stream.send_all(
                _post(conn, port, TOKEN, good, len(good)) + conn.send(h11.EndOfMessage())
            )
            assert (await _answer(stream, conn)).status_code == 200
        async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
            conn = h11.Connection(h11.CLIENT)
            await stream.send_all(_post(conn, port, "nope", b"{", LINGER_BYTES + 1))
            refused = await _answer(stream, conn)
            assert refused.status_code == 401
            assert (b"connection", b"close") in refused.headers


async def serves_a_good_run(url: str) -> None:
    """A fresh client's run on a fresh WebSocket is answered (the server went on)."""
    async with tt.EnvClient(url, token=TOKEN) as client:
        episode = await client.run(tt.RunSlot(tt.Task("say ok", answer="ok")), ECHO)
    assert (episode.ok, episode.completion) == (True, "say ok")


ECHO = tt.ModelContext(tt.EchoClient(), "echo")


async def test_websocket_runs_are_multiplexed_and_answered_by_id(server: str) -> None:
    """Several runs in one message, answered by id (in any order and grouping)."""
    ws = await RawWS.connect(server, TOKEN)
    try:
        bodies = [good_request() for _ in range(3)]
        for i, body in enumerate(bodies):
            body["slot"]["task"]["data"]["prompt"] = f"say {i}"
        await ws.send(orjson.dumps([run_item(i, body) for i, body in enumerate(bodies)]))
        answers: dict[int, dict[str, Any]] = {}
        with trio.fail_after(10):
            while len(answers) < 3:
                received = await ws.receive()
                assert isinstance(received, list)
                answers.update((a["id"], a) for a in received)
    finally:
        await ws.aclose()
    for i in range(3):
        assert answers[i]["status"] == 200
        assert tt.Episode.from_row(answers[i]["row"]).completion == f"say {i}"


BAD_ITEMS = [
    ("wrong type", run_item(1, {**good_request(), "slot": {
        "task": {"key": 5, "data": {"prompt": "x"}}}}), 422, "slot.task.key"),
    ("missing body", {"op": "run", "id": 1}, 422, "body: expected an object"),
    ("missing field", run_item(1, {"slot": good_request()["slot"]}), 422, "ctx: missing"),
    ("unknown op", {"op": "pickle", "id": 1}, 422, "op:"),
    ("unknown field", {**run_item(1, good_request()), "extra": 1}, 422, "extra: unknown"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("item", "status", "needle"),
    [case[1:] for case in BAD_ITEMS],
    ids=[case[0] for case in BAD_ITEMS],
)
async def test_a_bad_websocket_item_gets_an_error_for_its_id_and_the_connection_goes_on(
    server: str, item: dict[str, Any], status: int, needle: str
) -> None:
    ws = await RawWS.connect(server, TOKEN)
    try:
        with trio.fail_after(10):
            await ws.send(orjson.dumps(item))
            answers = await ws.receive()
            assert isinstance(answers, list)
            assert answers == [{"id": 1, "status": status, "error": answers[0]["error"]}]
            assert needle in answers[0]["error"]
            await ws.send(orjson.dumps([run_item("next", good_request())]))  # same connection
            answers = await ws.receive()
    finally:
        await ws.aclose()
    assert isinstance(answers, list)
    assert (answers[0]["id"], answers[0]["status"]) == ("next", 200)


async def test_a_bad_item_after_good_ones_with_the_same_context_is_still_named(
    server: str,
) -> None:
    ws = await RawWS.connect(server, TOKEN)
    bad = good_request()
    bad["slot"]["task"]["data"]["answer"] = 7
    try:
        with trio.fail_after(10):
            await ws.send(orjson.dumps([run_item(1, good_request()), run_item(2, good_request())]))
            answers: list[Any] = []
            while len(answers) < 2:
                received = await ws.receive()
                assert isinstance(received, list)
                answers += received
            await ws.send(orjson.dumps([run_item(3, bad)]))
            received = await ws.receive()
    finally:
        await ws.aclose()
    assert [a["status"] for a in answers] == [200, 200]
    assert isinstance(received, list)
    assert (received[0]["id"], received[0]["status"]) == (3, 422)
    assert received[0]["error"].startswith("slot.task.data.answer:")


BAD_MESSAGES = [
    ("malformed JSON", b"{not json", 1007, "not JSON"),
    ("an item without an id", orjson.dumps([{"op": "run", "body": good_request()}]), 1007, "id"),
    ("oversize", b"[" + b" " * 100_000 + b"]", 1009, ""),
]


@pytest.mark.parametrize(
    ("data", "code", "needle"),
    [case[1:] for case in BAD_MESSAGES],
    ids=[case[0] for case in BAD_MESSAGES],
)
async def test_an_unreadable_websocket_message_closes_that_connection_and_the_server_goes_on(
    server: str, data: bytes, code: int, needle: str
) -> None:
    with trio.fail_after(10):
        closed = await send_once(server, TOKEN, data)
    assert isinstance(closed, CloseConnection)
    assert closed.code == code
    assert needle in (closed.reason or "")
    await serves_a_good_run(server)


@pytest.mark.parametrize(("token", "needle"), [(None, "missing"), ("nope", "wrong")])
async def test_a_websocket_without_the_right_token_is_refused_with_401(
    server: str, token: str | None, needle: str
) -> None:
    with trio.fail_after(10), pytest.raises(HandshakeRefused) as refused:
        await RawWS.connect(server, token)
    assert refused.value.status == 401
    assert needle in str(refused.value)
    async with tt.EnvClient(server, token=token) as client:
        with pytest.raises(EnvServerError, match="HTTP 401") as caught:
            await client.run(tt.RunSlot(tt.Task("x")), ECHO)
    assert caught.value.status == 401
    await serves_a_good_run(server)


async def test_a_run_over_the_size_limit_goes_over_http_and_gets_413(server: str) -> None:
    """The client sends a request the server's limit would refuse as POST /run, so that only
    that run fails (with 413), not its WebSocket's other runs."""
    async with tt.EnvClient(server, token=TOKEN) as client:
        with pytest.raises(EnvServerError, match="HTTP 413") as caught:
            await client.run(tt.RunSlot(tt.Task("x" * 100_000)), ECHO)
        assert caught.value.status == 413
        episode = await client.run(tt.RunSlot(tt.Task("say ok", answer="ok")), ECHO)
    assert episode.ok


async def test_the_http_transport_still_runs_slots(server: str) -> None:
    async with tt.EnvClient(server, token=TOKEN, transport="http") as client:
        episode = await client.run(tt.RunSlot(tt.Task("say ok", answer="ok")), ECHO)
        assert not client._ws.connections  # no WebSocket was opened
    assert (episode.ok, episode.reward) == (True, 1.0)


def test_a_non_loopback_bind_needs_a_token() -> None:
    serve = [sys.executable, "-m", "trio_tasksets", "serve", "echo", "--port", "0"]
    done = forkserver.run([*serve, "--host", "0.0.0.0"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert "--token-var" in done.stderr
    env = {k: v for k, v in os.environ.items() if k != "TT_SURELY_UNSET"}
    done = forkserver.run(
        [*serve, "--host", "0.0.0.0", "--token-var", "TT_SURELY_UNSET"],
        capture_output=True, text=True, timeout=30, env=env,
    )  # fmt: skip
    assert done.returncode == 2
    assert "TT_SURELY_UNSET" in done.stderr


def test_a_pool_started_by_hand_serves_and_stops_cleanly_on_sigterm() -> None:
    proc = forkserver.popen(
        [sys.executable, "-m", "trio_tasksets", "serve", "echo", "--port", "0", "--workers", "2"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        url = read_line(proc).removeprefix("serving on ")
        workers = descendants(proc.pid)
        assert len(workers) == 2
        for _ in range(3):  # stdin at EOF (no parent pipe) does not stop a pool
            health = httpx.get(f"{url}/health", timeout=10).json()
            assert health["ok"]
            assert health["workers"] == 2
            assert health["pid"] in workers
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert not any(alive(pid) for pid in workers)
    finally:
        stop(proc)


# --- eval --serve end to end -------------------------------------------------------------------


def test_a_never_draining_stream_through_serve_pulls_exactly_3_in_the_main_process(
    tmp_path: Path,
) -> None:
    done = run_eval_cli(tmp_path, f"{FEEDS}:NeverDrains", "-n", "3", "--serve", "--run-name", "s")
    assert done.returncode == 0, done.stderr
    written = rows(tmp_path / "out" / "s" / "traces.jsonl")
    assert len(written) == 3
    assert all(r["ok"] and r["reward"] == 1.0 for r in written)
    # The pull log is shared with the server child: a pull there would show as a 4th line.
    assert (tmp_path / "pulls.log").read_text().splitlines() == ["0", "1", "2"]


def test_a_static_run_with_two_workers_gives_every_row(tmp_path: Path) -> None:
    args = (f"{FEEDS}:Numbers", "-n", "20", "-r", "2", "--serve", "--workers", "2")
    done = run_eval_cli(tmp_path, *args, "--run-name", "w")
    assert done.returncode == 0, done.stderr
    written = rows(tmp_path / "out" / "w" / "traces.jsonl")
    assert sorted((r["task"]["data"]["prompt"], r["rollout"]) for r in written) == sorted(
        (f"say {i}", r) for i in range(20) for r in range(2)
    )
    assert all(r["ok"] for r in written)


def test_serve_and_server_url_are_usage_errors_together(tmp_path: Path) -> None:
    done = run_eval_cli(tmp_path, "echo", "--serve", "--server-url", "http://127.0.0.1:9")
    assert done.returncode == 2
    assert "choose one" in done.stderr
    done = run_eval_cli(tmp_path, "echo", "--workers", "2")
    assert done.returncode == 2
    assert "--serve" in done.stderr
    assert not (tmp_path / "out").exists()


def test_server_url_checks_the_token_and_the_taskset_before_any_slot(
    tmp_path: Path, server: str
) -> None:
    done = run_eval_cli(tmp_path, f"{FEEDS}:Numbers", "-n", "2", "--server-url", server)
    assert done.returncode == 1
    assert f"env server {server} answered GET /health with HTTP 401" in done.stderr
    env = {**os.environ, TOKEN_VAR: TOKEN}
    done = forkserver.run(
        eval_command(tmp_path, f"{FEEDS}:Numbers", "-n", "2", "--server-url", server,
                     "--token-var", TOKEN_VAR, "--run-name", "m"),
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert done.returncode == 1
    assert "serves taskset EchoTaskset, but this eval's is Numbers" in done.stderr
    assert not (tmp_path / "out" / "m" / "traces.jsonl").exists()  # stopped before any slot


def test_killing_the_server_mid_run_ends_the_eval_with_an_error_naming_it(
    tmp_path: Path,
) -> None:
    proc, url = start_server(f"{FEEDS}:Numbers")
    try:
        traces = tmp_path / "out" / "k" / "traces.jsonl"
        args = (f"{FEEDS}:Numbers", "-n", "200", "-c", "4", "--echo-delay", "0.05",
                "--server-url", url, "--token-var", TOKEN_VAR, "--run-name", "k")  # fmt: skip
        run = forkserver.popen(
            eval_command(tmp_path, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env={**os.environ, TOKEN_VAR: TOKEN},
        )  # fmt: skip
        wait_for(lambda: line_count(traces) >= 8, what="the first rows")
        proc.send_signal(signal.SIGKILL)
        _, err = run.communicate(timeout=20)
    finally:
        stop(proc)
    assert run.returncode == 1, err
    assert f"env server {url}" in err
    written = rows(traces)  # every line whole
    assert 8 <= len(written) < 200
    assert all(r["ok"] for r in written)


def test_the_server_children_die_when_the_eval_is_sigkilled(tmp_path: Path) -> None:
    traces = tmp_path / "out" / "p" / "traces.jsonl"
    args = (f"{FEEDS}:Numbers", "-n", "200", "-c", "4", "--echo-delay", "0.05", "--serve",
            "--workers", "2", "--run-name", "p")  # fmt: skip
    run = forkserver.popen(
        eval_command(tmp_path, *args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_for(lambda: line_count(traces) >= 4, what="the first rows")
        children = descendants(run.pid)
        assert len(children) == 3  # the supervisor and its two workers
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=10)
        wait_for(lambda: not any(alive(pid) for pid in children), 10, "the children to exit")
    finally:
        if run.poll() is None:
            run.kill()


async def test_a_child_that_dies_while_starting_is_reported_with_its_stderr(
    tmp_path: Path,
) -> None:
    module = tmp_path / "fragile.py"
    module.write_text(
        "import os\nimport trio_tasksets as tt\n"
        "if 'TT_SERVE_TOKEN' in os.environ:\n"
        "    raise RuntimeError('no tasks for servers here')\n"
        "class Fragile(tt.Taskset[tt.Task, tt.TasksetConfig]):\n"
        "    def load(self):\n        return [tt.Task('x')]\n"
    )
    from trio_tasksets._env.loading import resolve_taskset

    env = tt.Env(resolve_taskset(f"{module}:Fragile")())
    with trio.fail_after(30), pytest.raises(EnvServerError) as caught:
        async with spawn_server(env, startup_timeout=20):
            pass
    assert "no tasks for servers here" in str(caught.value)
    assert "failed to start" in str(caught.value)


def half_reward(task: Any, completion: str) -> float:
    return 0.5


class TaggedEnv(tt.Env[Any]):
    """An Env subclass whose rollout marks the episode, to show the class travels."""

    async def rollout(self, task: Any, ctx: tt.ModelContext) -> tuple[list[Any], str]:
        messages, completion = await super().rollout(task, ctx)
        return messages, f"{completion} [tagged in {os.getpid()}]"


async def test_run_eval_serve_rebuilds_the_env_class_reward_and_config(tmp_path: Path) -> None:
    config = EchoConfig(phrases=("alpha", "beta"), system_prompt="be brief")
    env = TaggedEnv(EchoTaskset(config), reward=half_reward)
    ctx = tt.ModelContext(tt.EchoClient(), "echo")
    eval_config = tt.EvalConfig(
        rollouts_per_example=2, serve=True, output_dir=str(tmp_path), run_name="r",
        dashboard=False,
    )  # fmt: skip
    with trio.fail_after(30):
        result = await tt.run_eval(env, ctx, eval_config)
    written = rows(tmp_path / "r" / "traces.jsonl")
    assert len(written) == len(result.episodes) == 4
    assert {r["reward"] for r in written} == {0.5}
    assert all(r["completion"].endswith("]") for r in written)
    assert all(f"[tagged in {os.getpid()}]" not in r["completion"] for r in written)
    assert all(r["messages"][0] == {"role": "system", "content": "be brief"} for r in written)


async def test_an_env_failing_outside_an_episode_gets_500_and_the_server_goes_on(
    tmp_path: Path,
) -> None:
    module = tmp_path / "keyless.py"
    module.write_text(
        "import trio_tasksets as tt\n"
        "class Keyless(tt.Taskset[tt.Task, tt.TasksetConfig]):\n"
        "    @staticmethod\n"
        "    def task_from_data(data, key):\n"
        "        return object() if data.get('broken') else tt.Task(data['prompt'], key=key)\n"
    )
    from trio_tasksets._env.loading import resolve_taskset

    env = tt.Env(resolve_taskset(f"{module}:Keyless")())
    ctx = tt.ModelContext(tt.EchoClient(), "echo")
    fine = tt.RunSlot(tt.Task("x", key="b"))
    body = {"slot": {"task": {"key": "b", "data": {"broken": True}}, "rollout": 0},
            "ctx": good_request()["ctx"]}  # fmt: skip
    with trio.fail_after(30):
        async with (
            spawn_server(env) as server,
            tt.EnvClient(server.url, token=server.token) as client,
        ):
            with pytest.raises(EnvServerError, match="HTTP 500: the env failed") as caught:
                await client._request("POST", "/run", json.dumps(body).encode())
            assert caught.value.status == 500
            assert "TypeError" in server.stderr_tail()  # the traceback, for whoever runs it
            episode = await client.run(fine, ctx)  # the server goes on
            assert episode.completion == "x"


async def test_on_the_websocket_one_bad_run_fails_alone(tmp_path: Path) -> None:
    """A task_from_data that raises, and a row orjson cannot encode (int keys), each affect
    their own run only: the others on the same connection finish."""
    module = tmp_path / "picky.py"
    module.write_text(
        "import trio_tasksets as tt\n"
        "class Picky(tt.Taskset[tt.Task, tt.TasksetConfig]):\n"
        "    @staticmethod\n"
        "    def task_from_data(data, key):\n"
        "        info = {1: 'one'} if key == 'intkeys' else {}\n"
        "        return tt.Task(data['prompt'].strip(), key=key, info=info)\n"
    )
    from trio_tasksets._env.loading import resolve_taskset

    env = tt.Env(resolve_taskset(f"{module}:Picky")())
    slow = tt.ModelContext(tt.EchoClient(delay=0.5), "echo")
    outcomes: dict[str, str] = {}
    with trio.fail_after(30):
        async with (
            spawn_server(env) as server,
            tt.EnvClient(server.url, token=server.token, transport="websocket") as client,
        ):

            async def one(name: str, task: tt.Task) -> None:
                try:
                    episode = await client.run(tt.RunSlot(task), slow)
                    outcomes[name] = f"ok {episode.task.data['info']}"
                except EnvServerError as exc:
                    outcomes[name] = f"{exc.status}"

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(one, f"good{i}", tt.Task(f"say {i}", key=f"k{i}"))
                nursery.start_soon(one, "intkeys", tt.Task("say it", key="intkeys"))
                await health_until(client, lambda h: h["running"] == 4)
                bad = tt.Task([{"role": "user", "content": "x"}], key="bad")  # no .strip()
                nursery.start_soon(one, "bad", bad)
            health = await client.health()
    assert outcomes["bad"] == "500"
    assert outcomes["intkeys"] == "ok {'1': 'one'}"  # as POST /run would send it
    assert all(outcomes[f"good{i}"] == "ok {}" for i in range(3))
    assert health["failed"] == 1


async def test_an_integer_json_cannot_carry_exactly_is_refused_before_sending() -> None:
    from trio_tasksets._serve.wire import RunRequestEncoder

    ctx = tt.ModelContext(tt.EchoClient(), "echo")
    with pytest.raises(TypeError, match="64-bit"):
        RunRequestEncoder().encode(tt.RunSlot(tt.Task("x", info={"id": 2**70})), ctx)
    RunRequestEncoder().encode(tt.RunSlot(tt.Task("x", info={"id": 2**63})), ctx)  # fits


async def test_a_closed_client_refuses_runs_and_leaves_no_connection(server: str) -> None:
    client = tt.EnvClient(server, token=TOKEN)
    ctx = tt.ModelContext(tt.EchoClient(), "echo")
    with trio.fail_after(20):
        assert (await client.run(tt.RunSlot(tt.Task("a", key="a")), ctx)).ok
        await client.aclose()
        with pytest.raises(EnvServerError, match="closed"):
            await client.run(tt.RunSlot(tt.Task("b", key="b")), ctx)
    assert client._ws.connections == []
    assert client._ws.closed
