"""A client for another provider takes part in everything with no change to the package: the
seam is `ModelClientBase.describe` (what the rest of the package asks of a client) and
`EndpointCalls` (the retry, limits and outcome loop of every HTTP client).

The proof is a client of Anthropic's Messages API, which is not OpenAI-shaped (`POST
/v1/messages`, an `x-api-key` header, the reply's `content` blocks, `stop_reason`,
`usage.input_tokens`/`output_tokens`), written here and run against a small Messages server
of this module's own on 127.0.0.1: retries on 429 and 5xx with Retry-After, a bound on its
connections, outcomes to an adaptive window, and an eval row end to end through
`tt.run_eval`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

import trio_tasksets as tt
from trio_tasksets._core.adaptive import AdaptiveBounds, AdaptiveWindow, Outcome
from trio_tasksets._core.limits import CallObserver, EndpointLimits, observe_calls
from trio_tasksets._env.spec import TravelError
from trio_tasksets._models import (
    ClientDescription,
    EndpointCalls,
    ModelClientBase,
    ModelHTTPError,
    ModelResponseError,
    describe,
)
from trio_tasksets._models.base import text_of
from trio_tasksets._serve.wire import OpenAISpec, describe_client
from trio_tasksets._transport import HTTPClient

KEY = "sk-ant-test"

# --- the client: one module's worth, on the seam ------------------------------------------------


class MessagesClient(ModelClientBase):
    """Anthropic's Messages API: the request, the headers and the reply are its own; the
    retries, limits and outcomes are `EndpointCalls`'."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        max_tokens: int = 1024,
        max_retries: int = 3,
        backoff: float = 0.01,
        limits: EndpointLimits | None = None,
        http_client: HTTPClient | None = None,
    ) -> None:
        self.base_url = base_url
        self.max_tokens = max_tokens
        self._owns_http = http_client is None
        self._http = HTTPClient() if http_client is None else http_client
        self._headers = {
            "x-api-key": api_key,
            "anthropic-version": "2023-06-01",
            "content-type": "application/json",
        }
        self.calls = EndpointCalls(
            self._http, base_url.rstrip("/") + "/v1/messages", max_retries=max_retries,
            backoff=backoff, max_backoff=0.5, limits=limits,
        )  # fmt: skip

    def describe(self) -> ClientDescription:
        return ClientDescription(
            endpoints=(self.base_url,),
            limits=self.calls.limits,
            api_key=self._headers["x-api-key"],
        )

    async def chat(
        self, messages: list[dict[str, Any]], *, model: str, sampling: tt.Sampling
    ) -> tt.Completion:
        system = [text_of(m.get("content")) for m in messages if m.get("role") == "system"]
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": sampling.max_tokens or self.max_tokens,
            "messages": [
                {"role": m["role"], "content": text_of(m.get("content"))}
                for m in messages
                if m.get("role") != "system"
            ],
        }
        if system:
            body["system"] = "\n\n".join(system)
        if sampling.temperature is not None:
            body["temperature"] = sampling.temperature
        return await self.calls.post(
            json.dumps(body).encode(),
            headers=self._headers,
            parse=self._parse,
            reserve_tokens=body["max_tokens"],
        )

    def _parse(self, content: bytes) -> tt.Completion:
        try:
            data = json.loads(content)
            blocks = data["content"]
            text = "".join(b["text"] for b in blocks if b.get("type") == "text")
            usage = data.get("usage") or {}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelResponseError(
                f"{self.calls.url} returned no Messages reply ({exc})", url=self.calls.url
            ) from None
        return tt.Completion(
            text,
            usage={
                "prompt_tokens": int(usage.get("input_tokens", 0)),
                "completion_tokens": int(usage.get("output_tokens", 0)),
            },
            finish_reason=data.get("stop_reason"),
        )

    async def aclose(self) -> None:
        self.calls.closed = True
        if self._owns_http:
            await self._http.aclose()


# --- a small Messages server on 127.0.0.1 -------------------------------------------------------


@attrs.frozen
class Answer:
    """One scripted answer: a status, its headers and an error body (a 2xx: the reply)."""

    status: int = 200
    headers: dict[str, str] = attrs.Factory(dict)
    error: str = "error"


@attrs.define
class Seen:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    at: float


