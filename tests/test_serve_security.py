"""The served path on a hostile network (SPEC section 5, Security): real server processes on
127.0.0.1, attacked the way issue 11 measured them.

Every wait is bounded (`trio.fail_after`) and synchronises on an answer, a close, a log line
or a counter; time passes on the wall clock only where a timeout is what is tested. Servers
write their stderr (one line per refused request) to a file the tests read.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import stat
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import forkserver
import httpx
import orjson
import pytest
import trio
from chat_server import ChatServer
from env_server import EnvServer, start_env_server
from helpers import HTTPCase, http_cases
from hypercorn.config import Config
from hypercorn.trio import serve
from raw_ws import RawWS, run_item, send_once
from wsproto.events import CloseConnection

import trio_tasksets as tt
from trio_tasksets._cli.serve import FLAGS as SERVE_FLAGS
from trio_tasksets._core.builtin import EchoTaskset
from trio_tasksets._core.exceptions import ConfigError
from trio_tasksets._env.traces import write_atomic
from trio_tasksets._serve import EnvServerError
from trio_tasksets._serve.policy import (
    Access,
    Limits,
    ModelClients,
    ModelPolicy,
    RequestRefused,
    normalize_base_url,
)
from trio_tasksets._serve.transport import HandshakeRefused
from trio_tasksets._serve.wire import (
    MAX_DEPTH,
    EchoSpec,
    Forbidden,
    OpenAISpec,
    WireError,
    parse_run_request,
    quick_slot,
)

TOKEN = "security-token-0123456789"
TOKEN_VAR = "TT_TEST_SECURITY_TOKEN"
SECRET = "s3cret-that-must-not-leave"
KEY = "model-key-0123"
RSS_BOUND_MB = 100  # what a client that never reads may add to a server's resident memory
Server = EnvServer  # the name other test files import from here


# --- servers ---------------------------------------------------------------------------------


def start(log: Path, *args: str, token: bool = False, env: dict[str, str] | None = None) -> Server:
    """`trio-tasksets serve echo ARGS` on 127.0.0.1 and a free port."""
    extra = ["--token-var", TOKEN_VAR] if token else []
    return start_env_server(log, "echo", *extra, *args, env={TOKEN_VAR: TOKEN, **(env or {})})


@pytest.fixture(scope="module")
def basic(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Token, 64 KiB bodies, defaults otherwise: no endpoint, no key variable."""
    server = start(
        tmp_path_factory.mktemp("basic") / "stderr", "--max-body-bytes", "65536", token=True
    )
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def lenient(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Another allowed Host and Origin; short timeouts; 4 runs per connection."""
    server = start(
        tmp_path_factory.mktemp("lenient") / "stderr",
        "--allow-host", "ok.example", "--allow-origin", "http://ok.example",
        "--header-timeout", "0.5", "--idle-timeout", "1", "--max-runs-per-connection", "4",
    )  # fmt: skip
    try:
        yield server
    finally:
        server.stop()


def good_request(prompt: str = "say hi") -> dict[str, Any]:
    return {
        "slot": {"task": {"key": "k1", "data": {"prompt": prompt, "answer": "hi"}}, "rollout": 0},
        "ctx": {"model": "echo", "sampling": {}, "client": {"type": "echo", "delay": 0}},
    }


def openai_request(base_url: str, api_key_var: str | None) -> dict[str, Any]:
    body = good_request()
    body["ctx"]["client"] = {"type": "openai", "base_url": base_url, "timeout": 5.0,
                             "max_retries": 0, "api_key_var": api_key_var}  # fmt: skip
    return body


AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON = {"Content-Type": "application/json"}


async def post_run(
    server: Server, body: bytes | dict[str, Any], headers: dict[str, str] | None = None
) -> httpx.Response:
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as http:
        return await http.post("/run", content=content, headers={**JSON, **AUTH, **(headers or {})})


async def serves_a_good_run(server: Server) -> None:
    """A fresh client's run, over the WebSocket and over POST /run, is answered."""
    ctx = tt.ModelContext(tt.EchoClient(), "echo")
    with trio.fail_after(20):
        async with tt.EnvClient(server.url, token=TOKEN) as client:
            episode = await client.run(tt.RunSlot(tt.Task("say ok", answer="ok")), ctx)
        assert (episode.ok, episode.completion) == (True, "say ok")
        response = await post_run(server, good_request())
    assert response.status_code == 200, response.text


# --- the fake model endpoint, and a listener that must hear nothing ----------------------------


@pytest.fixture(scope="module")
def openai() -> Iterator[ChatServer]:
    """The suite's fake model endpoint, one for the module (servers started once per module
    are told its URL), answering "hi" with no usage. Its threads keep a connection open as
    long as the client does: the clients close first."""
    with ChatServer(answer=lambda _: "hi", usage={}) as chat:
        yield chat


@contextlib.contextmanager
def silent_listener() -> Iterator[tuple[str, Callable[[], int]]]:
    """A listening socket on 127.0.0.1 that never accepts: connections still complete in the
    kernel's backlog, so the count of them (taken at the end) shows whether anything
    connected. Yields its URL and the counting function."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)

        def count() -> int:
            sock.setblocking(False)
            found = 0
            while True:
                try:
                    conn, _ = sock.accept()
                except BlockingIOError:
                    return found
                conn.close()
                found += 1

        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1", count


@pytest.fixture(scope="module")
def guarded(openai: ChatServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """May reach the fake endpoint only, with the key in TT_TEST_KEY; holds a secret too."""
    server = start(
        tmp_path_factory.mktemp("guarded") / "stderr",
        "--api-key-var", "TT_TEST_KEY", f"--allow-base-url={openai.url}",
        token=True, env={"TT_TEST_KEY": KEY, "TT_TEST_SECRET": SECRET},
    )  # fmt: skip
    try:
        yield server
    finally:
        server.stop()


# --- the policy, unit by unit ------------------------------------------------------------------


def test_base_urls_are_compared_normalized_and_exactly() -> None:
    assert normalize_base_url("HTTP://Example.COM:80/v1/") == "http://example.com/v1"
    assert normalize_base_url("https://[::1]:8443/v1") == "https://[::1]:8443/v1"
    policy = ModelPolicy.from_flags(["http://127.0.0.1:9/v1"], None, {})
    policy.check(OpenAISpec("http://127.0.0.1:9/v1/"))
    for url in ("http://127.0.0.1:9/v2", "http://127.0.0.1:10/v1", "https://127.0.0.1:9/v1",
                "http://127.0.0.1:9@evil.example/v1", "http://evil.example/v1?u=127.0.0.1:9",
                "file:///etc/passwd", "http://127.0.0.1:9/v1/../.."):  # fmt: skip
        with pytest.raises(Forbidden, match="base_urls"):
            policy.check(OpenAISpec(url))
        with pytest.raises(Forbidden, match="--allow-base-url"):  # as the command line spells it
            policy.check(OpenAISpec(url), SERVE_FLAGS)
    for urls in (["ftp://x/v1"], ["http://x/v1?q=1"]):
        with pytest.raises(ConfigError, match="base_urls") as caught:
            ModelPolicy.from_flags(urls, None, {})
        assert caught.value.parameter == "base_urls"


@pytest.mark.parametrize(
    ("build", "name"),
    [(lambda: Limits(max_runs=0), "max_runs"), (lambda: Limits(max_body=-1), "max_body"),
     (lambda: Limits(header_timeout=0.0), "header_timeout"),
     (lambda: Limits(idle_timeout=float("nan")), "idle_timeout"),
     (lambda: Limits(model_clients=True), "model_clients"),
     (lambda: ModelPolicy(max_retries=-1), "max_retries"),
     (lambda: ModelPolicy(min_backoff=-0.1), "min_backoff"),
     (lambda: ModelPolicy(engine_metrics=(("http://h/v1", "http://h/metrics"),)),
      "engine_metrics")],
)  # fmt: skip
def test_the_servers_settings_are_valid_once_built(build: Callable[[], object], name: str) -> None:
    with pytest.raises(ConfigError) as caught:
        build()
    assert caught.value.parameter == name
    assert caught.value.spelled(SERVE_FLAGS).startswith(SERVE_FLAGS[name])


def test_a_request_names_the_servers_key_variable_or_none() -> None:
    policy = ModelPolicy.from_flags(["http://h/v1"], "TT_KEY", {"TT_KEY": " k ", "OTHER": "s"})
    assert policy.api_key == "k"
    policy.check(OpenAISpec("http://h/v1", api_key_var="TT_KEY"))
    policy.check(OpenAISpec("http://h/v1", api_key_var=None))
    policy.check(EchoSpec())
    with pytest.raises(Forbidden, match="TT_KEY") as caught:
        policy.check(OpenAISpec("http://h/v1", api_key_var="OTHER"))
    assert caught.value.status == 403
    keyless = ModelPolicy.from_flags(["http://h/v1"], None, {"OTHER": "s"})
    with pytest.raises(Forbidden, match="api_key_var OTHER"):
        keyless.check(OpenAISpec("http://h/v1", api_key_var="OTHER"))
    with pytest.raises(Forbidden, match="--api-key-var OTHER"):
        keyless.check(OpenAISpec("http://h/v1", api_key_var="OTHER"), SERVE_FLAGS)
    with pytest.raises(ConfigError, match="api_key_var: environment variable TT_NOPE") as unset:
        ModelPolicy.from_flags([], "TT_NOPE", {})
    assert unset.value.spelled(SERVE_FLAGS).startswith("--api-key-var: environment variable")


HOST_CASES = [
    ("127.0.0.1:8000", None, 200),
    ("LOCALHOST:8000", None, 200),
    ("[::1]:8000", None, 200),
    ("127.0.0.1:8001", None, 403),
    ("127.0.0.1", None, 403),
    ("evil.example:8000", None, 403),
    ("127.0.0.1:8000@evil", None, 403),
    ("ok.example", None, 200),
    ("ok.example:1234", None, 200),
    ("pinned.example:9", None, 200),
    ("pinned.example:10", None, 403),
    ("127.0.0.1:8000", "http://evil.example", 403),
    ("127.0.0.1:8000", "null", 403),
    ("127.0.0.1:8000", "HTTP://OK.example/", 200),
]  # fmt: skip


@pytest.mark.parametrize(("host", "origin", "status"), HOST_CASES)
def test_access_checks_host_and_origin(host: str, origin: str | None, status: int) -> None:
    access = Access.for_bind(
        "127.0.0.1", 8000, loopback=True, allow_hosts=["ok.example", "pinned.example:9"],
        allow_origins=["http://ok.example"],
    )  # fmt: skip
    headers = [(b"host", host.encode())]
    if origin is not None:
        headers.append((b"origin", origin.encode()))
    if status == 200:
        access.check(headers)
    else:
        with pytest.raises(RequestRefused) as caught:
            access.check(headers)
        assert caught.value.status == status
        assert ("allow_origins" if origin else "allow_hosts") in str(caught.value)
        with pytest.raises(RequestRefused) as spelled:
            access.check(headers, SERVE_FLAGS)
        assert ("--allow-origin" if origin else "--allow-host") in str(spelled.value)


def test_access_wants_one_host_and_a_bearer_token_in_any_case() -> None:
    access = Access.for_bind("127.0.0.1", 80, loopback=True, token="t0k")
    for auth in (b"Bearer t0k", b"bearer t0k", b"BEARER  t0k ", b"BeArEr t0k"):
        access.check([(b"host", b"127.0.0.1"), (b"authorization", auth)])
    for auth, needle in ((b"Basic t0k", "wrong"), (b"Bearer t0kx", "wrong"), (b"", "missing")):
        with pytest.raises(RequestRefused, match=needle) as caught:
            access.check([(b"host", b"localhost"), (b"authorization", auth)])
        assert caught.value.status == 401
    for headers in ([], [(b"host", b"127.0.0.1"), (b"host", b"127.0.0.1")]):
        with pytest.raises(RequestRefused, match="one Host") as caught:
            access.check(headers)
        assert caught.value.status == 400


def nested(depth: int, leaf: object = 1) -> object:
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"n": value}
    return value


@pytest.mark.parametrize(("where", "above"), [("info", 5), ("prompt", 6), ("extra", 4)])
def test_nesting_is_bounded_and_the_fast_path_agrees(where: str, above: int) -> None:
    """`above`: the levels of the body around the nested value (body, slot, task, ...)."""
    limit = MAX_DEPTH - above
    for depth, ok in ((limit, True), (limit + 1, False), (600, False)):
        body = good_request()
        data = body["slot"]["task"]["data"]
        if where == "info":
            data["info"] = {"x": nested(depth)}
        elif where == "prompt":
            data["prompt"] = [{"role": "user", "content": nested(depth)}]
        else:
            body["ctx"]["sampling"]["extra"] = {"x": nested(depth)}
        if ok:
            parse_run_request(body)
        else:
            with pytest.raises(WireError, match=f"deeper than {MAX_DEPTH}"):
                parse_run_request(body)
        if where != "extra":
            assert (quick_slot(body["slot"]) is not None) == ok


async def test_evicted_model_clients_are_closed_once_no_run_uses_them() -> None:
    policy = ModelPolicy.from_flags(["http://127.0.0.1:9/v1"], None, {})
    clients = ModelClients(policy, size=2)
    specs = [OpenAISpec("http://127.0.0.1:9/v1", timeout=1.0 + i) for i in range(4)]
    first = clients.get(specs[0])
    assert clients.acquire(first)  # a run uses it
    second = clients.get(specs[1])
    assert clients.get(specs[0]) is first  # cached, and now the most recent
    clients.get(specs[2])  # evicts specs[1], which no run uses
    clients.get(specs[3])  # evicts specs[0], still in use
    assert len(clients) == 2
    assert clients.generation == 2
    await clients.reap()
    assert isinstance(first, tt.OpenAIClient)
    assert isinstance(second, tt.OpenAIClient)
    assert second._closed
    assert not first._closed
    clients.release(first)
    await clients.reap()
    assert first._closed
    assert not clients.retiring
    assert not clients.acquire(clients.get(EchoSpec()))  # an echo client is not counted
    with pytest.raises(Forbidden):
        clients.get(OpenAISpec("http://127.0.0.1:10/v1"))
    await clients.aclose()


# --- credentials and endpoints --------------------------------------------------------------


async def test_a_run_cannot_send_a_server_secret_to_an_endpoint_it_names(
    guarded: Server, basic: Server, openai: ChatServer
) -> None:
    """The exfiltration of issue 11: a run names a secret variable and a listener. Refused
    with 403 naming the flag, on POST /run and on the WebSocket, before any outbound
    request: the listener hears nothing, and the model endpoint gets only the allowed key."""
    before = len(openai.received)
    with silent_listener() as (listener, connections):
        attempts = [
            (guarded, listener, "TT_TEST_SECRET", "--allow-base-url"),
            (guarded, listener, "TT_TEST_KEY", "--allow-base-url"),
            (guarded, listener, None, "--allow-base-url"),
            (guarded, openai.url, "TT_TEST_SECRET", "--api-key-var"),
            (guarded, openai.url, "PATH", "--api-key-var"),
            (guarded, openai.url.replace("/v1", "/v2"), "TT_TEST_KEY", "--allow-base-url"),
            (basic, listener, "TT_TEST_SECRET", "--allow-base-url"),
            (basic, openai.url, None, "--allow-base-url"),
        ]
        for server, url, var, flag in attempts:
            body = openai_request(url, var)
            response = await post_run(server, body)
            assert response.status_code == 403, response.text
            assert flag in response.json()["error"]
            ws = await RawWS.connect(server.url, TOKEN)
            try:
                with trio.fail_after(10):
                    await ws.send(orjson.dumps([run_item(1, body)]))
                    answers = await ws.answers(1)
            finally:
                await ws.aclose()
            assert isinstance(answers, list)
            assert answers[0]["status"] == 403
            assert flag in answers[0]["error"]
        assert connections() == 0
    assert len(openai.received) == before
    # The control: what the server was started to allow does go out, with its key only.
    response = await post_run(guarded, openai_request(openai.url, "TT_TEST_KEY"))
    assert response.status_code == 200, response.text
    assert response.json()["completion"] == "hi"
    sent = openai.received[before:]
    assert [r.headers.get("authorization") for r in sent] == [f"Bearer {KEY}"]
    assert all(SECRET not in value for r in sent for value in r.headers.values())
    keyless = await post_run(guarded, openai_request(openai.url, None))
    assert keyless.status_code == 200
    assert "authorization" not in openai.received[-1].headers


# --- who may talk to the server ----------------------------------------------------------------


REFUSALS = [
    ("foreign Host", "GET", "/health", {"Host": "evil.example"}, None, 403, "--allow-host"),
    ("rebinding Host", "POST", "/run", {"Host": "attacker.example:{port}"}, "good", 403,
     "--allow-host"),
    ("wrong port", "GET", "/health", {"Host": "127.0.0.1:1"}, None, 403, "--allow-host"),
    ("page Origin", "GET", "/health", {"Origin": "http://evil.example"}, None, 403,
     "--allow-origin"),
    ("page Origin on run", "POST", "/run", {"Origin": "null"}, "good", 403, "--allow-origin"),
    ("text/plain", "POST", "/run", {"Content-Type": "text/plain"}, "good", 415,
     "application/json"),
    ("form", "POST", "/run", {"Content-Type": "application/x-www-form-urlencoded"}, "good",
     415, "application/json"),
    ("no content type", "POST", "/run", {"Content-Type": ""}, "good", 415, "application/json"),
    ("basic auth", "GET", "/health", {"Authorization": "Basic eA=="}, None, 401, "wrong"),
]  # fmt: skip
ACCEPTED = [
    ("localhost", "GET", "/health", {"Host": "localhost:{port}"}, None),
    ("lower-case bearer", "GET", "/health", {"Authorization": f"bearer {TOKEN}"}, None),
    ("upper-case bearer", "POST", "/run", {"Authorization": f"BEARER {TOKEN}"}, "good"),
    ("json with charset", "POST", "/run", {"Content-Type": "Application/JSON; charset=utf-8"},
     "good"),
]  # fmt: skip


async def _request(server: Server, case: HTTPCase) -> httpx.Response:
    merged = {**JSON, **AUTH}
    for name, value in (case.headers or {}).items():
        merged[name] = value.format(port=server.port)
    merged = {k: v for k, v in merged.items() if v}
    content = orjson.dumps(good_request()) if case.body == "good" else None
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as http:
        return await http.request(case.method, case.path, headers=merged, content=content)


@http_cases(REFUSALS)
async def test_host_origin_content_type_and_token_refusals_are_logged_once(
    basic: Server, case: HTTPCase
) -> None:
    logged = len(basic.refusals())
    response = await _request(basic, case)
    assert response.status_code == case.status, response.text
    assert case.needle in response.json()["error"]
    lines = basic.refusals()[logged:]
    assert len(lines) == 1
    assert f"refused {case.status} {case.method} {case.path} from 127.0.0.1:" in lines[0]
    await serves_a_good_run(basic)


@http_cases(ACCEPTED)
async def test_what_the_checks_let_through(basic: Server, case: HTTPCase) -> None:
    response = await _request(basic, case)
    assert response.status_code == case.status == 200, response.text


@pytest.mark.parametrize(
    ("host", "headers", "status", "needle"),
    [("evil.example:{port}", {}, 403, "--allow-host"),
     (None, {"Origin": "http://evil.example"}, 403, "--allow-origin"),
     (None, {"Authorization": "Bearer nope"}, 401, "wrong")],
)  # fmt: skip
async def test_a_websocket_handshake_is_checked_the_same_way(
    basic: Server, host: str | None, headers: dict[str, str], status: int, needle: str
) -> None:
    logged = len(basic.refusals())
    with trio.fail_after(10), pytest.raises(HandshakeRefused) as refused:
        await RawWS.connect(
            basic.url, TOKEN, host=host.format(port=basic.port) if host else None, headers=headers
        )
    assert refused.value.status == status
    assert needle in str(refused.value)
    assert len(basic.refusals()) == logged + 1
    await serves_a_good_run(basic)


async def test_allowed_hosts_and_origins_are_served(lenient: Server) -> None:
    async with httpx.AsyncClient(base_url=lenient.url, timeout=20) as http:
        for headers in ({"Host": "ok.example"}, {"Host": "OK.example:443"},
                        {"Origin": "http://ok.example"}):  # fmt: skip
            assert (await http.get("/health", headers=headers)).status_code == 200
        refused = await http.get("/health", headers={"Origin": "http://ok.example:8080"})
        assert refused.status_code == 403
    ws = await RawWS.connect(
        lenient.url, TOKEN, host="ok.example", headers={"Origin": "http://ok.example"}
    )
    await ws.aclose()


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [(["--host", "0.0.0.0", "--token-var", "TT_T"], {"TT_T": "x"}, "--allow-host"),
     (["--api-key-var", "TT_SURELY_UNSET"], {}, "TT_SURELY_UNSET is not set"),
     (["--allow-base-url", "ftp://x/v1"], {}, "--allow-base-url"),
     (["--header-timeout", "0"], {}, "--header-timeout"),
     (["--max-runs-per-connection", "0"], {}, "--max-runs-per-connection")],
)  # fmt: skip
def test_a_server_refuses_to_start_with_an_unsafe_or_bad_flag(
    args: list[str], env: dict[str, str], needle: str
) -> None:
    environ = {k: v for k, v in os.environ.items() if k != "TT_SURELY_UNSET"}
    done = forkserver.run(
        [sys.executable, "-m", "trio_tasksets", "serve", "echo", "--port", "0", *args],
        capture_output=True, text=True, timeout=60, env={**environ, **env},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert needle in done.stderr


# --- bounded resources ---------------------------------------------------------------------


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def health(server: Server) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as http:
        payload: dict[str, Any] = (await http.get("/health", headers=AUTH)).json()
    return payload


async def health_until(server: Server, predicate: Callable[[dict[str, Any]], bool]) -> None:
    with trio.fail_after(20):
        while True:  # another process's counters: polled
            if predicate(await health(server)):
                return
            await trio.sleep(0.05)


async def test_a_client_that_never_reads_cannot_grow_the_server(tmp_path: Path) -> None:
    """Issue 11 measured 56 MB -> 1,748 MB in 17 s for one WebSocket that sends runs and
    never reads its answers, and 20,000 hour-long runs accepted on one connection. Now the
    server stops reading such a socket (its sends block and no run starts), holds at most
    1,024 runs for one connection, stays within +100 MB, and serves other clients; after
    --idle-timeout (5 s here) of unread answers it cancels the runs and discards what comes.
    Everything up to the 1,024 running must happen within those 5 s (1.7 s on a quiet
    machine: the flooder's buffers fill, a good run, the sleeper's runs start)."""
    server = start(tmp_path / "stderr", "--idle-timeout", "5", token=True)
    try:
        await serves_a_good_run(server)
        base = rss_mb(server.pid)
        peak = base
        sent = 0

        async def sample() -> None:
            nonlocal peak
            while True:
                peak = max(peak, rss_mb(server.pid))
                await trio.sleep(0.05)

        async def flood(ws: RawWS) -> None:
            nonlocal sent
            body = good_request("x" * 200)
            while True:
                await ws.send(orjson.dumps([run_item(sent + i, body) for i in range(16)]))
                sent += 16

        flooder = await RawWS.connect(server.url, TOKEN)
        sleeper = await RawWS.connect(server.url, TOKEN)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sample)
                nursery.start_soon(flood, flooder)
                with trio.fail_after(30):  # the flooder fills every buffer on the way, and
                    while True:  # its sends block (polled: a loaded machine fills them later)
                        sent_then = sent
                        await trio.sleep(0.5)
                        if sent == sent_then:
                            break
                before, sent_before = await health(server), sent
                await serves_a_good_run(server)  # others are served meanwhile
                await trio.sleep(0.5)
                after, sent_after = await health(server), sent
                hour = good_request()
                hour["ctx"]["client"]["delay"] = 3600
                for first in range(0, 3000, 100):  # 429s beyond 1,024, small enough to go out
                    items = [run_item(i, hour) for i in range(first, first + 100)]
                    await sleeper.send(orjson.dumps(items))
                await health_until(server, lambda h: h["running"] >= 1024)
                running = (await health(server))["running"]
                with trio.fail_after(20):  # the flooder stalls: one line, and its runs end
                    while True:
                        if any("answers not read for 5s" in line for line in server.refusals()):
                            break
                        await trio.sleep(0.05)
                await serves_a_good_run(server)
                nursery.cancel_scope.cancel()
        finally:
            await flooder.aclose()
            await sleeper.aclose()
        assert running == 1024  # the hour-long runs: the cap, no more
        # Backpressure: no more of the flooder's runs were read (the 2: the good client's)
        assert after["served"] == before["served"] + 2
        assert sent_after == sent_before  # and the flooder's sends blocked
        assert peak - base < RSS_BOUND_MB, f"{base:.0f} MB -> {peak:.0f} MB"
        await health_until(server, lambda h: h["running"] == 0)  # the sleeper's runs cancelled
        assert "Traceback" not in server.log.read_text()
    finally:
        server.stop()


async def test_a_thousand_model_client_descriptions_keep_fds_and_memory_bounded(
    guarded: Server, openai: ChatServer
) -> None:
    """Issue 11: 1,000 descriptions differing only in `timeout` took 860 MB and 1,000 fds.
    They now share the endpoint's connection pool, and at most 16 clients are kept."""
    ctx = tt.ModelContext(tt.OpenAIClient(openai.url, KEY, max_retries=0), "m")
    async with tt.EnvClient(guarded.url, token=TOKEN, api_key_var="TT_TEST_KEY") as client:
        assert (await client.run(tt.RunSlot(tt.Task("warm")), ctx)).ok
        base_fds, base_rss = fds(guarded.pid), rss_mb(guarded.pid)
        peak_fds = base_fds
        window = 16

        async def one(i: int) -> None:
            nonlocal peak_fds
            model = tt.OpenAIClient(openai.url, KEY, timeout=10 + i / 1000, max_retries=0)
            episode = await client.run(tt.RunSlot(tt.Task(f"t{i}")), tt.ModelContext(model, "m"))
            assert episode.ok, episode.errors
            peak_fds = max(peak_fds, fds(guarded.pid))

        async def slots() -> AsyncIterator[int]:
            for i in range(1000):
                yield i

        with trio.fail_after(120):
            await tt.run_stream(slots(), one, window=window)
    assert peak_fds - base_fds <= window + 4, (base_fds, peak_fds)
    assert fds(guarded.pid) - base_fds <= window + 4
    assert rss_mb(guarded.pid) - base_rss < RSS_BOUND_MB


async def test_a_connection_holds_at_most_its_runs_and_the_client_opens_another(
    lenient: Server,
) -> None:
    """--max-runs-per-connection 4: a fifth run on one WebSocket gets 429 naming the flag;
    `EnvClient` reads the cap from /health and spreads 10 concurrent runs over 3
    connections, with no 429."""
    slow = good_request()
    slow["ctx"]["client"]["delay"] = 30
    ws = await RawWS.connect(lenient.url, TOKEN)
    try:
        with trio.fail_after(10):
            await ws.send(orjson.dumps([run_item(i, slow) for i in range(5)]))
            answers = await ws.answers(1)
    finally:
        await ws.aclose()
    assert isinstance(answers, list)
    assert [(a["id"], a["status"]) for a in answers] == [(4, 429)]
    assert "--max-runs-per-connection" in answers[0]["error"]
    ctx = tt.ModelContext(tt.EchoClient(delay=0.3), "echo")
    async with tt.EnvClient(lenient.url) as client:
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                for i in range(10):
                    nursery.start_soon(client.run, tt.RunSlot(tt.Task(f"say {i}")), ctx)
        assert len(client._ws.connections) == 3


async def test_slow_headers_idle_connections_and_slow_bodies_time_out(lenient: Server) -> None:
    """--header-timeout 0.5: 50 connections that trickle a request head, and one that sends
    nothing, are closed by the server while /health still answers; a body that does not
    come gets 408. --idle-timeout 1: an idle WebSocket is closed with 1001."""
    streams = [await trio.open_tcp_stream("127.0.0.1", lenient.port) for _ in range(51)]
    closed: list[float] = []
    began = trio.current_time()

    async def trickle(stream: trio.SocketStream, head: bytes) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            for byte in head:
                await stream.send_all(bytes([byte]))
                with trio.move_on_after(0.1):
                    if not await stream.receive_some(1024):
                        break
            else:
                raise AssertionError("the server read a trickled head to its end")
        closed.append(trio.current_time() - began)

    async def silent(stream: trio.SocketStream) -> None:
        with contextlib.suppress(trio.BrokenResourceError):
            assert await stream.receive_some(1024) == b""
        closed.append(trio.current_time() - began)

    head = f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{lenient.port}\r\n".encode() + b"X" * 200
    try:
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                for stream in streams[:50]:
                    nursery.start_soon(trickle, stream, head)
                nursery.start_soon(silent, streams[50])
                assert (await health(lenient))["ok"]
    finally:
        for stream in streams:
            await stream.aclose()
    assert len(closed) == 51
    assert max(closed) < 10
    async with await trio.open_tcp_stream("127.0.0.1", lenient.port) as stream:
        await stream.send_all(
            f"POST /run HTTP/1.1\r\nHost: 127.0.0.1:{lenient.port}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{".encode()
        )
        with trio.fail_after(10):
            answer = b""
            while b"\r\n\r\n" not in answer:
                answer += await stream.receive_some(4096)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    ws = await RawWS.connect(lenient.url, TOKEN)
    try:
        with trio.fail_after(10):
            gone = await ws.receive()
    finally:
        await ws.aclose()
    assert isinstance(gone, CloseConnection)
    assert (gone.code, gone.reason) == (1001, "idle for 1s")


# --- malformed input: a seeded, bounded fuzz ------------------------------------------------


PATHS = [("slot",), ("slot", "task"), ("slot", "task", "key"), ("slot", "task", "data"),
         ("slot", "task", "data", "prompt"), ("slot", "task", "data", "answer"),
         ("slot", "task", "data", "info"), ("slot", "rollout"), ("ctx",), ("ctx", "model"),
         ("ctx", "sampling"), ("ctx", "sampling", "temperature"), ("ctx", "sampling", "seed"),
         ("ctx", "sampling", "max_tokens"), ("ctx", "sampling", "extra"), ("ctx", "client"),
         ("ctx", "client", "type"), ("ctx", "client", "delay")]  # fmt: skip
VALUES: list[object] = [None, True, False, 0, -1, 1.5, -0.0, "", "x", [], {}, [1], {"a": 1},
                        "openai", "echo", 2**63, -(2**63)]  # fmt: skip


def _set(body: dict[str, Any], path: tuple[str, ...], value: object) -> None:
    target: Any = body
    for name in path[:-1]:
        if not isinstance(target, dict):
            return
        target = target.setdefault(name, {})
    if isinstance(target, dict):
        target[path[-1]] = value


def _placed(rng: random.Random, literal: str) -> bytes:
    """A good body's JSON with one value replaced by `literal` (raw JSON text)."""
    body = good_request()
    _set(body, rng.choice(PATHS), "\u0000MARK\u0000")
    return orjson.dumps(body).replace(b'"\\u0000MARK\\u0000"', literal.encode())


def malformed(rng: random.Random) -> bytes:
    data = bytearray(orjson.dumps(good_request()))
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(len(data))
        action = rng.randrange(4)
        if action == 0:
            del data[at:]
            data += b"x" if not data else b""
        elif action == 1:
            data[at] = rng.choice(b'{}[]",:\\ 0aZ\x00')
        elif action == 2:
            data[at:at] = rng.choice([b"{", b"]", b",", b'"', b"NaN", b"Infinity", b"\\"])
        else:
            del data[at]
    return bytes(data)


def wrong_type(rng: random.Random) -> bytes:
    body = good_request()
    for _ in range(rng.randint(1, 3)):
        _set(body, rng.choice(PATHS), rng.choice(VALUES))
    return orjson.dumps(body)


def deep(rng: random.Random) -> bytes:
    depth = rng.choice([70, 100, 500, 1000, 1030, 5000])
    opener, closer = rng.choice([("[", "]"), ('{"a":', "}")])
    return _placed(rng, opener * depth + "1" + closer * depth)


def huge_number(rng: random.Random) -> bytes:
    literal = rng.choice(["1" + "0" * rng.randint(19, 400), "-" + "9" * rng.randint(19, 60),
                          "1e309", "-1e400", "1e-400", "123456789012345678901234567890.5",
                          "18446744073709551616", "-9223372036854775809", "1" * 5000])  # fmt: skip
    return _placed(rng, literal)


def bad_text(rng: random.Random) -> bytes:
    bad = rng.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf",
                      b"\\ud800", b"\\udfff", b"\\ud800\\u0041", b"\\udc00\\ud800"])  # fmt: skip
    return orjson.dumps(good_request()).replace(b"say hi", b"say " + bad + b" hi")


