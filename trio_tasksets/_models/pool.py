"""Many endpoints behind one model client: least-loaded routing, sticky rollouts and groups,
ejection of a dead endpoint and its probing back, a window and figures per endpoint.

`OpenAIClient([url, ...])` builds an `EndpointPool` over one `OpenAIClient` per URL (each
with the same options) and hands each `chat` to it (`EndpointPool.run`). The rules:

* **A window per endpoint.** Each endpoint's calls hold a place in its own window (the
  pool's `EndpointLimits`, keyed by the endpoint: adaptive `1-8-1024` unless the caller's
  `limits` say otherwise), moved by that endpoint's 429s and latencies alone.
* **Least loaded.** A call goes to the endpoint whose window is least used: the fewest
  calls routed to it and not yet answered, as a fraction of its window's size (ties: the
  one with fewer calls so far). While every live endpoint's window is full, calls wait in
  the pool, in one queue, and each goes to the first endpoint that frees a place: none
  idles while another queues.
* **Sticky.** All calls made under one `sticky()` block go to the endpoint the first one
  went to (its prefix cache holds their shared prefix). The eval runs each rollout in its
  own block; an enclosing block (a group's) wins over the inner ones, so a group's
  rollouts share one endpoint. A binding moves only when its endpoint is ejected, or when
  its window is full while another endpoint has room (an imbalanced pool rebalances).
* **Eject and probe back.** An endpoint whose call fails to connect or times out (after its
  client's own retries) is ejected: no call goes to it for `probe_after` seconds (doubling
  on each failed probe, up to `max_probe_after`); then one call at a time probes it, and a
  probe that succeeds brings it back. The failed call is retried at once on another
  endpoint (each endpoint at most once per call); with every endpoint ejected, the one due
  back first is probed.
* **Figures.** `stats()` gives, per URL: its state (``live``, ``ejected``, or ``probing``:
  ejected, with one probe call in flight), the calls in flight, calls, errors, 429s (attempts
  answered 429, retried or not), ejections, whether it is ejected now, latency mean/p50/p99
  (seconds, over the last 10,000 calls), its window's size, and with its engine's
  `/metrics` (`OpenAIClient(engine_metrics=...)`) that engine's last reading (`engine`:
  running, waiting, KV usage, preemptions).

The binding lives in a context variable (`sticky`), not in a table, so the pool keeps no
per-rollout state: memory is bounded by the endpoints, not by the rollouts.
"""

from __future__ import annotations

import contextvars
import math
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import attrs
import trio

from .._core.adaptive import AdaptiveBounds
from .._core.exceptions import ConfigError
from .._core.limits import EndpointLimits
from .._core.window import Window
from .base import ModelConnectionError, ModelTimeoutError
from .engine import EngineMetrics


class EndpointClient(Protocol):
    """What the pool needs of one endpoint's client (an `OpenAIClient` of one URL); the
    calls it routes are the caller's (`EndpointPool.run`)."""

    base_url: str
    limits: EndpointLimits | None
    limits_key: Hashable
    engine_metrics: EngineMetrics | None  # its engine's /metrics, if known

    @property
    def throttled(self) -> int: ...  # attempts answered 429

    async def aclose(self) -> None: ...


__all__ = ["EndpointPool", "EndpointStats", "sticky"]

DEFAULT_WINDOW = AdaptiveBounds(1, 8, 1024)
LATENCIES_KEPT = 10_000


class sticky:  # lower case: it reads as a call in `with sticky(key):`
    """``with sticky(key):`` the model calls made in the block (by this task and the tasks it
    starts) go to one endpoint of an `EndpointPool`. An enclosing block wins (a group's over
    its rollouts') unless `replace`. Without a pool, it does nothing. A class, not a
    generator: every attempt of every episode enters one."""

    # The block is its own binding (`_binding`: the key, and the endpoint its first call
    # chose): one object fewer per attempt of every episode than a separate record.
    __slots__ = ("_endpoint", "_key", "_replace", "_token")

    def __init__(self, key: Hashable, *, replace: bool = False) -> None:
        self._key = key
        self._replace = replace
        self._endpoint: int | None = None

    def __enter__(self) -> None:
        if _binding.get() is not None and not self._replace:
            self._token: contextvars.Token[sticky | None] | None = None
            return
        self._endpoint = None
        self._token = _binding.set(self)

    def __exit__(self, *exc_info: object) -> None:
        if self._token is not None:
            _binding.reset(self._token)


