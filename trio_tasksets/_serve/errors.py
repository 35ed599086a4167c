"""The served path's client error: what the server or the connection to it did."""

from __future__ import annotations

from .._core.exceptions import TrioTasksetsError
from .._transport import ConnectError, ConnectionClosed, HTTPError, HTTPTimeout, ProtocolError


class EnvServerError(TrioTasksetsError):
    """The env server could not be reached, went away, or refused a request.

    `url` is the server's; `status` the HTTP status it answered with (None when there was no
    answer: refused, reset, closed mid-request). An eval retries it only when its
    `RetryPolicy.include` names it (``--retry-on EnvServerError``), see `EnvClient.run_slot`.
    """

    def __init__(self, message: str, *, url: str, status: int | None = None) -> None:
        super().__init__(message)
        self.url = url
        self.status = status

    @property
    def retryable(self) -> bool:
        """No answer, or a 5xx: another attempt may succeed. A 4xx will not."""
        return self.status is None or self.status >= 500


def transport_reason(exc: HTTPError) -> str:
    """Why a request got no answer, from the transport's error."""
    if isinstance(exc, HTTPTimeout):
        return exc.reason
    if isinstance(exc, ConnectError):
        return f"connection refused or unreachable ({exc.reason})"
    if isinstance(exc, ConnectionClosed | ProtocolError):
        return f"the connection was closed or reset mid-request ({exc.reason})"
    return f"{type(exc).__name__}: {exc.reason}"
