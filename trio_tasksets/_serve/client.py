"""`EnvClient`: `run(slot, ctx) -> Episode` against an env server, and `health()`."""

from __future__ import annotations

import json
import math
import time
from typing import Any
from urllib.parse import urlsplit

import trio

from .._core.exceptions import ConfigError
from .._env.env import Episode, OnComplete, RetryPolicy, RunSlot, complete_slot
from .._models import ModelContext
from .._transport import HTTPError
from .errors import EnvServerError, transport_reason
from .transport import HandshakeRefused, HTTPConnections, TooLarge, WSConnection, WSGone
from .wire import MAX_ANSWER_BYTES, MAX_BODY_BYTES, WS_PATH, RunRequestEncoder


class _WSPool:
    """The WebSocket connections of an `EnvClient`: opened on first use, one per server
    worker unless `size` is given (the kernel deals connections to the workers that accept
    them, so up to 4 per worker are tried to reach distinct workers, by the pid each worker
    names at the handshake). A run goes on the connection with the fewest runs in flight;
    when every connection holds the server's ``max_runs`` (per connection, from
    ``/health``), one more is opened. A connection that ends is dropped, and one idle for
    half the server's ``idle_timeout`` is closed before the server would; the next run opens
    new ones."""

    def __init__(self, client: EnvClient, size: int | None) -> None:
        self.client = client
        self.size = size
        self.connections: list[WSConnection] = []
        self.available: bool | None = None  # None: not asked yet; False: use HTTP
        self.max_bytes = MAX_BODY_BYTES
        self.max_runs: int | None = None
        self.retire_after = math.inf  # seconds idle before a connection is closed here
        self.target = WS_PATH
        self.closed = False
        self._lock = trio.Lock()

    def live(self) -> WSConnection | None:
        """The open connection with the fewest runs in flight, if it has room for one more
        (else None: all are full, or none is open)."""
        best: WSConnection | None = None
        for connection in self.connections:
            if connection.gone is None and (
                best is None or connection.outstanding < best.outstanding
            ):
                best = connection
        if best is None or not best.has_room():
            return None
        if not best.outstanding and trio.current_time() - best.idle_since > self.retire_after:
            best.retire("closed by the client after it was idle")
            return self.live()
        return best

    async def pick(self) -> WSConnection | None:
        """A live connection with room (opened if needed), or None when the server has no
        ``/ws``."""
        if self.closed:
            raise EnvServerError(f"{self.client.url}: the client was closed", url=self.client.url)
        async with self._lock:
            connection = self.live()
            if connection is not None or self.available is False:
                return connection
            live = [c for c in self.connections if c.gone is None]
            opened = await (self._open_one() if live else self._open())
            if self.closed:  # aclose() ran while these were opening: theirs too
                with trio.CancelScope(shield=True):
                    for connection in opened:
                        await connection.close()
                raise EnvServerError(
                    f"{self.client.url}: the client was closed", url=self.client.url
                )
            self.connections = [*live, *opened]
            return self.live()

    async def _connect(self) -> WSConnection:
        client = self.client
        host, port = client._connections.host, client._connections.port
        return await WSConnection.open(
            host, port, client._prefix + self.target, client._ws_headers, self.max_bytes,
            max_message=client.max_message_bytes, limit=self.max_runs,
        )  # fmt: skip

    async def _open_one(self) -> list[WSConnection]:
        """One more connection, when all are full."""
        connection = await self._connect()
        connection.start()
        return [connection]

    async def _open(self) -> list[WSConnection]:
        client = self.client
        health = await client.health()
        target = health.get("websocket")
        if not isinstance(target, str):
            self.available = False  # a server without /ws: HTTP only
            return []
        self.available = True
        self.target = target
        self.max_bytes = int(health.get("max_body", MAX_BODY_BYTES))
        max_runs = health.get("max_runs")
        self.max_runs = max_runs if type(max_runs) is int and max_runs > 0 else None
        idle = health.get("idle_timeout")
        if isinstance(idle, int | float) and idle > 0:
            self.retire_after = idle / 2
        workers = int(health.get("workers", 1))
        size = self.size or workers
        wanted = min(size, workers)
        connections: list[WSConnection] = []
        seen: set[str] = set()
        try:
            for _ in range(size if self.size else 4 * workers):
                connection = await self._connect()
                if connection.pid in seen and len(seen) < wanted:
                    await connection.close()  # a worker we have: try for another
                    continue
                seen.add(connection.pid)
                connections.append(connection)
                connection.start()
                if len(connections) >= size:
                    break
        except BaseException:
            with trio.CancelScope(shield=True):
                for connection in connections:
                    await connection.close()
            raise
        return connections

    async def aclose(self) -> None:
        self.closed = True
        connections, self.connections = self.connections, []
        for connection in connections:
            await connection.close()


