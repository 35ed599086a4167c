"""`--metrics-port N`: a run's counters and health as Prometheus text, for `eval`,
`worker` and `serve`.

`Metrics` is one run's registry (its own `prometheus_client.CollectorRegistry`, never the
global one): counters of episodes by outcome and error type, model calls and tokens, the
seconds waited per kind of limit; gauges of the slots in flight, the window's size and the
scheduler's lag (read from a `health.Health` when scraped). `serve_metrics` answers
``GET /metrics`` on a port of its own, in the run's trio loop (no thread); it binds
127.0.0.1 unless told otherwise, reads at most 8 KiB of a request within 5 s, and answers
anything but ``GET /metrics`` with 404. `prometheus_client` is the `metrics` extra.

The metric names (all prefixed ``trio_tasksets_``): ``episodes_total{outcome, error_type}``,
``model_calls_total``, ``tokens_total{kind}`` (``prompt``, ``completion``),
``waited_seconds_total{kind}``, ``in_flight``, ``peak_in_flight``, ``window_size``,
``scheduler_lag_seconds`` (the latest probe) and ``scheduler_lag_max_seconds``; with
streamed replies ``ttft_seconds`` and ``tpot_seconds`` (summaries: quantiles 0.5 and 0.99 of
the newest replies, count and sum of all); a served
env adds ``served_total{outcome}`` (``served``, ``failed``, ``cancelled``, ``rejected``).
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import trio

from .._core.health import Health
from .._core.window import Window

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

__all__ = ["Metrics", "check_metrics", "serve_metrics"]

_PREFIX = "trio_tasksets_"
_MAX_REQUEST = 8192
_READ_WITHIN = 5.0


def check_metrics() -> str | None:
    """None when `prometheus_client` can be imported, else what to install."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return "pip install 'prometheus-client>=0.20' (a dependency of trio-tasksets)"
    return None


