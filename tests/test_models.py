"""Tests for trio_tasksets._models: Sampling, ModelContext, EchoClient, OpenAIClient.

The OpenAIClient tests talk to a real OpenAI-compatible HTTP server on 127.0.0.1: the suite's
fake (`tests/fixtures/chat_server.py`, the `chat` fixture), scripted per test.
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from chat_server import ChatServer, Reply
from helpers import free_port

from trio_tasksets._core.adaptive import AdaptiveBounds, Outcome
from trio_tasksets._core.limits import CallObserver, EndpointLimits, observe_calls
from trio_tasksets._models import (
    ClientDescription,
    Completion,
    EchoClient,
    ModelClient,
    ModelConnectionError,
    ModelContext,
    ModelError,
    ModelHTTPError,
    ModelResponseError,
    ModelTimeoutError,
    OpenAIClient,
    Sampling,
    api_key_from_env,
    describe,
)
from trio_tasksets._transport import ConnectError, HTTPClient, parse_retry_after
from trio_tasksets.testing import ScriptedClient

# ---------------------------------------------------------------------------------------
# The scripted OpenAI-compatible server
# ---------------------------------------------------------------------------------------


def completion_body(
    content: str | None = "hello", *, usage: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": "stop",
            }
        ],
        "usage": usage if usage is not None else {"prompt_tokens": 3, "completion_tokens": 1},
    }


@pytest.fixture
def server(chat: ChatServer) -> ChatServer:
    """The suite's fake, answering "hello" (as `completion_body()`) unless scripted."""
    chat.answer = lambda _: "hello"
    chat.usage = {"prompt_tokens": 3, "completion_tokens": 1}
    return chat


def make_client(server: ChatServer, **kwargs: Any) -> OpenAIClient:
    kwargs.setdefault("backoff", 0.001)
    return OpenAIClient(server.url, **kwargs)


MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "say hello"},
]

# ---------------------------------------------------------------------------------------
# Sampling, Completion, ModelContext
# ---------------------------------------------------------------------------------------


def test_sampling_to_request_omits_none() -> None:
    assert Sampling().to_request() == {}
    assert Sampling(temperature=0.0, seed=7).to_request() == {"temperature": 0.0, "seed": 7}
    full = Sampling(temperature=0.5, max_tokens=10, top_p=0.9, seed=1)
    assert full.to_request() == {"temperature": 0.5, "max_tokens": 10, "top_p": 0.9, "seed": 1}


def test_sampling_extra_merged_last() -> None:
    s = Sampling(temperature=0.5, extra={"temperature": 1.0, "stop": ["\n"]})
    assert s.to_request() == {"temperature": 1.0, "stop": ["\n"]}
    # Each instance gets its own extra dict.
    assert Sampling().extra is not Sampling().extra


def test_completion_defaults() -> None:
    c = Completion("x")
    assert c.usage == {}
    assert c.finish_reason is None
    assert Completion("x").usage is not c.usage


@attrs.define
class RecordingClient:
    calls: list[tuple[list[dict[str, Any]], str, Sampling]] = attrs.field(factory=list)

    async def chat(
        self, messages: list[dict[str, Any]], *, model: str, sampling: Sampling
    ) -> Completion:
        await trio.lowlevel.checkpoint()
        self.calls.append((messages, model, sampling))
        return Completion("recorded")

    async def aclose(self) -> None:
        pass


async def test_model_context_forwards_model_and_sampling() -> None:
    client = RecordingClient()
    sampling = Sampling(temperature=0.2)
    ctx = ModelContext(client, "my-model", sampling)
    result = await ctx.chat(MESSAGES)
    assert result == Completion("recorded")
    assert client.calls == [(MESSAGES, "my-model", sampling)]
    default = ModelContext(client, "m")
    assert default.sampling == Sampling()
    await default.chat(MESSAGES)
    assert client.calls[-1][2] == Sampling()


def test_clients_satisfy_protocol() -> None:
    assert isinstance(EchoClient(), ModelClient)
    assert isinstance(OpenAIClient("http://127.0.0.1:1/v1"), ModelClient)
    assert isinstance(RecordingClient(), ModelClient)
    assert not isinstance(object(), ModelClient)


