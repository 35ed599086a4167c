"""`OpenAIClient`: any OpenAI-compatible ``/v1/chat/completions`` endpoint, over the project's
HTTP transport, with retries, `Retry-After` and the endpoint limits around each attempt."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import orjson
import trio

from .._core.adaptive import AdaptiveWindow
from .._core.backoff import FIRST, MODEL_RETRIES, MOST
from .._core.exceptions import ConfigError
from .._core.limits import EndpointLimits
from .._core.views import View
from .._core.window import Window
from .._transport import HTTPClient, HTTPError, Timeouts, redact_url
from .base import (
    ClientDescription,
    Completion,
    ModelClientBase,
    ModelResponseError,
    Sampling,
    Tokens,
    VersionSpan,
    body_text,
    excerpt,
    parse_tool_calls,
    text_of,
)
from .calls import TIMEOUT, EndpointCalls, check_settings
from .engine import EngineMetrics
from .pool import EndpointPool, pool_limits
from .stream import SSEReply

__all__ = ["GENERATE_PATH", "OpenAIClient"]

GENERATE_PATH = "/inference/v1/generate"
"""vLLM's token-in/token-out endpoint (``vllm serve --enable-scale-out``), under the server's
root: the one that reports each output token's weight version (``weight_versions``)."""

_OWN_HEADERS = frozenset({"Content-Type", "Authorization"})  # the ones every request has


def _redacted(key: Hashable | None) -> Hashable | None:
    """A limits key with the password of its URL(s) redacted (`redact_url`)."""
    if isinstance(key, str):
        return redact_url(key)
    if isinstance(key, tuple):
        return tuple(redact_url(part) if isinstance(part, str) else part for part in key)
    return key


def _endpoint_key(url: str, first: str, key: Hashable | None) -> Hashable:
    """The limits key of one endpoint of a list: `url`, or the caller's key with the first
    URL replaced by this one (the CLI's `(base_url, api_key_var)`)."""
    if key is None:
        return url
    if isinstance(key, tuple) and key and key[0] == first:
        return (url, *key[1:])
    return (url, key)


