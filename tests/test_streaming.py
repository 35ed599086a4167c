"""Streamed replies (SPEC 13, issue 33): a reply assembled chunk by chunk (`ReplyBuilder`),
what a caller keeps of a cut call (`watch_reply`), and `VersionSpan`."""

from __future__ import annotations

import itertools
import json
import socket
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import forkserver
import h11
import hypothesis
import orjson
import pytest
import trio
from chat_server import ChatServer, Reply
from helpers import RawServer
from hypothesis import strategies as st

import trio_tasksets as tt
import trio_tasksets._transport.connection as http_wire
from trio_tasksets._core.health import Health
from trio_tasksets._models.stream import ReplyBuilder, SSEReply, attach_reply, watch_reply
from trio_tasksets._monitor.metrics import Metrics


def _chunk(delta: dict[str, object] | None = None, **choice: object) -> dict[str, object]:
    return {"choices": [{"index": 0, "delta": delta or {}, **choice}]}


async def test_a_builder_joins_content_tool_calls_token_ids_and_usage(
    autojump_clock: trio.abc.Clock,
) -> None:
    builder = ReplyBuilder(url="http://x/v1/chat/completions")
    builder.feed({"prompt_token_ids": [1, 2], **_chunk({"role": "assistant", "content": ""})})
    builder.feed(
        _chunk({"content": "Hel"}, token_ids=[7], logprobs={"content": [{"logprob": -0.5}]})
    )
    partial = builder.partial()
    assert partial.content == "Hel"
    assert partial.finish_reason is None
    assert partial.tokens == tt.Tokens([1, 2], [7], [-0.5])
    builder.feed(
        _chunk({"content": "lo"}, token_ids=[8], logprobs={"content": [{"logprob": -1.0}]})
    )
    builder.feed(
        _chunk(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "add", "arguments": '{"a"'},
                    }
                ]
            }
        )
    )
    builder.feed(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}))
    builder.feed(_chunk({}, finish_reason="tool_calls"))
    builder.feed({"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 2}})
    whole = builder.finish()
    assert whole.content == "Hello"
    assert whole.finish_reason == "tool_calls"
    assert whole.tool_calls == [tt.ToolCall("c1", "add", {"a": 1}, '{"a": 1}')]
    assert whole.usage == {"prompt_tokens": 2, "completion_tokens": 2}
    assert whole.tokens == tt.Tokens([1, 2], [7, 8], [-0.5, -1.0])
    assert whole.ttft == 0.0  # no time passed on trio's clock between request and token


@pytest.mark.parametrize(
    "chunk", [[1], {"choices": "x"}, _chunk({"content": 3}), _chunk(token_ids=["a"])]
)
async def test_a_malformed_chunk_is_a_response_error_naming_the_url(chunk: object) -> None:
    with pytest.raises(tt.ModelResponseError, match="http://x"):
        ReplyBuilder(url="http://x").feed(chunk)


async def test_a_watch_keeps_what_a_cut_call_had_received(autojump_clock: trio.abc.Clock) -> None:
    async def call() -> None:  # what a streaming client does per attempt
        builder = ReplyBuilder()
        attach_reply(builder)
        for piece in ["a", "b", "c"]:
            builder.feed(_chunk({"content": piece}, token_ids=[ord(piece)]))
            await trio.sleep(1)

    with watch_reply() as outer, watch_reply() as watch:
        with trio.move_on_after(1.5) as scope:
            await call()
    assert scope.cancelled_caught
    kept = watch.partial()
    assert kept.content == "ab"
    assert kept.finish_reason is None
    assert kept.tokens is not None
    assert kept.tokens.completion_ids == [97, 98]
    assert outer.partial() == kept
    assert watch.attempts == 1
    with watch_reply() as idle:
        pass
    assert idle.partial() == tt.Completion("")


def test_version_spans_check_their_bounds() -> None:
    span = tt.VersionSpan("3", 0, 5)
    assert len(span) == 5
    assert tt.VersionSpan.from_dict(span.to_dict()) == span
    with pytest.raises(tt.ConfigError, match="end"):
        tt.VersionSpan("3", 5, 4)
    with pytest.raises(tt.ConfigTypeError, match="version"):
        tt.VersionSpan(3, 0, 1)  # type: ignore[arg-type]
    with pytest.raises(tt.ConfigError, match="start"):
        tt.VersionSpan("3", -1, 1)
    assert tt.Completion("x").versions == []
    assert tt.Completion("x").ttft is None


# --- a streamed reply equals the same reply sent whole ------------------------------------------

_text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40)


@st.composite
def replies(draw: st.DrawFn) -> dict[str, Any]:
    """A random whole ``chat.completion`` (what vLLM or OpenAI send): content or none,
    maybe a reasoning field, tool calls, token ids, logprobs, usage, a finish reason."""
    calls = [
        {"id": draw(st.text("abc_0123", min_size=1, max_size=8)), "type": "function",
         "function": {"name": draw(st.sampled_from(["add", "search", "run_tool"])),
                      "arguments": draw(st.sampled_from(['{"a": 1, "b": 2}', "{}", "", '{"q": "é\\n"}',
                                                         "not json"]))}}
        for _ in range(draw(st.integers(0, 3)))
    ]  # fmt: skip
    content = draw(_text)
    message: dict[str, Any] = {
        "role": "assistant",
        "content": None if calls and not content else content,
    }
    if calls:
        message["tool_calls"] = calls
    if draw(st.booleans()):
        message["reasoning_content"] = draw(_text)
    if draw(st.booleans()):  # as vLLM sends a whole reply's message: nulls a stream omits
        message.update(refusal=None, annotations=None, audio=None, function_call=None)
    choice: dict[str, Any] = {"index": 0, "message": message,
                              "finish_reason": draw(st.sampled_from(["stop", "length", "tool_calls"]))}  # fmt: skip
    answer: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion", "model": "m",
                              "choices": [choice]}  # fmt: skip
    if draw(st.booleans()):
        answer["usage"] = {"prompt_tokens": draw(st.integers(0, 999)),
                           "completion_tokens": draw(st.integers(0, 999))}  # fmt: skip
    n = draw(st.integers(0, 30))
    if draw(st.booleans()):
        answer["prompt_token_ids"] = draw(st.lists(st.integers(0, 2**20), max_size=8))
        choice["token_ids"] = draw(st.lists(st.integers(0, 2**20), min_size=n, max_size=n))
    if draw(st.booleans()):
        values = draw(st.lists(st.floats(-50, 0), min_size=n, max_size=n))
        choice["logprobs"] = {"content": [{"token": "x", "logprob": v, "top_logprobs": []}
                                          for v in values]}  # fmt: skip
    return answer