# ---------------------------------------------------------------------------------------
# EchoClient
# ---------------------------------------------------------------------------------------


async def test_echo_replies_with_last_user_message() -> None:
    messages = [
        {"role": "system", "content": "sys prompt"},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "an answer"},
        {"role": "user", "content": "second question here"},
        {"role": "assistant", "content": "trailing"},
    ]
    result = await EchoClient().chat(messages, model="echo", sampling=Sampling())
    assert result.content == "second question here"
    # prompt: 2 + 2 + 2 + 3 + 1 words; reply: 3 words
    assert result.usage == {"prompt_tokens": 10, "completion_tokens": 3}
    assert result.finish_reason == "stop"


async def test_echo_joins_text_content_parts() -> None:
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look at"},
                {"type": "image_url", "image_url": {"url": "data:..."}},
                {"type": "text", "text": "this picture"},
            ],
        }
    ]
    result = await EchoClient().chat(messages, model="echo", sampling=Sampling())
    assert result.content == "look at this picture"
    assert result.usage == {"prompt_tokens": 4, "completion_tokens": 4}


async def test_echo_without_user_message_is_empty() -> None:
    messages = [{"role": "system", "content": "only a system prompt"}]
    result = await EchoClient().chat(messages, model="echo", sampling=Sampling())
    assert result.content == ""
    assert result.usage == {"prompt_tokens": 4, "completion_tokens": 0}
    empty = await EchoClient().chat([], model="echo", sampling=Sampling())
    assert empty.content == ""
    assert empty.usage == {"prompt_tokens": 0, "completion_tokens": 0}


async def test_echo_delay_uses_trio_clock(autojump_clock: trio.testing.MockClock) -> None:
    client = EchoClient(delay=2.5)
    start = trio.current_time()
    result = await client.chat(MESSAGES, model="echo", sampling=Sampling())
    assert trio.current_time() - start == pytest.approx(2.5, abs=1e-9)
    assert result.content == "say hello"
    start = trio.current_time()
    await EchoClient().chat(MESSAGES, model="echo", sampling=Sampling())
    assert trio.current_time() == start


async def test_echo_always_checkpoints() -> None:
    with trio.CancelScope() as scope:
        scope.cancel()
        await EchoClient().chat(MESSAGES, model="echo", sampling=Sampling())
        pytest.fail("EchoClient.chat did not checkpoint")  # pragma: no cover
    assert scope.cancelled_caught


async def test_echo_context_manager_and_bad_delay() -> None:
    async with EchoClient() as client:
        assert (await client.chat(MESSAGES, model="m", sampling=Sampling())).content
    await client.aclose()
    with pytest.raises(ValueError, match="delay"):
        EchoClient(delay=-1)


# ---------------------------------------------------------------------------------------
# api_key_from_env
# ---------------------------------------------------------------------------------------


def test_api_key_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TT_TEST_KEY", "sk-123\n")
    assert api_key_from_env("TT_TEST_KEY") == "sk-123"


