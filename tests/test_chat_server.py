"""The suite's fake model server (tests/fixtures/chat_server.py) does what its options say:
the tests that script it rely on that. Plain HTTP from the stdlib, a client we did not write,
against the server in its own thread; in the test's trio run, the package's HTTP client."""

from __future__ import annotations

import http.client
import json
import ssl
import threading
from typing import Any

import pytest
import trio
import trustme
from chat_server import Capacity, ChatServer, Reply

from trio_tasksets._transport import ConnectError, HTTPClient


def post(server: ChatServer, text: str = "What is 1 + 1?", **body: Any) -> tuple[int, Any, Any]:
    host, port = server.url.removeprefix("http://").removesuffix("/v1").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        payload = {"model": "m", "messages": [{"role": "user", "content": text}], **body}
        connection.request("POST", "/v1/chat/completions", json.dumps(payload),
                           {"content-type": "application/json", "authorization": "Bearer k"})  # fmt: skip
        response = connection.getresponse()
        return response.status, response.headers, json.loads(response.read())
    finally:
        connection.close()


def test_a_script_answers_in_order_then_the_usual_answer(chat: ChatServer) -> None:
    chat.retry_after = 2
    chat.script(429, Reply(503, retry_after="0.5"), Reply(body={"x": 1}, headers={"X-A": "b"}))
    answers = [post(chat) for _ in range(4)]
    assert [status for status, _, _ in answers] == [429, 503, 200, 200]
    assert answers[0][1]["retry-after"] == "2"  # the server's, for a refusal
    assert answers[1][1]["retry-after"] == "0.5"  # the reply's own
    assert answers[2][2] == {"x": 1}
    assert answers[2][1]["x-a"] == "b"
    assert answers[2][1]["retry-after"] is None  # not on a 200
    assert answers[3][2]["choices"][0]["message"]["content"] == "2"
    trio.run(chat.wait_answered, 4)  # counted once written, maybe after the client read it
    assert (chat.ok, chat.answered, chat.connections) == (2, 4, 4)
    assert [r.headers["authorization"] for r in chat.received] == ["Bearer k"] * 4
    assert chat.received[0].json()["messages"][0]["content"] == "What is 1 + 1?"


def test_status_fail_on_answer_usage_and_finish_reason(chat: ChatServer) -> None:
    chat.status, chat.fail_on = 401, "ping"
    chat.answer = str.upper
    chat.usage, chat.finish_reason = {"prompt_tokens": 5}, "length"
    assert post(chat, "ping me")[0] == 401
    status, _, body = post(chat, "pong")
    assert status == 200
    assert body["choices"][0] == {
        "index": 0, "message": {"role": "assistant", "content": "PONG"}, "finish_reason": "length",
    }  # fmt: skip
    assert body["usage"] == {"prompt_tokens": 5}
    with pytest.raises(ValueError, match="HTTP status"):
        Reply(99)


def test_over_capacity_is_429_at_once_and_not_in_flight() -> None:
    with ChatServer(delay=5, policy=Capacity(1), retry_after="0.05") as server:
        server.script(Reply(delay=0.3))  # the first request holds the only place
        first = threading.Thread(target=post, args=(server,))
        first.start()
        try:
            trio.run(server.wait_received)
            status, headers, _ = post(server)
            assert (status, headers["retry-after"]) == (429, "0.05")
            assert (server.limited, server.peak) == (1, 1)
        finally:
            first.join(10)
        trio.run(server.wait_answered, 2)  # counted once written, maybe after the client read it
        assert (server.ok, server.in_flight) == (1, 0)


async def test_waits_for_trio_tests(chat: ChatServer) -> None:
    async def client() -> None:
        await trio.to_thread.run_sync(post, chat)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client)
            await chat.wait_received()
            await chat.wait_answered()
    assert chat.answered == 1


async def test_served_in_the_tests_run_its_delays_are_the_clocks(autojump_clock: Any) -> None:
    async with ChatServer(delay=30) as server, HTTPClient() as http:
        server.script(Reply(503, retry_after=1), Reply(delay=0.5))
        start = trio.current_time()
        payload = json.dumps({"messages": [{"role": "user", "content": "What is 2 + 2?"}]})
        answers = [
            await http.request("POST", server.url + "/chat/completions", body=payload.encode())
            for _ in range(3)
        ]
        await server.wait_answered(3)
        assert trio.current_time() - start == pytest.approx(60.5)  # virtual: 30 + 0.5 + 30
        assert [answer.status for answer in answers] == [503, 200, 200]
        assert answers[0].retry_after == 1.0
        assert json.loads(answers[2].body)["choices"][0]["message"]["content"] == "4"
        assert [r.at - start for r in server.received] == pytest.approx([0, 30, 30.5])
        server.kill()
        async with HTTPClient() as fresh:  # a new connection: the port refuses it
            with pytest.raises(ConnectError):
                await fresh.request("POST", server.url + "/chat/completions", body=b"{}")


async def test_with_a_tls_context_it_serves_https() -> None:
    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)
    with trio.fail_after(10):
        async with (
            ChatServer(tls=context) as server,
            HTTPClient(ssl_context=client_context) as http,
        ):
            payload = json.dumps({"messages": [{"role": "user", "content": "What is 3 + 4?"}]})
            url = server.url + "/chat/completions"
            response = await http.request("POST", url, body=payload.encode())
    assert server.url.startswith("https://127.0.0.1:")
    assert json.loads(response.body)["choices"][0]["message"]["content"] == "7"
