"""What a request and a response are, whole: `Request` (what `HTTPClient` sends, as a handler
answering in memory sees it) and `Response` (what `HTTPClient.request` returns)."""

from __future__ import annotations

import json
from typing import Any

import attrs

from .support import parse_retry_after

__all__ = ["Request", "Response"]


@attrs.frozen
class Request:
    """A request as the client would send it: ``headers`` are (lower-case name, value)
    pairs, the client's defaults (``user-agent``, ...) with the request's own over them."""

    method: str
    url: str
    headers: list[tuple[str, str]] = attrs.field(factory=list)
    body: bytes = b""

    def header(self, name: str) -> str | None:
        """The value of header ``name`` (any case), or None."""
        wanted = name.lower()
        for key, value in self.headers:
            if key == wanted:
                return value
        return None

    def json(self) -> Any:
        """The body parsed as JSON; ``ValueError`` if it is not."""
        return json.loads(self.body)


@attrs.frozen
class Response:
    """A whole response. ``headers``: lower-case names and values as bytes, in order;
    ``body``: decoded (no gzip/deflate left). A handler may leave ``url`` empty: the
    client fills in the request's."""

    status: int
    headers: list[tuple[bytes, bytes]] = attrs.field(factory=list)
    body: bytes = b""
    url: str = ""

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (any case), or None."""
        wanted = name.lower().encode("latin-1")
        for key, value in self.headers:
            if key == wanted:
                return value.decode("latin-1")
        return None

    @property
    def retry_after(self) -> float | None:
        """Seconds the server asks to wait (``Retry-After``: seconds or an HTTP date)."""
        return parse_retry_after(self.header("retry-after"))

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body parsed as JSON; ``ValueError`` if it is not."""
        return json.loads(self.body)
