"""Streamed replies: a reply read as it arrives, and what a caller keeps of a cut one.

`SSEReply` reads the body of one streamed attempt as the transport hands it over (server-sent
events, split and decoded as they come) and feeds a `ReplyBuilder`, which assembles the
chunks (OpenAI ``chat.completion.chunk`` objects, vLLM's token ids) into a `Completion`:
whole with `ReplyBuilder.finish` once the stream has ended, or as it stands at any moment
with `ReplyBuilder.partial`. `OpenAIClient` makes one `SSEReply` per attempt of a call with
``Sampling(stream=True)``, as the attempt's request goes out.

`watch_reply` is the seam for a caller that may cut a call (a policy update's ``abort``)::

    with watch_reply() as watch:
        with trio.CancelScope() as scope:   # cancelled by an update
            completion = await ctx.chat(messages)
    if scope.cancelled_caught:
        kept = watch.partial()              # the text and token ids that had arrived

Its contract:

- Every streamed attempt of a model call made inside the block, by this task or by a task
  it starts inside it (trio copies the context into a new task), attaches its builder to
  the watch when its request goes out, before any byte of its reply: `watch.builder` is
  the latest attempt's (a retry replaces the one before: what a failed attempt had streamed
  is not part of the reply), `watch.attempts` counts them. A call that is not streamed
  attaches nothing: `watch.partial()` is then ``Completion("")``. Watches nest: an outer
  watch sees the attempts of an inner block too. Watch one call per block (a second call's
  attempts replace the first's).
- `watch.partial()` may be called at any moment, during the call or after it ended however
  it ended (returned, raised, cancelled), from any task of the run: it is a snapshot, a new
  `Completion` that later chunks do not change, of every event received whole so far (an
  event of which only part had come is not in it): ``content``; ``message`` (role, content,
  every other text field of the deltas, ``tool_calls`` so far, the last one's arguments
  maybe cut short, so maybe not JSON); ``tool_calls`` parsed from it; ``tokens`` (the
  prompt's ids when the server sent them, the reply's ids and logprobs so far, as many
  logprobs as ids when both come) or None when the server sent none; ``usage`` ({} until
  the last chunk); ``finish_reason`` None (even for a reply that ended: it is a partial
  view); ``ttft``, ``tpot`` as measured so far; ``versions`` [] (a policy stamps them).
- Nothing is lost between what the transport has read and what `partial` shows but an
  event not yet whole: a read's events are fed before the next wait, so when a cancel
  scope cuts the call at a checkpoint, every whole event that had arrived is in the builder.
"""

from __future__ import annotations

import contextvars
import operator
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn, cast

import orjson
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

__all__ = [
    "MAX_EVENT",
    "PROGRESS_EVERY",
    "ReplyBuilder",
    "ReplyWatch",
    "SSEReply",
    "attach_reply",
    "pop_watch",
    "push_watch",
    "watch_reply",
]

PROGRESS_EVERY = 0.5
"""Seconds: tokens arriving report progress (`report_progress("tokens")`, what a
``--stall-timeout`` watches) at most this often per reply, so a fast stream costs nothing."""

MAX_EVENT = 16 * 2**20
"""Bytes of one server-sent event, at most (a longer one is a `ModelResponseError`): what the
reader holds of an event not yet whole (the body as a whole is bounded by the transport)."""

# The message fields a stream sends in pieces, joined in order; any other string field of a
# delta (e.g. a server's own reasoning field) is joined the same way.
_ROLE = "role"


