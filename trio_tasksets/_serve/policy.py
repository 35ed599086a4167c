"""What an env server lets a request do, decided by the server's own settings.

* `Access`: who may talk to it: the ``Host`` a request names (the bound name, or one in
  ``allow_hosts``), its ``Origin`` (none, unless in ``allow_origins``: a browser page is
  refused) and its bearer token.
* `ModelPolicy`: which model endpoints a run may reach (``base_urls``) and with which
  credential (``api_key_var``, read once at start): a request never names a variable or
  an endpoint the server was not started to allow (`Forbidden`, 403, before any outbound
  request).
* `Limits`: what one connection may hold (runs in flight, queued answers) and for how long
  (header and idle timeouts), and how many model clients the server keeps open.
* `ModelClients`: the server's model clients, one per distinct description, an LRU of at
  most `Limits.model_clients`; an evicted client is closed once no run uses it. The clients
  of one endpoint share its connection pool; the runs over many endpoints share one window
  per endpoint, moved by its engine's `/metrics` when the server reads them
  (``engine_metrics``), and `endpoint_stats` gives each endpoint's figures (``/health``).

A refusal names the server setting that would allow the request by its parameter name
(``max_runs``, ``base_urls``), written as a mark (``{max_runs}``) and spelled by `spell`
with the server's `spelling` (the command line passes its flags, ``--max-runs-per-connection``).
"""

from __future__ import annotations

import hmac
import json
import logging
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

import attrs
import trio

from .._core.adaptive import AdaptiveWindow
from .._core.exceptions import ConfigError, TrioTasksetsError
from .._core.limits import EndpointLimits
from .._core.window import Window
from .._models import EchoClient, ModelClient, OpenAIClient, describe
from .._models.engine import EngineMetrics
from .._models.pool import DEFAULT_WINDOW
from .._transport import HTTPClient, redact_url
from .wire import MAX_BODY_BYTES, ClientSpec, EchoSpec, Forbidden, OpenAISpec

log = logging.getLogger("trio_tasksets._serve")

MAX_MODEL_RETRIES = 10
"""`ModelPolicy.max_retries`' default: the most retries a run's model client may ask for."""
MIN_MODEL_BACKOFF = 0.1
"""`ModelPolicy.min_backoff`'s default: seconds; a run's smaller backoff is raised to it."""

ANY = "*"
"""In ``allow_hosts`` / ``allow_origins``: any value (behind a proxy that checks it)."""

SETTINGS = frozenset({
    "allow_hosts", "allow_origins",  # Access.for_bind
    "base_urls", "api_key_var", "max_retries", "min_backoff", "engine_metrics",  # ModelPolicy
    "max_body", "max_runs", "header_timeout", "idle_timeout",  # Limits
})  # fmt: skip
"""The server settings a refusal may name (each a parameter of `Access.for_bind`,
`ModelPolicy` or `Limits`)."""

_MARK = re.compile(r"\{(\w+)\}")


def spell(template: str, spelling: Mapping[str, str] | None = None) -> str:
    """`template` with each mark of a server setting (``{max_runs}``) spelled as `spelling`
    says (default, and for a name it lacks: the parameter name itself)."""
    spelling = spelling or {}

    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        return spelling.get(name, name) if name in SETTINGS else match.group(0)

    return _MARK.sub(one, template)


class RequestRefused(TrioTasksetsError):
    """A request refused before it is read: `status`, a message, extra response headers."""

    def __init__(self, status: int, message: str, *headers: tuple[bytes, bytes]) -> None:
        super().__init__(message)
        self.status = status
        self.headers = list(headers)


def log_refusal(scope: Mapping[str, Any], status: int, message: str) -> None:
    """One line on stderr for a refused request (newlines escaped, at most 300 characters)."""
    client = scope.get("client")
    peer = f"{client[0]}:{client[1]}" if client else "?"
    what = "WS" if scope.get("type") == "websocket" else scope.get("method", "?")
    text = message.replace("\r", "\\r").replace("\n", "\\n")
    if len(text) > 300:
        text = text[:297] + "..."
    log.warning("refused %d %s %s from %s: %s", status, what, scope.get("path", "?"), peer, text)


# --- who may talk to the server -------------------------------------------------------------