class EnvClient(trio.abc.AsyncResource):
    """A client of an env server: `await client.run(slot, ctx) -> Episode`.

    `transport="websocket"` (the default) multiplexes the runs over a few long-lived
    WebSockets to ``/ws`` (`connections` of them; None: one per server worker), many runs per
    message; a server without ``/ws``, an ``https://`` URL, or a request over the server's
    size limit uses ``POST /run`` instead. `transport="http"`: one ``POST /run`` per run on
    keep-alive connections, at most `max_connections` open (None: no bound; an eval sizes
    it to its window). `health()` is always HTTP. Runs are untimed (an episode may take
    long); connecting times out after `connect_timeout`. A bad setting (a `url` that is not
    http(s)://host, an unknown `transport`, `connections` or `max_message_bytes` < 1) raises
    a `ConfigError` naming it. A message or answer from the
    server over `max_message_bytes` ends that connection (its runs fail). Every failure to
    get an answer raises `EnvServerError` naming `url`. `api_key_var` is the variable an
    OpenAI model's description asks the server's key from: it must be the one the server
    was started with (``--api-key-var``). Use `async with` or `aclose()`.
    """

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        api_key_var: str | None = None,
        max_connections: int | None = None,
        connect_timeout: float = 10.0,
        transport: str = "websocket",
        connections: int | None = None,
        max_message_bytes: int = MAX_ANSWER_BYTES,
    ) -> None:
        if transport not in ("websocket", "http"):
            raise ConfigError(
                f"{{transport}} must be 'websocket' or 'http', got {transport!r}",
                parameter="transport",
            )
        if connections is not None and connections < 1:
            raise ConfigError(
                f"{{connections}} must be >= 1, got {connections}", parameter="connections"
            )
        if max_message_bytes < 1:
            raise ConfigError(
                f"{{max_message_bytes}} must be >= 1, got {max_message_bytes}",
                parameter="max_message_bytes",
            )
        self.url = url.rstrip("/")
        self.transport = transport
        self.max_message_bytes = max_message_bytes
        self._connect_timeout = connect_timeout
        self.api_key_var = api_key_var
        self._encoder = RunRequestEncoder(api_key_var)
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(
                f"the env server's {{url}} must be http://host:port or https://..., got {url!r}",
                parameter="url",
            )
        port = parts.port or (443 if parts.scheme == "https" else 80)
        self._prefix = parts.path
        self._connections = HTTPConnections(
            self.url, parts.hostname, port, max_connections, connect_timeout,
            max_message_bytes,
        )  # fmt: skip
        self._headers: dict[str, str] = {}
        self._ws_headers: list[tuple[bytes, bytes]] = []
        token = token.strip() if token else None
        if token:
            self._headers["authorization"] = f"Bearer {token}"
            self._ws_headers.append((b"authorization", f"Bearer {token}".encode()))
        self._json_headers = {**self._headers, "content-type": "application/json"}
        self._ws = _WSPool(self, connections)
        if transport == "http" or parts.scheme != "http":
            self._ws.available = False

    def __repr__(self) -> str:
        return f"EnvClient({self.url!r})"

    async def _request(self, method: str, path: str, body: bytes = b"") -> Any:
        headers = self._headers if not body else self._json_headers
        if self._connections.http.is_closed:
            raise EnvServerError(f"{self.url}: the client was closed", url=self.url)
        try:
            status, content = await self._connections.request(method, path, headers, body)
        except TooLarge as exc:
            raise EnvServerError(f"env server {self.url}: {exc}", url=self.url) from None
        except HTTPError as exc:
            reason = transport_reason(exc)
            raise EnvServerError(f"env server {self.url} is gone: {reason}", url=self.url) from exc
        try:
            payload = json.loads(content)
        except ValueError:
            payload = None
        if status != 200:
            if isinstance(payload, dict):
                detail = payload.get("error")
            else:
                detail = content[:200].decode(errors="replace")
            raise EnvServerError(
                f"env server {self.url} answered {method} {path} with HTTP {status}: {detail}",
                url=self.url,
                status=status,
            )
        if payload is None:
            raise EnvServerError(
                f"env server {self.url} answered {path} with a body that is not JSON",
                url=self.url,
                status=status,
            )
        return payload

    async def health(self) -> dict[str, Any]:
        """The server's ``GET /health``: ``{"ok": true, "pid", "running", "served", ...}``.

        Raises `EnvServerError` (naming the URL) when the server cannot be reached or answers
        with an error or something that is not a health object."""
        payload = await self._request("GET", "/health")
        if not isinstance(payload, dict):
            raise EnvServerError(f"env server {self.url}: /health is not an object", url=self.url)
        keepalive = payload.get("header_timeout")
        if isinstance(keepalive, int | float) and keepalive > 0:  # close idle ones first
            http = self._connections.http
            http.keepalive_expiry = min(http.keepalive_expiry, keepalive / 2)
        return payload

    async def run(self, slot: RunSlot[Any], ctx: ModelContext) -> Episode:
        """Run one slot on the server and return its episode. Cancelling this call cancels
        the episode on the server: a ``cancel`` message on a WebSocket, or closing the
        connection of a ``POST /run``.

        The episode's own failure is recorded on it, as `Env.run_slot` does; a run the
        server could not answer raises `EnvServerError` (its `status` the server's, if it
        answered one), and a slot or context that cannot travel raises `TravelError` (a
        `ConfigError`)."""
        body = self._encoder.encode(slot, ctx)
        connection = None
        if self._ws.available is not False:
            connection = self._ws.live() or await self._ws_connection()
        if connection is None or len(body) + 64 > self._ws.max_bytes:
            # Over the server's message limit a run would close its WebSocket (1009) and
            # fail the others on it: send it alone, as POST /run (which answers 413).
            row = await self._request("POST", "/run", body)
        else:
            row = await self._ws_run(connection, body)
        try:
            return Episode._from_fresh_row(row)
        except (KeyError, TypeError, ValueError) as exc:
            raise EnvServerError(
                f"env server {self.url} answered /run with a row that is not an episode: {exc}",
                url=self.url,
            ) from exc

    async def _ws_connection(self) -> WSConnection | None:
        try:
            with trio.fail_after(self._connect_timeout):
                return await self._ws.pick()
        except trio.TooSlowError:
            reason = f"the WebSocket handshake took over {self._connect_timeout:g}s"
        except HandshakeRefused as exc:
            raise EnvServerError(
                f"env server {self.url} refused the WebSocket with HTTP {exc.status}: {exc}",
                url=self.url,
                status=exc.status,
            ) from exc
        except (OSError, WSGone) as exc:
            reason = f"connection refused or unreachable ({exc})"
        raise EnvServerError(f"env server {self.url} is gone: {reason}", url=self.url)

    async def _ws_run(self, connection: WSConnection, body: bytes) -> Any:
        answer = await connection.call(body)
        if answer is None:
            raise EnvServerError(f"env server {self.url} is gone: {connection.gone}", url=self.url)
        status = answer.get("status")
        if status != 200 or not isinstance(answer.get("row"), dict):
            raise EnvServerError(
                f"env server {self.url} answered a run on {WS_PATH} with status {status}: "
                f"{answer.get('error')}",
                url=self.url,
                status=status if isinstance(status, int) else None,
            )
        return answer["row"]

    async def run_slot(
        self,
        slot: RunSlot[Any],
        ctx: ModelContext,
        *,
        on_complete: OnComplete | None = None,
        retries: RetryPolicy | None = None,
    ) -> Episode:
        """`Env.run_slot` through the server: one `run` per slot (more only on a retry), the
        slot's live state set, and `on_complete(episode)` run once, shielded.

        A retryable `EnvServerError` (no answer, or 5xx) is retried per `retries` only when
        its `include` names it (or a base class): an empty `include` means "any episode
        error" to the env, not "a server that went away".
        """
        slot.started = time.time()
        attempt = 0
        while True:
            attempt += 1
            try:
                episode = await self.run(slot, ctx)
                break
            except EnvServerError as exc:
                if not retry_server_error(retries, exc, attempt):
                    raise
                await trio.sleep(retries.delay(attempt) if retries is not None else 0)
        return await complete_slot(slot, episode, on_complete)

    async def aclose(self) -> None:
        """Close the WebSockets (runs still waiting on them fail) and the idle HTTP
        connections (one in use closes when its request ends)."""
        await self._ws.aclose()
        await self._connections.aclose()


def retry_server_error(policy: RetryPolicy | None, exc: EnvServerError, attempt: int) -> bool:
    if policy is None or not exc.retryable:
        return False
    named = {klass.__name__ for klass in type(exc).__mro__} & set(policy.include)
    return bool(named) and policy.should_retry(exc, attempt)