CATEGORIES: list[tuple[str, Callable[[random.Random], bytes], set[int]]] = [
    ("malformed JSON", malformed, {200, 400, 403, 422}),
    ("wrong types", wrong_type, {200, 403, 422}),
    ("deep nesting", deep, {400, 422}),
    ("huge numbers", huge_number, {200, 400, 422}),
    ("invalid UTF-8 and lone surrogates", bad_text, {400}),
]
CASES = 25  # per category and per path (POST /run and the WebSocket)


@pytest.mark.parametrize(
    ("make", "statuses"), [c[1:] for c in CATEGORIES], ids=[c[0] for c in CATEGORIES]
)
async def test_fuzzed_run_requests_get_a_4xx_never_a_500(
    basic: Server, make: Callable[[random.Random], bytes], statuses: set[int]
) -> None:
    """Seeded: the same cases on every run. POST /run answers each with one of `statuses`
    (a 4xx with one log line each); on the WebSocket the same body is a run item, answered
    with the same status, or (not JSON) closes with 1007. Then the server still serves."""
    rng = random.Random(f"issue-11-{make.__name__}")
    bodies = [make(rng) for _ in range(CASES)]
    logged = len(basic.refusals())
    refused = 0
    async with httpx.AsyncClient(base_url=basic.url, timeout=20) as http:
        for body in bodies:
            response = await http.post("/run", content=body, headers={**JSON, **AUTH})
            assert response.status_code in statuses, (body[:200], response.text)
            if response.status_code != 200:
                refused += 1
                assert response.json()["error"]
            on_ws = await _ws_status(basic, body)
            assert on_ws in statuses | {1007}, (body[:200], on_ws)
            assert on_ws == response.status_code or (on_ws == 1007 and response.status_code == 400)
            refused += on_ws != 200
    assert len(basic.refusals()) - logged == refused  # one line each
    await serves_a_good_run(basic)
    assert "Traceback" not in basic.log.read_text()


