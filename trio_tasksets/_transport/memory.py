"""Answering requests in memory: `HTTPClient(handler=...)`, the test seam of the transport (in
the spirit of httpx's ``MockTransport``).

A handler is a function, plain or async, of a `Request` (what the client would have sent:
method, URL, headers with the client's own defaults, body) that returns a `Response`. No
socket is opened; everything above the transport (a model client's retries, limits,
timeouts and parsing) runs as it does against a server. Made for tests and for examples
that must run without a network, and for tests on trio's MockClock, where a real server
cannot run.

What still applies: the request's `Timeouts` (its ``total`` and ``read``: a handler that
answers later than the first of them ends in `HTTPTimeout`, as a server that late would),
the client's ``max_response_bytes`` and a ``Content-Encoding`` of the response (decoded as
from a server). An exception a handler raises propagates as raised (raise an `HTTPError`
subclass to act out a network failure).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Awaitable, Callable

import attrs
import trio

from .._core.exceptions import ConfigTypeError
from .messages import Request, Response
from .support import (
    CUT_SLOT,
    HTTPTimeout,
    RequestCut,
    ResponseTooLarge,
    Timeouts,
    decode_body,
)

__all__ = ["Handler", "answer"]


Handler = Callable[[Request], Response | Awaitable[Response]]
"""What answers a client's requests in memory: ``handler(request) -> Response``, or an async
function of it (which may sleep, on trio's clock)."""


async def answer(
    handler: Handler, request: Request, timeouts: Timeouts, *, max_bytes: int
) -> Response:
    """`handler`'s response to `request`, under the request's ``total`` and ``read``
    timeouts (`HTTPTimeout` when the first of them passes) and the client's size limit
    (`ResponseTooLarge`); a ``Content-Encoding`` is decoded."""
    await trio.lowlevel.checkpoint()  # a real call, as a request over a socket is
    phase, limit = _first_limit(timeouts)
    slot = CUT_SLOT.get()  # (a caller that may cut it: this scope is the one it cancels)
    with trio.move_on_after(limit) as scope:
        if slot is not None:
            slot.scope = scope
        try:
            found = handler(request)
            response = await found if inspect.isawaitable(found) else found
        finally:
            if slot is not None:
                slot.scope = None
    if scope.cancelled_caught:
        if slot is not None and slot.cut:
            raise RequestCut(request.url)
        raise HTTPTimeout(
            f"{phase} timeout ({limit:g}s)", url=request.url, phase=phase, timeout=limit
        )
    if not isinstance(response, Response):
        raise ConfigTypeError(
            f"an HTTPClient {{handler}} must return a Response, got {type(response).__name__}",
            parameter="handler",
        )
    body = response.body
    encoding = response.header("content-encoding")
    if encoding is not None:
        body = decode_body(body, encoding, limit=max_bytes, url=request.url)
    if len(body) > max_bytes:
        raise ResponseTooLarge(
            f"the response body is over the limit of {max_bytes:,} bytes (max_response_bytes)",
            url=request.url,
            limit=max_bytes,
        )
    return attrs.evolve(response, body=body, url=response.url or request.url)


def _first_limit(timeouts: Timeouts) -> tuple[str, float]:
    """The phase and seconds of the first limit a handler's answer runs into."""
    found = [(limit, phase) for phase, limit in (("read", timeouts.read),
             ("total", timeouts.total)) if limit is not None]  # fmt: skip
    if not found:
        return "read", math.inf
    limit, phase = min(found)
    return phase, limit