@pytest.mark.parametrize("value", [None, "", "   "])
def test_api_key_from_env_missing(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    if value is None:
        monkeypatch.delenv("TT_TEST_KEY", raising=False)
    else:
        monkeypatch.setenv("TT_TEST_KEY", value)
    with pytest.raises(ValueError, match="TT_TEST_KEY") as info:
        api_key_from_env("TT_TEST_KEY")
    assert "export TT_TEST_KEY=" in str(info.value)
    assert "--" not in str(info.value)  # the library names no flag (the CLI adds its own)


# ---------------------------------------------------------------------------------------
# Retry-After parsing and backoff
# ---------------------------------------------------------------------------------------


def testparse_retry_after() -> None:
    assert parse_retry_after(None) is None
    assert parse_retry_after("") is None
    assert parse_retry_after("soon") is None
    assert parse_retry_after("nan") is None
    assert parse_retry_after("2") == 2.0
    assert parse_retry_after(" 0.5 ") == 0.5
    assert parse_retry_after("-3") == 0.0
    future = email.utils.formatdate(time.time() + 100, usegmt=True)
    assert 95 <= (parse_retry_after(future) or 0) <= 101
    past = email.utils.formatdate(time.time() - 100, usegmt=True)
    assert parse_retry_after(past) == 0.0


def test_retry_delay_full_jitter_capped() -> None:
    client = OpenAIClient("http://x/v1", backoff=1.0, max_backoff=5.0)
    for retry in range(8):
        cap = min(5.0, 2.0**retry)
        delays = [client._calls.retry_delay(retry, None) for _ in range(50)]
        assert all(0.0 <= d <= cap for d in delays)
    assert max(client._calls.retry_delay(10, None) for _ in range(200)) > 2.5  # jitter spans range
    assert client._calls.retry_delay(0, 3.0) == 3.0  # Retry-After wins over jitter
    assert client._calls.retry_delay(0, 60.0) == 5.0  # ... capped by max_backoff


def test_openai_client_validates_arguments() -> None:
    with pytest.raises(ValueError, match="timeout"):
        OpenAIClient("http://x/v1", timeout=0)
    with pytest.raises(ValueError, match="max_retries"):
        OpenAIClient("http://x/v1", max_retries=-1)
    with pytest.raises(ValueError, match="base_url"):
        OpenAIClient("")
    assert "sk-secret" not in repr(OpenAIClient("http://x/v1", "sk-secret"))


# ---------------------------------------------------------------------------------------
# OpenAIClient against a real HTTP server
# ---------------------------------------------------------------------------------------


async def test_openai_success_forwards_request(server: ChatServer) -> None:
    server.script(
        Reply(
            body=completion_body(
                "Hi there",
                usage={"prompt_tokens": 7, "completion_tokens": 2, "details": {"x": 1}},
            )
        )
    )
    sampling = Sampling(temperature=0.3, max_tokens=64, seed=5, extra={"stop": ["END"]})
    async with OpenAIClient(server.url + "/", "sk-test", headers={"X-Extra": "yes"}) as client:
        result = await client.chat(MESSAGES, model="qwen", sampling=sampling)
    assert result == Completion(
        "Hi there", usage={"prompt_tokens": 7, "completion_tokens": 2}, finish_reason="stop"
    )
    [request] = server.received
    assert request.path == "/v1/chat/completions"
    assert request.headers["authorization"] == "Bearer sk-test"
    assert request.headers["x-extra"] == "yes"
    assert request.json() == {
        "model": "qwen",
        "messages": MESSAGES,
        "temperature": 0.3,
        "max_tokens": 64,
        "seed": 5,
        "stop": ["END"],
    }


async def test_openai_no_key_no_auth_header_and_null_content(server: ChatServer) -> None:
    server.script(Reply(body=completion_body(None)))
    async with make_client(server) as client:
        result = await client.chat(MESSAGES, model="m", sampling=Sampling())
    assert result.content == ""
    assert "authorization" not in server.received[0].headers
    assert server.received[0].json() == {"model": "m", "messages": MESSAGES}


async def test_openai_reuses_client_for_many_concurrent_requests(server: ChatServer) -> None:
    results: list[str] = []
    async with make_client(server) as client:

        async def one(i: int) -> None:
            messages = [{"role": "user", "content": f"q{i}"}]
            results.append((await client.chat(messages, model="m", sampling=Sampling())).content)

        async with trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(one, i)
    assert results == ["hello"] * 20
    assert len(server.received) == 20
    with pytest.raises(RuntimeError, match="closed"):
        await client.chat(MESSAGES, model="m", sampling=Sampling())


async def test_openai_429_honours_retry_after(server: ChatServer) -> None:
    server.script(
        Reply(status=429, body={"error": "slow down"}, headers={"Retry-After": "0.05"}),
        Reply(body=completion_body("after wait")),
    )
    async with make_client(server, max_retries=3, backoff=0.0) as client:
        start = trio.current_time()
        result = await client.chat(MESSAGES, model="m", sampling=Sampling())
        elapsed = trio.current_time() - start
    assert result.content == "after wait"
    assert len(server.received) == 2
    assert server.received[1].at - server.received[0].at >= 0.05
    assert elapsed >= 0.05


async def test_openai_retry_after_capped_by_max_backoff(server: ChatServer) -> None:
    server.script(Reply(status=503, headers={"Retry-After": "100"}), Reply())
    async with make_client(server, max_backoff=0.05) as client:
        start = trio.current_time()
        result = await client.chat(MESSAGES, model="m", sampling=Sampling())
        elapsed = trio.current_time() - start
    assert result.content == "hello"
    assert len(server.received) == 2
    assert 0.05 <= elapsed < 2.0


async def test_openai_5xx_exhausts_retries(server: ChatServer) -> None:
    server.script(*[Reply(status=503, body={"error": "overloaded"}) for _ in range(3)])
    server.script(Reply())  # would succeed, but must not be reached
    async with make_client(server, max_retries=2) as client:
        with pytest.raises(ModelHTTPError) as info:
            await client.chat(MESSAGES, model="m", sampling=Sampling())
    err = info.value
    assert err.status == 503
    assert err.attempts == 3
    assert len(server.received) == 3
    message = str(err)
    assert server.url + "/chat/completions" in message
    assert "503" in message
    assert "3 attempts" in message
    assert "overloaded" in message


async def test_openai_400_is_not_retried(server: ChatServer) -> None:
    server.script(Reply(status=400, body={"error": {"message": "bad model name"}}), Reply())
    async with make_client(server, max_retries=3) as client:
        with pytest.raises(ModelHTTPError) as info:
            await client.chat(MESSAGES, model="m", sampling=Sampling())
    assert info.value.status == 400
    assert info.value.attempts == 1
    assert "bad model name" in str(info.value)
    assert len(server.received) == 1


TOO_LARGE = (
    "Request too large for m in organization org-x on tokens per min (TPM): Limit "
    "30000, Requested 50000. The input or output tokens must be reduced in order "
    "to run successfully."
)  # OpenAI's words
SPENT = ("Rate limit reached for m on tokens per min (TPM): Limit 30000, Used 29000, "
         "Requested 2000. Please try again in 2ms.")  # fmt: skip


class Outcomes(CallObserver):
    def __init__(self) -> None:
        self.seen: list[Outcome] = []

    def on_call(self, outcome: Outcome, retry_after: float | None, latency: float | None) -> None:
        self.seen.append(outcome)


async def test_a_429_for_a_request_over_the_whole_budget_is_not_retried(
    server: ChatServer,
) -> None:
    """No wait lets a request larger than the limit's budget through: it fails at once,
    saying why, and counts as the request's fault, not a 429 of the endpoint's load (which
    an adaptive window would cut on). A 429 of a budget spent for now is retried."""
    server.script(Reply(429, body={"error": {"message": TOO_LARGE, "type": "tokens"}}))
    outcomes = Outcomes()
    async with make_client(server, max_retries=3) as client:
        with observe_calls(outcomes), pytest.raises(ModelHTTPError) as info:
            await client.chat(MESSAGES, model="m", sampling=Sampling())
        assert (info.value.status, info.value.attempts) == (429, 1)
        assert "Requested 50000" in str(info.value)
        assert "not retried" in str(info.value)
        assert len(server.received) == 1
        assert outcomes.seen == []
        spent = Reply(429, body={"error": {"message": SPENT}}, headers={"Retry-After": "0"})
        server.script(spent, Reply())
        with observe_calls(outcomes):
            assert (await client.chat(MESSAGES, model="m", sampling=Sampling())).content
    assert len(server.received) == 3
    assert outcomes.seen == [Outcome.RATE_LIMITED, Outcome.SUCCESS]


async def test_openai_timeout(server: ChatServer) -> None:
    server.script(Reply(delay=5.0))
    async with make_client(server, timeout=0.2, max_retries=0) as client:
        start = trio.current_time()
        with pytest.raises(ModelTimeoutError) as info:
            await client.chat(MESSAGES, model="m", sampling=Sampling())
        elapsed = trio.current_time() - start
    assert server.url + "/chat/completions" in str(info.value)
    assert "0.2s" in str(info.value)
    assert info.value.timeout == 0.2
    assert 0.15 <= elapsed < 2.0
    assert len(server.received) == 1


async def test_openai_timeout_then_retry_succeeds(server: ChatServer) -> None:
    server.script(Reply(delay=5.0), Reply(body=completion_body("second try")))
    async with make_client(server, timeout=0.2, max_retries=1) as client:
        result = await client.chat(MESSAGES, model="m", sampling=Sampling())
    assert result.content == "second try"
    assert len(server.received) == 2


async def test_openai_unreachable_server() -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    async with OpenAIClient(url, max_retries=1, backoff=0.001) as client:
        with pytest.raises(ModelConnectionError) as info:
            await client.chat(MESSAGES, model="m", sampling=Sampling())
    message = str(info.value)
    assert message.startswith(f"cannot reach {url}/chat/completions: ")
    assert "2 attempts" in message
    assert isinstance(info.value, ModelError)
    assert isinstance(info.value.__cause__, ConnectError)


@pytest.mark.parametrize(
    "body",
    [
        b"this is not json",
        {"choices": []},
        {"object": "error", "message": "no choices"},
        {"choices": [{"message": "flat"}]},
        {"choices": [{"message": {"content": 42}}]},
        [1, 2, 3],
    ],
)
async def test_openai_malformed_response(server: ChatServer, body: Any) -> None:
    server.script(Reply(body=body))
    async with make_client(server) as client:
        with pytest.raises(ModelResponseError, match="/v1/chat/completions"):
            await client.chat(MESSAGES, model="m", sampling=Sampling())
    assert len(server.received) == 1


@pytest.mark.parametrize("max_retries", [0, 3])
async def test_openai_cancellation_propagates(server: ChatServer, max_retries: int) -> None:
    server.script(Reply(delay=5.0))
    seen: list[BaseException] = []
    async with make_client(server, max_retries=max_retries) as client:

        async def call() -> None:
            try:
                await client.chat(MESSAGES, model="m", sampling=Sampling())
            except BaseException as exc:
                seen.append(exc)
                raise

        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(call)
            await server.wait_received()  # the request is at the server: cancel it there
            nursery.cancel_scope.cancel()
        elapsed = trio.current_time() - start
        assert len(seen) == 1
        assert isinstance(seen[0], trio.Cancelled)
        assert elapsed < 4.0  # not the server's 5 s
        assert len(server.received) == 1
        # The client is still usable afterwards.
        result = await client.chat(MESSAGES, model="m", sampling=Sampling())
        assert result.content == "hello"


async def test_openai_cancellation_during_backoff(server: ChatServer) -> None:
    server.script(Reply(status=429, headers={"Retry-After": "10"}), Reply())
    async with make_client(server, max_retries=3) as client:
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(client.chat, MESSAGES, model="m", sampling=Sampling()))
            await server.wait_answered()  # the 429 is sent: the client reads it, then waits 10 s
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
        assert trio.current_time() - start < 5.0  # not Retry-After's 10 s
    assert len(server.received) == 1