async def _ws_status(server: Server, body: bytes) -> int:
    """The status of `body` as a run item on a fresh WebSocket, or the close code."""
    ws = await RawWS.connect(server.url, TOKEN)
    try:
        with trio.fail_after(20):
            await ws.send(b'[{"op":"run","id":1,"body":' + body + b"}]")
            answers = await ws.answers(1)
    finally:
        await ws.aclose()
    if isinstance(answers, CloseConnection):
        return answers.code
    assert isinstance(answers, list), "the server dropped the connection"
    assert answers[0]["id"] == 1
    status: int = answers[0]["status"]
    return status


async def test_oversize_bodies_and_messages_are_refused(basic: Server) -> None:
    rng = random.Random("issue-11-oversize")
    async with httpx.AsyncClient(base_url=basic.url, timeout=20) as http:
        for _ in range(6):
            size = rng.choice([65_537, 100_000, 1_000_000, 3_000_000])
            body = orjson.dumps(good_request("x" * size))

            async def chunks(data: bytes = body) -> AsyncIterator[bytes]:
                for at in range(0, len(data), 8192):
                    yield data[at : at + 8192]

            for content in (body, chunks()):  # with Content-Length, and chunked
                response = await http.post("/run", content=content, headers={**JSON, **AUTH})
                assert response.status_code == 413, response.text
                assert "--max-body-bytes" in response.json()["error"]
            frame = b'[{"op":"run","id":1,"body":' + body + b"}]"
            with trio.fail_after(20):
                closed = await send_once(basic.url, TOKEN, frame)
            assert closed is None or (isinstance(closed, CloseConnection) and closed.code == 1009)
    await serves_a_good_run(basic)