@attrs.define(eq=False)
class MessagesServer:
    """Answers `POST /v1/messages` as Anthropic's API does, echoing the last user message;
    the `script`'s answers first, in order. `delay` seconds per request; `capacity`: more
    requests in flight at once get 429 with `Retry-After: retry_after`."""

    delay: float = 0.0
    capacity: int | None = None
    retry_after: str = "0.05"
    script: list[Answer] = attrs.Factory(list)
    seen: list[Seen] = attrs.Factory(list)
    active: int = 0
    peak: int = 0
    lock: threading.Lock = attrs.Factory(threading.Lock)
    url: str = ""

    def answer(
        self, path: str, headers: dict[str, str], raw: bytes
    ) -> tuple[int, dict[str, str], bytes]:
        body = json.loads(raw)
        with self.lock:
            self.seen.append(Seen(path, headers, body, time.monotonic()))
            scripted = self.script.pop(0) if self.script else None
            busy = self.capacity is not None and self.active >= self.capacity
            if scripted is None and not busy:
                self.active += 1
                self.peak = max(self.peak, self.active)
        if scripted is not None and scripted.status != 200:
            return scripted.status, scripted.headers, _error(scripted.error)
        if busy and scripted is None:
            return 429, {"retry-after": self.retry_after}, _error("rate_limit_error")
        try:
            time.sleep(self.delay)
        finally:
            if scripted is None:
                with self.lock:
                    self.active -= 1
        if path != "/v1/messages" or headers.get("x-api-key") != KEY:
            return 401, {}, _error("authentication_error")
        text = next(m["content"] for m in reversed(body["messages"]) if m["role"] == "user")
        reply = {
            "id": "msg_1", "type": "message", "role": "assistant", "model": body["model"],
            "content": [{"type": "text", "text": text}], "stop_reason": "end_turn",
            "usage": {"input_tokens": len(text.split()), "output_tokens": len(text.split())},
        }  # fmt: skip
        return 200, {}, json.dumps(reply).encode()


def _error(kind: str) -> bytes:
    return json.dumps(
        {"type": "error", "error": {"type": kind, "message": f"{kind} here"}}
    ).encode()


@pytest.fixture
def messages() -> Iterator[MessagesServer]:
    server = MessagesServer()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("content-length", 0)))
            headers = {k.lower(): v for k, v in self.headers.items()}
            status, extra, body = server.answer(self.path, headers, raw)
            self.send_response(status)
            for name, value in {"content-type": "application/json", **extra}.items():
                self.send_header(name, value)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    server.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        httpd.shutdown()
        httpd.server_close()


USER = [{"role": "user", "content": "hello there"}]


# --- the tests ----------------------------------------------------------------------------------


async def test_its_request_and_reply_are_the_providers_own(messages: MessagesServer) -> None:
    async with MessagesClient(messages.url, KEY) as client:
        ctx = tt.ModelContext(client, "claude-x", tt.Sampling(temperature=0.0, max_tokens=64))
        reply = await ctx.chat([{"role": "system", "content": "be brief"}, *USER])
    assert (reply.content, reply.finish_reason) == ("hello there", "end_turn")
    assert reply.usage == {"prompt_tokens": 2, "completion_tokens": 2}
    (seen,) = messages.seen
    assert seen.path == "/v1/messages"
    assert seen.headers["x-api-key"] == KEY
    assert "authorization" not in seen.headers
    assert seen.body == {
        "model": "claude-x", "max_tokens": 64, "system": "be brief", "temperature": 0.0,
        "messages": [{"role": "user", "content": "hello there"}],
    }  # fmt: skip


async def test_429_and_5xx_are_retried_after_their_retry_after(messages: MessagesServer) -> None:
    """A 429 (Retry-After 0.3 s), then Anthropic's 529 overloaded: both retried, the first
    after the server's wait; every attempt's outcome is reported."""
    messages.script = [Answer(429, {"retry-after": "0.3"}), Answer(529, error="overloaded_error")]
    outcomes: list[Outcome] = []

    class Watch(CallObserver):
        def on_outcome(self, outcome: Outcome, retry_after: float | None) -> None:
            outcomes.append(outcome)

    async with MessagesClient(messages.url, KEY) as client:
        with observe_calls(Watch()):
            reply = await client.chat(USER, model="m", sampling=tt.Sampling())
        assert client.calls.throttled == 1
    assert reply.content == "hello there"
    assert len(messages.seen) == 3
    assert messages.seen[1].at - messages.seen[0].at >= 0.3
    assert outcomes == [Outcome.RATE_LIMITED, Outcome.SERVER_ERROR, Outcome.SUCCESS]


async def test_a_4xx_is_raised_at_once_with_the_servers_own_message(
    messages: MessagesServer,
) -> None:
    messages.script = [Answer(400, error="invalid_request_error")]
    async with MessagesClient(messages.url, KEY) as client:
        with pytest.raises(
            ModelHTTPError, match="HTTP 400 after 1 attempt: invalid_request_error here"
        ) as info:
            await client.chat(USER, model="m", sampling=tt.Sampling())
    assert info.value.status == 400
    assert len(messages.seen) == 1