class ReplyBuilder:
    """One streamed reply, assembled chunk by chunk.

    `feed` takes one decoded chunk (``{"choices": [{"delta": {...}, "finish_reason",
    "token_ids", "logprobs"}], "usage", "prompt_token_ids"}``, as OpenAI and vLLM send them);
    only ``choices[0]`` is read (a chat call asks for one). What it joins:

    - the delta's ``content`` pieces (and every other string field of the delta, such as a
      server's reasoning text), in order; ``role`` is set, not joined; a field that is
      neither (a legacy ``function_call``, ``audio``) is not kept;
    - ``tool_calls`` deltas by their ``index``: the first piece of an index brings its ``id``,
      ``type`` and ``function.name``, every piece may bring a piece of
      ``function.arguments``;
    - vLLM's ``token_ids`` (per choice) and ``prompt_token_ids`` (top level, sent once),
      the choice's ``logprobs.content[].logprob``, the last ``finish_reason`` given, and the
      ``usage`` of the chunk that carries one (the last, with
      ``stream_options.include_usage``).

    `partial` is the reply as it stands, at any moment: the content, message, tool calls
    and token ids so far, ``finish_reason`` None (the reply did not finish), ``ttft`` and
    ``tpot`` as measured. `finish` is the whole reply once the stream has ended; it equals
    the `Completion` the same reply sent whole would parse to, but for ``ttft`` and
    ``tpot``.

    `started` is when the attempt's request went out (trio's clock); ``ttft`` is the time
    from then to the first chunk that carried a token (content, a tool call's piece, token
    ids), and `last_token_at` when the last such chunk came. A chunk that is not a JSON
    object, or whose parts have the wrong types, raises `ModelResponseError` naming `url`.
    """

    __slots__ = (
        "_chunks",
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
        self._chunks = 0  # chunks that carried a token

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
            self._chunks += 1
            self._tokens_came()

    def add_content(self, text: str, tokens: int) -> None:
        """Add the joined texts of plain text chunks that came together, as `feed` would
        add each chunk ``{"choices": [{"delta": {"content": piece}}]}``: ``tokens`` of them
        were not empty."""
        pieces = self._pieces.get("content")
        if pieces is None:
            pieces = self._pieces["content"] = []
        pieces.append(text)
        if tokens:
            self._chunks += tokens
            self._tokens_came()

    def _tokens_came(self) -> None:
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
                elif name == "content":
                    if isinstance(value, list):  # content parts: their text
                        self._pieces.setdefault(name, []).append(text_of(value))
                        token = True
                    elif value is not None:
                        self._malformed("a delta content that is not text", chunk)
                # another field that is not text (a legacy `function_call`, `audio`): not
                # joined, and not part of the reply's message
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
        if type(value) is list and len(value) == 1 and type(value[0]) is int:
            return value  # a token a chunk, as vLLM streams them
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
        came: a server that sends a whole reply's content as null streams it as null, as
        OpenAI does with tool calls; one that streams ``""`` sends ``""``, as vLLM does),
        every other joined text field, and ``tool_calls`` when any came."""
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

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first: from the first token to the last, over
        the reply's output tokens but one (its usage's ``completion_tokens``, else its
        token ids, else the chunks that carried a token); None below two tokens."""
        first, last = self.first_token_at, self.last_token_at
        if first is None or last is None:
            return None
        count = self.usage.get("completion_tokens")
        if count is None:
            count = len(self._token_ids) if self._token_ids is not None else self._chunks
        return (last - first) / (count - 1) if count > 1 else None

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
            tpot=self.tpot,
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
    token = push_watch(watch)
    try:
        yield watch
    finally:
        _watches.reset(token)


def push_watch(watch: ReplyWatch) -> contextvars.Token[tuple[ReplyWatch, ...]]:
    """`watch_reply` without the context manager (a hot path's): `watch` sees the streamed
    attempts of this context from now until `pop_watch` of the token returned."""
    return _watches.set((*_watches.get(), watch))


def pop_watch(token: contextvars.Token[tuple[ReplyWatch, ...]]) -> None:
    """End the watch `push_watch` began."""
    _watches.reset(token)


def attach_reply(builder: ReplyBuilder) -> None:
    """Hand a streamed attempt's builder to the watches of this context (`watch_reply`);
    a streaming client calls it once per attempt, before feeding the first chunk."""
    for watch in _watches.get():
        watch.attach(builder)


_DONE = b"[DONE]"