def ws_frame(rng: random.Random) -> bytes:
    """Random bytes, or a frame header with a random opcode, bits and length (masked or
    not), then random payload."""
    if rng.random() < 0.3:
        return rng.randbytes(rng.randint(1, 64))
    first = rng.randrange(256)
    length = rng.choice([0, 5, 125, 126, 127])
    masked = rng.random() < 0.7
    head = bytes([first, (0x80 if masked else 0) | length])
    if length == 126:
        head += rng.randrange(1 << 16).to_bytes(2, "big")
    elif length == 127:
        head += rng.randrange(1 << 63).to_bytes(8, "big")
    return head + (rng.randbytes(4) if masked else b"") + rng.randbytes(rng.randint(0, 40))


ITEMS: list[object] = [
    {"op": "pickle", "id": 1}, {"op": None, "id": 2}, {"op": ["run"], "id": 3},
    {"op": "run", "id": 4, "body": None}, {"op": "run", "id": 5, "body": [], "x": 1},
    {"op": "cancel", "id": 6}, {"op": "run", "id": "x" * 128, "body": "s"},
    {"op": "run", "id": 2**64 - 1, "body": {}},
]  # fmt: skip
UNANSWERABLE: list[object] = [
    1, "s", None, [[]], [1], {"op": "run"}, {"op": "run", "id": True}, {"op": "run", "id": 1.5},
    {"op": "run", "id": "x" * 129}, {"op": "run", "id": None}, {"op": "run", "id": [1]},
]  # fmt: skip


