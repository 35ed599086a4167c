"""Streamed replies: a reply read as it arrives, and what a caller keeps of a cut one.

`ReplyBuilder` assembles the chunks of one streamed attempt (OpenAI ``chat.completion.chunk``
objects, decoded) into a `Completion`: whole with `finish` once the stream has ended, or as
it stands at any moment with `partial`. A streaming client makes one builder per attempt
that got a 2xx answer and feeds it every chunk as it is decoded.

`watch_reply` is the seam for a caller that may cut a call (a policy update's ``abort``):
``with watch_reply() as watch:`` around a model call, and every streamed attempt made in
the block, by this task or by tasks it starts, hands its builder to ``watch`` before its
first chunk. When the call's cancel scope is cancelled, the caller still holds what had
arrived::

    with watch_reply() as watch:
        with trio.CancelScope() as scope:   # cancelled by an update
            completion = await ctx.chat(messages)
    if scope.cancelled_caught:
        kept = watch.partial()              # the text and token ids that had arrived
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn, cast

import trio

from .._core.limits import report_progress
from .base import (
    Completion,
    ModelResponseError,
    Tokens,
    excerpt,
    parse_tool_calls,
    text_of,
)

__all__ = ["PROGRESS_EVERY", "ReplyBuilder", "ReplyWatch", "attach_reply", "watch_reply"]

PROGRESS_EVERY = 0.5
"""Seconds: tokens arriving report progress (`report_progress("tokens")`, what a
``--stall-timeout`` watches) at most this often per reply, so a fast stream costs nothing."""

# The message fields a stream sends in pieces, joined in order; any other string field of a
# delta (e.g. a server's own reasoning field) is joined the same way.
_ROLE = "role"


class ReplyBuilder:
    """One streamed reply, assembled chunk by chunk.

    `feed` takes one decoded chunk (``{"choices": [{"delta": {...}, "finish_reason",
    "token_ids", "logprobs"}], "usage", "prompt_token_ids"}``, as OpenAI and vLLM send them);
    only ``choices[0]`` is read (a chat call asks for one). What it joins:

    - the delta's ``content`` pieces (and every other string field of the delta, such as a
      server's reasoning text), in order; ``role`` is set, not joined;
    - ``tool_calls`` deltas by their ``index``: the first piece of an index brings its ``id``,
      ``type`` and ``function.name``, every piece may bring a piece of
      ``function.arguments``;
    - vLLM's ``token_ids`` (per choice) and ``prompt_token_ids`` (top level, sent once),
      the choice's ``logprobs.content[].logprob``, the last ``finish_reason`` given, and the
      ``usage`` of the chunk that carries one (the last, with
      ``stream_options.include_usage``).

    `partial` is the reply as it stands, at any moment: the content, message, tool calls
    and token ids so far, ``finish_reason`` None (the reply did not finish), ``ttft`` as
    measured. `finish` is the whole reply once the stream has ended; it equals the
    `Completion` the same reply sent whole would parse to, but for ``ttft``.

    `started` is when the attempt's request went out (trio's clock); ``ttft`` is the time
    from then to the first chunk that carried a token (content, a tool call's piece, token
    ids), and `last_token_at` when the last such chunk came. A chunk that is not a JSON
    object, or whose parts have the wrong types, raises `ModelResponseError` naming `url`.
    """

    __slots__ = (
        "_logprobs",
        "_pieces",
        "_progress_at",
        "_prompt_ids",
        "_token_ids",
        "_tools",
        "finish_reason",
        "first_token_at",
        "last_token_at",
        "role",
        "started",
        "url",
        "usage",
    )

    def __init__(self, started: float | None = None, *, url: str = "") -> None:
        self.started = trio.current_time() if started is None else started
        self.url = url
        self.role = "assistant"
        self.finish_reason: str | None = None
        self.usage: dict[str, int] = {}
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self._pieces: dict[str, list[str]] = {}  # message field -> its pieces, in order
        self._tools: dict[int, dict[str, Any]] = {}  # index -> the call so far
        self._token_ids: list[int] | None = None
        self._prompt_ids: list[int] | None = None
        self._logprobs: list[float] | None = None
        self._progress_at = -float("inf")

    # --- feeding ---------------------------------------------------------------------------

    def feed(self, chunk: Any) -> None:
        """Add one decoded chunk (see the class). Raises `ModelResponseError` for a chunk
        that is not a chat completion chunk."""
        if not isinstance(chunk, dict):
            self._malformed("a chunk that is not a JSON object", chunk)
        token = False
        prompt_ids = chunk.get("prompt_token_ids")
        if prompt_ids is not None:
            self._prompt_ids = self._ints(prompt_ids, "prompt_token_ids", chunk)
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = {
                str(k): v
                for k, v in usage.items()
                if isinstance(v, int) and not isinstance(v, bool)
            }
        choices = chunk.get("choices")
        if choices:
            if not isinstance(choices, list) or not isinstance(choices[0], dict):
                self._malformed("choices that are not a list of objects", chunk)
            token = self._choice(choices[0], chunk)
        if token:
            now = trio.current_time()
            if self.first_token_at is None:
                self.first_token_at = now
            self.last_token_at = now
            if now - self._progress_at >= PROGRESS_EVERY:
                self._progress_at = now
                report_progress("tokens")

    def _choice(self, choice: dict[str, Any], chunk: Any) -> bool:
        """Add one chunk's choice; whether it carried a token."""
        token = False
        delta = choice.get("delta")
        if delta is not None:
            if not isinstance(delta, dict):
                self._malformed("a delta that is not an object", chunk)
            for name, value in delta.items():
                if name == _ROLE:
                    if isinstance(value, str):
                        self.role = value
                elif name == "tool_calls":
                    if value:
                        self._tool_deltas(value, chunk)
                        token = True
                elif isinstance(value, str):
                    self._pieces.setdefault(name, []).append(value)
                    token = token or bool(value)
                elif isinstance(value, list) and name == "content":
                    self._pieces.setdefault(name, []).append(text_of(value))
                    token = True
                elif value is not None:
                    self._malformed(f"a delta field {name!r} that is not text", chunk)
        ids = choice.get("token_ids")
        if ids is not None:
            ids = self._ints(ids, "token_ids", chunk)
            if self._token_ids is None:
                self._token_ids = list(ids)
            else:
                self._token_ids.extend(ids)
            token = token or bool(ids)
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict):
            entries = logprobs.get("content")
            if entries is not None:
                try:
                    values = [float(entry["logprob"]) for entry in entries]
                except (TypeError, KeyError, ValueError):
                    self._malformed("malformed logprobs", chunk)
                if self._logprobs is None:
                    self._logprobs = values
                else:
                    self._logprobs.extend(values)
        reason = choice.get("finish_reason")
        if isinstance(reason, str):
            self.finish_reason = reason
        return token

    def _tool_deltas(self, deltas: Any, chunk: Any) -> None:
        if not isinstance(deltas, list):
            self._malformed("tool_calls that are not a list", chunk)
        for delta in deltas:
            if not isinstance(delta, dict):
                self._malformed("a tool call delta that is not an object", chunk)
            index = delta.get("index", len(self._tools))
            if isinstance(index, bool) or not isinstance(index, int):
                self._malformed("a tool call delta without an integer index", chunk)
            call = self._tools.get(index)
            if call is None:
                call = self._tools[index] = {"id": "", "type": "function", "name": "", "args": []}
            ident = delta.get("id")
            if isinstance(ident, str) and ident:
                call["id"] = ident
            kind = delta.get("type")
            if isinstance(kind, str) and kind:
                call["type"] = kind
            function = delta.get("function")
            if isinstance(function, dict):
                name = function.get("name")
                if isinstance(name, str) and name:
                    call["name"] += name
                arguments = function.get("arguments")
                if isinstance(arguments, str):
                    call["args"].append(arguments)
                elif arguments is not None:
                    self._malformed("tool call arguments that are not text", chunk)

    def _ints(self, value: Any, name: str, chunk: Any) -> list[int]:
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            self._malformed(f"{name} that are not a list of ints", chunk)
        return cast(list[int], value)

    def _malformed(self, what: str, chunk: Any) -> NoReturn:
        raise ModelResponseError(
            f"{self.url} streamed {what}: {excerpt(repr(chunk))}", url=self.url
        )

    # --- reading ---------------------------------------------------------------------------

    @property
    def ttft(self) -> float | None:
        """Seconds from `started` to the first token, or None before it."""
        return None if self.first_token_at is None else self.first_token_at - self.started

    @property
    def token_ids(self) -> list[int]:
        """The reply's token ids so far (vLLM's ``token_ids``; [] when the server sends
        none)."""
        return list(self._token_ids or ())

    def message(self) -> dict[str, Any]:
        """The assistant message so far: ``role``, ``content`` (None until a piece of it
        came), every other joined text field, and ``tool_calls`` when any came."""
        message: dict[str, Any] = {"role": self.role}
        content = self._pieces.get("content")
        message["content"] = None if content is None else "".join(content)
        for name, pieces in self._pieces.items():
            if name != "content":
                message[name] = "".join(pieces)
        if self._tools:
            message["tool_calls"] = [
                {
                    "id": call["id"],
                    "type": call["type"],
                    "function": {"name": call["name"], "arguments": "".join(call["args"])},
                }
                for _, call in sorted(self._tools.items())
            ]
        return message

    def tokens(self) -> Tokens | None:
        """The token ids and logprobs so far, or None when the server sent none of them."""
        if self._prompt_ids is None and self._token_ids is None and self._logprobs is None:
            return None
        try:
            return Tokens(
                list(self._prompt_ids or ()),
                list(self._token_ids or ()),
                list(self._logprobs or ()),
            )
        except ValueError as exc:  # ids and logprobs of different lengths
            raise ModelResponseError(
                f"{self.url} streamed token ids and logprobs that do not match: {exc}",
                url=self.url,
            ) from None

    def partial(self) -> Completion:
        """The reply as it stands (see the class): ``finish_reason`` None."""
        return self._completion(None)

    def finish(self) -> Completion:
        """The whole reply, once its stream has ended (the server's ``[DONE]``)."""
        return self._completion(self.finish_reason)

    def _completion(self, finish_reason: str | None) -> Completion:
        message = self.message()
        return Completion(
            content=text_of(message["content"]),
            usage=dict(self.usage),
            finish_reason=finish_reason,
            message=message,
            tool_calls=parse_tool_calls(message),
            tokens=self.tokens(),
            ttft=self.ttft,
        )