class OpenAIClient(ModelClientBase):
    """A client for any OpenAI-compatible ``/chat/completions`` endpoint (vLLM, SGLang,
    llama.cpp server, OpenAI, ...). ``base_url`` includes the version prefix, e.g.
    ``http://127.0.0.1:8000/v1``.

    Contract:

    - POSTs ``{"model", "messages", **sampling.to_request()}`` to
      ``{base_url}/chat/completions``, with ``Authorization: Bearer <api_key>`` when a key
      is given, plus ``headers``.
    - The reply's message is kept as sent (``tool_calls``, reasoning and unknown fields),
      but for the fields sent as null other than ``content`` (vLLM's ``refusal``,
      ``audio``, ``function_call``, ...), left out as a streamed reply leaves them out.
    - A reply's token ids and logprobs, in vLLM's shape (asked for with
      ``Sampling(return_tokens=True)``), become ``Completion.tokens``.
    - ``Sampling(stream=True)`` (or ``"stream": true`` in its ``extra``) asks for the reply
      as server-sent events, read as they arrive (`trio_tasksets._models.stream.SSEReply`):
      chat chunks, tool-call deltas, the usage of the last chunk, vLLM's token ids and
      logprobs, assembled into the `Completion` the same reply sent whole parses to, with
      its ``ttft``. An attempt is retried as below until the first byte of its body; a
      stream that breaks off after it raises `ModelConnectionError` or `ModelTimeoutError`
      at once, a streamed event that is not a chunk (or the server's ``{"error": ...}``)
      `ModelResponseError`.
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
    CA bundle, proxy or limits, or one that answers in memory: ``HTTPClient(handler=...)``)
    to use it as is; it is left open. The retries, limits and outcomes are those of every
    HTTP model client (`trio_tasksets._models.calls.EndpointCalls`).

    A password in a ``base_url`` (``http://user:pw@host/v1``) is not sent (give a key as
    ``api_key``), and the client keeps, shows and records the URL without it
    (``http://user:***@host/v1``).

    A bad ``base_url``, ``timeout``, ``max_retries``, ``backoff``, ``max_backoff`` or
    ``engine_metrics`` raises `ConfigError` naming it.
    """

    def __init__(
        self,
        base_url: str | Sequence[str],
        api_key: str | None = None,
        *,
        timeout: float = TIMEOUT,
        max_retries: int = MODEL_RETRIES,
        backoff: float = FIRST,
        max_backoff: float = MOST,
        headers: dict[str, str] | None = None,
        http_client: HTTPClient | None = None,
        limits: EndpointLimits | None = None,
        limits_key: Hashable | None = None,
        engine_metrics: str | EngineMetrics | Sequence[str | EngineMetrics | None] | None = None,
    ) -> None:
        if not base_url:
            raise ConfigError(
                "{base_url} must not be empty, e.g. http://127.0.0.1:8000/v1",
                parameter="base_url",
            )
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not all(isinstance(url, str) and url for url in urls):
            raise ConfigError(
                f"{{base_url}} must be a URL or a list of URLs, got {base_url!r}",
                parameter="base_url",
            )
        # A URL's userinfo is never sent (a key goes as api_key): every URL and key the
        # client keeps, shows (repr, errors, figures, config.json) and sends on is redacted.
        urls = [redact_url(url) for url in urls]
        limits_key = _redacted(limits_key)
        base_url = urls[0]
        self.base_urls = urls
        metrics_urls: list[str | EngineMetrics | None] = (
            [] if engine_metrics is None
            else [engine_metrics] if isinstance(engine_metrics, str | EngineMetrics)
            else list(engine_metrics)
        )  # fmt: skip
        if metrics_urls and len(metrics_urls) != len(urls):
            raise ConfigError(
                f"{{engine_metrics}} needs one URL per base_url ({len(urls)}), got "
                f"{len(metrics_urls)}: {metrics_urls!r}",
                parameter="engine_metrics",
            )
        # One engine's /metrics per endpoint (a pool's are its endpoints' clients').
        only = metrics_urls[0] if len(metrics_urls) == 1 else None
        self.engine_metrics: EngineMetrics | None = (
            EngineMetrics(only) if isinstance(only, str) else only
        )
        check_settings(timeout, max_retries, backoff, max_backoff)
        self.base_url = base_url
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.backoff = backoff
        self.max_backoff = max_backoff
        self._headers: dict[str, str] = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        if headers:
            self._headers.update(headers)
        self._owns_http = http_client is None
        # Created now, without I/O, so that a proxy setting it cannot use fails here.
        self._http: HTTPClient | None = (
            http_client
            if http_client is not None
            else HTTPClient(
                timeouts=Timeouts(connect=timeout, read=timeout, write=timeout, total=timeout)
            )
        )
        self._closed = False
        self.limits = limits
        self.limits_key: Hashable = base_url if limits_key is None else limits_key
        self.pool: EndpointPool[OpenAIClient] | None = None
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
        self._calls = EndpointCalls(
            self._http, self.url, timeout=timeout, max_retries=max_retries,
            backoff=backoff, max_backoff=max_backoff, limits=self.limits,
            limits_key=self.limits_key,
        )  # fmt: skip
        self._contexts: dict[str, int | None] = {}  # a model's context, asked once
        self._completions = EndpointCalls(
            self._http, base_url.rstrip("/") + "/completions", timeout=timeout,
            max_retries=max_retries, backoff=backoff, max_backoff=max_backoff,
            limits=self.limits, limits_key=self.limits_key,
        )  # fmt: skip
        # vLLM's scale-out endpoints (`--enable-scale-out`): the chat rendered to token ids
        # (no engine work: outside the limits), then generated from them with the output's
        # weight versions; whether the server offers them is asked once (`offers_generate`).
        root = base_url.rstrip("/").removesuffix("/v1").rstrip("/")
        self._render = EndpointCalls(
            self._http, base_url.rstrip("/") + "/chat/completions/render", timeout=timeout,
            max_retries=max_retries, backoff=backoff, max_backoff=max_backoff,
        )  # fmt: skip
        self._generate = EndpointCalls(
            self._http, root + GENERATE_PATH, timeout=timeout, max_retries=max_retries,
            backoff=backoff, max_backoff=max_backoff, limits=self.limits,
            limits_key=self.limits_key,
        )  # fmt: skip
        self._generates: bool | None = None
        self._probing = trio.Lock()

    cut_in_transport = True
    """Its requests can be cut through the transport's own cancel scope (`CutSlot`), and
    each reply it returns is a new object made for its call: a `tt.Policy` governing its
    calls needs no cancel scope of its own per call and stamps a reply's versions in
    place."""

    timeout = View[float]("_calls", "Seconds per request, as a whole (each attempt its own).")
    max_retries = View[int]("_calls", "Retries after a call's first attempt.")
    throttled = View[int]("_calls", "Attempts answered 429 (a pool: per endpoint's client).")

    def __repr__(self) -> str:
        urls = self.base_url if self.pool is None else self.base_urls
        return f"OpenAIClient({urls!r}, max_retries={self.max_retries})"

    def describe(self) -> ClientDescription:
        """Its endpoints, limits and key; how it travels (``type: "openai"``, with its
        endpoints, timeout and retry settings); its figures per endpoint and its engines'
        readings, when it has them."""
        travel: dict[str, Any] = {
            "type": "openai",
            "base_url": self.base_url,
            "timeout": self.timeout,
            "max_retries": self.max_retries,
            "backoff": self.backoff,
            "max_backoff": self.max_backoff,
        }
        if len(self.base_urls) > 1:
            travel["base_urls"] = list(self.base_urls)
        auth = self._headers.get("Authorization", "")  # the key lives only in the headers
        return ClientDescription(
            endpoints=self.base_urls,
            limits=self.limits,
            api_key=auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else None,
            headers=frozenset(self._headers) - _OWN_HEADERS,
            travel=travel,
            endpoint_stats=None if self.pool is None else self.endpoint_stats,
            engine_metrics=self.feed_engine_metrics if self.has_engine_metrics else None,
        )

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

    # duplicates: ModelClient.chat's signature (with tools), which every client implements
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
        `ModelTimeoutError`, `ModelResponseError`) once its retries are spent, and
        ``RuntimeError`` once the client is closed."""
        if self._closed:
            raise RuntimeError("OpenAIClient is closed")
        if self.pool is not None:
            return await self.pool.run(
                lambda client: client.chat(messages, model=model, sampling=sampling, tools=tools)
            )
        payload: dict[str, Any] = {"model": model, "messages": messages}
        if tools is not None:
            payload["tools"] = tools
        payload.update(sampling.to_request())
        body = orjson.dumps(payload, option=orjson.OPT_NON_STR_KEYS)
        reserve = payload.get("max_tokens")
        if isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 0:
            reserve = None
        stream = self._stream if payload.get("stream") is True else None
        return await self._calls.post(
            body, headers=self._headers, parse=self._parse, reserve_tokens=reserve, stream=stream
        )

    async def complete_ids(
        self, prompt_ids: list[int], *, model: str, sampling: Sampling
    ) -> Completion:
        """Continue a sequence from token ids: POST ``{"prompt": prompt_ids}`` to
        ``{base_url}/completions`` (vLLM continues a token-id prompt exactly), asking for the
        output's token ids (and logprobs with ``return_tokens``). Without a ``max_tokens`` it
        runs to the model's context, as the server lists it (vLLM's ``max_model_len`` in
        ``GET /models``, asked once per model). What a call cut by a ``tt.Policy`` update
        (``mode="abort"``) continues through. Where the server offers vLLM's
        ``/inference/v1/generate`` (`offers_generate`) the ids go there instead (its
        ``sampling_params`` are the named settings and ``extra``; no ``max_tokens``: to the
        context's end), and the reply carries vLLM's own ``weight_versions`` as its
        `Completion.versions`. Raises as `chat`."""
        if self._closed:
            raise RuntimeError("OpenAIClient is closed")
        if self.pool is not None:
            return await self.pool.run(
                lambda client: client.complete_ids(prompt_ids, model=model, sampling=sampling)
            )
        if await self.offers_generate():
            params: dict[str, Any] = sampling.named_settings()
            if sampling.return_tokens:
                params["logprobs"] = 0
            params.update(sampling.extra)
            request = {"model": model, "token_ids": prompt_ids, "sampling_params": params}
            return await self._generate_from(request, stream=False)
        payload: dict[str, Any] = {"model": model, "prompt": prompt_ids}
        if sampling.max_tokens is None:  # to the context's end, as a chat call would go
            # (/completions' own default is 16 tokens, and vLLM reads a null as that)
            context = await self._context_length(model)
            if context is not None:
                payload["max_tokens"] = max(1, context - len(prompt_ids))
        payload.update(sampling.named_settings())
        payload["return_token_ids"] = True
        if sampling.return_tokens:
            payload["logprobs"] = 0  # the sampled token's own logprob
        payload.update(sampling.extra)
        body = orjson.dumps(payload, option=orjson.OPT_NON_STR_KEYS)
        return await self._completions.post(
            body, headers=self._headers, parse=self._parse_text, reserve_tokens=sampling.max_tokens
        )

    # duplicates: ModelClient.chat's signature (with tools), which every client implements
    async def chat_with_versions(
        self,
        messages: list[dict[str, Any]],
        *,
        model: str,
        sampling: Sampling,
        tools: list[dict[str, Any]] | None = None,
    ) -> Completion:
        """`chat`, with the engine's own version spans where the server offers them: when it
        serves vLLM's scale-out endpoints (`offers_generate`) and the call has no ``tools``,
        the chat is rendered to token ids (``POST {base_url}/chat/completions/render``, the
        model's own template and the request's sampling) and generated from them (``POST
        /inference/v1/generate``, text and token ids out, streamed as ``sampling`` says),
        so the reply's `Completion.versions` are vLLM's ``weight_versions`` (two spans when
        a policy update fell inside the call) and its ``tokens`` the prompt's and output's
        ids. Else (another server, or ``tools``: vLLM's tool parser runs only on the chat
        path) it is `chat`. What a `tt.ModelContext` with a ``tt.Policy`` sends its calls
        with ``Sampling(return_tokens=True)`` through. Raises as `chat`."""
        if self._closed:
            raise RuntimeError("OpenAIClient is closed")
        if self.pool is not None:
            return await self.pool.run(
                lambda client: client.chat_with_versions(
                    messages, model=model, sampling=sampling, tools=tools
                )
            )
        if tools is not None or not await self.offers_generate():
            return await self.chat(messages, model=model, sampling=sampling, tools=tools)
        payload: dict[str, Any] = {"model": model, "messages": messages}
        payload.update(sampling.to_request())
        stream = payload.pop("stream", None) is True
        payload.pop("stream_options", None)
        rendered = await self._render.post(
            orjson.dumps(payload, option=orjson.OPT_NON_STR_KEYS),
            headers=self._headers,
            parse=self._parse_rendered,
        )
        return await self._generate_from(rendered.message, stream=stream)

    async def offers_generate(self) -> bool:
        """Whether the server offers vLLM's token-in/token-out endpoints (``vllm serve
        --enable-scale-out``): asked once per client (an empty ``POST
        /inference/v1/generate``, which such a server refuses as invalid, 400 or 422, and
        any other answers otherwise: 404, or 403 when served without the flag); a request
        that gets no answer says no for this call and is asked again next time."""
        if self._generates is None:
            async with self._probing:
                if self._generates is None:
                    found = await self._probe_generate()
                    if found is None:
                        return False
                    self._generates = found
        return self._generates

    async def _probe_generate(self) -> bool | None:
        http = self._http
        if http is None:
            return None
        try:
            response = await http.request(
                "POST", self._generate.url, headers=self._headers, body=b"{}"
            )
        except HTTPError:
            return None
        return response.status in (400, 422)

    async def _generate_from(self, request: dict[str, Any], *, stream: bool) -> Completion:
        """POST a rendered `request` (``token_ids``, ``sampling_params``, ...) to vLLM's
        generate endpoint, asking for text and token ids back (streamed or whole)."""
        request["output_mode"] = "text"
        request["return_token_ids"] = True
        if stream:
            request["stream"] = True
            request["stream_options"] = {"include_usage": True}
        params = request.get("sampling_params")
        reserve = params.get("max_tokens") if isinstance(params, dict) else None
        if isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 0:
            reserve = None
        return await self._generate.post(
            orjson.dumps(request, option=orjson.OPT_NON_STR_KEYS),
            headers=self._headers,
            parse=self._parse_generated,
            reserve_tokens=reserve,
            stream=self._generated_stream if stream else None,
        )

    def _parse_rendered(self, content: bytes) -> Completion:
        """A ``/chat/completions/render`` reply (vLLM's ``GenerateRequest``), carried as the
        `message` of a bare `Completion` (what `EndpointCalls` hands back)."""
        url = self._render.url
        try:
            data = orjson.loads(content)
        except orjson.JSONDecodeError:
            data = None
        if not isinstance(data, dict) or not isinstance(data.get("token_ids"), list):
            raise ModelResponseError(
                f"{url} returned no rendered request: {excerpt(body_text(content))}", url=url
            )
        return Completion("", message=data)

    def _parse_generated(self, content: bytes) -> Completion:
        """A whole ``/inference/v1/generate`` reply (``output_mode`` text): its text, token
        ids, logprobs, usage, finish reason and vLLM's ``weight_versions``."""
        url = self._generate.url
        try:
            data = orjson.loads(content)
            choice = data["choices"][0]
            text = choice.get("text") or ""
            logprobs = choice.get("logprobs")
            entries = logprobs.get("content") if isinstance(logprobs, dict) else None
            finish = choice.get("finish_reason")
            return Completion(
                content=text if isinstance(text, str) else "",
                usage={
                    str(k): v
                    for k, v in (data.get("usage") or {}).items()
                    if isinstance(v, int) and not isinstance(v, bool)
                },
                finish_reason=finish if isinstance(finish, str) else None,
                tokens=Tokens(
                    list(data.get("prompt_token_ids") or []),
                    list(choice.get("token_ids") or []),
                    [float(entry["logprob"]) for entry in entries or ()],
                ),
                versions=_weight_versions(choice.get("weight_versions")),
            )
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, ValueError) as exc:
            raise ModelResponseError(
                f"{url} returned no usable generation ({exc}): {excerpt(body_text(content))}",
                url=url,
            ) from None

    def _generated_stream(self) -> _GeneratedReply:
        return _GeneratedReply(self._generate.url)

    async def _context_length(self, model: str) -> int | None:
        """The model's context in tokens, as the server lists it (vLLM's `max_model_len` in
        ``GET /models``), asked once per model; None when the server does not say."""
        if model not in self._contexts:
            found: int | None = None
            http = self._http
            try:
                if http is not None:
                    url = self.base_url.rstrip("/") + "/models"
                    response = await http.request("GET", url, headers=self._headers)
                    listed = orjson.loads(response.body) if response.status == 200 else {}
                    for entry in listed.get("data") or []:
                        if isinstance(entry, dict) and entry.get("id") == model:
                            value = entry.get("max_model_len")
                            found = value if isinstance(value, int) and value > 0 else None
            except (HTTPError, orjson.JSONDecodeError, AttributeError):
                found = None
            self._contexts[model] = found
        return self._contexts[model]

    def _parse_text(self, content: bytes) -> Completion:
        """A ``/completions`` reply: its text, token ids and logprobs (vLLM's shape)."""
        url = self._completions.url
        try:
            data = orjson.loads(content)
            choice = data["choices"][0]
            text = choice.get("text") or ""
            ids = list(choice.get("token_ids") or [])
            prompt_ids = list(choice.get("prompt_token_ids") or data.get("prompt_token_ids") or [])
            logprobs = choice.get("logprobs")
            values = (
                list(logprobs.get("token_logprobs") or []) if isinstance(logprobs, dict) else []
            )
            usage = {
                str(k): v
                for k, v in (data.get("usage") or {}).items()
                if isinstance(v, int) and not isinstance(v, bool)
            }
            finish = choice.get("finish_reason")
            return Completion(
                content=text if isinstance(text, str) else "",
                usage=usage,
                finish_reason=finish if isinstance(finish, str) else None,
                tokens=Tokens(prompt_ids, ids, [float(v or 0.0) for v in values]),
            )
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError) as exc:
            raise ModelResponseError(
                f"{url} returned no usable completion ({exc}): {excerpt(body_text(content))}",
                url=url,
            ) from None

    def _stream(self) -> SSEReply:
        return SSEReply(self.url)

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
        nulls = [key for key, value in message.items() if value is None and key != "content"]
        for key in nulls:  # vLLM's `refusal`, `audio`, ...: they say nothing, a stream omits them
            del message[key]
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
        self._closed = self._calls.closed = self._completions.closed = True
        self._render.closed = self._generate.closed = True
        if self.pool is not None:
            await self.pool.aclose()  # its clients share this one's HTTP client
        http, self._http = self._http, None
        if http is not None and self._owns_http:
            await http.aclose()