async def test_garbage_frames_and_unknown_items_never_crash_the_websocket(basic: Server) -> None:
    """Random frames after the handshake end that connection (or wait for more); items of
    unknown ops and wrong shapes get a 4xx each; an item with no usable id closes with
    1007. The server serves a good run after each kind."""
    rng = random.Random("issue-11-frames")
    for _ in range(CASES):
        ws = await RawWS.connect(basic.url, TOKEN)
        try:
            await ws.stream.send_all(ws_frame(rng))
            with trio.move_on_after(0.2):  # it may wait for the rest of a frame: fine
                await ws.receive()
        finally:
            await ws.aclose()
    await serves_a_good_run(basic)
    ws = await RawWS.connect(basic.url, TOKEN)
    try:
        with trio.fail_after(20):
            await ws.send(b"[]")  # no item: nothing to answer
            await ws.send(orjson.dumps(ITEMS))
            answers = await ws.answers(len(ITEMS) - 1)  # the cancel is not answered
    finally:
        await ws.aclose()
    assert isinstance(answers, list)
    assert sorted(str(a["id"]) for a in answers) == sorted(
        str(item["id"]) for item in ITEMS if isinstance(item, dict) and item["op"] != "cancel"
    )
    assert {a["status"] for a in answers} == {422}
    for item in UNANSWERABLE:
        for frame in (orjson.dumps(item), orjson.dumps(item).decode()):  # binary and text
            with trio.fail_after(20):
                closed = await send_once(basic.url, TOKEN, frame)
            assert isinstance(closed, CloseConnection), (item, closed)
            assert closed.code == 1007
    await serves_a_good_run(basic)
    health = await _health(basic)
    assert health["failed"] == 0
    assert "Traceback" not in basic.log.read_text()


