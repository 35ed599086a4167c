"""What every model client shares: `Sampling`, `Completion`, the `ModelClient` protocol,
`ModelClientBase` and the `ClientDescription` a client gives of itself, `ModelContext`, the
model errors, and small text helpers of the clients.

The clients: the offline :class:`EchoClient` (`echo`) and the HTTP :class:`OpenAIClient`
(`openai`); the loop every HTTP client runs its calls in is `calls.EndpointCalls`.

Every client satisfies the :class:`ModelClient` protocol: an async ``chat`` that takes
OpenAI-style messages and returns a :class:`Completion`, and an async ``aclose``.
:class:`ModelContext` bundles a client with the model name and :class:`Sampling` settings
an episode should use. The rest of the package never asks which class a client is: it asks
its description (`describe`).

Errors raised by :class:`OpenAIClient` are subclasses of :class:`ModelError` with distinct
type names (``ModelConnectionError``, ``ModelTimeoutError``, ``ModelHTTPError``,
``ModelResponseError``) so an env's retry policy can match them by name.
``trio.Cancelled`` is never caught or converted.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import json
import os
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol, cast, runtime_checkable

import attrs
import trio

from .._core.exceptions import ConfigError, ConfigTypeError, TrioTasksetsError
from .._core.limits import EndpointLimits, report_progress, report_stream
from .._core.window import Window

# duplicates: _models and the flat API re-list these names; each __all__ is its module's own
__all__ = [
    "ClientDescription",
    "Completion",
    "Governs",
    "Message",
    "ModelClient",
    "ModelClientBase",
    "ModelConnectionError",
    "ModelContext",
    "ModelError",
    "ModelHTTPError",
    "ModelResponseError",
    "ModelTimeoutError",
    "Sampling",
    "Tokens",
    "ToolCall",
    "VersionSpan",
    "api_key_from_env",
    "body_text",
    "describe",
    "excerpt",
    "observe_completions",
    "override_sampling",
    "parse_tool_calls",
    "plural",
    "text_of",
    "word_count",
]

Message = dict[str, Any]

# ---------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------


def _is_bool(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigTypeError(
            f"{{{attribute.name}}} must be a bool, got {value!r}", parameter=attribute.name
        )


@attrs.frozen
class Sampling:
    """Sampling settings for a chat request; ``None`` means "use the server's default". A
    `return_tokens` or `stream` that is not a bool raises a `ConfigTypeError` naming it."""

    temperature: float | None = None
    max_tokens: int | None = None
    top_p: float | None = None
    seed: int | None = None
    extra: dict[str, Any] = attrs.field(factory=dict)
    # Ask for token ids and logprobs (vLLM's `return_token_ids` and `logprobs`), for a
    # trainer: each reply's `Completion.tokens`, and the rows' `tokens`.
    return_tokens: bool = attrs.field(default=False, validator=_is_bool)
    # Ask for the reply as server-sent events (`stream: true`), read as it arrives: the
    # reply's time to first token (`Completion.ttft`), tokens arriving count as progress.
    stream: bool = attrs.field(default=False, validator=_is_bool)

    def named_settings(self) -> dict[str, Any]:
        """The named settings that are set (``temperature``, ``max_tokens``, ``top_p``,
        ``seed``; not ``None``), without ``extra``."""
        fields: dict[str, Any] = {
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "top_p": self.top_p,
            "seed": self.seed,
        }
        return {name: value for name, value in fields.items() if value is not None}

    def to_request(self) -> dict[str, Any]:
        """Return the OpenAI request fields that are set: ``None`` fields are omitted,
        ``return_tokens`` adds ``return_token_ids: true`` and ``logprobs: true``, ``stream``
        adds ``stream: true`` and ``stream_options: {"include_usage": true}`` (the usage
        in the last event), and ``extra`` is merged last (so it may override the named
        fields)."""
        request = self.named_settings()
        if self.return_tokens:
            request["return_token_ids"] = True
            request["logprobs"] = True
        if self.stream:
            request["stream"] = True
            request["stream_options"] = {"include_usage": True}
        request.update(self.extra)
        return request


def _int_list(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise ConfigTypeError(
            f"Tokens.{{{attribute.name}}} must be a list of ints, got {value!r:.80}",
            parameter=attribute.name,
        )


def _float_list(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, list) or not all(
        isinstance(v, float | int) and not isinstance(v, bool) for v in value
    ):
        raise ConfigTypeError(
            f"Tokens.{{{attribute.name}}} must be a list of floats, got {value!r:.80}",
            parameter=attribute.name,
        )


@attrs.frozen
class Tokens:
    """The token ids and logprobs of one model call, for a trainer: the prompt's ids as the
    server tokenized it, the reply's ids, and each reply token's logprob. A part the server
    did not send is ``[]``; when both are sent, ``completion_logprobs`` has one entry per
    ``completion_ids`` entry. Else a `ConfigError` (a ValueError) naming both; a part that is
    not a list of numbers raises a `ConfigTypeError` naming it."""

    prompt_ids: list[int] = attrs.field(factory=list, validator=_int_list)
    completion_ids: list[int] = attrs.field(factory=list, validator=_int_list)
    completion_logprobs: list[float] = attrs.field(factory=list, validator=_float_list)

    def __attrs_post_init__(self) -> None:
        ids, logprobs = self.completion_ids, self.completion_logprobs
        if ids and logprobs and len(ids) != len(logprobs):
            raise ConfigError(
                f"Tokens: {len(ids)} {{completion_ids}} but {len(logprobs)} "
                f"{{completion_logprobs}} (one logprob per completion token)",
                parameter=("completion_ids", "completion_logprobs"),
            )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, under the field names (a row's ``tokens`` entry)."""
        return {
            "prompt_ids": self.prompt_ids,
            "completion_ids": self.completion_ids,
            "completion_logprobs": self.completion_logprobs,
        }

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> Tokens:
        """The inverse of `to_dict` (a missing part is ``[]``)."""
        return cls(
            list(value.get("prompt_ids") or []),
            list(value.get("completion_ids") or []),
            [float(v) for v in value.get("completion_logprobs") or []],
        )