_binding: contextvars.ContextVar[sticky | None] = contextvars.ContextVar(
    "trio_tasksets_sticky_endpoint", default=None
)


def sticky_key() -> Hashable | None:
    """The key of the innermost effective `sticky` block, or None."""
    binding = _binding.get()
    return None if binding is None else binding._key


@attrs.define
class EndpointStats:
    """One endpoint's figures (see `EndpointPool.stats`)."""

    url: str
    calls: int = 0
    errors: int = 0
    ejections: int = 0
    latencies: deque[float] = attrs.field(factory=lambda: deque(maxlen=LATENCIES_KEPT))

    def to_dict(
        self,
        *,
        ejected: bool,
        window: int | None,
        state: str = "live",
        in_flight: int = 0,
        throttled: int = 0,
        engine: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        ordered = sorted(self.latencies)

        def quantile(q: float) -> float | None:
            if not ordered:
                return None
            return round(ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)], 6)

        mean = round(sum(ordered) / len(ordered), 6) if ordered else None
        found = {
            "state": state,
            "in_flight": in_flight,
            "calls": self.calls,
            "errors": self.errors,
            "throttled": throttled,
            "ejections": self.ejections,
            "ejected": ejected,
            "latency_mean_s": mean,
            "latency_p50_s": quantile(0.5),
            "latency_p99_s": quantile(0.99),
            "window": window,
        }
        if engine is not None:
            found["engine"] = engine
        return found


C = TypeVar("C", bound=EndpointClient)
T = TypeVar("T")


class _Endpoint(Generic[C]):
    def __init__(self, index: int, client: C) -> None:
        self.index = index
        self.client = client
        self.stats = EndpointStats(client.base_url)
        self.pending = 0  # calls routed here and not yet answered
        self.ejected_until = -math.inf
        self.probe_after = 0.0
        self.probing = False

    def window(self) -> Window | None:
        limits = self.client.limits
        if limits is None or limits.connections is None:
            return None
        return limits.connections.window(self.client.limits_key)

    def size(self) -> float:
        window = self.window()
        return math.inf if window is None else window.size

    def load(self) -> float:
        return self.pending / self.size()

    def has_room(self) -> bool:
        return self.pending < self.size()

    def state(self, now: float) -> str:
        """``live``; ``ejected`` (no call goes to it until it is due back); ``probing`` (due
        back, one probe call in flight, or none yet)."""
        if self.ejected_until == -math.inf:
            return "live"
        return "ejected" if now < self.ejected_until else "probing"

    def usable(self, now: float) -> bool:
        if now >= self.ejected_until:
            return not (self.probing and self.ejected_until > -math.inf)
        return False