async def _health(server: Server) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as http:
        payload: dict[str, Any] = (await http.get("/health", headers=AUTH)).json()
    return payload


async def test_garbage_http_gets_a_400_or_a_close(basic: Server) -> None:
    rng = random.Random("issue-11-http")
    for _ in range(CASES):
        garbage = rng.choice([
            rng.randbytes(rng.randint(1, 200)),
            b"GET /health HTTP/1.1\r\n" + rng.randbytes(50) + b"\r\n\r\n",
            b"POST /run HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: -1\r\n\r\n",
            b"POST /run HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            b"GET / HTTP/9.9\r\n\r\n",
            b"GET " + b"/" * 20_000 + b" HTTP/1.1\r\n\r\n",
        ])  # fmt: skip
        async with await trio.open_tcp_stream("127.0.0.1", basic.port) as stream:
            with contextlib.suppress(trio.BrokenResourceError):
                await stream.send_all(garbage)
            answer = b""
            with trio.move_on_after(0.2), contextlib.suppress(trio.BrokenResourceError):
                while chunk := await stream.receive_some(4096):
                    answer += chunk
        assert not answer.startswith(b"HTTP/1.1 5"), answer[:200]
    await serves_a_good_run(basic)
    assert "Traceback" not in basic.log.read_text()