async def test_openai_external_http_client_left_open(server: ChatServer) -> None:
    async with HTTPClient() as http:
        client = OpenAIClient(server.url, http_client=http)
        result = await client.chat(MESSAGES, model="m", sampling=Sampling())
        await client.aclose()
        assert result.content == "hello"
        assert not http.is_closed


async def test_openai_owned_http_client_closed(server: ChatServer) -> None:
    client = make_client(server)
    await client.chat(MESSAGES, model="m", sampling=Sampling())
    http = client._http
    assert http is not None
    await client.aclose()
    assert http.is_closed
    await client.aclose()  # idempotent


# ---------------------------------------------------------------------------------------
# Through an episode: what the env records when the model server fails
# ---------------------------------------------------------------------------------------


async def test_5xx_exhaustion_is_recorded_on_the_episode(server: ChatServer) -> None:
    import trio_tasksets as tt

    server.script(*[Reply(status=502, body={"error": "bad gateway"}) for _ in range(2)])
    env = tt.Env(tt.testing.FeedTaskset())
    async with make_client(server, max_retries=1) as client:
        ctx = tt.ModelContext(client, "m")
        episode = await env.run_slot(tt.RunSlot(tt.Task("say hello", answer="hello")), ctx)
    assert not episode.ok
    assert episode.reward == 0.0
    assert [e.type for e in episode.errors] == ["ModelHTTPError"]
    assert "502" in episode.errors[0].message
    assert len(server.received) == 2