class SSEReply:
    """The body of one streamed attempt, read incrementally: `feed` takes the body's pieces
    as the transport hands them over (``HTTPClient.request(on_body=...)``), splits them into
    server-sent events (``data:`` lines; CRLF, LF or CR line ends; comments, ``event:``,
    ``id:`` and ``retry:`` fields skipped; the lines of one event joined by a newline) and
    feeds each event's JSON to a `ReplyBuilder`, which the attempt hands to the watches of
    its context (`attach_reply`) when it is made. The events of one piece are decoded in one
    go. `finish` gives the whole reply once the body has ended.

    Raises `ModelResponseError` naming the URL for an event that is not JSON, an event of
    the server's own error (``{"error": ...}``, as vLLM sends on a failure mid-stream), an
    event over `MAX_EVENT` bytes, or (`finish`) a body that ended before ``data: [DONE]``
    and without a ``finish_reason``."""

    __slots__ = (
        "_cr",
        "_cut",
        "_end",
        "_feed",
        "_glue",
        "_head",
        "_lead",
        "_learning",
        "_mid",
        "_needle",
        "_nl",
        "_parts",
        "_size",
        "_template",
        "builder",
        "done",
        "received",
    )

    def __init__(self, url: str = "") -> None:
        self.builder = ReplyBuilder(url=url)
        self._feed: Callable[[Any], None] = self.builder.feed
        self._parts: list[bytes] = []  # the event not yet whole
        self._size = 0  # its bytes
        self._nl = False  # it ends in a line end (a blank line may be split)
        self._cr = False  # the last piece ended in a CR (a CRLF may be split)
        self.done = False
        self.received = 0  # bytes of the body so far
        self._template: tuple[bytes, bytes] | None = None  # the text chunks' shape: `_learn`
        self._learning = _LEARN_TRIES  # chunks with token ids it still learns from
        # its bytes around and between texts (`_learn`)
        self._lead = self._needle = self._head = self._mid = self._glue = self._end = b""
        self._cut: Callable[[bytes], bytes] = bytes
        attach_reply(self.builder)

    def feed(self, piece: bytes) -> None:
        """Add the next piece of the body."""
        self.received += len(piece)
        if self._cr or b"\r" in piece:
            piece = self._lines(piece)
        parts = self._parts
        if (
            not parts
            and self._template is not None
            and piece.startswith(self._lead)
            and piece.endswith(self._end)
        ):  # one text chunk of the learnt shape, as a stream brings a token a read
            try:
                text = orjson.loads(piece[len(self._lead) : len(piece) - len(self._end)])
            except orjson.JSONDecodeError:
                text = None
            if type(text) is str:  # no line end in it, so the piece is that one event
                self.builder.add_content(text, 1 if text else 0)
                return
        if b"\n\n" not in piece and not (self._nl and piece.startswith(b"\n")):
            if piece:  # no event ends in it
                parts.append(piece)
                self._size += len(piece)
                self._nl = piece.endswith(b"\n")
                if self._size > MAX_EVENT:
                    self._error(f"an event over {MAX_EVENT:,} bytes")
            return
        buffer = b"".join(parts) + piece if parts else piece
        parts.clear()
        end = buffer.rfind(b"\n\n")
        region, rest = buffer[:end], buffer[end + 2 :]
        if rest:
            parts.append(rest)
        self._size, self._nl = len(rest), rest.endswith(b"\n")
        if self._template is None and self._learning:
            region = self._first(region)
        if region and (self._template is None or not self._bulk(region)):
            self._events(region.split(b"\n\n"))

    def _first(self, region: bytes) -> bytes:
        """Feed the builder the events at the start of `region` one by one until the
        stream's text chunks have shown their shape (`_learn`) or it stops looking; the
        rest of `region` (its events then go in bulk where they can)."""
        at = 0
        while self._template is None and self._learning:
            end = region.find(b"\n\n", at)
            if end < 0:
                self._events([region[at:]])
                return b""
            self._events([region[at:end]])
            at = end + 2
        return region[at:]

    def _events(self, events: list[bytes]) -> None:
        """Feed the builder `events` (raw, without their blank lines), in order, one by
        one: a text chunk of the learnt shape by its text alone, any other decoded whole
        (and learnt from, until the shape is known: `_learn`)."""
        for event in events:
            if event.startswith(b"data: ") and b"\n" not in event:
                data = event[6:]  # the usual event: one data line
            else:
                found = _data_of(event)
                if found is None:
                    continue
                data = found
            if data == _DONE:
                self.done = True
                continue
            template = self._template
            if template is not None:
                prefix, suffix = template
                text = data[len(prefix) : len(data) - len(suffix)]
                if (
                    len(text) >= 2
                    and data.startswith(prefix)
                    and data.endswith(suffix)
                    and (decoded := _strings([text])) is not None
                ):
                    self.builder.add_content(*decoded)
                    continue
            try:
                chunk = orjson.loads(data)
            except orjson.JSONDecodeError:
                chunk = self._decode(data)  # raises, naming it
            if type(chunk) is dict and "error" in chunk:
                self._error(f"an error: {excerpt(repr(chunk['error']), 400)}")
            self._feed(chunk)
            if template is None and self._learning:
                self._learn(data, chunk)

    def _learn(self, data: bytes, chunk: Any) -> None:
        template = _learn(data, chunk)
        if template is None:
            if _carries_tokens(chunk):  # as every chunk of a stream with token ids does:
                self._learning -= 1  # stop looking after a few
            return
        self._template = template
        prefix, suffix = template
        self._lead = lead = b"data: " + prefix  # an event's bytes before its text
        self._needle = lead[-_NEEDLE:]  # where `_bulk` splits (short: fast to find)
        self._head = lead[: len(lead) - len(self._needle)]
        self._mid = suffix + b"\n\n" + self._head  # from one text to the next needle
        self._glue = self._mid + self._needle  # from one text to the next
        self._end = suffix + b"\n\n"
        self._cut = operator.itemgetter(slice(0, -len(self._mid)))

    def _bulk(self, region: bytes) -> bool:
        """Feed the builder the events of `region` (whole events, the blank line after the
        last one cut off) with its run of text chunks of the learnt shape read in bulk, all
        at C speed: split where each such chunk's text begins (a short `_needle`, the end
        of the bytes before a text), each piece cut to its text (the bytes after a text
        and up to the next needle are the same in every chunk of the run), the pieces
        checked to be exactly that in one comparison (the run rebuilt from its texts), and
        the texts decoded in one `orjson` call. False, having fed nothing, when `region`
        has no such run or a text is not one JSON string (then each event goes its own way,
        `_events`, which names a bad one)."""
        pieces = region.split(self._needle)
        if len(pieces) < 2:
            return False
        first, last = pieces[0], pieces[-1]
        head = self._head
        if not first.endswith(head):  # the events before the run, then its first's lead
            return False
        early = first[: len(first) - len(head)]
        if early:
            if not early.endswith(b"\n\n"):
                return False
            early = early[:-2]
        end = self._end
        stop = last.find(end)  # the run's last text, then the events after it
        if stop >= 0:
            final, later = last[:stop], last[stop + len(end) :]
        elif last.endswith(end[:-2]):
            final, later = last[: len(last) - len(end) + 2], b""
        else:
            return False
        middle = pieces[1:-1]
        texts = list(map(self._cut, middle))
        if middle and self._glue.join(texts) + self._mid != self._needle.join(middle):
            return False  # a piece is not a text followed by the bytes between texts
        texts.append(final)
        decoded = _strings(texts)
        if decoded is None:
            return False
        if early:
            self._events(early.split(b"\n\n"))
        self.builder.add_content(*decoded)
        if later:
            self._events(later.split(b"\n\n"))
        return True

    def _lines(self, piece: bytes) -> bytes:
        """``piece`` with its CRLF and CR line ends as LF (a CR ending the previous piece
        already counted as a line end)."""
        if self._cr and piece.startswith(b"\n"):
            piece = piece[1:]
        self._cr = piece.endswith(b"\r")
        return piece.replace(b"\r\n", b"\n").replace(b"\r", b"\n")

    def _decode(self, data: bytes) -> Any:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            self._error(f"an event that is not JSON: {excerpt(data.decode('utf-8', 'replace'))}")

    def _error(self, what: str) -> NoReturn:
        url = self.builder.url
        raise ModelResponseError(f"{url} streamed {what}", url=url)

    def finish(self) -> Completion:
        """The whole reply (`ReplyBuilder.finish`), once the body has ended."""
        if b"".join(self._parts).strip():
            self.feed(b"\n\n")  # a last event without its blank line
        if not self.done and self.builder.finish_reason is None:
            self._error("a reply that ended before its last event (no [DONE], no finish_reason)")
        return self.builder.finish()