# --- the client side, and the files ------------------------------------------------------------


@attrs.define
class Bloated:
    """A fake env server whose /health and WebSocket answers are `size` bytes."""

    size: int
    websocket: bool = True

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
        elif scope["type"] == "http":
            pad = "x" * (self.size if not self.websocket else 0)
            body = orjson.dumps({"ok": True, "workers": 1, "websocket": "/ws", "pad": pad})
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": body})
        else:
            await receive()
            await send({"type": "websocket.accept"})
            await receive()  # a run: answered with a message over the client's limit
            await send({"type": "websocket.send", "bytes": b'["' + b"x" * self.size + b'"]'})
            while (await receive())["type"] != "websocket.disconnect":
                pass


@pytest.mark.parametrize("websocket", [True, False])
async def test_the_client_refuses_a_message_over_its_limit(websocket: bool) -> None:
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.loglevel = "WARNING"
    app: Any = Bloated(200_000, websocket)
    ctx = tt.ModelContext(tt.EchoClient(), "echo")
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(serve, app, config)
        async with tt.EnvClient(binds[0], max_message_bytes=100_000) as client:
            with trio.fail_after(20), pytest.raises(EnvServerError, match="over 100000 bytes"):
                await (client.run(tt.RunSlot(tt.Task("x")), ctx) if websocket else client.health())
        nursery.cancel_scope.cancel()


