"""`OpenAIClient`: any OpenAI-compatible ``/v1/chat/completions`` endpoint, over the project's
HTTP transport, with retries, `Retry-After` and the endpoint limits around each attempt."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

import orjson
import trio

from .._core.adaptive import AdaptiveWindow, Outcome
from .._core.backoff import Backoff
from .._core.limits import Call, EndpointLimits, pace, report_outcome, rest, says_request_rate
from .._core.window import Window
from .._transport import (
    DecodingError,
    HTTPClient,
    HTTPError,
    HTTPTimeout,
    ResponseTooLarge,
    Timeouts,
    parse_retry_after,
)
from .base import (
    Completion,
    ModelClientBase,
    ModelConnectionError,
    ModelHTTPError,
    ModelResponseError,
    ModelTimeoutError,
    Sampling,
    Tokens,
    body_text,
    excerpt,
    parse_tool_calls,
    plural,
    text_of,
)
from .engine import EngineMetrics
from .pool import EndpointPool, pool_limits

if TYPE_CHECKING:
    import httpx  # only for a caller's own http_client; imported where used

__all__ = ["OpenAIClient"]


_RETRYABLE_STATUS = frozenset({429})


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


def _endpoint_key(url: str, first: str, key: Hashable | None) -> Hashable:
    """The limits key of one endpoint of a list: `url`, or the caller's key with the first
    URL replaced by this one (the CLI's `(base_url, api_key_var)`)."""
    if key is None:
        return url
    if isinstance(key, tuple) and key and key[0] == first:
        return (url, *key[1:])
    return (url, key)


def _is_retryable_status(status: int) -> bool:
    return status in _RETRYABLE_STATUS or 500 <= status <= 599


class OpenAIClient(ModelClientBase):
    """A client for any OpenAI-compatible ``/chat/completions`` endpoint (vLLM, SGLang,
    llama.cpp server, OpenAI, ...). ``base_url`` includes the version prefix, e.g.
    ``http://127.0.0.1:8000/v1``.

    Contract:

    - POSTs ``{"model", "messages", **sampling.to_request()}`` to
      ``{base_url}/chat/completions``, with ``Authorization: Bearer <api_key>`` when a key
      is given, plus ``headers``.
    - A reply's token ids and logprobs, in vLLM's shape (asked for with
      ``Sampling(return_tokens=True)``), become ``Completion.tokens``.
    - 429, 5xx, connection errors and timeouts are retried up to ``max_retries`` times
      (``max_retries + 1`` attempts in all), sleeping with full-jitter exponential backoff
      (``uniform(0, min(max_backoff, backoff * 2**retry))``) or, when the response has a
      ``Retry-After`` header, that many seconds, capped at ``max_backoff``.
    - Other 4xx raise :class:`ModelHTTPError` at once; exhausted retries raise
      :class:`ModelHTTPError`, :class:`ModelConnectionError` or :class:`ModelTimeoutError`;
      a malformed 2xx body, or one over the transport's size limit, raises
      :class:`ModelResponseError`.
    - ``timeout`` (seconds) bounds each request as a whole: from taking a connection to
      the last byte of the response (a server trickling bytes cannot hold it longer), also
      with a caller's ``http_client``; each attempt has its own. An attempt never outlasts
      the caller's ``trio.current_effective_deadline()``: its timeout is cut to the time
      left, and when that deadline passes the call ends with ``trio.Cancelled`` (the
      caller's own scope), not a retry.
    - ``trio.Cancelled`` propagates untouched.
    - ``base_url`` may be a list of endpoints: the client then routes each call through an
      `trio_tasksets._models.pool.EndpointPool` of one client per URL (same options): least
      loaded, sticky per rollout and group, a dead endpoint ejected and probed back, a
      window and figures per endpoint (`endpoint_stats()`). ``base_url`` is then the first
      URL and ``base_urls`` all of them. A list of one is a single endpoint.
    - ``engine_metrics``: the Prometheus ``/metrics`` URL (or an `EngineMetrics`, to share
      one reader) of the engine behind each ``base_url`` (vLLM, SGLang), in the same order
      (one for one endpoint; None for an endpoint without).
      `feed_engine_metrics` reads them; each endpoint's figures then hold its engine's
      running, waiting, KV usage and preemptions.
    - ``limits`` (an `EndpointLimits`, shared by every client of the process that talks to
      the endpoint) gates each attempt, under the key ``limits_key`` (default: ``base_url``;
      the CLI uses ``(base_url, api_key_var)``): a connection slot, then rpm and tpm (with
      ``max_tokens`` reserved when the request sets it, settled from the response's
      ``usage``). Each attempt's status feeds the endpoint's adaptive window; the
      Retry-After sleep before a retry happens outside the gate and never extends its
      cooldown. Each attempt's outcome also goes to `trio_tasksets._core.limits.report_outcome`
      (for an adaptive rollout window), with or without ``limits``.

    The transport is a `trio_tasksets._transport.HTTPClient` (trio, a keep-alive pool
    that holds about one connection per request in flight), created here and closed by
    :meth:`aclose` or ``async with``. Pass ``http_client`` (an ``HTTPClient`` with your own
    CA bundle, proxy or limits, or an ``httpx.AsyncClient``) to use it as is; it is left
    open.
    """

    def __init__(
        self,
        base_url: str | Sequence[str],
        api_key: str | None = None,
        *,
        timeout: float = 120.0,
        max_retries: int = 3,
        backoff: float = 0.5,
        max_backoff: float = 30.0,
        headers: dict[str, str] | None = None,
        http_client: HTTPClient | httpx.AsyncClient | None = None,
        limits: EndpointLimits | None = None,
        limits_key: Hashable | None = None,
        engine_metrics: str | EngineMetrics | Sequence[str | EngineMetrics | None] | None = None,
    ) -> None:
        if not base_url:
            raise ValueError("base_url must not be empty, e.g. http://127.0.0.1:8000/v1")
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not all(isinstance(url, str) and url for url in urls):
            raise ValueError(f"base_url must be a URL or a list of URLs, got {base_url!r}")
        base_url = urls[0]
        self.base_urls = urls
        metrics_urls: list[str | EngineMetrics | None] = (
            [] if engine_metrics is None
            else [engine_metrics] if isinstance(engine_metrics, str | EngineMetrics)
            else list(engine_metrics)
        )  # fmt: skip
        if metrics_urls and len(metrics_urls) != len(urls):
            raise ValueError(
                f"engine_metrics needs one URL per base_url ({len(urls)}), got "
                f"{len(metrics_urls)}: {metrics_urls!r}"
            )
        # One engine's /metrics per endpoint (a pool's are its endpoints' clients').
        only = metrics_urls[0] if len(metrics_urls) == 1 else None
        self.engine_metrics: EngineMetrics | None = (
            EngineMetrics(only) if isinstance(only, str) else only
        )
        self.throttled = 0  # attempts answered 429 (a pool: per endpoint's client)
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0, got {timeout!r}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries!r}")
        if not backoff >= 0:
            raise ValueError(f"backoff must be >= 0, got {backoff!r}")
        if not max_backoff >= 0:
            raise ValueError(f"max_backoff must be >= 0, got {max_backoff!r}")
        self.base_url = base_url
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self._headers: dict[str, str] = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        if headers:
            self._headers.update(headers)
        self._timeouts = Timeouts(connect=timeout, read=timeout, write=timeout, total=timeout)
        self._owns_http = http_client is None
        # Created now, without I/O, so that a proxy setting it cannot use fails here.
        self._http: HTTPClient | httpx.AsyncClient | None = (
            http_client if http_client is not None else HTTPClient(timeouts=self._timeouts)
        )
        self._closed = False
        self.limits = limits
        self.limits_key: Hashable = base_url if limits_key is None else limits_key
        self.pool: EndpointPool | None = None
        if len(urls) > 1:
            shared = pool_limits(limits)
            self.limits = shared
            self.pool = EndpointPool([
                OpenAIClient(
                    url, api_key, timeout=timeout, max_retries=max_retries, backoff=backoff,
                    max_backoff=max_backoff, headers=headers, http_client=self._http,
                    limits=shared, limits_key=_endpoint_key(url, base_url, limits_key),
                    engine_metrics=metrics,
                )
                for url, metrics in zip(urls, metrics_urls or [None] * len(urls), strict=True)
            ])  # fmt: skip

    def __repr__(self) -> str:
        urls = self.base_url if self.pool is None else self.base_urls
        return f"OpenAIClient({urls!r}, max_retries={self.max_retries})"

    def endpoint_stats(self) -> dict[str, dict[str, Any]] | None:
        """Per endpoint of a list of `base_url`s: calls, errors, ejections, latency and
        window (`EndpointPool.stats`); None for a single endpoint."""
        return None if self.pool is None else self.pool.stats()

    @property
    def has_engine_metrics(self) -> bool:
        """Whether an engine's `/metrics` is known for this client's endpoint(s)."""
        if self.pool is None:
            return self.engine_metrics is not None
        return any(e.client.engine_metrics is not None for e in self.pool.endpoints)

    async def feed_engine_metrics(self, window: Window | None = None) -> None:
        """Read the engines' `/metrics` (``engine_metrics``) every second until cancelled:
        one endpoint's into `window` (the rollout window, when it is adaptive); a pool's each
        into its endpoint's own connection window (when adaptive). Either way the readings
        are kept for the figures. Without ``engine_metrics`` it returns at once."""
        if self.pool is None:
            if self.engine_metrics is not None:
                adaptive = window if isinstance(window, AdaptiveWindow) else None
                await self.engine_metrics.feed(adaptive)
            return
        async with trio.open_nursery() as nursery:
            for endpoint in self.pool.endpoints:
                metrics = endpoint.client.engine_metrics
                if metrics is not None:
                    own = endpoint.window()
                    nursery.start_soon(
                        metrics.feed, own if isinstance(own, AdaptiveWindow) else None
                    )

    def _client(self) -> HTTPClient | httpx.AsyncClient:
        if self._closed or self._http is None:
            raise RuntimeError("OpenAIClient is closed")
        return self._http

    def _retry_delay(self, retry: int, retry_after: float | None) -> float:
        """Seconds to sleep before retry number ``retry`` (0-based): the server's
        Retry-After up to `max_backoff`, else the project's `Backoff`."""
        return Backoff(self.backoff, self.max_backoff).delay(retry + 1, retry_after=retry_after)

    async def _post(self, body: bytes) -> tuple[int, bytes, float | None, bool]:
        """One POST: (status, body, Retry-After seconds, whether it is a 429 whose headers
        name a spent rate budget: `says_request_rate`). Raises `HTTPError` subclasses (the
        transport's, or httpx's errors translated to them)."""
        client = self._client()
        timeouts, timeout = self._timeouts, self.timeout
        left = trio.current_effective_deadline() - trio.current_time()
        if left < timeout:  # the caller's deadline comes first: no request outlives it
            timeout = max(left, 1e-6)
            timeouts = Timeouts(connect=timeout, read=timeout, write=timeout, total=timeout)
        if isinstance(client, HTTPClient):
            response = await client.request(
                "POST", self.url, headers=self._headers, body=body, timeouts=timeouts
            )
            request_rate = response.status == 429 and says_request_rate(
                (name.decode("latin-1"), value.decode("latin-1"))
                for name, value in response.headers
            )
            return response.status, response.body, response.retry_after, request_rate
        import httpx

        try:
            reply = await client.post(
                self.url, content=body, headers=self._headers, timeout=httpx.Timeout(timeout)
            )
        except httpx.TimeoutException as exc:
            raise HTTPTimeout(str(exc), url=self.url, phase="read", timeout=self.timeout) from exc
        except httpx.TransportError as exc:
            raise HTTPError(str(exc) or type(exc).__name__, url=self.url) from exc
        return (
            reply.status_code,
            reply.content,
            parse_retry_after(reply.headers.get("retry-after")),
            reply.status_code == 429 and says_request_rate(reply.headers.items()),
        )

    async def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        model: str,
        sampling: Sampling,
        tools: list[dict[str, Any]] | None = None,
    ) -> Completion:
        """POST one chat completion request, retrying per the class contract. ``tools``
        (OpenAI function schemas) go as the request's ``tools``. The reply is whole: its
        message as sent (``tool_calls`` and unknown fields kept) and its parsed tool calls.
        Raises a `ModelError` as the class says (`ModelHTTPError`, `ModelConnectionError`,
        `ModelTimeoutError`, `ModelResponseError`) once its retries are spent."""
        if self.pool is not None:
            return await self.pool.chat(messages, model=model, sampling=sampling, tools=tools)
        payload: dict[str, Any] = {"model": model, "messages": messages}
        if tools is not None:
            payload["tools"] = tools
        payload.update(sampling.to_request())
        body = orjson.dumps(payload, option=orjson.OPT_NON_STR_KEYS)
        reserve = payload.get("max_tokens")
        if isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 0:
            reserve = None
        attempts = 0
        while True:
            attempts += 1
            retry_after: float | None = None
            outcome: Outcome | None = None  # of this attempt, for the rest before a retry
            try:
                status, content, retry_after, completion = await self._attempt(body, reserve)
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
                    cause = exc.__cause__ if type(exc) is HTTPError else exc  # httpx's own
                    raise ModelConnectionError(
                        f"cannot reach {self.url}: {exc.reason} ({plural(attempts, 'attempt')})",
                        url=self.url,
                    ) from cause
            else:
                if completion is not None:
                    return completion
                text = content.decode("utf-8", errors="replace")
                if not _is_retryable_status(status) or attempts > self.max_retries:
                    raise ModelHTTPError(
                        f"{self.url} returned HTTP {status} after "
                        f"{plural(attempts, 'attempt')}: "
                        f"{excerpt(_error_message(text), 400) or '<empty body>'}",
                        url=self.url,
                        status=status,
                        body=text,
                        attempts=attempts,
                    )
                outcome = Outcome.from_status(status)
            # Outside the limits' gate: a rest holds no connection slot (and, for an adaptive
            # rollout window, a rest after a 429 lends the rollout's place meanwhile).
            kind = "backoff" if retry_after is None else "retry_after"
            await rest(self._retry_delay(attempts - 1, retry_after), outcome=outcome, kind=kind)

    async def _attempt(
        self, body: bytes, reserve: int | None
    ) -> tuple[int, bytes, float | None, Completion | None]:
        """One POST, under the endpoint's limits if there are any: (status, body,
        Retry-After seconds, the completion of a 2xx). Its outcome is recorded."""
        await pace()  # a request-rate limit's pacing (an adaptive window's), before any limit
        if self.limits is None:
            return await self._post_recorded(body, None)
        async with self.limits.call(self.limits_key, reserve_tokens=reserve) as call:
            return await self._post_recorded(body, call)

    async def _post_recorded(
        self, body: bytes, call: Call | None
    ) -> tuple[int, bytes, float | None, Completion | None]:
        started = trio.current_time()
        try:
            status, content, retry_after, request_rate = await self._post(body)
        except HTTPTimeout:
            _record(call, Outcome.TIMEOUT)
            raise
        latency = trio.current_time() - started
        if status == 429:
            self.throttled += 1
        if not 200 <= status <= 299:
            outcome: Outcome | int = Outcome.REQUEST_RATE if request_rate else status
            _record(call, outcome, retry_after, latency=latency)
            return status, content, retry_after, None
        try:
            completion = self._parse(content)
        except ModelResponseError:
            _record(call, status)
            raise
        _record(call, status, tokens=_tokens(completion.usage), latency=latency)
        return status, content, retry_after, completion

    def _parse(self, content: bytes) -> Completion:
        try:
            data = orjson.loads(content)
        except orjson.JSONDecodeError as exc:
            text = content.decode("utf-8", errors="replace")
            raise ModelResponseError(
                f"{self.url} returned a body that is not JSON: {excerpt(text) or '<empty>'}",
                url=self.url,
            ) from exc
        choices = data.get("choices") if isinstance(data, dict) else None
        choice = choices[0] if isinstance(choices, list) and choices else None
        message = choice.get("message") if isinstance(choice, dict) else None
        if not isinstance(choice, dict) or not isinstance(message, dict):
            raise ModelResponseError(
                f"{self.url} returned no choices[0].message: {excerpt(body_text(content))}",
                url=self.url,
            )
        raw_content = message.get("content")
        if raw_content is not None and not isinstance(raw_content, str | list):
            raise ModelResponseError(
                f"{self.url} returned a non-text message content: {excerpt(body_text(content))}",
                url=self.url,
            )
        raw_usage = data.get("usage")
        usage: dict[str, int] = {}
        if isinstance(raw_usage, dict):
            usage = {
                str(k): v
                for k, v in raw_usage.items()
                if isinstance(v, int) and not isinstance(v, bool)
            }
        finish_reason = choice.get("finish_reason")
        if "role" not in message:
            message["role"] = "assistant"  # so that it can be sent back as is
        return Completion(
            content=text_of(raw_content),
            usage=usage,
            finish_reason=finish_reason if isinstance(finish_reason, str) else None,
            message=message,
            tool_calls=parse_tool_calls(message),
            tokens=self._tokens(data, choice, content),
        )

    def _tokens(
        self, data: dict[str, Any], choice: dict[str, Any], content: bytes
    ) -> Tokens | None:
        """The reply's token ids and logprobs in vLLM's shape (`prompt_token_ids` at the top,
        `choices[0].token_ids`, `choices[0].logprobs.content[].logprob`), or None when it has
        none of them. Present but malformed: `ModelResponseError` (never a silent drop)."""
        prompt_ids = data.get("prompt_token_ids")
        completion_ids = choice.get("token_ids")
        logprobs = choice.get("logprobs")
        entries = logprobs.get("content") if isinstance(logprobs, dict) else None
        if prompt_ids is None and completion_ids is None and entries is None:
            return None
        try:
            values = [] if entries is None else [entry["logprob"] for entry in entries]
            return Tokens(list(prompt_ids or []), list(completion_ids or []), values)
        except (TypeError, KeyError, ValueError) as exc:
            raise ModelResponseError(
                f"{self.url} returned malformed token ids or logprobs ({exc}): "
                f"{excerpt(body_text(content))}",
                url=self.url,
            ) from None

    async def aclose(self) -> None:
        """Close the HTTP client if this object created it. Idempotent."""
        self._closed = True
        if self.pool is not None:
            await self.pool.aclose()  # its clients share this one's HTTP client
        http, self._http = self._http, None
        if http is not None and self._owns_http:
            await http.aclose()


def _error_message(text: str) -> str:
    """An error body's own message (vLLM's `message`, OpenAI's `error.message`), so that
    what the server says is not cut off behind its JSON wrapping; else the body itself."""
    try:
        data = orjson.loads(text)
    except orjson.JSONDecodeError:
        return text
    error = data.get("error") if isinstance(data, dict) else None
    for found in (error.get("message") if isinstance(error, dict) else error,
                  data.get("message") if isinstance(data, dict) else None):  # fmt: skip
        if isinstance(found, str) and found.strip():
            return found
    return text
