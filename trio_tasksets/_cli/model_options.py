"""The model options of `eval` and `worker`: the model client, its endpoints and key, the
sampling settings, the limits on its calls (`--max-connections`, `--rpm`, `--tpm`) and the
engines' own metrics (`--engine-metrics`, one per `--base-url`).

A command reads them once at its edge (`model_options(args)`, `endpoints(args)`: the only
functions here that see the parsed arguments) into a frozen `ModelOptions`; every builder
below takes that object.

`--base-url` without `-m` is a usage error that lists the models the server offers
(`offered_models`: its `GET /models`, asked with the project's HTTP client under a short
timeout): the default model name, ``echo``, is the offline model's, never one to send."""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import shlex
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import attrs
import trio

from .._core.adaptive import AdaptiveBounds
from .._core.limits import EndpointLimits
from .._models import (
    EchoClient,
    ModelClient,
    ModelContext,
    OpenAIClient,
    Sampling,
    api_key_from_env,
)
from .._models.calls import TIMEOUT
from .._models.engine import EngineMetrics
from .._transport import HTTPClient, HTTPError, Timeouts
from .options import (
    DEFAULT_API_KEY_VAR,
    UsageError,
    add_flags,
    json_object,
    per_minute,
    window_option,
)

__all__ = [
    "LIST_TIMEOUT",
    "Endpoints",
    "ModelOptions",
    "OfferedModels",
    "add_endpoint_options",
    "add_model_options",
    "api_key",
    "api_key_var",
    "check_engine_metrics",
    "endpoint_limits",
    "endpoints",
    "engine_metrics_urls",
    "limit_flags",
    "model_context",
    "model_options",
    "offered_models",
]