async def test_an_idle_websocket_is_replaced_without_failing_a_run(lenient: Server) -> None:
    """--idle-timeout 1: the client closes a connection idle for 0.5 s before using it, and
    the server closes one idle for 1 s; either way the next run opens a new one."""
    ctx = tt.ModelContext(tt.EchoClient(), "echo")
    async with tt.EnvClient(lenient.url) as client:
        assert (await client.run(tt.RunSlot(tt.Task("a")), ctx)).ok
        first = client._ws.connections[0]
        await trio.sleep(0.7)  # the time that passes is what is tested
        assert (await client.run(tt.RunSlot(tt.Task("b")), ctx)).ok
        assert first.gone is not None
        second = client._ws.connections[-1]
        assert second is not first
        with trio.fail_after(10):  # the server's close, seen by the client's reader
            while True:
                if second.gone is not None:
                    break
                await trio.sleep(0.05)
        assert (await client.run(tt.RunSlot(tt.Task("c")), ctx)).ok


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o664])
def test_a_rewrite_keeps_the_files_mode(tmp_path: Path, mode: int) -> None:
    """`--resume` rewrites traces.jsonl atomically: the new file has the old one's mode."""
    path = tmp_path / "traces.jsonl"
    path.write_text('{"a": 1}\n')
    path.chmod(mode)
    write_atomic(path, [{"a": 2}])
    assert stat.S_IMODE(path.stat().st_mode) == mode
    assert path.read_text() == '{"a":2}\n'
    fresh = tmp_path / "summary.json"
    write_atomic(fresh, text="{}")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o644 & ~umask
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


async def test_a_serve_eval_reaches_its_own_endpoint_with_its_key(
    openai: ChatServer, tmp_path: Path
) -> None:
    """`--serve` starts its child with --allow-base-url (the eval's endpoint) and
    --api-key-var TT_SERVE_API_KEY (the eval's key, in the child's environment only)."""
    env = tt.Env(EchoTaskset())
    ctx = tt.ModelContext(tt.OpenAIClient(openai.url, "eval-key", max_retries=0), "m")
    config = tt.EvalConfig(serve=True, output_dir=str(tmp_path), run_name="r", dashboard=False)
    before = len(openai.received)
    with trio.fail_after(60):
        result = await tt.run_eval(env, ctx, config)
    assert result.episodes
    assert all(e.ok and e.completion == "hi" for e in result.episodes)
    sent = openai.received[before:]
    assert len(sent) == len(result.episodes)
    assert {r.headers.get("authorization") for r in sent} == {"Bearer eval-key"}