@attrs.frozen
class ToolCall:
    """One tool call of a model reply, as OpenAI-compatible servers send it
    (``{"id", "type": "function", "function": {"name", "arguments"}}``).

    `raw_arguments` is the arguments' text exactly as the model wrote it; `arguments` is that
    text decoded when it is a JSON object, else ``{}`` (a tool env then answers the model
    that its arguments are not valid JSON: `arguments_error`)."""

    id: str
    name: str
    arguments: dict[str, Any] = attrs.field(factory=dict)
    raw_arguments: str = "{}"

    @property
    def arguments_error(self) -> str | None:
        """Why `raw_arguments` is not a JSON object, or None when it is one (or when
        `arguments` holds the call's arguments already)."""
        if self.arguments:
            return None
        return _arguments_error(self.raw_arguments)

    def to_message(self) -> dict[str, Any]:
        """The call as an assistant message's ``tool_calls`` entry."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.raw_arguments},
        }


def _arguments_error(raw: str) -> str | None:
    return _decode_arguments(raw)[1]


MAX_ARGUMENT_DEPTH = 100
"""How deeply a tool call's arguments may nest (arrays and objects): deeper ones are an
error text for the model, never a `RecursionError` that fails the episode."""
_TOO_DEEP = f"the arguments nest more than {MAX_ARGUMENT_DEPTH} levels deep"


def _nested_over(value: object, limit: int) -> bool:
    """Whether `value` (decoded JSON) nests arrays and objects more than `limit` deep; it
    recurses nowhere."""
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth >= limit:
                return True
            inner = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in inner)
    return False


def _decode_arguments(raw: str) -> tuple[dict[str, Any], str | None]:
    """(the arguments, None), or ({}, why the text is not a JSON object)."""
    if not raw.strip():
        return {}, None  # some servers send "" for a call without arguments
    try:
        value = json.loads(raw)
    except ValueError as exc:
        return {}, f"the arguments are not valid JSON ({exc})"
    except RecursionError:  # (the decoder's own bound, far deeper than ours)
        return {}, _TOO_DEEP
    # (with fewer brackets than the bound, nothing can nest that deep: no walk)
    if raw.count("[") + raw.count("{") > MAX_ARGUMENT_DEPTH and _nested_over(
        value, MAX_ARGUMENT_DEPTH
    ):
        return {}, _TOO_DEEP
    if not isinstance(value, dict):
        return {}, f"the arguments must be a JSON object, got {type(value).__name__}"
    return value, None


def parse_tool_calls(message: dict[str, Any]) -> list[ToolCall]:
    """The `ToolCall`s of an assistant message's ``tool_calls`` ([] when it has none). An
    entry that is not an object is skipped (it stays in the message); a missing id or name is
    ``""``; arguments given as an object (some servers do) are kept and encoded as text, and the
    message then holds that text in their place (OpenAI's form, which any request can send)."""
    raw_calls = message.get("tool_calls")
    if not isinstance(raw_calls, list):
        return []
    calls: list[ToolCall] = []
    for entry in raw_calls:
        if not isinstance(entry, dict):
            continue
        function = entry.get("function")
        function = function if isinstance(function, dict) else {}
        name, ident, raw = function.get("name"), entry.get("id"), function.get("arguments")
        if isinstance(raw, dict):
            arguments: dict[str, Any] = raw
            if _nested_over(raw, MAX_ARGUMENT_DEPTH):
                arguments = {}  # (arguments_error says why, from the text)
            try:
                raw = json.dumps(raw)
            except RecursionError:  # too deep to encode: a text that says as much
                raw = "[" * (MAX_ARGUMENT_DEPTH + 1) + "]" * (MAX_ARGUMENT_DEPTH + 1)
            # the message goes back to the model in the next request: as text, OpenAI's form
            # (an object deeper than the request's encoder takes would fail that request)
            function["arguments"] = raw
        else:
            raw = raw if isinstance(raw, str) else ("" if raw is None else json.dumps(raw))
            arguments = _decode_arguments(raw)[0]
        calls.append(
            ToolCall(
                id=ident if isinstance(ident, str) else "",
                name=name if isinstance(name, str) else "",
                arguments=arguments,
                raw_arguments=raw,
            )
        )
    return calls


def _span_version(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str):
        raise ConfigTypeError(
            f"VersionSpan.{{version}} must be a str, got {value!r}", parameter="version"
        )


def _span_bound(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigTypeError(
            f"VersionSpan.{{{attribute.name}}} must be an int, got {value!r}",
            parameter=attribute.name,
        )
    if value < 0:
        raise ConfigError(
            f"VersionSpan.{{{attribute.name}}} must be >= 0, got {value}",
            parameter=attribute.name,
        )


@attrs.frozen
class VersionSpan:
    """Which policy version made which output tokens of one model call: the tokens
    ``[start, end)`` (0-based positions in the reply's output tokens) were made by
    `version` (`tt.Policy` versions are strings: ``Policy(0).version == "0"``). A
    `Completion`'s spans are in order and do not overlap.

    A `version` that is not a str, or a `start`/`end` that is not an int, raises
    `ConfigTypeError` naming it; a negative one, or an `end` before `start`, a `ConfigError`
    naming it."""

    version: str = attrs.field(validator=_span_version)
    start: int = attrs.field(validator=_span_bound)
    end: int = attrs.field(validator=_span_bound)

    def __attrs_post_init__(self) -> None:
        if self.end < self.start:
            raise ConfigError(
                f"VersionSpan: {{end}} ({self.end}) is before start ({self.start}); a span "
                f"is the tokens [start, end)",
                parameter="end",
            )

    def __len__(self) -> int:
        return self.end - self.start

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"version", "start", "end"}`` (a row's spans)."""
        return {"version": self.version, "start": self.start, "end": self.end}

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> VersionSpan:
        """The inverse of `to_dict`."""
        return cls(value["version"], value["start"], value["end"])


def _default_message(completion: Completion) -> dict[str, Any]:
    return {"role": "assistant", "content": completion.content}


def _message_tool_calls(completion: Completion) -> list[ToolCall]:
    message = completion.message
    if "tool_calls" not in message:  # most replies: no parsing (every model call)
        return []
    return parse_tool_calls(message)


@attrs.frozen
class Completion:
    """One model reply, whole.

    `content` is its text, `usage` its token counts (e.g. ``prompt_tokens``,
    ``completion_tokens``), `finish_reason` the server's if it gave one. `message` is the
    assistant message as the server sent it (role, content, ``tool_calls``, reasoning
    fields and any other field kept): append it to the messages as is to continue the
    conversation. It defaults to ``{"role": "assistant", "content": content}``.
    `tool_calls` are the `ToolCall`s parsed from ``message["tool_calls"]`` ([] when none);
    given explicitly, they are what a tool env runs. `tokens` holds the reply's token ids and
    logprobs when the server returned them (``Sampling(return_tokens=True)`` asks for them),
    else None.

    `ttft` is the seconds from the request to the reply's first token, for a streamed reply
    (``Sampling(stream=True)``), else None; `tpot` the seconds per output token after the
    first (from the first token to the last, over the output tokens but one), for a streamed
    reply of two tokens or more, else None. `versions` says which policy version made which
    output tokens (`VersionSpan`s, in order), when the call ran under a `tt.Policy` or the
    engine reported them; [] when nothing said."""

    content: str
    usage: dict[str, int] = attrs.field(factory=dict)
    finish_reason: str | None = None
    message: dict[str, Any] = attrs.field(default=attrs.Factory(_default_message, takes_self=True))
    tool_calls: list[ToolCall] = attrs.field(
        default=attrs.Factory(_message_tool_calls, takes_self=True)
    )
    tokens: Tokens | None = None
    ttft: float | None = None
    versions: list[VersionSpan] = attrs.field(factory=list)
    tpot: float | None = None


@runtime_checkable
class ModelClient(Protocol):
    """What a model client provides. ``chat`` must be a real async call (it checkpoints),
    must let ``trio.Cancelled`` propagate, and should raise :class:`ModelError` subclasses
    for model failures. ``aclose`` releases the client's resources. A client that serves
    tool-calling envs also takes ``tools: list[dict] | None = None`` (keyword), passed only
    when a caller gives tools (`ModelContext.chat`)."""

    async def chat(
        self, messages: list[dict[str, Any]], *, model: str, sampling: Sampling
    ) -> Completion: ...

    async def aclose(self) -> None: ...


def _urls(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


def _names(value: Iterable[str]) -> frozenset[str]:
    return frozenset(value)


@attrs.frozen(eq=False)
class ClientDescription:
    """What a model client tells the rest of the package about itself (`describe`), so that
    nothing outside a client's own module asks which class it is. Every field has the
    default of a client that says nothing: no endpoint, no limits, cannot travel.

    - `endpoints`: the URLs of the endpoints it calls, the first one first (what a run's
      record names, and what a spawned env server is allowed to reach).
    - `limits`: the `EndpointLimits` its calls pass (the report's waits and connection
      windows).
    - `api_key`: the credential it sends, for a spawned env server (handed over by
      environment variable, never on the wire) or a harness that calls the endpoint itself;
      never shown in ``repr``.
    - `headers`: the names of the extra headers it sends (not their values: they may be
      credentials); a client with any cannot travel.
    - `travel`: how it travels to an env server: the wire's ``ctx.client`` object, its
      ``type`` (``"echo"``, ``"openai"``) and fields, JSON values and never a secret (the
      server rebuilds the client from it); None: it cannot travel.
    - `endpoint_stats`: the figures per endpoint of a client over many (`EndpointPool.stats`),
      or None.
    - `engine_metrics`: what reads its engines' ``/metrics`` until cancelled, given the
      rollout window (``feed(window)``), or None without any.
    """

    endpoints: tuple[str, ...] = attrs.field(default=(), converter=_urls)
    limits: EndpointLimits | None = None
    api_key: str | None = attrs.field(default=None, repr=False)
    headers: frozenset[str] = attrs.field(default=frozenset(), converter=_names)
    travel: dict[str, Any] | None = None
    endpoint_stats: Callable[[], dict[str, dict[str, Any]] | None] | None = None
    engine_metrics: Callable[[Window | None], Awaitable[None]] | None = None


class ModelClientBase(trio.abc.AsyncResource):
    """What every model client of the package shares (`EchoClient`, `OpenAIClient`,
    `testing.ScriptedClient`): ``async with client:`` gives the client itself and awaits its
    `aclose` on the way out, however the block ends (an error, a cancellation). A subclass
    that holds something overrides `aclose`, idempotent; one with endpoints, limits or a
    way to travel says so in `describe`."""

    def describe(self) -> ClientDescription:
        """What the rest of the package needs to know of this client; the default says
        nothing (no endpoint, no limits, cannot travel)."""
        return ClientDescription()

    async def aclose(self) -> None:
        """Nothing to release."""


def describe(client: ModelClient) -> ClientDescription:
    """`client`'s own description (`ModelClientBase.describe`); a client that is not a
    `ModelClientBase` says nothing (`ClientDescription()`)."""
    if isinstance(client, ModelClientBase):
        return client.describe()
    return ClientDescription()


class Governs(Protocol):
    """What governs a `ModelContext`'s calls (`tt.Policy`): `govern` runs one call, `send`
    (the request as made without a policy), and may park it, cut it and continue it."""

    async def govern(
        self, ctx: ModelContext, send: Callable[[], Awaitable[Completion]], sampling: Sampling
    ) -> Completion: ...


def _is_policy(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not callable(getattr(value, "govern", None)):
        raise ConfigTypeError(
            f"ModelContext({{policy}}=...) must be a tt.Policy or None, got {value!r}",
            parameter="policy",
        )


@attrs.frozen
class ModelContext:
    """The model an episode talks to: a client, the model name and sampling settings, and
    the `tt.Policy` its calls run under, if any (they then park during its updates, carry
    its versions and are cut and continued by an ``abort`` update). A `policy` that is not
    a policy raises a `ConfigTypeError` naming it."""

    client: ModelClient
    model: str
    sampling: Sampling = attrs.field(factory=Sampling)
    policy: Governs | None = attrs.field(default=None, kw_only=True, validator=_is_policy)

    async def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        **sampling_overrides: Any,
    ) -> Completion:
        """Send ``messages`` to ``client`` with this context's model and sampling, and return
        the whole reply (and show it to the observer of :class:`observe_completions`, if
        any).

        ``tools`` (OpenAI function schemas, e.g. ``[tool.schema for tool in tools]``) go to
        the client as ``tools=``; a client whose ``chat`` takes no ``tools`` gets a clear
        `ConfigTypeError` (a TypeError) naming ``tools``. ``sampling_overrides`` replace this
        context's sampling for this call: `Sampling`'s own fields by name (``temperature=0``),
        any other name into its ``extra`` request fields (``tool_choice="required"``; an
        override named ``extra`` raises a `ConfigTypeError` naming it)."""
        sampling = self.sampling
        if sampling_overrides:
            sampling = override_sampling(sampling, sampling_overrides)
        if self.policy is not None:
            completion = await self.policy.govern(
                self, self._sender(messages, tools, sampling), sampling
            )
        elif tools is None:
            completion = await self.client.chat(messages, model=self.model, sampling=sampling)
        else:
            completion = await self._chat_with_tools(messages, tools, sampling)
        observer = _observer.get()
        if observer is not None:
            observer(completion)
        report_progress("model")  # for a stall timeout, and the run's count of calls
        if completion.ttft is not None:
            report_stream(completion.ttft, completion.tpot)
        return completion

    def _sender(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        sampling: Sampling,
    ) -> Callable[[], Awaitable[Completion]]:
        """One call as a policy sends it, a partial of the client's own method (no frame of
        its own: each checkpoint of a call resumes every frame above it): the client's
        `chat_with_versions` when it has one and the call asks for token ids
        (`OpenAIClient`'s: the engine's own version spans, where vLLM offers them), else as
        without a policy."""
        if sampling.return_tokens:
            versioned = getattr(self.client, "chat_with_versions", None)
            if versioned is not None:
                return functools.partial(
                    versioned, messages, model=self.model, sampling=sampling, tools=tools
                )
        if tools is None:
            return functools.partial(
                self.client.chat, messages, model=self.model, sampling=sampling
            )
        return functools.partial(self._chat_with_tools, messages, tools, sampling)

    async def _chat_with_tools(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], sampling: Sampling
    ) -> Completion:
        chat: Any = self.client.chat
        try:
            return cast(
                Completion, await chat(messages, model=self.model, sampling=sampling, tools=tools)
            )
        except TypeError as exc:
            if _takes_tools(chat):
                raise
            raise ConfigTypeError(
                f"ModelContext.chat({{tools}}=...): the model client "
                f"{type(self.client).__name__} takes no `tools`; give its chat a "
                f"`tools: list[dict] | None = None` parameter (OpenAIClient sends them as the "
                f"request's `tools`)",
                parameter="tools",
            ) from exc


def _takes_tools(chat: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(chat).parameters.values()
    except (TypeError, ValueError):
        return True  # cannot tell: let its own error through
    return any(p.name == "tools" or p.kind is p.VAR_KEYWORD for p in parameters)


_SAMPLING_FIELDS = frozenset({"temperature", "max_tokens", "top_p", "seed"})


def override_sampling(sampling: Sampling, overrides: dict[str, Any]) -> Sampling:
    """`sampling` with `overrides`: its own fields by name, anything else into `extra`. An
    override named ``extra`` raises a `ConfigTypeError` naming it."""
    named = {k: v for k, v in overrides.items() if k in _SAMPLING_FIELDS}
    extra = {k: v for k, v in overrides.items() if k not in _SAMPLING_FIELDS}
    if "extra" in extra:
        raise ConfigTypeError(
            "chat(): pass extra request fields by name, not as {extra}=", parameter="extra"
        )
    if extra:
        named["extra"] = {**sampling.extra, **extra}
    return attrs.evolve(sampling, **named)


_observer: contextvars.ContextVar[Callable[[Completion], None] | None] = contextvars.ContextVar(
    "trio_tasksets_completion_observer", default=None
)


class observe_completions:  # lower case: it reads as a call in `with observe_completions(...)`
    """``with observe_completions(record):`` every :meth:`ModelContext.chat` made inside the
    block, by this task or by tasks it starts, passes its :class:`Completion` to ``record``
    (how an episode sums its token usage over all its model calls)."""

    __slots__ = ("_record", "_token")

    def __init__(self, record: Callable[[Completion], None]) -> None:
        self._record = record

    def __enter__(self) -> None:
        self._token = _observer.set(self._record)

    def __exit__(self, *exc_info: object) -> None:
        _observer.reset(self._token)


# ---------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------


class ModelError(TrioTasksetsError):
    """Base class for errors talking to a model server."""

    def __init__(self, message: str, *, url: str = "") -> None:
        super().__init__(message)
        self.url = url


class ModelConnectionError(ModelError):
    """The server could not be reached (refused, reset, DNS, ...). Retried by the client."""


class ModelTimeoutError(ModelError):
    """The request did not complete within the client's timeout. Retried by the client."""

    def __init__(self, message: str, *, url: str = "", timeout: float = 0.0) -> None:
        super().__init__(message, url=url)
        self.timeout = timeout


class ModelHTTPError(ModelError):
    """The server answered with an error status. 429 and 5xx are retried first; other 4xx
    are raised at once. ``status`` is the HTTP status, ``attempts`` the requests made."""

    def __init__(
        self, message: str, *, url: str = "", status: int = 0, body: str = "", attempts: int = 1
    ) -> None:
        super().__init__(message, url=url)
        self.status = status
        self.body = body
        self.attempts = attempts


class ModelResponseError(ModelError):
    """The server answered 2xx but the body is not a usable chat completion. Not retried."""


# ---------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------


def text_of(content: Any) -> str:
    """The text of a message ``content``: a string as is, a list of OpenAI content parts
    as its text parts joined by a space, anything else (``None``) as ``""``."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        ]
        return " ".join(texts)
    return ""


def body_text(content: bytes) -> str:
    return content.decode("utf-8", errors="replace")


def word_count(text: str) -> int:
    return len(text.split())


def excerpt(text: str, limit: int = 200) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def api_key_from_env(var: str) -> str:
    """Return the API key stored in environment variable ``var`` (surrounding whitespace
    stripped). Raises `ConfigError` (a ``ValueError``) naming ``var`` when it is unset or
    empty."""
    value = os.environ.get(var, "").strip()
    if not value:
        raise ConfigError(
            f"environment variable {var} is not set or empty; set it with "
            f"`export {var}=...`, or read the key from another variable",
            parameter="var",
        )
    return value
