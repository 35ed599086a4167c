"""The served path's client error: what the server or the connection to it did."""

from __future__ import annotations

from .._exceptions import TrioTasksetsError


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


def transport_reason(exc: Exception) -> str | None:
    """Why a request got no answer, for an httpcore transport error; None for any other."""
    import httpcore

    detail = str(exc) or type(exc).__name__
    if isinstance(exc, httpcore.ConnectError | httpcore.ConnectTimeout):
        return f"connection refused or unreachable ({detail})"
    if isinstance(exc, httpcore.NetworkError | httpcore.RemoteProtocolError):
        return f"the connection was closed or reset mid-request ({detail})"
    other = (httpcore.ProtocolError, httpcore.TimeoutException, httpcore.UnsupportedProtocol)
    return f"{type(exc).__name__}: {detail}" if isinstance(exc, other) else None