async def test_a_429_then_success_is_one_ok_episode(server: ChatServer) -> None:
    import trio_tasksets as tt

    server.script(Reply(status=429, headers={"Retry-After": "0"}), Reply())
    env = tt.Env(tt.testing.FeedTaskset())
    async with make_client(server, max_retries=2) as client:
        episode = await env.run_slot(
            tt.RunSlot(tt.Task("q", answer="HELLO")), tt.ModelContext(client, "m")
        )
    assert episode.ok
    assert episode.errors == []  # the client's own retry, below the episode
    assert episode.completion == "hello"
    assert episode.reward == 1.0
    assert len(server.received) == 2


# ---------------------------------------------------------------------------------------
# Limits on the calls (EndpointLimits) and what observers hear
# ---------------------------------------------------------------------------------------


async def test_limits_gate_each_attempt_and_a_rest_holds_no_connection(
    server: ChatServer,
) -> None:
    """Each attempt goes through the endpoint's gate (a connection slot, then rpm) and
    reports its status (the adaptive window is cut by the 429); the wait before a retry
    happens outside the gate, holding no connection."""
    server.script(Reply(429, headers={"retry-after": "0.05"}), Reply(503), Reply())
    limits = EndpointLimits(connections=AdaptiveBounds(1, 4, 8), rpm=60_000)
    assert limits.connections is not None
    window = limits.connections.window("k")
    heard: list[tuple[Any, ...]] = []

    class Watch(CallObserver):
        def on_wait(self, connection: float, rate: float) -> None:
            heard.append(("wait", window.in_flight))

        def on_outcome(self, outcome: Outcome, retry_after: float | None) -> None:
            heard.append(("outcome", outcome, retry_after))

        @asynccontextmanager
        async def resting(self, outcome: Outcome | None) -> AsyncIterator[None]:
            heard.append(("rest", outcome, window.in_flight))
            yield

    async with make_client(server, limits=limits, limits_key="k") as client:
        with observe_calls(Watch()):
            reply = await client.chat(MESSAGES, model="m", sampling=Sampling())
    assert reply.content == "hello"
    assert heard == [
        ("wait", 1), ("outcome", Outcome.RATE_LIMITED, 0.05), ("rest", Outcome.RATE_LIMITED, 0),
        ("wait", 1), ("outcome", Outcome.SERVER_ERROR, None), ("rest", Outcome.SERVER_ERROR, 0),
        ("wait", 1), ("outcome", Outcome.SUCCESS, None),
    ]  # fmt: skip
    assert [reason for _, _, reason in window.history] == ["start", "429"]
    assert window.in_flight == 0
    rpm, _ = limits.rate_limiters("k")
    assert rpm is not None
    assert rpm.calls == 3