class Metrics:
    """The Prometheus metrics of one run: `record(episode_row_fields)` per finished episode;
    the rest is read from `health`, `window` and `extra` at each scrape."""

    def __init__(
        self,
        health: Health,
        *,
        window: Window | None = None,
        extra: Callable[[], dict[str, int]] | None = None,
        endpoints: Callable[[], dict[str, dict[str, Any]] | None] | None = None,
    ) -> None:
        from prometheus_client.registry import CollectorRegistry

        self.health = health
        self.window = window
        self.extra = extra  # e.g. an env server's counts: {"served": 3, "failed": 0, ...}
        self.endpoints = endpoints  # many endpoints: their figures (OpenAIClient.endpoint_stats)
        self.episodes: Counter[tuple[str, str]] = Counter()
        self.tokens: Counter[str] = Counter()
        self.registry: CollectorRegistry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))

    def record(self, ok: bool, error_type: str | None, usage: dict[str, int]) -> None:
        """One finished episode: its outcome, its last error's type, its token usage."""
        self.episodes["ok" if ok else "failed", "" if ok else (error_type or "unknown")] += 1
        for kind in ("prompt", "completion"):
            self.tokens[kind] += usage.get(f"{kind}_tokens", 0)

    def text(self) -> bytes:
        """The Prometheus text exposition of every metric, now."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class _Collector:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        m, health = self.metrics, self.metrics.health
        episodes = CounterMetricFamily(
            _PREFIX + "episodes", "Episodes finished, by outcome and (failed) error type",
            labels=["outcome", "error_type"],
        )  # fmt: skip
        for (outcome, error_type), count in sorted(m.episodes.items()):
            episodes.add_metric([outcome, error_type], count)
        yield episodes
        yield CounterMetricFamily(
            _PREFIX + "model_calls", "Model calls that returned a reply, in this process",
            value=health.model_calls,
        )  # fmt: skip
        tokens = CounterMetricFamily(_PREFIX + "tokens", "Tokens the replies used", labels=["kind"])
        for kind in ("prompt", "completion"):
            tokens.add_metric([kind], m.tokens[kind])
        yield tokens
        waited = CounterMetricFamily(
            _PREFIX + "waited_seconds", "Seconds waited on the runner's own limits, by kind",
            labels=["kind"],
        )  # fmt: skip
        for kind, seconds in sorted(health.waited.items()):
            waited.add_metric([kind], seconds)
        yield waited
        yield GaugeMetricFamily(_PREFIX + "in_flight", "Slots running now", value=health.in_flight)
        yield GaugeMetricFamily(
            _PREFIX + "peak_in_flight", "Most slots running at once", value=health.peak_in_flight
        )
        if m.window is not None:
            yield GaugeMetricFamily(
                _PREFIX + "window_size", "The rollout window's size now", value=m.window.size
            )
        yield GaugeMetricFamily(
            _PREFIX + "scheduler_lag_seconds", "The trio scheduler's lag, latest probe",
            value=health.lag_now(),
        )  # fmt: skip
        yield GaugeMetricFamily(
            _PREFIX + "scheduler_lag_max_seconds", "The trio scheduler's largest lag so far",
            value=health.lag_max,
        )  # fmt: skip
        if health.streamed:
            yield from _reply_families(health)
        found = m.endpoints() if m.endpoints is not None else None
        if found:
            yield from _endpoint_families(found)
        if m.extra is not None:
            served = CounterMetricFamily(
                _PREFIX + "served", "Runs an env server answered, by outcome", labels=["outcome"]
            )
            for outcome, count in sorted(m.extra().items()):
                served.add_metric([outcome], count)
            yield served


# Per endpoint (label `endpoint`, its URL): (figure, name, help, counter?)
_ENDPOINT_FIGURES = (
    ("calls", "endpoint_calls", "Model calls routed to the endpoint", True),
    ("errors", "endpoint_errors", "Model calls that failed on the endpoint", True),
    ("throttled", "endpoint_throttled", "Attempts the endpoint answered 429", True),
    ("ejections", "endpoint_ejections", "Times the endpoint was taken out", True),
    ("in_flight", "endpoint_in_flight", "Model calls in flight to the endpoint now", False),
    ("window", "endpoint_window_size", "The endpoint's window size now", False),
    ("latency_p50_s", "endpoint_latency_p50_seconds", "The endpoint's median call latency", False),
)
_ENGINE_FIGURES = (
    ("running", "engine_requests_running", "Requests the engine runs, its last /metrics"),
    ("waiting", "engine_requests_waiting", "Requests waiting in the engine, its last /metrics"),
    ("kv_usage", "engine_kv_cache_usage", "The engine's KV cache usage (0 to 1), last read"),
    ("preemptions", "engine_preemptions", "The engine's preemptions so far, last read"),
)


def _reply_families(health: Health) -> Iterator[Any]:
    """The streamed replies' times to first token and per output token, as summaries: the
    count and sum of all of them, the 0.5 and 0.99 quantiles of the newest."""
    from prometheus_client.core import Metric

    figures = health.replies()
    for name, doc, count, total in (
        ("ttft", "Seconds from a streamed reply's request to its first token",
         health.streamed, health.ttft_sum),
        ("tpot", "Seconds per output token of a streamed reply, after the first",
         health.tpot_count, health.tpot_sum),
    ):  # fmt: skip
        full = f"{_PREFIX}{name}_seconds"
        family = Metric(full, doc, "summary")
        for key, quantile in (("p50", "0.5"), ("p99", "0.99")):
            value = figures[f"{name}_s"][key]
            if value is not None:
                family.add_sample(full, {"quantile": quantile}, value)
        family.add_sample(full + "_count", {}, count)
        family.add_sample(full + "_sum", {}, total)
        yield family


def _endpoint_families(found: dict[str, dict[str, Any]]) -> Iterator[Any]:
    """Each endpoint's figures, labelled by its URL; `trio_tasksets_endpoint_up` is 1 while
    it is live (0 ejected or probing); with its engine's /metrics, that engine's readings."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    up = GaugeMetricFamily(
        _PREFIX + "endpoint_up", "1 while the endpoint is live, 0 ejected or probing",
        labels=["endpoint", "state"],
    )  # fmt: skip
    for url, figures in found.items():
        state = str(figures.get("state", "live"))
        up.add_metric([url, state], 1.0 if state == "live" else 0.0)
    yield up
    for key, name, text, counter in _ENDPOINT_FIGURES:
        kind = CounterMetricFamily if counter else GaugeMetricFamily
        family = kind(_PREFIX + name, text, labels=["endpoint"])
        for url, figures in found.items():
            value = figures.get(key)
            if isinstance(value, int | float):
                family.add_metric([url], value)
        yield family
    for key, name, text in _ENGINE_FIGURES:
        gauge = GaugeMetricFamily(_PREFIX + name, text, labels=["endpoint"])
        for url, figures in found.items():
            value = (figures.get("engine") or {}).get(key)
            if isinstance(value, int | float):
                gauge.add_metric([url], value)
        yield gauge


async def serve_metrics(
    metrics: Metrics,
    port: int,
    *,
    host: str = "127.0.0.1",
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Answer ``GET /metrics`` with `metrics.text()` on `host:port` until cancelled; with
    ``nursery.start`` the started value is the port bound (for `port` 0, a free one)."""
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound: int = listeners[0].socket.getsockname()[1]
    task_status.started(bound)
    await trio.serve_listeners(functools.partial(_answer, metrics=metrics), listeners)


async def _answer(stream: trio.SocketStream, *, metrics: Metrics) -> None:
    async with stream:
        request = b""
        with trio.move_on_after(_READ_WITHIN):
            while b"\r\n\r\n" not in request and len(request) <= _MAX_REQUEST:
                data = await stream.receive_some(_MAX_REQUEST)
                if not data:
                    return
                request += data
        line = request.split(b"\r\n", 1)[0].split()
        if len(line) >= 2 and line[0] == b"GET" and line[1].split(b"?")[0] == b"/metrics":
            status, kind, body = (
                b"200 OK",
                b"text/plain; version=0.0.4; charset=utf-8",
                metrics.text(),
            )
        else:
            status, kind, body = b"404 Not Found", b"text/plain", b"the metrics are at /metrics\n"
        head = b"HTTP/1.1 %s\r\ncontent-type: %s\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
        with contextlib.suppress(trio.BrokenResourceError):
            await stream.send_all(head % (status, kind, len(body)) + body)