class ReplyWatch:
    """What a caller holds of the model call it watches (`watch_reply`): the `builder` of
    the call's latest streamed attempt, None until one began (a call that is not streamed
    never has one). A retried attempt replaces the builder of the one before: what a
    failed attempt had streamed is not part of the reply."""

    __slots__ = ("attempts", "builder")

    def __init__(self) -> None:
        self.builder: ReplyBuilder | None = None
        self.attempts = 0  # streamed attempts that began

    def attach(self, builder: ReplyBuilder) -> None:
        """A streamed attempt began (the client calls this before its first chunk)."""
        self.builder = builder
        self.attempts += 1

    def partial(self) -> Completion:
        """The reply as it stands (`ReplyBuilder.partial`): the content, message, tool calls
        and token ids that had arrived, ``finish_reason`` None; an empty reply
        (``Completion("")``) when no streamed attempt began."""
        if self.builder is None:
            return Completion("")
        return self.builder.partial()


_watches: contextvars.ContextVar[tuple[ReplyWatch, ...]] = contextvars.ContextVar(
    "trio_tasksets_reply_watches", default=()
)


@contextmanager
def watch_reply() -> Iterator[ReplyWatch]:
    """``with watch_reply() as watch:``: every streamed attempt of a model call made in the
    block (by this task or tasks it starts) attaches its `ReplyBuilder` to ``watch``
    before its first chunk, so that a caller whose cancel scope cuts the call still holds
    what had arrived (``watch.partial()``). Watches nest: an outer one sees the attempts of
    an inner block too. Watch one call at a time: a second call in the block replaces the
    first's builder, as a retry does."""
    watch = ReplyWatch()
    token = _watches.set((*_watches.get(), watch))
    try:
        yield watch
    finally:
        _watches.reset(token)


def attach_reply(builder: ReplyBuilder) -> None:
    """Hand a streamed attempt's builder to the watches of this context (`watch_reply`);
    a streaming client calls it once per attempt, before feeding the first chunk."""
    for watch in _watches.get():
        watch.attach(builder)