def add_model_options(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Add the model options (`-m`, `--base-url`, `--api-key-var`, sampling, ...)."""
    model = parser.add_argument_group("the model")
    model.add_argument(
        "-m", "--model", default=None,
        help="model name, as the server lists it (its /v1/models); required with --base-url "
        "(default: echo, the built-in offline model: replies with the prompt)",
    )  # fmt: skip
    add_endpoint_options(model)
    model.add_argument(
        "--api-key-var", default=None, metavar="VAR",
        help=f"the environment variable holding the API key (default: {DEFAULT_API_KEY_VAR}; "
        f"no key is sent when it is unset)",
    )  # fmt: skip
    add_flags(model, {
        "--timeout S": "bound each model request as a whole, from connecting to the reply's "
        "last byte, to S seconds (each retry has its own S; never past the rollout's deadline) "
        f"(default: {TIMEOUT:g})",
        "--temperature T": "sampling temperature >= 0 (default: the server's)",
    }, type=float)  # fmt: skip
    add_flags(model, {
        "--max-tokens N": "most tokens per reply (default: the server's)",
    }, type=int)  # fmt: skip
    add_flags(model, {"--top-p P": "nucleus sampling, in (0, 1] (default: the server's)"},
              type=float)  # fmt: skip
    add_flags(model, {"--sampling-seed N": "the seed sent with each request (default: none)"},
              type=int)  # fmt: skip
    model.add_argument(
        "-S", "--sampling-args", default=None, metavar="JSON",
        help="more request fields as a JSON object, merged into every request: e.g. "
        "'{\"response_format\": {\"type\": \"json_object\"}, \"tools\": [...], "
        "\"stop\": [\"\\n\"]}' (temperature, max_tokens, top_p, seed here count as their "
        "flags) (default: none)",
    )  # fmt: skip
    model.add_argument(
        "--return-tokens", action="store_true",
        help="ask the server for token ids and logprobs (vLLM's return_token_ids and "
        "logprobs); rows keep them per model call under `tokens`",
    )  # fmt: skip
    model.add_argument(
        "--stream-replies", action="store_true",
        help="ask for each reply as server-sent events, read as it arrives: rows, the "
        "summary, the dashboard and --metrics-port get time to first token and per output "
        "token, and tokens arriving count as progress for --stall-timeout",
    )  # fmt: skip
    add_flags(model, {
        "--echo-delay S": "latency of the echo model, to watch the window work (default: 0)",
    }, type=float)  # fmt: skip
    add_flags(model, {
        "--max-connections N|MIN-START-MAX": "most model calls in flight to the endpoint "
        "(--base-url and its key variable), across every rollout of this process: a rollout's "
        "every call counts; MIN-START-MAX adapts it on the calls' 429s (default: no bound)",
    }, type=window_option)  # fmt: skip
    add_flags(model, {
        "--rpm N": "most model calls started per minute, spread evenly (GCRA) (default: no "
        "limit)",
        "--tpm N": "most tokens per minute, metered from the replies' usage; --max-tokens is "
        "reserved before each call (default: no limit)",
    }, type=per_minute)  # fmt: skip
    return model


BASE_URL_HELP = (
    "an OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1 (default: none; needed by "
    "every model but echo); repeat it for many endpoints: calls go to the least loaded, a "
    "rollout's calls to one, a dead one is taken out and probed back"
)
ENGINE_METRICS_HELP = (
    "the engine's Prometheus /metrics (vLLM, SGLang), e.g. http://127.0.0.1:8000/metrics, "
    "read every second: an adaptive window reads its load (waiting requests, KV cache, "
    "preemptions); with many --base-url give one per --base-url, in the same order: each "
    "moves its endpoint's own window and shows in its figures (default: none: latency and "
    "429s only)"
)


def add_endpoint_options(
    group: argparse._ActionsContainer,
    *,
    base_url_help: str = BASE_URL_HELP,
    engine_metrics_help: str = ENGINE_METRICS_HELP,
) -> None:
    """`--base-url URL` (repeatable) and `--engine-metrics URL` (one per `--base-url`): the
    endpoints, as `eval`, `worker` and `serve` take them (read with `endpoints`)."""
    group.add_argument(
        "--base-url", dest="base_urls", default=None, metavar="URL", action="append",
        help=base_url_help,
    )  # fmt: skip
    group.add_argument(
        "--engine-metrics", default=None, metavar="URL", action="append",
        help=engine_metrics_help,
    )  # fmt: skip


@attrs.frozen
class Endpoints:
    """Every `--base-url` and every `--engine-metrics` given, in order."""

    base_urls: tuple[str, ...] = ()
    engine_metrics: tuple[str, ...] = ()

    @property
    def base_url(self) -> str | None:
        """The first `--base-url` (what a single endpoint's code reads), or None."""
        return self.base_urls[0] if self.base_urls else None


def endpoints(args: argparse.Namespace) -> Endpoints:
    """The endpoints of a command that added them (`add_endpoint_options`); a `--base-url`
    that ends in ``/chat/completions`` (the path the client adds itself) is a `UsageError`
    naming the URL to give."""
    given = Endpoints(tuple(args.base_urls or ()), tuple(args.engine_metrics or ()))
    for url in given.base_urls:
        _refuse_endpoint_path(url)
    return given


_CHAT_PATH = "/chat/completions"


def _refuse_endpoint_path(url: str) -> None:
    """A base URL is what precedes ``/chat/completions``: given with it, every call would
    go to ``.../chat/completions/chat/completions`` and fail 404."""
    trimmed = url.rstrip("/")
    if trimmed.endswith(_CHAT_PATH):
        base = trimmed.removesuffix(_CHAT_PATH)
        raise UsageError(
            f"--base-url {url} ends in {_CHAT_PATH}, the path each call adds to it",
            fix=f"--base-url {base}",
        )


@attrs.frozen
class ModelOptions:
    """The model options as given (`model_options` reads them): what `model_context` builds
    the model client from."""

    model: str | None = None  # `-m`; None: not given (the echo model, unless --base-url)
    endpoints: Endpoints = Endpoints()
    api_key_var: str | None = None
    timeout: float | None = None
    temperature: float | None = None
    max_tokens: int | None = None
    top_p: float | None = None
    sampling_seed: int | None = None
    sampling_args: str | None = None
    return_tokens: bool = False
    stream_replies: bool = False
    echo_delay: float | None = None
    max_connections: int | AdaptiveBounds | None = None
    rpm: float | None = None
    tpm: float | None = None

    @property
    def name(self) -> str:
        """The model's name: `-m`'s, else ``echo``."""
        return "echo" if self.model is None else self.model

    @property
    def base_url(self) -> str | None:
        """The first `--base-url`, or None."""
        return self.endpoints.base_url

    def given(self, *pairs: tuple[str, str]) -> list[str]:
        """The flags of `pairs` (a flag, its field) whose option was given (not None)."""
        return [flag for flag, field in pairs if getattr(self, field) is not None]


def model_options(args: argparse.Namespace) -> ModelOptions:
    """The model options of a command that added them (`add_model_options`)."""
    return ModelOptions(
        args.model, endpoints(args), args.api_key_var, args.timeout, args.temperature,
        args.max_tokens, args.top_p, args.sampling_seed, args.sampling_args,
        args.return_tokens, args.stream_replies, args.echo_delay, args.max_connections,
        args.rpm, args.tpm,
    )  # fmt: skip


def _is_echo(options: ModelOptions) -> bool:
    return options.name == "echo" and options.base_url is None


def _check_base_url(url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        example = f"http://{url}" if "://" not in url else "http://127.0.0.1:8000/v1"
        raise UsageError(
            f"--base-url must be an http:// or https:// URL, got {url!r}", fix=f"e.g. {example}"
        )


# -S keys that name a sampling flag's field: (the flag, Sampling's field)
_NAMED = {"temperature": ("--temperature", "temperature"), "max_tokens": ("--max-tokens",
          "max_tokens"), "top_p": ("--top-p", "top_p"), "seed": ("--sampling-seed", "seed")}  # fmt: skip
# Request fields the client sets itself: -S may not replace them.
_OWNED = {"model": "-m/--model", "messages": "the taskset's prompts",
          "stream": "the client (it reads whole replies)", "stream_options": "the client"}  # fmt: skip


def _sampling_args(options: ModelOptions) -> tuple[dict[str, Any], dict[str, Any]]:
    """`-S/--sampling-args JSON`: (the values of named sampling fields it gives, the other
    request fields)."""
    if options.sampling_args is None:
        return {}, {}
    fields = json_object(
        options.sampling_args, "-S/--sampling-args", what="a JSON object of request fields",
        quoted="""-S '{"response_format": {"type": "json_object"}}'""",
        example="""-S '{"stop": ["\\n"]}'""",
    )  # fmt: skip
    named: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in fields.items():
        if key in _OWNED:
            raise UsageError(
                f"-S/--sampling-args: {key!r} is set by {_OWNED[key]}", fix=f"drop {key!r}"
            )
        if key in _NAMED:
            flag, field = _NAMED[key]
            if options.given((flag, "sampling_seed" if field == "seed" else field)):
                raise UsageError(
                    f"{flag} and -S/--sampling-args {key!r} both set {key}", fix="give one"
                )
            named[field] = value
        else:
            extra[key] = value
    return named, extra


def _sampling(options: ModelOptions) -> Sampling:
    named, extra = _sampling_args(options)
    temperature = named.get("temperature", options.temperature)
    top_p = named.get("top_p", options.top_p)
    max_tokens = named.get("max_tokens", options.max_tokens)
    seed = named.get("seed", options.sampling_seed)
    for field, value, kind in (("temperature", temperature, (int, float)),
                               ("top_p", top_p, (int, float)), ("max_tokens", max_tokens, int),
                               ("seed", seed, int)):  # fmt: skip
        if field in named and (isinstance(value, bool) or not isinstance(value, kind)):
            raise UsageError(f"-S/--sampling-args: {field!r} must be a number, got {value!r}")
    if temperature is not None and not (math.isfinite(temperature) and temperature >= 0):
        raise UsageError(f"--temperature must be >= 0, got {temperature}")
    if top_p is not None and not 0 < top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {top_p}")
    if max_tokens is not None and max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {max_tokens}")
    return Sampling(temperature=temperature, max_tokens=max_tokens, top_p=top_p,
                    seed=seed, extra=extra,
                    return_tokens=options.return_tokens,
                    stream=options.stream_replies)  # fmt: skip


def api_key_var(options: ModelOptions) -> str | None:
    """The variable the model's API key is read from, when a key is sent (never the key)."""
    if _is_echo(options):
        return None
    var = options.api_key_var or DEFAULT_API_KEY_VAR
    return var if os.environ.get(var, "").strip() else None


# What only shapes an HTTP request or its limits: (the flag, its field).
_HTTP_ONLY = (("--timeout", "timeout"), ("--api-key-var", "api_key_var"),
              ("--max-connections", "max_connections"), ("--rpm", "rpm"), ("--tpm", "tpm"),
              ("--temperature", "temperature"), ("--max-tokens", "max_tokens"),
              ("--top-p", "top_p"), ("--sampling-seed", "sampling_seed"),
              ("-S/--sampling-args", "sampling_args"))  # fmt: skip


def model_context(
    options: ModelOptions, *, remote: bool = False, engine_metrics_on_client: bool = True
) -> ModelContext:
    """The model the options name; a bad value, or an option that would do nothing with this
    model, is a `UsageError` naming its flag.

    `remote`: the model calls are made by other processes with their own endpoint (`eval
    --via`: the workers'), so only the model's name and sampling are used here; the
    context's client is the offline echo model, never called.

    `engine_metrics_on_client`: `--engine-metrics` goes to the client
    (`OpenAIClient(engine_metrics=...)`: each endpoint's own); False when the caller feeds
    it to its rollout window itself (`eval` with one endpoint: `EvalConfig.engine_metrics`)."""
    client: ModelClient
    if options.model is None and options.base_url is not None:
        for url in options.endpoints.base_urls:
            _check_base_url(url)
        raise _no_model(options)
    sampling = _sampling(options)
    if remote and not _is_echo(options):
        return ModelContext(EchoClient(), options.name, sampling)
    if _is_echo(options):
        # Every option that only shapes an HTTP request or its limits does nothing here:
        # each is refused alike (the sampling flags, -S and --timeout included).
        unused = options.given(*_HTTP_ONLY)
        if options.endpoints.engine_metrics:
            unused.append("--engine-metrics")
        if unused and not remote:
            flags = ", ".join(unused)
            raise UsageError(
                f"{flags} {'does' if len(unused) == 1 else 'do'} nothing with the echo model",
                fix=f"drop {flags}, or name an HTTP model with -m MODEL --base-url URL",
            )
        delay = 0.0 if options.echo_delay is None else options.echo_delay
        if not delay >= 0:
            raise UsageError(f"--echo-delay must be >= 0, got {delay}")
        client = EchoClient(delay=delay)
        return ModelContext(client, options.name, sampling)
    if options.base_url is None:
        raise UsageError(
            f"-m/--model {options.model!r} needs --base-url (an OpenAI-compatible endpoint)",
            fix="add --base-url http://127.0.0.1:8000/v1 (or https://api.openai.com/v1), "
            "or use -m echo",
        )
    urls = list(options.endpoints.base_urls)
    for url in urls:
        _check_base_url(url)
    if len(set(urls)) != len(urls):
        raise UsageError(
            f"--base-url names an endpoint twice: {urls}", fix="give each endpoint once"
        )
    if options.echo_delay is not None:
        raise UsageError(
            "--echo-delay applies to the echo model only", fix="drop it (or drop --base-url)"
        )
    timeout = TIMEOUT if options.timeout is None else options.timeout
    if not timeout > 0:
        raise UsageError(f"--timeout must be > 0, got {timeout}")
    key = None
    if options.api_key_var is not None:  # named: it must hold a key
        try:
            key = api_key_from_env(options.api_key_var)
        except ValueError as exc:
            raise UsageError(f"--api-key-var: {exc}") from None
    else:
        key = os.environ.get(DEFAULT_API_KEY_VAR, "").strip() or None
    limits = endpoint_limits(options)
    metrics = engine_metrics_urls(options.endpoints) if engine_metrics_on_client else []
    client = OpenAIClient(
        urls if len(urls) > 1 else options.base_url, key, timeout=timeout, limits=limits,
        limits_key=(options.base_url, options.api_key_var or DEFAULT_API_KEY_VAR),
        engine_metrics=metrics or None,
    )  # fmt: skip
    return ModelContext(client, options.name, sampling)


def engine_metrics_urls(given: Endpoints) -> list[str]:
    """Every `--engine-metrics URL`, checked: each an http(s) URL, and one per `--base-url`
    (in the same order) when there are many; a `UsageError` naming the flag otherwise."""
    found = list(given.engine_metrics)
    if not found:
        return []
    for url in found:
        try:
            EngineMetrics(url)
        except ValueError as exc:
            raise UsageError(
                f"--engine-metrics: {exc}",
                fix="e.g. --engine-metrics http://127.0.0.1:8000/metrics",
            ) from None
    urls = given.base_urls
    if len(found) != max(1, len(urls)):
        raise UsageError(
            f"--engine-metrics given {len(found)} times for {len(urls)} --base-url: give one "
            f"per --base-url, in the same order",
            fix="e.g. --base-url http://h1:8000/v1 --base-url http://h2:8000/v1 "
            "--engine-metrics http://h1:8000/metrics --engine-metrics http://h2:8000/metrics",
        )
    return found


def check_engine_metrics(options: ModelOptions, window: int | AdaptiveBounds) -> None:
    """`--engine-metrics` moves an adaptive window: `window` (`-c`) with one endpoint, each
    endpoint's own (`--max-connections`, adaptive unless a fixed N) with many. One that would
    move nothing is a `UsageError` naming the flags."""
    found = engine_metrics_urls(options.endpoints)
    if not found or _is_echo(options):  # the echo model: `model_context` refuses the flag
        return
    if len(options.endpoints.base_urls) > 1:
        connections = options.max_connections
        if connections is not None and not isinstance(connections, AdaptiveBounds):
            raise UsageError(
                f"--engine-metrics moves each endpoint's adaptive window, but "
                f"--max-connections {connections} fixes them",
                fix="give --max-connections as MIN-START-MAX (e.g. 1-8-1024), or drop it",
            )
    elif not isinstance(window, AdaptiveBounds):
        raise UsageError(
            f"--engine-metrics moves an adaptive window, but -c/--max-concurrent {window} is fixed",
            fix="give -c as MIN-START-MAX, e.g. -c 1-8-1024",
        )


# --- the models a server offers ------------------------------------------------------------------

LIST_TIMEOUT = 2.0
"""Seconds `offered_models` waits for a server's model list, all told: it is asked only to
word an error, which must not wait on a server that does not answer."""

_SHOWN = 12  # the most model names a message lists


@attrs.frozen
class OfferedModels:
    """What `GET {base_url}/models` said: the model ids it lists (`names`), or why none
    could be read (`problem`: a phrase, e.g. "HTTP 404" or the connection's error)."""

    url: str  # the listing's URL
    names: tuple[str, ...] | None = None
    problem: str | None = None

    def shown(self) -> str:
        """The names as a message lists them (the first few, and how many more)."""
        names = self.names or ()
        more = len(names) - _SHOWN
        return ", ".join(names[:_SHOWN]) + (f" (and {more} more)" if more > 0 else "")

    def closest(self, model: str) -> str | None:
        """The listed name closest to `model` (a case or a suffix apart), else the first."""
        if not self.names:
            return None
        by_case = {name.lower(): name for name in self.names}
        close = difflib.get_close_matches(model.lower(), list(by_case), n=1, cutoff=0.6)
        return by_case[close[0]] if close else self.names[0]


def offered_models(
    base_url: str, api_key: str | None = None, *, timeout: float = LIST_TIMEOUT
) -> OfferedModels:
    """The models the OpenAI-compatible server at `base_url` offers, from its
    ``GET {base_url}/models`` (OpenAI's and vLLM's ``{"data": [{"id": ...}, ...]}``), asked
    with `api_key` (as the model calls are) within `timeout` seconds. Never raises for what
    the server does: an `OfferedModels` with the `problem`. Runs a trio run of its own: call
    it from synchronous code (the command line's edge, or after its run); from a trio run it
    runs in a thread, blocking that run for up to `timeout` seconds."""
    url = f"{base_url.rstrip('/')}/models"
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}

    async def ask() -> OfferedModels:
        limit = Timeouts(connect=timeout, read=timeout, write=timeout, total=timeout)
        async with HTTPClient(timeouts=limit, max_response_bytes=4 * 2**20) as http:
            with trio.move_on_after(timeout):
                try:
                    response = await http.request("GET", url, headers=headers)
                except (HTTPError, ValueError) as exc:
                    return OfferedModels(url, problem=getattr(exc, "reason", None) or str(exc))
                return _read_models(url, response.status, response.body)
        return OfferedModels(url, problem=f"no answer within {timeout:g}s")

    if not trio.lowlevel.in_trio_run():
        return trio.run(ask)
    # Called from a trio run (a command's edge driven from one): a run of its own, in a
    # thread, which this one waits for (the timeout bounds it).
    with ThreadPoolExecutor(1) as thread:
        return thread.submit(trio.run, ask).result()


def _read_models(url: str, status: int, body: bytes) -> OfferedModels:
    if status != 200:
        return OfferedModels(url, problem=f"HTTP {status}")
    try:
        data = json.loads(body).get("data")
        names = tuple(str(item["id"]) for item in data)
    except (ValueError, TypeError, KeyError, AttributeError):
        return OfferedModels(url, problem='not a model list ({"data": [{"id": ...}, ...]})')
    return OfferedModels(url, names=names)


def api_key(options: ModelOptions) -> str | None:
    """The API key the model calls carry (from `api_key_var`'s variable), or None."""
    var = api_key_var(options)
    return None if var is None else os.environ[var].strip()


def _no_model(options: ModelOptions) -> UsageError:
    """`--base-url` without `-m`: the error, listing what the server offers."""
    url = options.endpoints.base_urls[0]
    offered = offered_models(url, api_key(options))
    message = f"--base-url {url} needs -m/--model: the model to ask the server for"
    if offered.names:
        example = shlex.quote(offered.names[0])
        return UsageError(message, fix=f"add -m {example} (the server offers {offered.shown()})")
    if offered.names is not None:
        return UsageError(message, fix=f"add -m MODEL ({offered.url} lists no model)")
    return UsageError(
        message,
        fix=f"add -m MODEL (could not list the models at {offered.url}: {offered.problem})",
    )


def endpoint_limits(options: ModelOptions) -> EndpointLimits | None:
    """The limits `--max-connections`, `--rpm` and `--tpm` set on the model's calls (one
    `EndpointLimits` for the process: every rollout's calls share it), or None."""
    connections, rpm, tpm = options.max_connections, options.rpm, options.tpm
    if connections is None and rpm is None and tpm is None:
        return None
    return EndpointLimits(connections=connections, rpm=rpm, tpm=tpm)


def limit_flags(options: ModelOptions) -> list[str]:
    """The model-call limit flags given (`--max-connections`, `--rpm`, `--tpm`)."""
    return options.given(("--max-connections", "max_connections"), ("--rpm", "rpm"),
                         ("--tpm", "tpm"))  # fmt: skip