def _split_host(value: str) -> tuple[str, int | None] | None:
    """A ``Host`` value as (lower-case name, port or None); None if it is not one."""
    value = value.strip().lower()
    if value.startswith("["):
        name, sep, rest = value[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            return None
        port = rest[1:]
    else:
        name, _, port = value.partition(":")
    if not name or (port and not port.isdigit()):
        return None
    return name, int(port) if port else None


@attrs.frozen
class Access:
    """Who may talk to the server. Contract of `check` (in this order):

    - ``Host`` must be present and name `names` (the bound host, and for a loopback bind also
      ``localhost``, ``127.0.0.1`` and ``::1``) with the bound `port` (or no port when it is
      80), or an `allowed_hosts` entry (``name`` matches any port, ``name:port`` that port,
      ``*`` anything): else 400 (missing) / 403, against DNS rebinding;
    - an ``Origin`` header (what browsers send) is refused with 403 unless it is in
      `allowed_origins` (``*``: any): against cross-site requests from a web page;
    - with a `token`, ``Authorization: Bearer <token>`` (the scheme in any case) is
      required: else 401 with ``WWW-Authenticate: Bearer``; compared in constant time.
    """

    names: frozenset[str]
    port: int
    allowed_hosts: frozenset[str] = frozenset()
    allowed_origins: frozenset[str] = frozenset()
    token: bytes | None = attrs.field(default=None, repr=False)

    @classmethod
    def for_bind(
        cls,
        host: str,
        port: int,
        *,
        loopback: bool,
        allow_hosts: Iterable[str] = (),
        allow_origins: Iterable[str] = (),
        token: str | None = None,
    ) -> Access:
        """The access of a server bound to host:port (`loopback`: host is this machine only)."""
        names = {host.strip("[]").lower()}
        if loopback:
            names |= {"localhost", "127.0.0.1", "::1"}
        return cls(
            frozenset(names),
            port,
            frozenset(h.strip().lower() for h in allow_hosts),
            frozenset(o.strip().lower().rstrip("/") for o in allow_origins),
            token.encode() if token else None,
        )

    def check(
        self, headers: Iterable[tuple[bytes, bytes]], spelling: Mapping[str, str] | None = None
    ) -> None:
        """`RequestRefused` unless the request's headers pass (see the class docstring); its
        message names the setting that would allow the request as `spelling` says (`spell`)."""
        host: bytes | None = None
        origin: bytes | None = None
        auth: bytes | None = None
        hosts = 0
        for name, value in headers:
            if name == b"host":
                host = value
                hosts += 1
            elif name == b"origin":
                origin = value
            elif name == b"authorization":
                auth = value
        if host is None or hosts > 1:
            raise RequestRefused(400, "a request needs exactly one Host header")
        self._check_host(host.decode("latin-1"), spelling)
        if origin is not None:
            self._check_origin(origin.decode("latin-1"), spelling)
        if self.token is not None:
            self._check_token(auth)

    def _check_host(self, value: str, spelling: Mapping[str, str] | None) -> None:
        if ANY in self.allowed_hosts:
            return
        parts = _split_host(value)
        if parts is not None:
            name, port = parts
            if name in self.names and (port == self.port or (port is None and self.port == 80)):
                return
            allowed = self.allowed_hosts
            if name in allowed or (port is not None and f"{name}:{port}" in allowed):
                return
            if port is not None and f"[{name}]:{port}" in allowed:
                return
        template = (
            f"Host {value!r} is not this server's name (it serves "
            f"{_host_port(min(self.names), self.port)}); to serve requests for that name, "
            f"start it with {{allow_hosts}} {value.strip() or 'NAME'}"
        )
        raise RequestRefused(403, spell(template, spelling))

    def _check_origin(self, value: str, spelling: Mapping[str, str] | None) -> None:
        allowed = self.allowed_origins
        if ANY in allowed or value.strip().lower().rstrip("/") in allowed:
            return
        template = (
            f"Origin {value!r} is refused: requests from web pages are not served (start the "
            f"server with {{allow_origins}} {value.strip() or 'ORIGIN'} to allow that page)"
        )
        raise RequestRefused(403, spell(template, spelling))

    def _check_token(self, auth: bytes | None) -> None:
        scheme, _, given = (auth or b"").strip().partition(b" ")
        if scheme.lower() != b"bearer" or not given.strip():
            reason = "missing Authorization: Bearer token" if not auth else "wrong bearer token"
            raise RequestRefused(401, reason, (b"www-authenticate", b"Bearer"))
        assert self.token is not None
        if not hmac.compare_digest(given.strip(), self.token):
            raise RequestRefused(401, "wrong bearer token", (b"www-authenticate", b"Bearer"))


def _host_port(name: str, port: int) -> str:
    return f"[{name}]:{port}" if ":" in name else f"{name}:{port}"


# --- which endpoints and credentials a run may use ------------------------------------------


def normalize_base_url(url: str) -> str:
    """`url` in the form base URLs are compared in: scheme and host in lower case, no
    default port, no trailing slash, its password redacted (`redact_url`). Raises
    `ConfigError` (``url``) for one that is not http(s)://host..."""
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"expected http://host[:port]/path or https://..., got {url!r}", parameter="url"
        )
    if parts.query or parts.fragment:
        raise ConfigError(f"a base URL has no query or fragment, got {url!r}", parameter="url")
    port = parts.port
    default = {"http": 80, "https": 443}[scheme]
    host = parts.hostname.lower()
    host = f"[{host}]" if ":" in host else host
    netloc = host if port in (None, default) else f"{host}:{port}"
    if parts.username is not None or parts.password is not None:
        userinfo = parts.netloc.rpartition("@")[0]
        netloc = f"{userinfo}@{netloc}"
    # (a password is never sent, and a client keeps its URL redacted: compared redacted)
    return redact_url(f"{scheme}://{netloc}{parts.path.rstrip('/')}")


