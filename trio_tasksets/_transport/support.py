"""The parts of the HTTP transport that do no I/O: errors, timeouts, where a URL's requests
go (proxies from the environment), TLS contexts, body decoding and ``Retry-After``, and how
a caller cuts its requests (`CUT_SLOT`).

Depends on the standard library, attrs and trio (the cut's cancel scope) only;
`transport.client` builds on it.
"""

from __future__ import annotations

import base64
import contextvars
import email.utils
import functools
import ipaddress
import math
import os
import re
import ssl
import zlib
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Protocol
from urllib.parse import unquote, urlsplit

import attrs
import trio

from .._core.exceptions import ConfigError, TrioTasksetsError

__all__ = [
    "CUT_SLOT",
    "ConnectError",
    "ConnectionClosed",
    "CutSlot",
    "DecodingError",
    "HTTPError",
    "HTTPTimeout",
    "ProtocolError",
    "Proxies",
    "Proxy",
    "ProxyError",
    "RequestCut",
    "ResponseTooLarge",
    "Route",
    "Timeouts",
    "UnsupportedProxy",
    "decode_body",
    "no_proxy_matches",
    "parse_retry_after",
    "proxies_from_env",
    "redact_url",
    "route_for",
    "tls_context",
]


# --- errors ---------------------------------------------------------------------------------


class HTTPError(TrioTasksetsError):
    """A request got no usable response. ``url`` is the URL requested, ``reason`` what
    went wrong; the message is ``"{url}: {reason}"``."""

    def __init__(self, reason: str, *, url: str) -> None:
        super().__init__(f"{url}: {reason}")
        self.url = url
        self.reason = reason


# --- cutting a request from outside (a policy update's abort) ---------------------------------


class CutSlot(Protocol):
    """What a caller hands the requests it makes (`CUT_SLOT`), to cut them from another task:
    while one is in flight its cancel scope is in `scope` (None between requests); setting
    `cut` and cancelling `scope` ends it with `RequestCut`, and a request begun once `cut`
    is set ends so at once."""

    cut: bool
    scope: trio.CancelScope | None


CUT_SLOT: contextvars.ContextVar[CutSlot | None] = contextvars.ContextVar(
    "trio_tasksets_cut_slot", default=None
)
"""The `CutSlot` of the requests made in this context, if any: a caller that may cut them
(`tt.Policy`'s gate) sets it around its call, so that it needs no cancel scope of its own: the
request's own (one per request, for its timeouts) is the one cut."""


class RequestCut(TrioTasksetsError):
    """A request its caller cut (`CutSlot`): not an `HTTPError` (nothing failed, nothing to
    retry); what the request had streamed to ``on_body`` before is all it gets. The caller
    that cut it catches it (`tt.Policy`'s gate); it reaches no one else."""

    def __init__(self, url: str) -> None:
        super().__init__(f"{url}: cut by its caller")
        self.url = url


class ConnectError(HTTPError):
    """No connection could be opened: DNS, refused, unreachable, TLS handshake or
    certificate verification, or a proxy that refused the tunnel. Nothing was sent."""


class ProxyError(ConnectError):
    """The proxy answered the ``CONNECT`` with an error status (``status``)."""

    def __init__(self, reason: str, *, url: str, status: int) -> None:
        super().__init__(reason, url=url)
        self.status = status


class ConnectionClosed(HTTPError):
    """The connection closed or broke before the whole response arrived.
    ``request_sent``: the request may have reached the server (it was handed to the
    kernel, in part or whole); the transport never resends such a request itself."""

    def __init__(self, reason: str, *, url: str, request_sent: bool) -> None:
        super().__init__(reason, url=url)
        self.request_sent = request_sent


class ProtocolError(HTTPError):
    """The server's bytes are not valid HTTP/1.1."""


class HTTPTimeout(HTTPError, TimeoutError):
    """A timeout expired. ``phase`` is ``"connect"``, ``"write"``, ``"read"``, ``"pool"``
    (waiting for a free connection under ``max_connections``) or ``"total"``;
    ``timeout`` is the limit in seconds."""

    def __init__(self, reason: str, *, url: str, phase: str, timeout: float) -> None:
        super().__init__(reason, url=url)
        self.phase = phase
        self.timeout = timeout


class ResponseTooLarge(HTTPError):
    """The response body (before or after decoding) is over ``limit`` bytes."""

    def __init__(self, reason: str, *, url: str, limit: int) -> None:
        super().__init__(reason, url=url)
        self.limit = limit


class DecodingError(HTTPError):
    """The body's ``Content-Encoding`` is unsupported or its bytes do not decode."""


class UnsupportedProxy(ConfigError):
    """A proxy setting this transport cannot use (raised when the client is created)."""


# --- timeouts --------------------------------------------------------------------------------