def _split(draw: Any, seq: Any) -> list[Any]:
    """`seq` cut at random places (maybe nowhere; empty pieces allowed)."""
    cuts = sorted(draw(st.lists(st.integers(0, len(seq)), max_size=6)))
    bounds = [0, *cuts, len(seq)]
    return [seq[a:b] for a, b in itertools.pairwise(bounds)]


@st.composite
def streamed(draw: st.DrawFn, answer: dict[str, Any]) -> list[bytes]:
    """`answer` as a random stream of server-sent events, cut into random pieces of body:
    its text fields in random pieces, its token ids and logprobs in random groups, each
    tool call's arguments in random pieces, the usage in its last chunk or one of its own,
    random line ends, comments and event names between."""
    choice = answer["choices"][0]
    message = choice["message"]
    opening = "" if message["content"] is not None else None  # as vLLM, or as OpenAI's null
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": opening}]
    if "reasoning_content" in message:
        deltas += [{"reasoning_content": p} for p in _split(draw, message["reasoning_content"])]
    if message["content"] is not None:
        deltas += [{"content": p} for p in _split(draw, message["content"])]
    for index, call in enumerate(message.get("tool_calls", [])):
        function = call["function"]
        deltas.append({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                       "function": {"name": function["name"]}}]})  # fmt: skip
        for piece in _split(draw, function["arguments"]):
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
    chunks: list[dict[str, Any]] = [
        {"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas
    ]
    ids = choice.get("token_ids")
    entries = (choice.get("logprobs") or {}).get("content")
    n = len(ids if ids is not None else entries or [])
    at = 0
    groups = _split(draw, list(range(n)))  # the tokens' ids and logprobs, in groups, in order
    places = sorted(draw(st.lists(st.integers(0, len(chunks) - 1), min_size=len(groups),
                                  max_size=len(groups))))  # fmt: skip
    for group, place in zip(groups, places, strict=True):
        target = chunks[place]["choices"][0]
        if ids is not None:
            target.setdefault("token_ids", []).extend(ids[at : at + len(group)])
        if entries is not None:
            logprobs = target.setdefault("logprobs", {"content": []})
            logprobs["content"].extend(entries[at : at + len(group)])
        at += len(group)
    chunks[-1]["choices"][0]["finish_reason"] = choice["finish_reason"]
    if "prompt_token_ids" in answer:
        chunks[0]["prompt_token_ids"] = answer["prompt_token_ids"]
    if "usage" in answer:
        if draw(st.booleans()):
            chunks.append({"choices": [], "usage": answer["usage"]})
        else:
            chunks[-1]["usage"] = answer["usage"]
    newline = draw(st.sampled_from([b"\n", b"\r\n", b"\r"]))
    body = b""
    for chunk in chunks:
        if draw(st.integers(0, 4)) == 0:
            body += b": keep-alive" + newline + newline
        name = b"event: message" + newline if draw(st.integers(0, 4)) == 0 else b""
        body += name + b"data: " + orjson.dumps(chunk) + newline + newline
    body += b"data: [DONE]" + newline + newline
    return [bytes(piece) for piece in _split(draw, body)]


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(data=st.data())
def test_a_streamed_reply_is_the_completion_the_whole_reply_parses_to(data: st.DataObject) -> None:
    """Property: whatever the reply and however its stream is cut (into chunks, events and
    pieces of body), the `Completion` assembled from it equals the one the same reply sent
    whole parses to (but for `ttft`, which only a stream has)."""
    answer = data.draw(replies())
    pieces = data.draw(streamed(answer))
    whole = CLIENT._parse(orjson.dumps(answer))

    async def read() -> tt.Completion:
        reader = SSEReply(CLIENT.url)
        for piece in pieces:
            reader.feed(piece)
        return reader.finish()

    got = trio.run(read)
    assert got.ttft is not None or not any(
        [got.content, got.tool_calls, got.tokens and got.tokens.completion_ids]
    )
    assert attrs.evolve(got, ttft=None, tpot=None) == whole


CLIENT = tt.OpenAIClient("http://127.0.0.1:9/v1")


# --- the fast paths read a stream as the event-by-event reader does --------------------------

# Raw bytes a text chunk's content may be, beyond well-formed strings: not a string, more than
# one, broken, a string with the bytes of the reader's needle or of the next event in it.
_RAW_CONTENT = [b"1", b"null", b'["x"]', b'"a","content":"b"', b'"a","b"', b'"unterminated', b' "a" ',
                b'"\\u00e9\\"\\\\"', b'"tab\there"', b'"a"}]}\n\ndata: {"x":1', b'""',
                b'"a"},"logprobs":null,"finish_reason":null}]}\n\ndata: {"choices":[]}',
                b'"lta\\":{\\"content\\":"']  # fmt: skip
_TEXT = st.lists(st.sampled_from(["a", "é", '"', "\\", "\n", " ", "}", 'lta":{"content":', "\r"]),
                 max_size=6).map("".join)  # fmt: skip


@st.composite
def text_streams(draw: st.DrawFn) -> list[bytes]:
    """A stream of mostly plain text chunks of one shape (what the fast paths read in bulk),
    some of them odd: a content that is not one well-formed string, a different envelope,
    comments, event names, a chunk's data over two lines, CRLF line ends; cut at random."""
    envelope = draw(st.sampled_from([{}, {"id": "chatcmpl-1", "created": 1, "model": "m"}]))
    extra = draw(st.sampled_from([{}, {"logprobs": None, "finish_reason": None}]))

    def event(choice: dict[str, Any], **more: Any) -> bytes:
        chunk = {**envelope, "object": "chat.completion.chunk", "choices": [choice], **more}
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    events = [event({"index": 0, "delta": {"role": "assistant", "content": ""}, **extra})]
    for text in draw(st.lists(_TEXT, min_size=2, max_size=16)):
        raw = event({"index": 0, "delta": {"content": "@T@"}, **extra})
        odd = draw(st.integers(0, 39))  # mostly the usual chunk
        if odd == 0:
            raw = raw.replace(b'"@T@"', draw(st.sampled_from(_RAW_CONTENT)))
        elif odd == 1:
            raw = raw.replace(b'"index":0', b'"index":0,"x":1')
        elif odd == 2:
            raw = b": keep-alive\n\n" + raw
        elif odd == 3:
            raw = b"event: message\n" + raw
        elif odd == 4:
            raw = raw.replace(b',"choices"', b'\ndata: ,"choices"')
        elif odd == 5:
            raw = raw.replace(b"\n", b"\r\n")
        elif odd == 6:  # as long as the usual bytes, but saying more
            raw = raw.replace(b'"logprobs":null', b'"token_ids":[7]')
        elif odd == 7:  # a line that is not data
            raw = raw.replace(b',"choices"', b'\n,"choices"')
        events.append(raw.replace(b'"@T@"', orjson.dumps(text)))
    events.append(event({"index": 0, "delta": {}, "finish_reason": "stop"}))
    if draw(st.booleans()):
        events.append(
            b"data: " + orjson.dumps({"choices": [], "usage": {"completion_tokens": 3}}) + b"\n\n"
        )
    events.append(b"data: [DONE]\n\n")
    if draw(st.booleans()):  # an event a read, as a stream paced by its tokens comes
        return events
    return [bytes(piece) for piece in _split(draw, b"".join(events))]


_USUAL = b'data: {"object":"c","choices":[{"index":0,"delta":{"content":"@T@"}}]}\n\n'


def _texts(*events: bytes) -> list[bytes]:
    """A stream of the text chunks `events` (``@T@`` for a text) in one piece, usual ones
    after them; the first that is read whole teaches the reader the shape."""
    body = b"".join([*events, _USUAL, _USUAL]).replace(b"@T@", b"t")
    return [body + b'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}\n\n']


@hypothesis.settings(max_examples=400, deadline=None)
@hypothesis.given(pieces=text_streams())
@hypothesis.example(  # a first event of many lines, then one with a line that is not data
    pieces=[
        _USUAL.replace(b',"choices"', b'\ndata: ,"choices"'),
        _USUAL.replace(b',"choices"', b'\n,"choices"'),
        b"data: [DONE]\n\n",
    ]
)
@hypothesis.example(
    pieces=[
        b"".join(
            _texts(
                _USUAL.replace(b',"choices"', b'\ndata: ,"choices"'),
                _USUAL.replace(b',"choices"', b'\n,"choices"'),
            )
        )
    ]
)
@hypothesis.example(  # a chunk as long as the usual ones but the server's error, in a run
    pieces=_texts(_USUAL, _USUAL.replace(b'"object"', b'"error" '))
)
@hypothesis.example(pieces=_texts(_USUAL, _USUAL, _USUAL.replace(b'"object"', b'"error" ')))
@hypothesis.example(  # two strings where one goes, in a run or alone (as a read brings it)
    pieces=_texts(_USUAL, _USUAL, _USUAL.replace(b'"@T@"', b'"a","b"'))
)
@hypothesis.example(
    pieces=[_USUAL, _USUAL, _USUAL.replace(b'"@T@"', b'"a","b"'), b"data: [DONE]\n\n"]
)
@hypothesis.example(pieces=[_USUAL, _USUAL.replace(b'"@T@"', b"1"), b"data: [DONE]\n\n"])
@hypothesis.example(  # a reasoning model's stream: its text comes after many other chunks
    pieces=_texts(*[_USUAL.replace(b'"content"', b'"reasoning_content"')] * 12)
)
@hypothesis.example(  # a data line before a chunk of the run
    pieces=_texts(_USUAL, b"data: 1\n" + _USUAL)
)  # fmt: skip
def test_the_fast_paths_read_a_stream_as_the_event_by_event_reader_does(
    pieces: list[bytes],
) -> None:
    """Differential: `SSEReply` (a text chunk of a learnt shape read by its text alone, in
    bulk or a token a read) gives the same `Completion`, or the same error, as the reader
    that decodes every event whole, on any stream of text chunks, odd ones among them."""

    async def read(fast: bool) -> tt.Completion | str:
        reader = SSEReply(CLIENT.url)
        if not fast:
            reader._learning = 0  # never learns a shape: every event decoded whole
        try:
            for piece in pieces:
                reader.feed(piece)
            return attrs.evolve(reader.finish(), ttft=None, tpot=None)
        except tt.ModelResponseError as exc:
            return str(exc)

    assert trio.run(read, True) == trio.run(read, False)


# --- the transport hands a streamed body on as it arrives ------------------------------------


class Segments:
    """A connection whose reads return `segments` in turn, then EOF (what the transport's
    readers see of a socket)."""

    def __init__(self, segments: list[bytes]) -> None:
        self.segments = list(segments)
        self.reads = 0

    async def receive(self, wait: bool) -> bytes:
        await trio.lowlevel.checkpoint()
        self.reads += 1
        return self.segments.pop(0) if self.segments else b""


def _chunked(
    head: list[tuple[str, str]], pieces: list[bytes], trailer: bool, extensions: bool = False
) -> bytes:
    """A chunked response of `pieces`, one chunk each (sizes in upper case hex and with a
    chunk extension, with `extensions`), and a trailer field, with `trailer`."""
    out = b"HTTP/1.1 200 \r\n"
    for name, value in [*head, ("Transfer-Encoding", "chunked")]:
        out += f"{name}: {value}\r\n".encode()
    out += b"\r\n"
    for piece in pieces:
        size = b"%X;x=1" % len(piece) if extensions else b"%x" % len(piece)
        out += size + b"\r\n" + piece + b"\r\n"
    return out + b"0\r\n" + (b"x-trailer: 1\r\n" if trailer else b"") + b"\r\n"


_PIECES = st.binary(min_size=1, max_size=40) | st.sampled_from(
    [b"data: {}\n\n", b"a\r\nb", b"\r\n", b"1\r\n", b"0\r\n\r\n", b"\r"]
)


@hypothesis.settings(max_examples=100, deadline=None)
@hypothesis.given(
    pieces=st.lists(_PIECES, max_size=8),
    chunked=st.booleans(),
    trailer=st.booleans(),
    extensions=st.booleans(),
    after=st.sampled_from([b"", b"", b"junk"]),
    data=st.data(),
)
def test_a_streamed_body_reaches_the_sink_whole_however_it_is_cut(
    pieces: list[bytes],
    chunked: bool,
    trailer: bool,
    extensions: bool,
    after: bytes,
    data: st.DataObject,
) -> None:
    """Differential: the streaming readers (chunked or Content-Length framing, the fast path
    and h11's) hand the sink exactly the body the whole-body reader returns, however the
    bytes are cut into reads, and call the connection reusable exactly when it does."""
    body = b"".join(pieces)
    head = [("content-type", "text/event-stream")]
    if chunked:
        raw = _chunked(head, pieces, trailer, extensions)
    else:
        raw = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n%s" % (
            len(body), body)  # fmt: skip
    raw += after
    segments = [bytes(s) for s in _split(data.draw, raw) if s]
    request = http_wire.RequestHead(b"GET / HTTP/1.1\r\n", "GET", False)

    async def read(sink: bool, fast: bool) -> tuple[int, bytes, bool]:
        got: list[bytes] = []
        connection: Any = Segments(segments)
        with trio.fail_after(5):
            if fast:
                status, _, whole, reusable = await http_wire.read_response(
                    connection, request, 1 << 20, lambda: None, got.append if sink else None
                )
            else:
                status, _, whole, reusable = await http_wire._read_with_h11(
                    connection, request, 1 << 20, lambda: None, bytearray(), False,
                    got.append if sink else None,
                )  # fmt: skip
        if sink:
            assert whole == b""
            assert all(got)  # no empty pieces
        return status, b"".join(got) if sink else whole, reusable

    expected = trio.run(read, False, False)
    assert expected[:2] == (200, body)
    assert trio.run(read, True, True) == expected
    assert trio.run(read, True, False) == expected


