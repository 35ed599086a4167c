"""The health of a run: the trio scheduler's lag, the peak in flight, and the
seconds waited per kind of limit; what `summary.json["health"]`, the dashboard and
`--metrics-port` show.

The lag is measured by a probe task (`Health.probe`), not a `trio.abc.Instrument`: every
`interval` seconds (0.1 by default) it sleeps and measures how much later than asked it was
woken; that overshoot is the time the scheduler could not run a ready task (a blocking call
in some task, or a loop saturated with work), as prime-rl's lag monitor does. Its cost is
one sleep and wake-up per interval, about 10 µs of CPU at 10 per second; an Instrument would
see every task step (`before_task_step`/`after_task_step`, two calls per step of every task,
on the hot path of a 2,000-episodes/s eval). The probe's clock is the run's
(`trio.current_time()`): on a `MockClock` the lag is 0.

`Health` is also a `limits.CallObserver`: under `observe_calls(health)` it sums the seconds
of every wait of the runner's own (`limits.parked`: `connection`, `rpm`, `tpm`,
`retry_after`, `backoff`, `retry`), counts the model calls that finished, and keeps the
streamed replies' times to first token and per output token (`on_stream`).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import trio

from .exceptions import ConfigError
from .limits import CallObserver

__all__ = ["Health"]

_SAMPLES = 4096  # lag samples kept for the percentiles (the newest); `max` covers the run


class Health(CallObserver):
    """Counts and lag samples of one run; `snapshot()` is `summary.json["health"]`."""

    def __init__(self, *, interval: float = 0.1) -> None:
        if not interval > 0:
            raise ConfigError(
                f"{{interval}} must be > 0 seconds, got {interval!r}", parameter="interval"
            )
        self.interval = interval
        self.lags: deque[float] = deque(maxlen=_SAMPLES)
        self.lag_max = 0.0
        self.in_flight = 0
        self.peak_in_flight = 0
        self.waited: dict[str, float] = {}
        self.model_calls = 0
        self.ttfts: deque[float] = deque(maxlen=_SAMPLES)  # streamed replies' (the newest)
        self.tpots: deque[float] = deque(maxlen=_SAMPLES)
        self.streamed = 0  # streamed replies, all of them
        self.ttft_sum = 0.0  # over all of them (a Prometheus summary's sum)
        self.tpot_count = 0
        self.tpot_sum = 0.0

    # --- what the eval tells it ------------------------------------------------------------

    def started(self) -> None:
        """A slot started running."""
        self.in_flight += 1
        if self.in_flight > self.peak_in_flight:
            self.peak_in_flight = self.in_flight

    def finished(self) -> None:
        """A slot stopped running (finished or cancelled)."""
        self.in_flight -= 1

    # --- what the model calls tell it (CallObserver) ---------------------------------------

    def on_unpark(self, kind: str, seconds: float) -> None:
        self.waited[kind] = self.waited.get(kind, 0.0) + seconds

    def on_progress(self, kind: str) -> None:
        if kind == "model":
            self.model_calls += 1

    def on_stream(self, ttft: float, tpot: float | None) -> None:
        self.streamed += 1
        self.ttft_sum += ttft
        self.ttfts.append(ttft)
        if tpot is not None:
            self.tpot_count += 1
            self.tpot_sum += tpot
            self.tpots.append(tpot)

    # --- the lag ---------------------------------------------------------------------------

    async def probe(self) -> None:
        """Measure the scheduler's lag every `interval` seconds, until cancelled."""
        interval = self.interval
        while True:
            asked = trio.current_time() + interval
            await trio.sleep_until(asked)
            self.sample(max(0.0, trio.current_time() - asked))

    def sample(self, lag: float) -> None:
        """Record one lag measurement, in seconds."""
        self.lags.append(lag)
        if lag > self.lag_max:
            self.lag_max = lag

    def lag_now(self) -> float:
        """The latest lag sample (0.0 before the first)."""
        return self.lags[-1] if self.lags else 0.0

    def lag_text(self) -> str | None:
        """The lag for the dashboard, e.g. ``lag 0.4 ms (p99 3.1 ms, max 12 ms)``; None
        before the first sample."""
        if not self.lags:
            return None
        p99 = _percentile(sorted(self.lags), 0.99) or 0.0
        return f"lag {_ms(self.lag_now())} (p99 {_ms(p99)}, max {_ms(self.lag_max)})"

    def replies_text(self) -> str | None:
        """Streamed replies for the dashboard, e.g. ``ttft p50 120 ms (p99 480 ms), tpot p50
        21 ms``; None before the first."""
        if not self.ttfts:
            return None
        ttfts = sorted(self.ttfts)
        text = (
            f"ttft p50 {_ms(_percentile(ttfts, 0.5) or 0.0)} "
            f"(p99 {_ms(_percentile(ttfts, 0.99) or 0.0)})"
        )
        if self.tpots:
            text += f", tpot p50 {_ms(_percentile(sorted(self.tpots), 0.5) or 0.0)}"
        return text

    def dashboard_text(self) -> str | None:
        """The dashboard's line of health: the lag (`lag_text`) and the streamed replies'
        times (`replies_text`), those there are."""
        parts = [text for text in (self.lag_text(), self.replies_text()) if text is not None]
        return ", ".join(parts) or None

    def replies(self) -> dict[str, Any]:
        """The streamed replies' times: ``ttft_s`` and ``tpot_s``, each ``p50``, ``p99``,
        ``mean`` and ``samples`` (the newest 4,096 replies'), and ``streamed`` (every
        streamed reply); {} when there was none."""
        if not self.streamed:
            return {}
        return {
            "streamed": self.streamed,
            "ttft_s": _figures(self.ttfts),
            "tpot_s": _figures(self.tpots),
        }

    def snapshot(self) -> dict[str, Any]:
        """`summary.json["health"]`: ``lag_s`` (``p50``, ``p99``, ``max``, ``samples``,
        ``probe_interval``), ``peak_in_flight``, ``waited_s`` (seconds per kind of wait),
        ``model_calls`` (the calls made in this process) and, when replies were streamed,
        their times to first token and per output token (`replies`)."""
        ordered = sorted(self.lags)
        return {
            "lag_s": {
                "p50": _percentile(ordered, 0.5),
                "p99": _percentile(ordered, 0.99),
                "max": self.lag_max,
                "samples": len(ordered),
                "probe_interval": self.interval,
            },
            "peak_in_flight": self.peak_in_flight,
            "waited_s": dict(sorted(self.waited.items())),
            "model_calls": self.model_calls,
            **self.replies(),
        }


def _figures(samples: deque[float]) -> dict[str, Any]:
    ordered = sorted(samples)
    return {
        "p50": _percentile(ordered, 0.5),
        "p99": _percentile(ordered, 0.99),
        "mean": sum(ordered) / len(ordered) if ordered else None,
        "samples": len(ordered),
    }


def _percentile(ordered: list[float], q: float) -> float | None:
    """The `q` quantile of sorted samples (nearest rank), None without samples."""
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _ms(seconds: float) -> str:
    ms = seconds * 1000
    return f"{ms:.1f} ms" if ms < 100 else f"{ms:.0f} ms"
