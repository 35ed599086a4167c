"""What the server's two front doors share: the ASGI message types, the counters `GET /health`
reports, and how an answer becomes JSON."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import orjson

__all__ = ["Message", "Receive", "Send", "ServerStats", "encode_answer"]


Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


@attrs.define
class ServerStats:
    """A worker's counters, as ``GET /health`` reports them."""

    running: int = 0  # episodes in progress
    served: int = 0  # episodes answered
    cancelled: int = 0  # episodes cancelled (the client went away, or shutdown)
    failed: int = 0  # requests the env failed outside an episode (500)
    rejected: int = 0  # bad or refused requests (4xx)


def encode_answer(payload: object) -> bytes:
    """`payload` as JSON (orjson; what it refuses, such as non-string keys or integers over
    64 bits, through `json` with ``str()`` keys); `ValueError` if it cannot be JSON at all
    (a lone surrogate, nesting the encoders cannot follow)."""
    try:
        return orjson.dumps(payload, default=str)
    except TypeError:
        pass
    try:
        text = json.dumps(payload, ensure_ascii=False, allow_nan=False, default=str)
        return text.encode()
    except (TypeError, ValueError, RecursionError) as exc:  # UnicodeEncodeError: a ValueError
        raise ValueError(f"{type(exc).__name__}: {exc}") from None
