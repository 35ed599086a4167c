"""Streamed replies (SPEC 13, issue 33): a reply assembled chunk by chunk (`ReplyBuilder`),
what a caller keeps of a cut call (`watch_reply`), and `VersionSpan`."""

from __future__ import annotations

import pytest
import trio

import trio_tasksets as tt
from trio_tasksets._models.stream import ReplyBuilder, attach_reply, watch_reply


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