async def test_a_streamed_body_over_the_limit_or_encoded_is_refused() -> None:
    request = http_wire.RequestHead(b"GET / HTTP/1.1\r\n", "GET", False)
    raw = _chunked([], [b"x" * 50, b"y" * 60], False)
    with pytest.raises(http_wire.ResponseTooLargeSignal):
        await http_wire.read_response(Segments([raw]), request, 100, lambda: None, print)  # type: ignore[arg-type]
    raw = _chunked([("content-encoding", "gzip")], [b"x"], False)
    with pytest.raises(h11.RemoteProtocolError, match="gzip"):
        await http_wire.read_response(Segments([raw]), request, 100, lambda: None, print)  # type: ignore[arg-type]
    bad = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n"
    with pytest.raises(h11.RemoteProtocolError, match="chunk size"):
        await http_wire.read_response(Segments([bad]), request, 100, lambda: None, print)  # type: ignore[arg-type]


# --- OpenAIClient(stream=True) against the suite's server ------------------------------------

MESSAGES = [{"role": "user", "content": "What is 40 + 2? Say it in words, é included."}]
STREAM = tt.Sampling(stream=True)
ANSWER = "Forty-two, or quarante-deux in French (é), is the answer."
USAGE = {"prompt_tokens": 10, "completion_tokens": 9}  # ANSWER streamed a word a token