def _count(least: int) -> Callable[[object, attrs.Attribute[Any], object], None]:
    """A validator: an int >= `least`, else `ConfigError` naming the field."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            name = attribute.name
            raise ConfigError(f"{{{name}}} must be >= {least}, got {value!r}", parameter=name)

    return check


def _seconds(*, strict: bool) -> Callable[[object, attrs.Attribute[Any], object], None]:
    """A validator: a number of seconds, > 0 (`strict`) or >= 0, else `ConfigError` naming
    the field."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not (value > 0 if strict else value >= 0)
        ):
            name, bound = attribute.name, "> 0" if strict else ">= 0"
            raise ConfigError(f"{{{name}}} must be {bound} seconds, got {value!r}", parameter=name)

    return check


@attrs.frozen
class ModelPolicy:
    """The model endpoints and the credential a run may use. Contract of `check`:

    - an echo model needs nothing;
    - an OpenAI endpoint's ``base_url`` must be one of `base_urls` (compared after
      `normalize_base_url`): else `Forbidden` naming the setting ``base_urls``;
    - ``api_key_var`` must be null (no key) or the server's own `api_key_var`: else
      `Forbidden` naming ``api_key_var``. The key was read from the server's environment
      at start; a request cannot make the server read any other variable.
    - ``max_retries`` must be at most `max_retries`: else `Forbidden` naming it, so one run
      cannot make the server hammer its endpoint with its key. `build` raises ``backoff``
      and ``max_backoff`` to at least `min_backoff`.

    `engine_metrics` pairs an allowed endpoint (normalized) with its engine's ``/metrics``
    URL: the server reads it, never a request. A bad field is a `ConfigError` naming it.
    The policy crosses to a pool's worker processes as data (`to_json`, `from_json`): the
    key itself never does (each worker reads it from ``api_key_var``).
    """

    base_urls: frozenset[str] = frozenset()
    api_key_var: str | None = None
    api_key: str | None = attrs.field(default=None, repr=False)
    max_retries: int = attrs.field(default=MAX_MODEL_RETRIES, validator=_count(0))
    min_backoff: float = attrs.field(default=MIN_MODEL_BACKOFF, validator=_seconds(strict=False))
    engine_metrics: tuple[tuple[str, str], ...] = attrs.field(default=())

    @engine_metrics.validator
    def _check_engine_metrics(self, _: object, pairs: tuple[tuple[str, str], ...]) -> None:
        for base_url, url in pairs:
            if base_url not in self.base_urls:
                raise ConfigError(
                    f"{{engine_metrics}} names {base_url!r}, not an allowed endpoint "
                    f"({{base_urls}})",
                    parameter=("engine_metrics", "base_urls"),
                )
            try:
                EngineMetrics(url)  # an http(s) URL
            except ValueError as exc:
                raise ConfigError(
                    f"{{engine_metrics}}: {exc}", parameter="engine_metrics"
                ) from None

    def to_json(self) -> str:
        """The policy as JSON, without the key (`from_json` reads it again)."""
        return json.dumps({
            "base_urls": sorted(self.base_urls), "api_key_var": self.api_key_var,
            "max_retries": self.max_retries, "min_backoff": self.min_backoff,
            "engine_metrics": [list(pair) for pair in self.engine_metrics],
        })  # fmt: skip

    @classmethod
    def from_json(cls, text: str, environ: Mapping[str, str]) -> ModelPolicy:
        """The policy `to_json` wrote, its key read from `environ`. Raises `ConfigError` as
        `from_flags` does (the variable unset, ...), and `ValueError`, `KeyError` or
        `TypeError` for text `to_json` did not write."""
        data = json.loads(text)
        return cls.from_flags(
            data["base_urls"], data["api_key_var"], environ, max_retries=data["max_retries"],
            min_backoff=data["min_backoff"],
            engine_metrics=[(base, url) for base, url in data["engine_metrics"]],
        )  # fmt: skip

    @classmethod
    def from_flags(
        cls,
        base_urls: Iterable[str],
        api_key_var: str | None,
        environ: Mapping[str, str],
        *,
        max_retries: int = MAX_MODEL_RETRIES,
        min_backoff: float = MIN_MODEL_BACKOFF,
        engine_metrics: Iterable[tuple[str, str]] = (),
    ) -> ModelPolicy:
        """The policy of the endpoints runs may reach (`base_urls`), the variable holding the
        key (`api_key_var`, read from `environ`), the limits on a run's model client
        (`max_retries`, `min_backoff`) and `engine_metrics` (pairs of an endpoint and its
        engine's /metrics URL, the endpoint allowed with them). Raises `ConfigError` naming
        the parameter for a URL that is not one, a variable that is not set, or a negative
        number."""
        if max_retries < 0:
            raise ConfigError(
                f"{{max_retries}} must be >= 0, got {max_retries}", parameter="max_retries"
            )
        if not min_backoff >= 0:
            raise ConfigError(
                f"{{min_backoff}} must be >= 0 seconds, got {min_backoff}", parameter="min_backoff"
            )
        urls = set()
        for url in base_urls:
            try:
                urls.add(normalize_base_url(url))
            except ValueError as exc:
                raise ConfigError(f"{{base_urls}}: {exc}", parameter="base_urls") from None
        pairs = []
        for base_url, url in engine_metrics:
            try:
                EngineMetrics(url)
                normal = normalize_base_url(base_url)
            except ValueError as exc:
                raise ConfigError(
                    f"{{engine_metrics}}: {exc}", parameter="engine_metrics"
                ) from None
            urls.add(normal)
            pairs.append((normal, url))
        key = None
        if api_key_var is not None:
            key = environ.get(api_key_var, "").strip()
            if not key:
                raise ConfigError(
                    f"{{api_key_var}}: environment variable {api_key_var} is not set",
                    parameter="api_key_var",
                )
        return cls(frozenset(urls), api_key_var, key, max_retries, min_backoff, tuple(pairs))

    def check(self, spec: ClientSpec, spelling: Mapping[str, str] | None = None) -> None:
        """`Forbidden` unless `spec` is allowed (see the class docstring); its message names
        the setting that would allow it as `spelling` says (`spell`)."""
        if isinstance(spec, EchoSpec):
            return
        for requested in (spec.base_url, *spec.base_urls):  # many endpoints: each one
            try:
                url = normalize_base_url(requested)
            except ValueError as exc:
                problem = f"{exc}; the server reaches only its {{base_urls}}"
                raise Forbidden("ctx.client.base_url", spell(problem, spelling)) from None
            if url not in self.base_urls:
                allowed = ", ".join(sorted(self.base_urls)) or "none"
                problem = (
                    f"{requested!r} is not an endpoint this server may reach (allowed: "
                    f"{allowed}); start the server with {{base_urls}} {url}"
                )
                raise Forbidden("ctx.client.base_url", spell(problem, spelling))
        var = spec.api_key_var
        if var is not None and var != self.api_key_var:
            if self.api_key_var is None:
                fix = f"start the server with {{api_key_var}} {var} (the variable set there)"
            else:
                fix = (
                    f"the server's key is in {self.api_key_var} (its {{api_key_var}}): name "
                    f"that, or null for no key"
                )
            problem = f"{var!r} is not the server's key variable; {fix}"
            raise Forbidden("ctx.client.api_key_var", spell(problem, spelling))
        if spec.max_retries > self.max_retries:
            problem = (
                f"{spec.max_retries} retries is over this server's cap of {self.max_retries} "
                f"(its {{max_retries}}): ask for at most {self.max_retries}, or start the "
                f"server with {{max_retries}} {spec.max_retries}"
            )
            raise Forbidden("ctx.client.max_retries", spell(problem, spelling))

    def build(
        self,
        spec: ClientSpec,
        http_client: HTTPClient | None = None,
        *,
        limits: EndpointLimits | None = None,
        engines: Mapping[str, EngineMetrics] | None = None,
    ) -> ModelClient:
        """The model client `spec` stands for (on `http_client`, if given); call `check`
        first. It reaches the allowed URL itself (normalized), not the request's spelling.
        Many endpoints: their windows are `limits`' (keyed by the normalized URL) and their
        engines' readings `engines`' (by the same URL), when given."""
        if isinstance(spec, EchoSpec):
            return EchoClient(delay=spec.delay)
        assert isinstance(spec, OpenAISpec)
        urls = [normalize_base_url(url) for url in spec.base_urls]
        many = len(urls) > 1
        found = engines or {}
        return OpenAIClient(
            urls if many else normalize_base_url(spec.base_url),
            self.api_key if spec.api_key_var is not None else None,
            timeout=spec.timeout,
            max_retries=spec.max_retries,
            backoff=max(spec.backoff, self.min_backoff),
            max_backoff=max(spec.max_backoff, self.min_backoff),
            http_client=http_client,
            limits=limits if many else None,
            engine_metrics=[found.get(url) for url in urls] if many and found else None,
        )