def _check_timeout(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not (isinstance(value, int | float) and value > 0):
        raise ConfigError(
            f"Timeouts.{{{attribute.name}}} must be > 0 seconds or None, got {value!r}",
            parameter=attribute.name,
        )


@attrs.frozen
class Timeouts:
    """Seconds each phase of a request may take; ``None``: no limit.

    ``connect``: DNS, TCP, a proxy's ``CONNECT`` and the TLS handshake. ``write``: sending the
    request. ``read``: the longest wait for the next bytes of the response (not the whole
    response). ``total``: the whole request, waiting for a free connection included. A value
    that is not > 0 or None raises `ConfigError` naming it."""

    connect: float | None = attrs.field(default=10.0, validator=_check_timeout)
    read: float | None = attrs.field(default=120.0, validator=_check_timeout)
    write: float | None = attrs.field(default=120.0, validator=_check_timeout)
    total: float | None = attrs.field(default=None, validator=_check_timeout)


# --- routes and proxies ----------------------------------------------------------------------


@attrs.frozen(cache_hash=True)
class Proxy:
    """An ``http://`` proxy: where to connect, and its ``Proxy-Authorization`` if any."""

    host: str
    port: int
    authorization: bytes | None
    shown: str  # the proxy URL without its password, for messages


@attrs.frozen(cache_hash=True)
class Route:
    """Where the requests for one URL go and what their request line and Host say.
    Requests with the same ``key`` can share keep-alive connections."""

    scheme: str
    host: str
    port: int
    target: bytes
    host_header: bytes
    proxy: Proxy | None
    key: tuple[str, str, int, Proxy | None]


_DEFAULT_PORTS = {"http": 80, "https": 443}


_USERINFO_PASSWORD = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^\s:/?#@]*):[^\s/?#]*@")


def redact_url(text: str) -> str:
    """`text` (a URL, a command-line argument, a log line) with the password of every URL in
    it replaced by ``***`` (``http://user:***@host/v1``), for anything shown or recorded: the
    one redaction of proxy, Redis and model endpoint URLs."""
    if "@" not in text:
        return text  # (the usual case)
    return _USERINFO_PASSWORD.sub(r"\1:***@", text)


def _parse_proxy(variable: str, value: str) -> Proxy:
    raw = value if "://" in value else "http://" + value
    parts = urlsplit(raw)
    scheme = parts.scheme.lower()
    shown = redact_url(raw)
    if scheme != "http":
        raise UnsupportedProxy(
            f"{variable}={shown}: {scheme}:// proxies are not supported, only http:// ones "
            f"(https:// targets go through them with CONNECT). Unset {variable}, exempt the "
            "host with NO_PROXY, or create the client with trust_env=False"
        )
    if not parts.hostname:
        raise UnsupportedProxy(f"{variable}={shown}: the proxy URL has no host")
    auth = None
    if parts.username is not None:
        userpass = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        auth = b"Basic " + base64.b64encode(userpass.encode())
    return Proxy(parts.hostname, parts.port or 80, auth, shown)


@attrs.frozen
class Proxies:
    """The proxies for ``http://`` and ``https://`` targets and the ``NO_PROXY`` list."""

    http: Proxy | None = None
    https: Proxy | None = None
    no_proxy: tuple[str, ...] = ()

    def for_url(self, scheme: str, host: str, port: int) -> Proxy | None:
        proxy = self.http if scheme == "http" else self.https
        if proxy is None or no_proxy_matches(self.no_proxy, host, port):
            return None
        return proxy


def _env(name: str, environ: Mapping[str, str]) -> tuple[str, str] | None:
    """(variable, value) for the lower- then upper-case spelling of ``name``."""
    for variable in (name.lower(), name.upper()):
        value = environ.get(variable, "").strip()
        # HTTP_PROXY is ignored under CGI, where a client's Proxy: header sets it (httpoxy).
        if value and not (variable == "HTTP_PROXY" and "REQUEST_METHOD" in environ):
            return variable, value
    return None


def proxies_from_env(environ: Mapping[str, str] | None = None) -> Proxies:
    """Read ``HTTP_PROXY``, ``HTTPS_PROXY``, ``ALL_PROXY`` and ``NO_PROXY`` (either case).
    Raises `UnsupportedProxy` naming the variable for a proxy that is not ``http://``."""
    environ = os.environ if environ is None else environ
    found: dict[str, Proxy | None] = {}
    every = _env("all_proxy", environ)
    fallback = _parse_proxy(*every) if every else None
    for scheme in ("http", "https"):
        own = _env(f"{scheme}_proxy", environ)
        found[scheme] = _parse_proxy(*own) if own else fallback
    no = _env("no_proxy", environ)
    entries = tuple(e.strip().lower() for e in no[1].split(",") if e.strip()) if no else ()
    return Proxies(found["http"], found["https"], entries)


def no_proxy_matches(entries: tuple[str, ...], host: str, port: int) -> bool:
    """Whether ``NO_PROXY`` ``entries`` exempt ``host``: ``*``; a host or domain (also its
    subdomains, a leading dot optional), optionally with ``:port``; an IP or CIDR range."""
    host = host.lower().strip("[]")
    try:
        address: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(host)
    except ValueError:
        address = None
    for entry in entries:
        if entry == "*":
            return True
        name, _, entry_port = entry.rpartition(":") if entry.count(":") == 1 else (entry, "", "")
        if entry_port and entry_port != str(port):
            continue
        name = name.strip("[]").lstrip(".")
        if address is not None:
            try:
                if address in ipaddress.ip_network(name, strict=False):
                    return True
            except ValueError:
                pass
            continue
        if host == name or host.endswith("." + name):
            return True
    return False


def route_for(url: str, proxies: Proxies) -> Route:
    """The route of an absolute ``http://`` or ``https://`` URL. Raises a `ConfigError` (a
    ValueError) naming ``url`` if it is not one."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not parts.hostname:
        raise ConfigError(
            f"{{url}} must be an absolute http:// or https:// URL, got {url!r}", parameter="url"
        )
    try:
        port = parts.port or _DEFAULT_PORTS[scheme]
    except ValueError as exc:
        raise ConfigError(
            f"{{url}}: the URL {url!r} has a bad port: {exc}", parameter="url"
        ) from None
    host = parts.hostname
    netloc = parts.netloc.rpartition("@")[2]
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    proxy = proxies.for_url(scheme, host, port)
    # Through a proxy, an http:// request names its whole URL; https:// ones are tunnelled.
    target = f"http://{netloc}{path}" if proxy is not None and scheme == "http" else path
    key = (scheme, host, port, proxy)
    return Route(scheme, host, port, target.encode("ascii"), netloc.encode("ascii"), proxy, key)


# --- TLS ------------------------------------------------------------------------------------


@functools.cache
def _default_tls() -> ssl.SSLContext:
    context = ssl.create_default_context()  # the system store (and SSL_CERT_FILE/_DIR)
    try:
        import certifi
    except ImportError:  # pragma: no cover - certifi comes with the project's dependencies
        pass
    else:
        context.load_verify_locations(certifi.where())
    context.set_alpn_protocols(["http/1.1"])
    return context


def tls_context(ca_bundle: str | os.PathLike[str] | None = None) -> ssl.SSLContext:
    """The context https connections verify servers with: the system trust store plus
    certifi's, or only the CA certificates in ``ca_bundle`` (a PEM file or a c_rehash'd
    directory). Raises `ConfigError` naming ``ca_bundle`` if it cannot be loaded."""
    if ca_bundle is None:
        return _default_tls()
    path = os.fspath(ca_bundle)
    try:
        if os.path.isdir(path):
            context = ssl.create_default_context(capath=path)
        else:
            context = ssl.create_default_context(cafile=path)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"{{ca_bundle}}={path!r} cannot be loaded as PEM CA certificates: {exc}",
            parameter="ca_bundle",
        ) from None
    context.set_alpn_protocols(["http/1.1"])
    return context


# --- bodies and headers ----------------------------------------------------------------------


def _inflate(data: bytes, wbits: int, limit: int) -> bytes:
    """Decompress ``data`` (gzip members or one zlib/raw deflate stream), at most ``limit``
    bytes out; raises ``OverflowError`` over it and ``zlib.error`` on bad bytes."""
    out: list[bytes] = []
    size = 0
    while data:
        decompressor = zlib.decompressobj(wbits)
        chunk = decompressor.decompress(data, limit + 1 - size)
        size += len(chunk)
        if size > limit or decompressor.unconsumed_tail:
            raise OverflowError
        out.append(chunk)
        if not decompressor.eof:
            raise zlib.error("truncated stream")
        data = decompressor.unused_data if wbits > 16 else b""
    return b"".join(out)


def decode_body(body: bytes, content_encoding: str, *, limit: int, url: str) -> bytes:
    """``body`` without its ``Content-Encoding`` (gzip, deflate, identity, in any stack).
    Raises `ResponseTooLarge` when the decoded body is over ``limit`` bytes and
    `DecodingError` for any other encoding or bytes that do not decode."""
    codings = [c.strip().lower() for c in content_encoding.split(",") if c.strip()]
    for coding in reversed(codings):
        try:
            if coding in ("gzip", "x-gzip"):
                body = _inflate(body, 16 + zlib.MAX_WBITS, limit)
            elif coding == "deflate":
                try:  # RFC 9110 deflate is zlib-wrapped; some servers send raw deflate
                    body = _inflate(body, zlib.MAX_WBITS, limit)
                except zlib.error:
                    body = _inflate(body, -zlib.MAX_WBITS, limit)
            elif coding != "identity":
                raise DecodingError(
                    f"the server sent Content-Encoding {coding!r}, which this client does "
                    "not decode (it asks for gzip or deflate)",
                    url=url,
                )
        except OverflowError:
            raise ResponseTooLarge(
                f"the {coding} body is over the limit of {limit:,} bytes once decoded",
                url=url,
                limit=limit,
            ) from None
        except zlib.error as exc:
            raise DecodingError(f"the {coding} body does not decode: {exc}", url=url) from None
    return body


def parse_retry_after(value: str | None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or an HTTP date), or
    ``None`` if absent or unparseable. Never negative."""
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - datetime.now(UTC)).total_seconds()
    if not math.isfinite(seconds):
        return None
    return max(0.0, seconds)
