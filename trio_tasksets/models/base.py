"""What every model client shares: `Sampling`, `Completion`, the `ModelClient` protocol,
`ModelContext`, the model errors, and small text helpers of the clients.

The clients: the offline :class:`EchoClient` (`echo`) and the HTTP :class:`OpenAIClient`
(`openai`).

Every client satisfies the :class:`ModelClient` protocol: an async ``chat`` that takes
OpenAI-style messages and returns a :class:`Completion`, and an async ``aclose``.
:class:`ModelContext` bundles a client with the model name and :class:`Sampling` settings
an episode should use.

Errors raised by :class:`OpenAIClient` are subclasses of :class:`ModelError` with distinct
type names (``ModelConnectionError``, ``ModelTimeoutError``, ``ModelHTTPError``,
``ModelResponseError``) so an env's retry policy can match them by name.
``trio.Cancelled`` is never caught or converted.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs

from .._exceptions import TrioTasksetsError

if TYPE_CHECKING:
    pass  # only for a caller's own http_client; imported where used

__all__ = [
    "Completion",
    "Message",
    "ModelClient",
    "ModelConnectionError",
    "ModelContext",
    "ModelError",
    "ModelHTTPError",
    "ModelResponseError",
    "ModelTimeoutError",
    "Sampling",
    "api_key_from_env",
    "body_text",
    "excerpt",
    "observe_completions",
    "plural",
    "text_of",
    "word_count",
]

Message = dict[str, Any]

# ---------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------


@attrs.frozen
class Sampling:
    """Sampling settings for a chat request; ``None`` means "use the server's default"."""

    temperature: float | None = None
    max_tokens: int | None = None
    top_p: float | None = None
    seed: int | None = None
    extra: dict[str, Any] = attrs.field(factory=dict)

    def to_request(self) -> dict[str, Any]:
        """Return the OpenAI request fields that are set: ``None`` fields are omitted and
        ``extra`` is merged last (so it may override the named fields)."""
        fields: dict[str, Any] = {
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "top_p": self.top_p,
            "seed": self.seed,
        }
        request = {name: value for name, value in fields.items() if value is not None}
        request.update(self.extra)
        return request


@attrs.frozen
class Completion:
    """One model reply: its text, token usage (e.g. ``prompt_tokens``,
    ``completion_tokens``) and the server's ``finish_reason`` if it gave one."""

    content: str
    usage: dict[str, int] = attrs.field(factory=dict)
    finish_reason: str | None = None


@runtime_checkable
class ModelClient(Protocol):
    """What a model client provides. ``chat`` must be a real async call (it checkpoints),
    must let ``trio.Cancelled`` propagate, and should raise :class:`ModelError` subclasses
    for model failures. ``aclose`` releases the client's resources."""

    async def chat(
        self, messages: list[dict[str, Any]], *, model: str, sampling: Sampling
    ) -> Completion: ...

    async def aclose(self) -> None: ...


@attrs.frozen
class ModelContext:
    """The model an episode talks to: a client, the model name and sampling settings."""

    client: ModelClient
    model: str
    sampling: Sampling = attrs.field(factory=Sampling)

    async def chat(self, messages: list[dict[str, Any]]) -> Completion:
        """Send ``messages`` to ``client`` with this context's model and sampling (and show
        the reply to the observer of :class:`observe_completions`, if any)."""
        completion = await self.client.chat(messages, model=self.model, sampling=self.sampling)
        observer = _observer.get()
        if observer is not None:
            observer(completion)
        return completion


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
    stripped). Raises ``ValueError`` naming ``var`` when it is unset or empty."""
    value = os.environ.get(var, "").strip()
    if not value:
        raise ValueError(
            f"environment variable {var} is not set or empty; set it with "
            f"`export {var}=...` or name another variable with --api-key-var"
        )
    return value