class EndpointPool(Generic[C]):
    """Routes calls (`run`) over `clients` (one client per endpoint); see the module.

    `probe_after` (seconds) is the first ejection's length, doubling per failed probe up to
    `max_probe_after`. No client, one endpoint twice or a bad `probe_after` raise
    `ConfigError`.
    """

    def __init__(
        self,
        clients: Sequence[C],
        *,
        probe_after: float = 1.0,
        max_probe_after: float = 30.0,
    ) -> None:
        if len(clients) < 1:
            raise ConfigError(
                "an EndpointPool needs at least one of {clients}", parameter="clients"
            )
        urls = [client.base_url for client in clients]
        if len(set(urls)) != len(urls):
            raise ConfigError(f"{{base_url}} lists an endpoint twice: {urls}", parameter="base_url")
        if not 0 < probe_after <= max_probe_after:
            raise ConfigError(
                "need 0 < {probe_after} <= {max_probe_after} (seconds)",
                parameter=("probe_after", "max_probe_after"),
            )
        self.endpoints = [_Endpoint(i, client) for i, client in enumerate(clients)]
        self.probe_after = probe_after
        self.max_probe_after = max_probe_after
        self._freed = trio.Event()  # set (and replaced) whenever a call leaves an endpoint

    @property
    def urls(self) -> list[str]:
        return [endpoint.client.base_url for endpoint in self.endpoints]

    async def _room(self, tried: set[int]) -> None:
        """Wait while every live endpoint's window is full: the calls queue here, in one
        queue, and each goes to whichever endpoint frees a place first."""
        while True:
            now = trio.current_time()
            live = [e for e in self.endpoints if e.index not in tried and e.usable(now)]
            if not live or any(e.has_room() for e in live):
                return
            await self._freed.wait()

    def _pick(self, tried: set[int]) -> _Endpoint[C] | None:
        now = trio.current_time()
        candidates = [e for e in self.endpoints if e.index not in tried]
        if not candidates:
            return None
        live = [e for e in candidates if e.usable(now)]
        binding = _binding.get()
        if binding is not None and binding._endpoint is not None:
            bound = self.endpoints[binding._endpoint]
            if bound in live and (bound.has_room() or not any(e.has_room() for e in live)):
                return bound
        if not live:  # every endpoint left is ejected: probe the one due back first
            chosen = min(candidates, key=lambda e: (e.ejected_until, e.index))
        else:
            chosen = min(live, key=lambda e: (e.load(), e.stats.calls, e.index))
        if binding is not None:
            binding._endpoint = chosen.index
        return chosen

    async def run(self, call: Callable[[C], Awaitable[T]]) -> T:
        """`call(client)` (one chat completion, say) on the least loaded live endpoint's
        client (or this context's sticky one). A failure to connect or a timeout
        (`ModelConnectionError`, `ModelTimeoutError`) ejects the endpoint and runs `call`
        again on another, each endpoint at most once: once every endpoint failed, the last
        failure is raised; any other exception is raised at once."""
        tried: set[int] = set()
        error: BaseException | None = None
        while True:
            await self._room(tried)
            endpoint = self._pick(tried)
            if endpoint is None:  # every endpoint failed this call
                assert error is not None
                raise error
            tried.add(endpoint.index)
            now = trio.current_time()
            probe = endpoint.ejected_until > -math.inf and now >= endpoint.ejected_until
            if probe:
                endpoint.probing = True
            endpoint.pending += 1
            endpoint.stats.calls += 1
            started = now
            try:
                result = await call(endpoint.client)
            except (ModelConnectionError, ModelTimeoutError) as exc:
                endpoint.stats.errors += 1
                self._eject(endpoint)
                error = exc
                continue
            except Exception:
                endpoint.stats.errors += 1
                raise
            finally:
                endpoint.pending -= 1
                if probe:
                    endpoint.probing = False
                self._freed.set()  # a place is free: the calls waiting for one pick again
                self._freed = trio.Event()
            endpoint.stats.latencies.append(trio.current_time() - started)
            if endpoint.ejected_until > -math.inf:  # a probe answered: it is back
                endpoint.ejected_until = -math.inf
                endpoint.probe_after = 0.0
            return result

    def _eject(self, endpoint: _Endpoint[C]) -> None:
        endpoint.probe_after = min(
            self.max_probe_after,
            self.probe_after if endpoint.probe_after == 0 else 2 * endpoint.probe_after,
        )
        if endpoint.ejected_until <= trio.current_time():
            endpoint.stats.ejections += 1
        endpoint.ejected_until = trio.current_time() + endpoint.probe_after

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per URL: state (live, ejected, probing), calls in flight, calls, errors, 429s
        (`throttled`), ejections, ejected (now), latency mean/p50/p99 in seconds, the size of
        its window (None: unbounded), and its engine's last reading (`engine`) when its
        `/metrics` is known."""
        now = trio.current_time() if trio.lowlevel.in_trio_run() else -math.inf
        found = {}
        for endpoint in self.endpoints:
            window = endpoint.window()
            metrics = endpoint.client.engine_metrics
            found[endpoint.client.base_url] = endpoint.stats.to_dict(
                ejected=now < endpoint.ejected_until,
                window=None if window is None else window.size,
                state=endpoint.state(now) if now > -math.inf else "live",
                in_flight=endpoint.pending,
                throttled=endpoint.client.throttled,
                engine=None if metrics is None else metrics.figures(),
            )
        return found

    async def aclose(self) -> None:
        for endpoint in self.endpoints:
            with trio.CancelScope(shield=True):
                await endpoint.client.aclose()


def pool_limits(limits: EndpointLimits | None) -> EndpointLimits:
    """The limits a pool's endpoints share: the caller's, or per-endpoint adaptive windows
    (`DEFAULT_WINDOW`) when they bound no connections."""
    if limits is not None and limits.connections is not None:
        return limits
    return EndpointLimits(
        connections=DEFAULT_WINDOW,
        rpm=None if limits is None else limits.rpm,
        tpm=None if limits is None else limits.tpm,
    )