def _weight_versions(value: Any) -> list[VersionSpan]:
    """vLLM's ``weight_versions`` (``[{"version", "start", "end"}]``) as `VersionSpan`s;
    [] when it sent none. Malformed: `TypeError` or `ValueError` (the caller's
    `ModelResponseError`)."""
    if not value:
        return []
    if not isinstance(value, list):
        raise TypeError(f"weight_versions is not a list: {value!r}")
    try:
        return [VersionSpan(str(span["version"]), span["start"], span["end"]) for span in value]
    except (KeyError, ConfigError) as exc:
        raise ValueError(f"malformed weight_versions {value!r}: {exc}") from None


class _GeneratedReply(SSEReply):
    """A streamed ``/inference/v1/generate`` reply (``output_mode`` text): each chunk's
    ``choices[0]`` (``text``, ``token_ids``, ``logprobs``, ``finish_reason``) fed to the
    builder as the chat chunk it stands for, and the last chunk's ``weight_versions`` kept
    for the whole reply's `Completion.versions`."""

    __slots__ = ("versions",)

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.versions: list[VersionSpan] = []
        self._feed = self._generated

    def _generated(self, chunk: Any) -> None:
        if not isinstance(chunk, dict):
            self.builder.feed(chunk)  # (its error)
            return
        choices = chunk.get("choices")
        converted: dict[str, Any] = {
            key: chunk[key] for key in ("usage", "prompt_token_ids") if key in chunk
        }
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            choice = choices[0]
            try:
                spans = _weight_versions(choice.get("weight_versions"))
            except (TypeError, ValueError) as exc:
                self._error(f"malformed weight versions ({exc})")
            if spans:
                self.versions = spans
            text = choice.get("text")
            converted["choices"] = [{
                "delta": {"content": text} if text else {},
                "token_ids": choice.get("token_ids"),
                "logprobs": choice.get("logprobs"),
                "finish_reason": choice.get("finish_reason"),
            }]  # fmt: skip
        else:
            converted["choices"] = choices
        self.builder.feed(converted)

    def finish(self) -> Completion:
        """The whole reply, with vLLM's version spans."""
        c = super().finish()
        return Completion(
            c.content, c.usage, c.finish_reason, c.message, c.tool_calls, c.tokens,
            ttft=c.ttft, tpot=c.tpot, versions=self.versions,
        )  # fmt: skip