# --- limits ---------------------------------------------------------------------------------


@attrs.frozen
class Limits:
    """What one connection may hold, and for how long.

    - `max_body`: bytes of a request body or WebSocket message (413 / close 1009);
    - `max_runs`: runs in flight on one WebSocket; one more is answered 429 (a client that
      honours ``/health``'s ``max_runs`` never sends it);
    - `max_queued`: answers waiting to be sent on one WebSocket; at it, the server stops
      reading that WebSocket until they are sent (backpressure: the client's sends block);
    - `header_timeout`: seconds for a connection to send a whole request head (from its
      start, or from the end of its last answer on a keep-alive connection), and then its
      body: hypercorn's ``keep_alive_timeout``, and 408 for a late body;
    - `idle_timeout`: seconds a WebSocket may stay with nothing in flight, queued or
      received before the server closes it (code 1001);
    - `model_clients`: model clients kept open (an LRU; an evicted one is closed once no run
      uses it).

    Each count is >= 1 and each timeout > 0 seconds: else `ConfigError` naming the field.
    """

    max_body: int = attrs.field(default=MAX_BODY_BYTES, validator=_count(1))
    max_runs: int = attrs.field(default=1024, validator=_count(1))
    max_queued: int = attrs.field(default=256, validator=_count(1))
    header_timeout: float = attrs.field(default=10.0, validator=_seconds(strict=True))
    idle_timeout: float = attrs.field(default=60.0, validator=_seconds(strict=True))
    model_clients: int = attrs.field(default=16, validator=_count(1))