async def test_without_limits_each_attempt_still_reports_its_outcome(server: ChatServer) -> None:
    server.script(Reply(429, headers={"retry-after": "0"}), Reply())
    outcomes: list[Outcome] = []

    class Watch(CallObserver):
        def on_outcome(self, outcome: Outcome, retry_after: float | None) -> None:
            outcomes.append(outcome)

    async with make_client(server) as client:
        assert client.limits is None
        with observe_calls(Watch()):
            await client.chat(MESSAGES, model="m", sampling=Sampling())
    assert outcomes == [Outcome.RATE_LIMITED, Outcome.SUCCESS]


# ---------------------------------------------------------------------------------------
# Token ids and logprobs, for a trainer (the happy path against vLLM's shape: tests/test_tokens.py)
# ---------------------------------------------------------------------------------------


async def test_malformed_token_ids_are_a_response_error(server: ChatServer) -> None:
    body = completion_body("hi")
    body["choices"][0]["token_ids"] = ["not", "ids"]
    server.script(Reply(body=body))
    async with make_client(server) as client:
        with pytest.raises(ModelResponseError, match="malformed token ids"):
            await client.chat(MESSAGES, model="m", sampling=Sampling(return_tokens=True))


async def test_logprobs_alone_fill_the_tokens(server: ChatServer) -> None:
    body = completion_body("hi")
    body["choices"][0]["logprobs"] = {"content": [{"token": "hi", "logprob": -0.5}]}
    server.script(Reply(body=body))
    async with make_client(server) as client:
        reply = await client.chat(MESSAGES, model="m", sampling=Sampling())
    assert reply.tokens is not None
    assert (reply.tokens.prompt_ids, reply.tokens.completion_ids) == ([], [])
    assert reply.tokens.completion_logprobs == [-0.5]