def test_stream_asks_for_events_and_the_usage() -> None:
    assert STREAM.to_request() == {"stream": True, "stream_options": {"include_usage": True}}
    assert "stream" not in tt.Sampling().to_request()
    with pytest.raises(tt.ConfigTypeError, match="stream"):
        tt.Sampling(stream="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["plain", "tokens", "tools"])
async def test_a_streamed_call_equals_the_whole_one_and_times_its_first_token(
    kind: str, autojump_clock: trio.abc.Clock
) -> None:
    tools = [{"type": "function", "function": {"name": "add"}}] if kind == "tools" else None
    async with ChatServer(delay=1.0, token_delay=0.25, tokens=kind == "tokens",
                          tools=kind == "tools", answer=lambda _: ANSWER) as server:  # fmt: skip
        async with tt.OpenAIClient(server.url) as client:
            sampling = tt.Sampling(return_tokens=kind == "tokens")
            whole = await client.chat(MESSAGES, model="m", sampling=sampling, tools=tools)
            began = trio.current_time()
            got = await client.chat(
                MESSAGES, model="m", sampling=attrs.evolve(sampling, stream=True), tools=tools
            )
            took = trio.current_time() - began
        asked = server.requests[-1]
    assert asked["stream"] is True
    assert asked["stream_options"] == {"include_usage": True}
    assert attrs.evolve(got, ttft=None, tpot=None) == whole
    assert whole.ttft is None
    # The role comes after the delay and one gap, the first token after the next one.
    assert got.ttft == pytest.approx(1.5)
    assert took > 1.5 + 1.0  # the rest of the tokens came after it
    if kind == "tokens":
        assert whole.tokens is not None
        assert len(whole.tokens.completion_ids) > 10


async def test_a_watch_keeps_the_tokens_of_a_call_cut_mid_stream(
    autojump_clock: trio.abc.Clock,
) -> None:
    server = ChatServer(token_delay=1.0, tokens=True, answer=lambda _: ANSWER)
    async with server, tt.OpenAIClient(server.url) as client:
        with watch_reply() as watch, trio.move_on_after(5.5) as scope:
            await client.chat(
                MESSAGES, model="m", sampling=tt.Sampling(return_tokens=True, stream=True)
            )
    assert scope.cancelled_caught
    kept = watch.partial()
    # One event a second: the role, then one token (one byte) an event.
    assert kept.tokens is not None
    assert kept.tokens.completion_ids == list(ANSWER.encode()[:4])
    assert kept.content == bytes(kept.tokens.completion_ids).decode()
    assert kept.finish_reason is None


async def test_a_stream_is_retried_before_its_first_byte(autojump_clock: trio.abc.Clock) -> None:
    async with ChatServer() as server:
        server.script(503, Reply())
        async with tt.OpenAIClient(server.url, max_retries=2, backoff=0.0) as client:
            got = await client.chat(MESSAGES, model="m", sampling=STREAM)
    assert got.content
    assert len(server.requests) == 2


class BreaksOff(RawServer):
    """Answers a streamed request with its head and `events`, then hangs up or, with
    `stall`, goes quiet."""

    def __init__(self, events: list[bytes], stall: bool = False) -> None:
        super().__init__()
        self.events = events
        self.stall = stall
        self.requests = 0

    def serve(self, conn: socket.socket) -> None:
        with conn:
            request = b""
            while b"\r\n\r\n" not in request:  # the whole request, so a close sends no RST
                request += conn.recv(65536)
            head, _, body = request.partition(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            while len(body) < length:
                body += conn.recv(65536)
            self.requests += 1
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip
            for event in self.events:
                conn.sendall(b"%x\r\n%s\r\n" % (len(event), event))
            if self.stall:
                time.sleep(2)


FIRST = b'data: {"choices": [{"index": 0, "delta": {"content": "Hel"}}]}\n\n'


@pytest.mark.parametrize("stall", [False, True])
async def test_a_stream_that_breaks_off_is_a_model_error_not_a_retry(stall: bool) -> None:
    with BreaksOff([FIRST], stall=stall) as server:
        async with tt.OpenAIClient(
            f"http://127.0.0.1:{server.port}/v1", max_retries=3, timeout=0.5
        ) as client:
            error = tt.ModelTimeoutError if stall else tt.ModelConnectionError
            with watch_reply() as watch, pytest.raises(error, match="mid-stream"):
                await client.chat(MESSAGES, model="m", sampling=STREAM)
    assert server.requests == 1
    assert watch.partial().content == "Hel"


async def test_an_error_event_mid_stream_is_a_response_error() -> None:
    error = b'data: {"error": {"message": "engine died", "code": 500}}\n\n'
    with BreaksOff([FIRST, error]) as server:
        async with tt.OpenAIClient(f"http://127.0.0.1:{server.port}/v1") as client:
            with pytest.raises(tt.ModelResponseError, match="engine died"):
                await client.chat(MESSAGES, model="m", sampling=STREAM)


async def test_tokens_arriving_are_progress_for_the_stall_timeout(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A reply streamed over 6 s, a token every 0.4 s, under a 2 s stall timeout: not a
    stall; the same reply sent whole after 6 s is one."""
    async with (
        ChatServer(token_delay=0.4, answer=lambda _: "one two three four five six " * 2) as server,
        tt.OpenAIClient(server.url) as client,
    ):
        env = tt.Env(tt.EchoTaskset(), stall_timeout=2.0)
        task = tt.Task("hi", answer="one")
        streamed = await env.run_slot(tt.RunSlot(task), tt.ModelContext(client, "m", STREAM))
        assert streamed.ok, streamed.errors
        server.delay, server.token_delay = 6.0, 0.0
        whole = await env.run_slot(tt.RunSlot(task), tt.ModelContext(client, "m", STREAM))
    assert [e.type for e in whole.errors] == ["StalledError"]


# --- time to first token and per output token: rows, summary, dashboard, metrics ---------------


def test_the_cli_streams_replies_and_its_rows_and_summary_carry_their_times(
    tmp_path: Path,
) -> None:
    with ChatServer(token_delay=0.02, answer=lambda _: ANSWER, usage=USAGE) as server:
        done = forkserver.run(
            [sys.executable, "-m", "trio_tasksets", "eval", "trio_tasksets:EchoTaskset", "-m", "tiny", "-n", "2",
             "--base-url", server.url, "--stream-replies", "--no-dashboard",
             "-o", str(tmp_path / "out"), "--run-name", "r"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert all(asked["stream"] is True for asked in server.requests)
    rows = [json.loads(x) for x in (tmp_path / "out/r/traces.jsonl").read_text().splitlines()]
    for row in rows:
        assert row["completion"] == ANSWER
        assert 0.02 <= row["timing"]["ttft"] < row["timing"]["duration"]
        assert row["timing"]["tpot"] > 0
    summary = json.loads((tmp_path / "out/r/summary.json").read_text())
    assert summary["health"]["streamed"] == 2
    assert summary["health"]["ttft_s"]["samples"] == 2
    assert summary["health"]["tpot_s"]["p50"] > 0
    saved = json.loads((tmp_path / "out/r/config.json").read_text())
    assert "--stream-replies" in saved["command"]
    assert "stream" not in saved["identity"]["sampling"]  # a run resumes with or without it


def test_stream_travels_to_an_env_server() -> None:
    from trio_tasksets._serve.wire import WireError, encode_run_request, parse_run_request

    ctx = tt.ModelContext(tt.EchoClient(), "echo", STREAM)
    body = json.loads(encode_run_request(tt.RunSlot(tt.Task("x")), ctx))
    assert parse_run_request(body).sampling == ctx.sampling
    body["ctx"]["sampling"]["stream"] = 1
    with pytest.raises(WireError) as caught:
        parse_run_request(body)
    assert caught.value.field == "ctx.sampling.stream"


async def test_health_keeps_the_streamed_replies_times_for_the_dashboard_and_metrics() -> None:
    health = Health()
    assert health.replies() == {}
    assert health.dashboard_text() is None
    for ttft, tpot in [(0.1, 0.02), (0.3, None), (0.2, 0.04)]:
        health.on_stream(ttft, tpot)
    figures = health.replies()
    assert figures["streamed"] == 3
    assert figures["ttft_s"]["p50"] == 0.2
    assert figures["ttft_s"]["p99"] == 0.3
    assert figures["tpot_s"]["samples"] == 2
    assert health.snapshot()["ttft_s"] == figures["ttft_s"]
    assert health.dashboard_text() == "ttft p50 200 ms (p99 300 ms), tpot p50 20.0 ms"
    text = Metrics(health).text().decode()
    assert 'trio_tasksets_ttft_seconds{quantile="0.5"} 0.2' in text
    assert "trio_tasksets_ttft_seconds_count 3.0" in text
    assert "trio_tasksets_tpot_seconds_sum 0.06" in text


async def test_a_model_context_reports_each_streamed_reply_to_the_observers(
    autojump_clock: trio.abc.Clock,
) -> None:
    health = Health()
    server = ChatServer(token_delay=0.5, answer=lambda _: ANSWER, usage=USAGE)
    async with server, tt.OpenAIClient(server.url) as client:
        ctx = tt.ModelContext(client, "m", STREAM)
        with tt.observe_calls(health):
            reply = await ctx.chat(MESSAGES)
            await ctx.chat(MESSAGES, stream=False)
    assert health.streamed == 1
    assert list(health.ttfts) == [reply.ttft] == [1.0]  # the role, then the first word
    assert reply.tpot == pytest.approx(0.5)  # 9 tokens, 0.5 s apart