class ModelClients:
    """The server's model clients, one per distinct description, at most `size` kept (least
    recently used evicted). The OpenAI clients of one endpoint share one HTTP connection
    pool (made once per allowed endpoint, so a description that differs only in `timeout`
    costs neither a pool nor its TLS set-up). An evicted client is closed by `reap` once the
    runs that use it (counted by `acquire` and `release`) are done; an echo client holds
    nothing and is not counted. `generation` changes on each eviction, so that a cache of
    contexts knows to drop its entries."""

    def __init__(
        self, policy: ModelPolicy, size: int, *, spelling: Mapping[str, str] | None = None
    ) -> None:
        self.policy = policy
        self.size = size
        self.spelling = spelling  # how a refusal names the server's settings (`spell`)
        self.generation = 0
        self._clients: OrderedDict[ClientSpec, ModelClient] = OrderedDict()
        self._users: dict[ModelClient, int] = {}  # open non-echo clients -> runs using them
        self._retired: list[ModelClient] = []
        self._pools: dict[str, HTTPClient] = {}  # by normalized base URL
        # Runs over many endpoints: one window per endpoint (by its normalized URL) for
        # every client, and one reader of its engine's /metrics (`engine_metrics`).
        self.endpoint_limits = EndpointLimits(connections=DEFAULT_WINDOW)
        self.engines = {base: EngineMetrics(url) for base, url in policy.engine_metrics}

    def _pool(self, spec: ClientSpec) -> HTTPClient | None:
        if not isinstance(spec, OpenAISpec):
            return None
        url = normalize_base_url(spec.base_url)
        pool = self._pools.get(url)
        if pool is None:  # as OpenAIClient makes its own; the timeouts are set per request
            pool = self._pools[url] = HTTPClient()
        return pool

    def __len__(self) -> int:
        return len(self._clients)

    def get(self, spec: ClientSpec) -> ModelClient:
        """The client for `spec` (checked by the policy first: `Forbidden`)."""
        client = self._clients.get(spec)
        if client is not None:
            self._clients.move_to_end(spec)
            return client
        self.policy.check(spec, self.spelling)
        client = self._clients[spec] = self.policy.build(
            spec, self._pool(spec), limits=self.endpoint_limits, engines=self.engines
        )
        if not isinstance(spec, EchoSpec):  # an echo client holds nothing to close
            self._users[client] = 0
        while len(self._clients) > self.size:
            _, old = self._clients.popitem(last=False)
            self.generation += 1
            if old in self._users:
                self._retired.append(old)
        return client

    async def feed_engines(self) -> None:
        """Read each engine's `/metrics` (the policy's `engine_metrics`) every second into its
        endpoint's window until cancelled; without any, return at once."""
        async with trio.open_nursery() as nursery:
            for url, metrics in self.engines.items():
                window = self._window(url)
                nursery.start_soon(
                    metrics.feed, window if isinstance(window, AdaptiveWindow) else None
                )

    def endpoint_stats(self) -> dict[str, dict[str, Any]]:
        """Per endpoint that a run over many endpoints reached (or whose engine is read):
        the figures of each client's `ClientDescription.endpoint_stats`, summed over the
        server's clients (calls, errors, 429s, ejections, calls in flight; the latency of the
        client with the most calls; the shared window; the engine's last reading)."""
        found: dict[str, dict[str, Any]] = {}
        most: dict[str, int] = {}  # the calls of the busiest client, per endpoint
        summed = ("in_flight", "calls", "errors", "throttled", "ejections")
        clients = (*self._clients.values(), *self._retired)
        readers = [d.endpoint_stats for d in map(describe, clients) if d.endpoint_stats]
        for read in readers:
            for url, figures in (read() or {}).items():
                have = found.get(url)
                if have is None:
                    found[url], most[url] = dict(figures), figures["calls"]
                    continue
                for key in summed:
                    have[key] += figures[key]
                if figures["calls"] > most[url]:
                    most[url] = figures["calls"]
                    for key in ("latency_mean_s", "latency_p50_s", "latency_p99_s"):
                        have[key] = figures[key]
                if figures["state"] != "live":
                    have["state"] = figures["state"]
                have["ejected"] = have["ejected"] or figures["ejected"]
        for url, metrics in self.engines.items():
            entry = found.setdefault(url, {"state": "live", "in_flight": 0, "calls": 0})
            entry["engine"] = metrics.figures()
            entry["window"] = self._window(url).size
        return found

    def _window(self, url: str) -> Window:
        connections = self.endpoint_limits.connections
        assert connections is not None  # made with DEFAULT_WINDOW
        return connections.window(url)

    def acquire(self, client: ModelClient) -> bool:
        """Count a run of `client`; True if it is counted (then `release` it)."""
        users = self._users.get(client)
        if users is None:
            return False
        self._users[client] = users + 1
        return True

    def release(self, client: ModelClient) -> None:
        """The end of a run of `client` (counted by `acquire`, or not counted at all)."""
        users = self._users.get(client)
        if users is not None:
            self._users[client] = users - 1

    @property
    def retiring(self) -> bool:
        """Whether evicted clients wait to be closed (`reap`)."""
        return bool(self._retired)

    async def reap(self) -> None:
        """Close the evicted clients no run uses (shielded)."""
        if not self._retired:
            return
        idle = [c for c in self._retired if self._users.get(c, 0) == 0]
        self._retired = [c for c in self._retired if self._users.get(c, 0) > 0]
        with trio.CancelScope(shield=True):
            for client in idle:
                self._users.pop(client, None)
                await client.aclose()

    async def aclose(self) -> None:
        """Close every client and connection pool (shielded)."""
        clients = [*self._clients.values(), *self._retired]
        pools = list(self._pools.values())
        self._clients.clear()
        self._retired.clear()
        self._users.clear()
        self._pools.clear()
        with trio.CancelScope(shield=True):
            for client in clients:
                await client.aclose()
            for pool in pools:
                await pool.aclose()