async def test_exhausted_retries_name_the_attempts(messages: MessagesServer) -> None:
    messages.script = [Answer(500)] * 3
    async with MessagesClient(messages.url, KEY, max_retries=2) as client:
        with pytest.raises(ModelHTTPError, match="HTTP 500 after 3 attempts") as info:
            await client.chat(USER, model="m", sampling=tt.Sampling())
    assert info.value.attempts == 3


async def test_its_connections_are_bounded_by_the_endpoint_limits(
    messages: MessagesServer,
) -> None:
    messages.delay = 0.1
    limits = EndpointLimits(connections=2)
    async with MessagesClient(messages.url, KEY, limits=limits) as client, trio.open_nursery() as n:
        for _ in range(8):
            n.start_soon(lambda: client.chat(USER, model="m", sampling=tt.Sampling()))
    assert len(messages.seen) == 8
    assert messages.peak == 2


class Say(tt.Taskset[tt.Task, tt.TasksetConfig]):
    def load(self) -> Iterable[tt.Task]:
        return [tt.Task(f"say {i}", answer=f"say {i}", key=str(i)) for i in range(24)]


async def test_an_eval_runs_end_to_end_its_429s_moving_an_adaptive_window(
    messages: MessagesServer, tmp_path: Path
) -> None:
    """Through `tt.run_eval`: rows with the provider's reply and usage, the summary's
    tokens, the run's record naming the endpoint, and the server's 429s (over 2 in flight)
    reaching the adaptive rollout window as they come."""
    messages.delay, messages.capacity = 0.05, 2
    window = AdaptiveWindow(1, 6, 16)
    config = tt.EvalConfig(
        output_dir=str(tmp_path), run_name="run", max_concurrent=window, dashboard=False
    )
    async with MessagesClient(messages.url, KEY, max_retries=20) as client:
        result = await tt.run_eval(tt.Env(Say()), tt.ModelContext(client, "claude-x"), config)
    assert result.summary["ok"] == 24
    assert result.summary["reward_mean"] == 1.0
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "traces.jsonl").read_text().splitlines()]
    assert sorted(row["completion"] for row in rows) == sorted(f"say {i}" for i in range(24))
    assert all(row["usage"] == {"prompt_tokens": 2, "completion_tokens": 2} for row in rows)
    assert result.summary["usage"] == {"prompt_tokens": 48, "completion_tokens": 48}
    assert json.loads((run / "config.json").read_text())["base_url"] == messages.url
    assert messages.peak <= 2
    assert any(reason.startswith("429") for _, _, reason in window.history)
    assert window.size < 6


def test_it_says_what_it_is_and_so_stays_in_process() -> None:
    """The served path asks the description, not the class: this client names no way to
    travel, so it cannot go to an env server; its key and limits are told, not guessed."""
    limits = EndpointLimits(connections=4)
    client = MessagesClient("http://127.0.0.1:9", KEY, limits=limits)
    found = describe(client)
    assert (found.endpoints, found.limits, found.api_key) == (("http://127.0.0.1:9",), limits, KEY)
    assert KEY not in repr(found)
    with pytest.raises(TravelError, match="MessagesClient cannot travel"):
        describe_client(client)


def test_the_headers_an_openai_client_sends_keep_it_in_process_by_name() -> None:
    """The served path reads the header names from the description (never a value): a
    client with its own headers cannot travel; its key travels as a variable's name."""
    client = tt.OpenAIClient("http://127.0.0.1:9/v1", "sk-1", headers={"X-Org": "org-secret"})
    with pytest.raises(TravelError, match=r"custom headers \(X-Org\)") as info:
        describe_client(client)
    assert "org-secret" not in str(info.value)
    keyed = describe_client(tt.OpenAIClient("http://127.0.0.1:9/v1", "sk-1"), api_key_var="K")
    assert isinstance(keyed, OpenAISpec)
    assert keyed.api_key_var == "K"


async def test_the_report_reads_its_limits_from_what_it_says(
    messages: MessagesServer, tmp_path: Path
) -> None:
    """The run's record and summary take the client's limits from its description: an
    adaptive bound on its connections is recorded, and its history kept per endpoint."""
    messages.delay = 0.02
    limits = EndpointLimits(connections=AdaptiveBounds(1, 2, 4))
    config = tt.EvalConfig(output_dir=str(tmp_path), run_name="run", dashboard=False)
    async with MessagesClient(messages.url, KEY, limits=limits) as client:
        result = await tt.run_eval(tt.Env(Say()), tt.ModelContext(client, "claude-x"), config)
    assert result.summary["ok"] == 24
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())
    assert recorded["limits"]["max_connections"] == "1-2-4"
    assert list(result.summary["connection_history"]) == [f"{messages.url}/v1/messages"]
    assert messages.peak <= 4
