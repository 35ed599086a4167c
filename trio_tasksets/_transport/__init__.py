"""The HTTP/1.1 client the model clients use: trio + h11 with a keep-alive pool that follows
its load (docs/models.md, and docs/benchmarks.md for why not httpx).

Rooms: `client` (`HTTPClient`, the pool, deadlines), `connection` (one connection: sockets,
request heads, responses), `messages` (`Request`, `Response`), `memory` (a handler that
answers in memory instead of a server: the test seam), `support` (errors, timeouts, proxies,
TLS, decoding). Of the rest of the package, only its exceptions (`_core.exceptions`) are
imported here.
"""

from .client import HTTPClient, PoolStats
from .messages import Request, Response
from .support import (
    CUT_SLOT,
    ConnectError,
    ConnectionClosed,
    CutSlot,
    DecodingError,
    HTTPError,
    HTTPTimeout,
    ProtocolError,
    ProxyError,
    RequestCut,
    ResponseTooLarge,
    Timeouts,
    UnsupportedProxy,
    parse_retry_after,
    redact_url,
)

__all__ = [
    "CUT_SLOT",
    "ConnectError",
    "ConnectionClosed",
    "CutSlot",
    "DecodingError",
    "HTTPClient",
    "HTTPError",
    "HTTPTimeout",
    "PoolStats",
    "ProtocolError",
    "ProxyError",
    "Request",
    "RequestCut",
    "Response",
    "ResponseTooLarge",
    "Timeouts",
    "UnsupportedProxy",
    "parse_retry_after",
    "redact_url",
]
