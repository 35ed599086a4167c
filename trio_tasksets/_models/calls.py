"""`EndpointCalls`: the loop every HTTP model client runs its calls in, whatever the provider.

A client knows its provider's request body, headers and reply; everything else of a call is
the same for every provider and lives here, once:

- each attempt passes the endpoint's limits (`EndpointLimits`: a connection slot, rpm, tpm
  with the request's ``max_tokens`` reserved and settled from the reply's usage), after the
  request-rate pacing of an adaptive window (`trio_tasksets._core.limits.pace`);
- each attempt's outcome goes to the endpoint's limits (its adaptive window, tpm) and to
  `trio_tasksets._core.limits.report_outcome` (an adaptive rollout window), with its latency;
  a 429 whose headers name a spent rate budget counts as a request-rate outcome;
- 429, 5xx, a failure to connect and a timeout are retried up to ``max_retries`` times
  (not a 429 that says the request is over the limit's whole budget: no wait helps), after a
  rest (`trio_tasksets._core.limits.rest`, outside the limits' gate) of the server's
  Retry-After (capped) or else the shared `Backoff`;
- each attempt's timeout is cut to the caller's deadline, which ends the call with the
  caller's own ``trio.Cancelled``, never a retry (a streamed attempt's is not cut: its
  tokens may move that deadline, a stall timeout's, and the caller's scope ends it);
- a streamed reply (``post(stream=...)``) is read as it arrives and retried only until the
  first byte of its body;
- the errors are the model errors (`ModelHTTPError`, `ModelConnectionError`,
  `ModelTimeoutError`, `ModelResponseError`), each naming the URL.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Mapping
from contextlib import AbstractAsyncContextManager, nullcontext
from typing import Any, Protocol

import orjson
import trio

from .._core.adaptive import Outcome
from .._core.backoff import FIRST, MODEL_RETRIES, MOST, Backoff
from .._core.exceptions import ConfigError
from .._core.limits import Call, EndpointLimits, pace, report_outcome, rest, says_request_rate
from .._transport import (
    DecodingError,
    HTTPClient,
    HTTPError,
    HTTPTimeout,
    ResponseTooLarge,
    Timeouts,
)
from .base import (
    Completion,
    ModelConnectionError,
    ModelHTTPError,
    ModelResponseError,
    ModelTimeoutError,
    excerpt,
    plural,
)

__all__ = ["TIMEOUT", "EndpointCalls", "StreamedReply", "check_settings", "error_message"]

Sink = Callable[[bytes], None]


class StreamedReply(Protocol):
    """What reads one attempt's streamed reply (`EndpointCalls.post`'s ``stream``):
    `feed` takes the body's pieces as they arrive, `received` counts their bytes, `finish`
    is the whole reply once the body has ended (`ModelResponseError` if it is not one)."""

    received: int

    def feed(self, piece: bytes) -> None: ...

    def finish(self) -> Completion: ...


TIMEOUT = 120.0
"""Seconds: a model request's default timeout, the request as a whole (each attempt's own)."""

_RETRYABLE_STATUS = frozenset({429})


def _is_retryable_status(status: int) -> bool:
    return status in _RETRYABLE_STATUS or 500 <= status <= 599


_OVER_BUDGET = re.compile(r"Limit (\d+), Requested (\d+)")


def over_whole_budget(text: str) -> bool:
    """Whether a 429's message says the request is larger than the limit's whole budget
    (OpenAI's "Request too large for gpt-4o ... on tokens per min (TPM): Limit 30000,
    Requested 50000"): no wait lets it through, so it is not retried, and it is the
    request's fault, not the endpoint's load (a window would read it as a concurrency
    limit's 429)."""
    found = _OVER_BUDGET.search(text, 0, 4096)
    return found is not None and int(found[2]) > int(found[1])


def _tokens(usage: dict[str, int]) -> int | None:
    """The tokens a reply's usage counts (prompt + completion, else the total), or None."""
    if "prompt_tokens" in usage or "completion_tokens" in usage:
        return usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)
    return usage.get("total_tokens")


def _record(
    call: Call | None,
    outcome: Outcome | int,
    retry_after: float | None = None,
    *,
    tokens: int | None = None,
    latency: float | None = None,
) -> None:
    """One attempt's outcome: to its endpoint's limits (the adaptive window, tpm) and to
    the observers of `trio_tasksets._core.limits.observe_calls`."""
    if call is not None:
        call.record(outcome, retry_after=retry_after, tokens=tokens, latency=latency)
    report_outcome(outcome, retry_after=retry_after, latency=latency)


def check_settings(timeout: float, max_retries: int, backoff: float, max_backoff: float) -> None:
    """`ConfigError` naming ``timeout`` (seconds, > 0), ``max_retries`` (>= 0), ``backoff``
    or ``max_backoff`` (seconds, >= 0) when it is out of range."""
    if not timeout > 0:
        raise ConfigError(f"{{timeout}} must be > 0, got {timeout!r}", parameter="timeout")
    if max_retries < 0:
        raise ConfigError(
            f"{{max_retries}} must be >= 0, got {max_retries!r}", parameter="max_retries"
        )
    for name, value in (("backoff", backoff), ("max_backoff", max_backoff)):
        if not value >= 0:
            raise ConfigError(f"{{{name}}} must be >= 0, got {value!r}", parameter=name)


class EndpointCalls:
    """The calls of one model client to one endpoint URL: `post` runs one call, with the
    retries, limits and outcomes the module describes. The client gives the body, its headers
    and how to read a 2xx reply (`parse`, which raises `ModelResponseError` for a body that
    is not a usable reply).

    ``http``: the transport (left open: its owner closes it). ``timeout``: seconds per
    attempt, as a whole. ``max_retries``: retries after the first attempt. ``backoff`` and
    ``max_backoff``: the waits between attempts, the shared `Backoff` (full jitter, the cap
    doubling from ``backoff`` up to ``max_backoff``, which caps a Retry-After too).
    ``limits``: gates each attempt under ``limits_key`` (default: ``url``). `throttled`
    counts the attempts answered 429; the owner sets `closed` when it closes. A bad
    ``timeout``, ``max_retries``, ``backoff`` or ``max_backoff`` raises `ConfigError`
    naming it."""

    def __init__(
        self,
        http: HTTPClient,
        url: str,
        *,
        timeout: float = TIMEOUT,
        max_retries: int = MODEL_RETRIES,
        backoff: float = FIRST,
        max_backoff: float = MOST,
        limits: EndpointLimits | None = None,
        limits_key: Hashable | None = None,
    ) -> None:
        check_settings(timeout, max_retries, backoff, max_backoff)
        self.http = http
        self.url = url
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = Backoff(backoff, max_backoff)
        self.limits = limits
        self.limits_key: Hashable = url if limits_key is None else limits_key
        self.throttled = 0
        self.closed = False  # set by the owner when it closes: no attempt starts after it
        self._timeouts = Timeouts(connect=timeout, read=timeout, write=timeout, total=timeout)

    def __repr__(self) -> str:
        return f"EndpointCalls({self.url!r}, max_retries={self.max_retries})"

    def retry_delay(self, retry: int, retry_after: float | None) -> float:
        """Seconds to rest before retry number ``retry`` (0-based): the server's Retry-After
        up to the backoff's ``max``, else a `Backoff` draw."""
        return self.backoff.delay(retry + 1, retry_after=retry_after)

    async def post(
        self,
        body: bytes,
        *,
        headers: Mapping[str, str],
        parse: Callable[[bytes], Completion],
        reserve_tokens: int | None = None,
        stream: Callable[[], StreamedReply] | None = None,
    ) -> Completion:
        """POST ``body`` to the URL until a 2xx reply, which `parse` reads; ``reserve_tokens``
        (the request's ``max_tokens``, if set) is held against a tpm limit until the reply's
        usage settles it.

        ``stream``: the reply is streamed. Each attempt makes its reader (``stream()``, as
        its request goes out), the transport hands it the 2xx body as it arrives
        (`StreamedReply.feed`) and its `StreamedReply.finish` is the reply (`parse` is not
        used). An attempt is retried as above until its first byte of body; once bytes have
        come, a broken connection or a timeout ends the call (`ModelConnectionError`,
        `ModelTimeoutError` saying mid-stream), never a retry that would stream the reply
        twice.

        Raises `ModelHTTPError` (a status that is not retried, or retries exhausted),
        `ModelConnectionError`, `ModelTimeoutError` (retries exhausted),
        `ModelResponseError` (from `parse`, or a reply over the transport's size limit or
        undecodable: not retried), ``RuntimeError`` once the owner has closed; lets
        ``trio.Cancelled`` through."""
        attempts = 0
        while True:
            attempts += 1
            retry_after: float | None = None
            outcome: Outcome | None = None  # of this attempt, for the rest before a retry
            try:
                status, content, retry_after, completion = await self._attempt(
                    body, headers, parse, reserve_tokens, stream
                )
            except (ResponseTooLarge, DecodingError) as exc:
                raise ModelResponseError(f"{self.url}: {exc.reason}", url=self.url) from exc
            except HTTPTimeout as exc:
                outcome = Outcome.TIMEOUT
                if trio.current_time() >= trio.current_effective_deadline():
                    await trio.lowlevel.checkpoint()  # the caller's deadline: its Cancelled
                if attempts > self.max_retries:
                    raise ModelTimeoutError(
                        f"request to {self.url} timed out after {self.timeout:g}s "
                        f"({plural(attempts, 'attempt')})",
                        url=self.url,
                        timeout=self.timeout,
                    ) from exc
            except HTTPError as exc:
                if attempts > self.max_retries:
                    raise ModelConnectionError(
                        f"cannot reach {self.url}: {exc.reason} ({plural(attempts, 'attempt')})",
                        url=self.url,
                    ) from exc
            else:
                if completion is not None:
                    return completion
                text = content.decode("utf-8", errors="replace")
                never = status == 429 and over_whole_budget(text)
                if not _is_retryable_status(status) or attempts > self.max_retries or never:
                    why = " (over the limit's whole budget: not retried)" if never else ""
                    raise ModelHTTPError(
                        f"{self.url} returned HTTP {status} after "
                        f"{plural(attempts, 'attempt')}: "
                        f"{excerpt(error_message(text), 400) or '<empty body>'}{why}",
                        url=self.url,
                        status=status,
                        body=text,
                        attempts=attempts,
                    )
                outcome = Outcome.from_status(status)
            # Outside the limits' gate: a rest holds no connection slot (and, for an adaptive
            # rollout window, a rest after a 429 lends the rollout's place meanwhile).
            kind = "backoff" if retry_after is None else "retry_after"
            await rest(self.retry_delay(attempts - 1, retry_after), outcome=outcome, kind=kind)

    async def _attempt(
        self,
        body: bytes,
        headers: Mapping[str, str],
        parse: Callable[[bytes], Completion],
        reserve: int | None,
        stream: Callable[[], StreamedReply] | None = None,
    ) -> tuple[int, bytes, float | None, Completion | None]:
        """One POST, under the endpoint's limits if there are any: (status, body,
        Retry-After seconds, the completion of a 2xx). Its outcome is recorded."""
        await pace()  # a request-rate limit's pacing (an adaptive window's), before any limit
        gate: AbstractAsyncContextManager[Call | None] = (
            nullcontext()
            if self.limits is None
            else self.limits.call(self.limits_key, reserve_tokens=reserve)
        )
        async with gate as call:
            started = trio.current_time()
            reader = None if stream is None else stream()
            try:
                status, content, retry_after, request_rate = await self._post(
                    body, headers, None if reader is None else reader.feed
                )
            except HTTPTimeout as exc:
                _record(call, Outcome.TIMEOUT)
                if reader is not None and reader.received:
                    if trio.current_time() >= trio.current_effective_deadline():
                        await trio.lowlevel.checkpoint()  # the caller's deadline: its Cancelled
                    raise self._mid_stream(exc, reader.received) from exc
                raise
            except (ResponseTooLarge, DecodingError):
                raise
            except HTTPError as exc:
                if reader is not None and reader.received:
                    raise self._mid_stream(exc, reader.received) from exc
                raise
            except ModelResponseError:  # the reader's: a streamed event it cannot use
                _record(call, 200)
                raise
            latency = trio.current_time() - started
            if status == 429:
                self.throttled += 1
            if not 200 <= status <= 299:
                outcome: Outcome | int = Outcome.REQUEST_RATE if request_rate else status
                if status == 429 and over_whole_budget(content[:4096].decode(errors="replace")):
                    outcome = 413  # the request's own fault (as a 413 would be), not the load
                _record(call, outcome, retry_after, latency=latency)
                return status, content, retry_after, None
            try:
                completion = parse(content) if reader is None else reader.finish()
            except ModelResponseError:
                _record(call, status)
                raise
            _record(call, status, tokens=_tokens(completion.usage), latency=latency)
            return status, content, retry_after, completion

    def _mid_stream(
        self, exc: HTTPError, received: int
    ) -> ModelTimeoutError | ModelConnectionError:
        """The error ending a call whose reply broke off mid-stream (after `received` bytes
        of it): not retried."""
        where = f"mid-stream, after {received:,} bytes of the reply"
        if isinstance(exc, HTTPTimeout):
            return ModelTimeoutError(
                f"request to {self.url} timed out {where} ({exc.reason})",
                url=self.url,
                timeout=self.timeout,
            )
        return ModelConnectionError(f"{self.url} broke off {where}: {exc.reason}", url=self.url)

    async def _post(
        self, body: bytes, headers: Mapping[str, str], on_body: Sink | None = None
    ) -> tuple[int, bytes, float | None, bool]:
        """One POST: (status, body, Retry-After seconds, whether it is a 429 whose headers
        name a spent rate budget: `says_request_rate`). Raises the transport's `HTTPError`
        subclasses."""
        if self.closed:
            raise RuntimeError(f"the model client of {self.url} is closed")
        timeouts, timeout = self._timeouts, self.timeout
        left = trio.current_effective_deadline() - trio.current_time()
        # The caller's deadline comes first: no request outlives it. A streamed one is not
        # cut to it here: its tokens arriving may move that deadline (a stall timeout's),
        # and the caller's own scope ends the request when the deadline passes.
        if left < timeout and on_body is None:
            timeout = max(left, 1e-6)
            timeouts = Timeouts(connect=timeout, read=timeout, write=timeout, total=timeout)
        response = await self.http.request(
            "POST", self.url, headers=headers, body=body, timeouts=timeouts, on_body=on_body
        )
        request_rate = response.status == 429 and says_request_rate(
            (name.decode("latin-1"), value.decode("latin-1")) for name, value in response.headers
        )
        return response.status, response.body, response.retry_after, request_rate


def error_message(text: str) -> str:
    """An error body's own message (vLLM's `message`, OpenAI's and Anthropic's
    `error.message`), so that what the server says is not cut off behind its JSON wrapping;
    else the body itself."""
    try:
        data: Any = orjson.loads(text)
    except orjson.JSONDecodeError:
        return text
    error = data.get("error") if isinstance(data, dict) else None
    for found in (error.get("message") if isinstance(error, dict) else error,
                  data.get("message") if isinstance(data, dict) else None):  # fmt: skip
        if isinstance(found, str) and found.strip():
            return found
    return text