_CONTENT_KEY = b'"content":'
_NEEDLE = 16  # bytes: longer needles cost CPython's search more per match
_LEARN_TRIES = 8  # chunks with token ids before `SSEReply` stops learning the shape
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def _learn(data: bytes, chunk: Any) -> tuple[bytes, bytes] | None:
    """The shape of a stream's text chunks, from one of them (`data`, decoded: `chunk`):
    (the bytes before its text's JSON string, the bytes after it), or None when `chunk` is
    not a plain text chunk (one choice, a delta of ``content`` alone, no finish reason,
    token ids, logprobs, usage or prompt ids). A server sends the same id, time and model
    in every chunk of a stream, so the chunks that carry the next tokens are these bytes
    around another string: read by that string alone (`SSEReply._events`), they cost a
    fraction of decoding each whole."""
    if type(chunk) is not dict or any(
        chunk.get(key) is not None for key in ("usage", "prompt_token_ids", "error")
    ):
        return None
    choices = chunk.get("choices")
    if type(choices) is not list or len(choices) != 1 or type(choices[0]) is not dict:
        return None
    choice = choices[0]
    delta = choice.get("delta")
    if type(delta) is not dict or delta.keys() != {"content"} or type(delta["content"]) is not str:
        return None
    if any(choice.get(key) is not None for key in ("finish_reason", "token_ids", "logprobs")):
        return None
    if data.count(_CONTENT_KEY) != 1:
        return None  # the text's key is the only "content" of the chunk, and it names it
    at = data.index(_CONTENT_KEY)
    if at == 0 or data[at - 1] == 92:  # a backslash: an escaped quote, not the key
        return None
    start = at + len(_CONTENT_KEY)
    found = _STRING.match(data, start)
    if found is None or orjson.loads(found.group()) != delta["content"]:
        return None
    prefix, suffix = data[:start], data[found.end() :]
    if b"\n" in prefix or b"\n" in suffix:
        return None  # an event of many data lines: its raw bytes are not `data: ` + data
    return prefix, suffix


