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
  the pool, in one queue, first come first served: each freed place is handed to the
  call at the head (a call that just failed elsewhere goes to the head), so a newcomer
  never takes a place ahead of a waiting call, and none idles while another queues. The
  wait is one of the runner's own, `parked("connection")`, and the call's connection wait
  (`report_wait`): the run's health counts it as such, never as working time nor as a
  stall, as one endpoint's window does.
* **Sticky.** All calls made under one `sticky()` block go to the endpoint the first one
  went to (its prefix cache holds their shared prefix). The eval runs each rollout in its
  own block; an enclosing block (a group's) wins over the inner ones, so a group's
  rollouts share one endpoint. A binding moves only when its endpoint is ejected, or when
  its window is full while another endpoint has room (an imbalanced pool rebalances).
* **Eject and probe back.** An endpoint whose call fails to connect or times out is
  ejected: at the first such attempt while another endpoint is live (an endpoint that
  accepts and then says nothing costs one `timeout`, not one per retry), else once its
  client's own retries are spent. No call goes to it for `probe_after` seconds (doubling
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
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Sequence
from contextlib import asynccontextmanager
from typing import Any, Generic, Protocol, TypeVar

import attrs
import trio

from .._core.adaptive import AdaptiveBounds, Outcome
from .._core.exceptions import ConfigError
from .._core.limits import CallObserver, EndpointLimits, observe_calls, parked, report_wait
from .._core.window import Window
from .._transport import RequestCut
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


class _Waiter:
    """A call waiting in the pool's queue: what it may not use (`tried`), its `binding`
    (its caller's `sticky` block), and once served the place it holds (`_take`)."""

    __slots__ = ("binding", "gone", "placed", "served", "tried")

    def __init__(self, tried: set[int], binding: sticky | None) -> None:
        self.tried = tried
        self.binding = binding
        self.placed: _Placed[Any] | None = None
        self.served = trio.Event()
        self.gone = False  # cancelled while waiting: skipped when its turn comes


_Placed = tuple["_Endpoint[C]", bool]  # where a call goes, and whether it probes it


class _FULL:
    """`EndpointPool._choose`'s answer when every live endpoint's window is full."""


class _Watch(CallObserver):
    """Watches one call on one endpoint of a pool: when an attempt timed out or could not
    connect and the client is about to retry it there (`resting`), while another endpoint
    is live, the endpoint is ejected and the call cancelled (`scope`), to be retried at once
    elsewhere: a hung endpoint costs one `timeout`, not one per retry."""

    __slots__ = ("endpoint", "pool", "scope", "timed_out")

    def __init__(self, pool: EndpointPool[Any], endpoint: _Endpoint[Any]) -> None:
        self.pool = pool
        self.endpoint = endpoint
        self.scope = trio.CancelScope()
        self.timed_out = False  # the attempt it cancelled on timed out (else: no connection)

    @asynccontextmanager
    async def resting(self, outcome: Outcome | None) -> AsyncIterator[None]:
        if (outcome is None or outcome is Outcome.TIMEOUT) and self.pool._others_live(
            self.endpoint
        ):
            self.timed_out = outcome is Outcome.TIMEOUT
            self.scope.cancel()
        yield


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
        self._queue: deque[_Waiter] = deque()  # calls waiting for a place, first come first

    @property
    def urls(self) -> list[str]:
        return [endpoint.client.base_url for endpoint in self.endpoints]

    @property
    def queued(self) -> int:
        """Calls waiting in the pool's queue for a place at an endpoint."""
        return sum(1 for waiter in self._queue if not waiter.gone)

    def _choose(self, tried: set[int], binding: sticky | None) -> _Endpoint[C] | type[_FULL] | None:
        """Where a call goes now: its binding's endpoint if live with room, else the least
        loaded live one with room; `_FULL` when every live endpoint's window is full; with
        no live endpoint left, the ejected one due back first (probed); None once the call
        has tried every endpoint."""
        now = trio.current_time()
        candidates = [e for e in self.endpoints if e.index not in tried]
        if not candidates:
            return None
        live = [e for e in candidates if e.usable(now)]
        if not live:  # every endpoint left is ejected: probe the one due back first
            return min(candidates, key=lambda e: (e.ejected_until, e.index))
        if binding is not None and binding._endpoint is not None:
            bound = self.endpoints[binding._endpoint]
            if bound in live and bound.has_room():
                return bound
        chosen = min(live, key=lambda e: (e.load(), e.stats.calls, e.index))
        return chosen if chosen.has_room() else _FULL

    def _take(self, endpoint: _Endpoint[C], binding: sticky | None) -> _Placed[C]:
        """A place at `endpoint` for a call (bound there from now on, if it has a binding):
        the endpoint, and whether the call is its probe (it is due back and no other call
        probes it): marked at once, so that no other call is placed there meanwhile."""
        endpoint.pending += 1
        if binding is not None:
            binding._endpoint = endpoint.index
        due = -math.inf < endpoint.ejected_until <= trio.current_time()
        probe = due and not endpoint.probing
        if probe:
            endpoint.probing = True
        return endpoint, probe

    def _others_live(self, endpoint: _Endpoint[C]) -> bool:
        """Whether an endpoint other than `endpoint` is live (not ejected)."""
        return any(e is not endpoint and e.ejected_until == -math.inf for e in self.endpoints)

    async def _place(self, tried: set[int], *, retry: bool) -> _Placed[C] | None:
        """A place at an endpoint for one call (its `pending` already counted; see `_take`),
        or None once
        the call has tried every endpoint. While every live endpoint's window is full the
        call waits in the pool's one queue, first come first served (a `retry` of a call
        that failed elsewhere at its head): a newcomer never takes a place ahead of a
        waiter. The wait is `parked("connection")` and reported as the call's connection
        wait (`report_wait`): not working time, not a stall."""
        binding = _binding.get()
        if self._queue and not retry:
            self._dispatch()  # places freed since (a window grew, an endpoint came due)
        if retry or not self._queue:
            found = self._choose(tried, binding)
            if found is None:
                return None
            if found is not _FULL:
                assert isinstance(found, _Endpoint)
                return self._take(found, binding)
        waiter = _Waiter(tried, binding)
        if retry:
            self._queue.appendleft(waiter)
        else:
            self._queue.append(waiter)
            if self._choose(set(), None) is not _FULL:  # room that those ahead cannot use
                self._dispatch()
        began = trio.current_time()
        try:
            with parked("connection"):
                await waiter.served.wait()
        except BaseException:
            waiter.gone = True
            if waiter.placed is not None:  # served as it was cancelled: give it back
                endpoint, probe = waiter.placed
                endpoint.pending -= 1
                if probe:
                    endpoint.probing = False
                self._dispatch()
            raise
        report_wait(trio.current_time() - began)
        return waiter.placed

    def _dispatch(self) -> None:
        """Hand the places free now to the waiting calls, in their order. A waiter that
        cannot use any (it failed on the endpoints that have room) keeps its turn while the
        ones behind it are served."""
        queue = self._queue
        skipped: list[_Waiter] = []
        while queue:
            waiter = queue[0]
            if waiter.gone:
                queue.popleft()
                continue
            found = self._choose(waiter.tried, waiter.binding)
            if found is _FULL:
                if waiter.tried and self._choose(set(), None) is not _FULL:
                    skipped.append(queue.popleft())  # room, but not for this one
                    continue
                break
            queue.popleft()
            if found is not None:
                assert isinstance(found, _Endpoint)
                waiter.placed = self._take(found, waiter.binding)
            waiter.served.set()
        queue.extendleft(reversed(skipped))

    async def run(self, call: Callable[[C], Awaitable[T]]) -> T:
        """`call(client)` (one chat completion, say) on the least loaded live endpoint's
        client (or this context's sticky one), once it has a place there (see `_place`).
        A failure to connect or a timeout (`ModelConnectionError`, `ModelTimeoutError`, or
        one attempt's while another endpoint is live) ejects the endpoint and runs `call`
        again on another, each endpoint at most once: once every endpoint failed, the last
        failure is raised; any other exception is raised at once."""
        tried: set[int] = set()
        error: BaseException | None = None
        while True:
            placed = await self._place(tried, retry=error is not None)
            if placed is None:  # every endpoint failed this call
                assert error is not None
                raise error
            endpoint, probe = placed
            tried.add(endpoint.index)
            endpoint.stats.calls += 1
            started = trio.current_time()
            watch = _Watch(self, endpoint)
            try:
                with watch.scope, observe_calls(watch):
                    result = await call(endpoint.client)
            except (ModelConnectionError, ModelTimeoutError) as exc:
                endpoint.stats.errors += 1
                self._eject(endpoint)
                error = exc
                continue
            except RequestCut:  # its caller cut it (a policy update): not the endpoint's fault
                raise
            except Exception:
                endpoint.stats.errors += 1
                raise
            finally:
                endpoint.pending -= 1
                if probe:
                    endpoint.probing = False
                self._dispatch()  # a place is free: the next waiting call takes it
            if watch.scope.cancelled_caught:  # an attempt failed; the others answer
                endpoint.stats.errors += 1
                self._eject(endpoint)
                error = _failure(endpoint.client, timed_out=watch.timed_out)
                continue
            endpoint.stats.latencies.append(trio.current_time() - started)
            if endpoint.ejected_until > -math.inf:  # a probe answered: it is back
                endpoint.ejected_until = -math.inf
                endpoint.probe_after = 0.0
            return result

    def _eject(self, endpoint: _Endpoint[C]) -> None:
        if endpoint.ejected_until > trio.current_time():
            return  # ejected already (by a call that failed there at the same time)
        endpoint.probe_after = min(
            self.max_probe_after,
            self.probe_after if endpoint.probe_after == 0 else 2 * endpoint.probe_after,
        )
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


def _failure(client: EndpointClient, *, timed_out: bool) -> Exception:
    """The error of a call `_Watch` moved off `client`'s endpoint after one attempt."""
    url = client.base_url
    if timed_out:
        timeout = float(getattr(client, "timeout", 0.0))
        return ModelTimeoutError(
            f"request to {url} timed out after {timeout:g}s (ejected at once: another endpoint "
            f"is live)",
            url=url,
            timeout=timeout,
        )
    return ModelConnectionError(
        f"cannot reach {url} (ejected at once: another endpoint is live)", url=url
    )


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