def _clients() -> list[Any]:
    from trio_tasksets.testing import ScriptedClient

    return [EchoClient(), OpenAIClient("http://127.0.0.1:1/v1"), ScriptedClient(["hi"])]


@pytest.mark.parametrize("client", _clients(), ids=lambda c: type(c).__name__)
async def test_every_model_client_closes_on_leaving_its_block(client: Any) -> None:
    """The clients share one async-context-manager base (`ModelClientBase`): ``async with``
    gives the client itself, and its `aclose` runs however the block ends."""
    from trio_tasksets._models import ModelClientBase

    closed: list[bool] = []
    real = client.aclose

    async def aclose() -> None:
        closed.append(True)
        await real()

    client.aclose = aclose
    assert isinstance(client, ModelClientBase)
    async with client as entered:
        assert entered is client
    assert closed == [True]
    with pytest.raises(KeyError):
        async with client:
            raise KeyError("boom")
    assert closed == [True, True]
    await real()  # idempotent


# ---------------------------------------------------------------------------------------
# What a client says of itself (`describe`): what the rest of the package asks instead of
# its class
# ---------------------------------------------------------------------------------------


def test_an_openai_client_describes_its_endpoint_key_and_headers_by_name() -> None:
    limits = EndpointLimits(connections=4)
    client = OpenAIClient(
        "http://127.0.0.1:9/v1", "sk-secret", timeout=7.0, headers={"X-Org": "org-secret"},
        limits=limits,
    )  # fmt: skip
    found = describe(client)
    assert found.endpoints == ("http://127.0.0.1:9/v1",)
    assert (found.limits, found.api_key) == (limits, "sk-secret")
    assert found.headers == frozenset({"X-Org"})
    assert found.travel == {
        "type": "openai", "base_url": "http://127.0.0.1:9/v1", "timeout": 7.0,
        "max_retries": 3, "backoff": 0.5, "max_backoff": 30.0,
    }  # fmt: skip
    assert "secret" not in repr(found)  # neither the key nor a header's value
    assert found.endpoint_stats is None
    assert found.engine_metrics is None


def test_a_client_over_many_endpoints_describes_them_and_its_figures() -> None:
    urls = ["http://127.0.0.1:9/v1", "http://127.0.0.1:10/v1"]
    client = OpenAIClient(urls, engine_metrics=["http://127.0.0.1:9/metrics", None])
    found = describe(client)
    assert found.endpoints == tuple(urls)
    assert found.travel is not None
    assert found.travel["base_urls"] == urls
    assert found.endpoint_stats is not None
    assert set(found.endpoint_stats() or {}) == set(urls)
    assert found.engine_metrics is not None
    assert found.limits is client.limits is not None  # the pool's windows per endpoint


def test_the_offline_clients_and_any_other_describe_themselves_too() -> None:
    assert describe(EchoClient(delay=0.5)).travel == {"type": "echo", "delay": 0.5}
    scripted = describe(ScriptedClient(["hi"]))
    assert (scripted.endpoints, scripted.limits, scripted.travel) == ((), None, None)

    class Plain:  # a ModelClient by its two methods alone: it says nothing
        async def chat(self, *args: object, **kwargs: object) -> Completion:
            return Completion("")

        async def aclose(self) -> None:
            pass

    found = describe(Plain())
    assert isinstance(found, ClientDescription)
    assert (found.endpoints, found.api_key, found.travel) == ((), None, None)