def _carries_tokens(chunk: Any) -> bool:
    """Whether `chunk` carries token ids or logprobs (so it is no plain text chunk, and no
    chunk of its stream will be: a stream sends them with every token or never)."""
    choices = chunk.get("choices") if type(chunk) is dict else None
    choice = choices[0] if type(choices) is list and choices else None
    return type(choice) is dict and (
        choice.get("token_ids") is not None or choice.get("logprobs") is not None
    )


def _strings(texts: list[bytes]) -> tuple[str, int] | None:
    """The JSON strings `texts`, decoded in one go: (their texts joined, how many are not
    empty); None unless each is exactly one string (then the events are decoded one by
    one, and a bad one is named)."""
    try:
        decoded = orjson.loads(b"[" + b",".join(texts) + b"]")
    except orjson.JSONDecodeError:
        return None
    if len(decoded) != len(texts):
        return None  # each text starts with a value: as many values, one in each
    try:
        joined = "".join(decoded)
    except TypeError:  # a value that is not a string
        return None
    return joined, len(decoded) - decoded.count("")


def _data_of(event: bytes) -> bytes | None:
    """The data of one event (its ``data:`` lines joined by a newline), or None when it has
    none (a comment, a keep-alive)."""
    lines = [
        line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
    ]
    return b"\n".join(lines) if lines else None
