"""An inference engine's own load, read from its Prometheus `/metrics` (vLLM, SGLang).

* `parse_engine_metrics(text)`: an `EngineLoad` from Prometheus text, parsed by
  `prometheus_client`'s parser: requests running and waiting, KV cache usage (0 to 1) and the
  preemptions so far, by vLLM's names (``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` or the older
  ``vllm:gpu_cache_usage_perc``, ``vllm:num_preemptions_total``) or SGLang's
  (``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:token_usage``,
  ``sglang:num_retracted_requests_total``), and the requests finished
  (``vllm:request_success_total``, ``sglang:num_requests_total``). Label sets (models, data-parallel ranks) are
  summed; the KV usage is the highest of them. Only those families' lines reach the parser
  (a vLLM scrape is mostly histogram buckets).
* `EngineMetrics(url)`: reads one engine's `/metrics` over the project's HTTP transport;
  `await metrics.feed(window)` reads it every `interval` seconds into an `AdaptiveWindow`
  (`AdaptiveWindow.engine_load`) until cancelled (`feed(None)`: the readings only, for the
  figures). `figures()` is the last reading as a dict (per endpoint in `summary.json`, the
  dashboard and `--metrics-port`). A reading that fails is counted
  (`errors`, `last_error`) and skipped: the window's growth freezes once its readings are
  stale, so a dead metrics endpoint never lets the window run away.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from urllib.parse import urlsplit

import trio

from .._core.adaptive import AdaptiveWindow, EngineLoad
from .._core.exceptions import ConfigError, EvalWarning, TrioTasksetsError
from .._transport import HTTPClient, HTTPError, Timeouts, redact_url

__all__ = ["EngineMetrics", "EngineMetricsError", "parse_engine_metrics"]

RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
PREEMPTIONS = ("vllm:num_preemptions_total", "sglang:num_retracted_requests_total")
FINISHED = ("vllm:request_success_total", "sglang:num_requests_total")
_SAMPLES = frozenset(RUNNING + WAITING + KV_USAGE + PREEMPTIONS + FINISHED)
_FAMILIES = frozenset(name.removesuffix("_total") for name in _SAMPLES)


def _read_lines(text: str) -> str:
    """Only the lines of the families read (their samples, HELP and TYPE). vLLM 0.32's
    `/metrics` is about 600 lines, most of them histogram buckets: parsed whole, 23 ms of CPU
    per reading on a loaded core of these machines, on the client's own cores."""
    kept = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE") and parts[2] in _FAMILIES:
                kept.append(line)
            continue
        name = line.split("{", 1)[0].split(None, 1)[0] if line.strip() else ""
        if name in _SAMPLES or name in _FAMILIES:
            kept.append(line)
    return "\n".join(kept) + "\n"


class EngineMetricsError(TrioTasksetsError, ValueError):
    """Metrics text that is not Prometheus text, or that names none of the known metrics."""


def parse_engine_metrics(text: str) -> EngineLoad:
    """The `EngineLoad` of one `/metrics` reading. Raises `EngineMetricsError` for text that
    does not parse, or that has none of vLLM's or SGLang's load metrics."""
    # Imported here: prometheus_client is some 12,000 objects that every full garbage
    # collection of every eval would otherwise scan (it is needed only for --engine-metrics).
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    highest: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(_read_lines(text)):
            for sample in family.samples:
                value = float(sample.value)
                if not math.isfinite(value):
                    continue
                sums[sample.name] = sums.get(sample.name, 0.0) + value
                highest[sample.name] = max(highest.get(sample.name, -math.inf), value)
    except ValueError as exc:
        raise EngineMetricsError(f"not Prometheus text: {exc}") from exc

    def first(names: Iterable[str], found: dict[str, float]) -> float | None:
        for name in names:
            if name in found:
                return found[name]
        return None

    load = EngineLoad(
        running=first(RUNNING, sums),
        waiting=first(WAITING, sums),
        kv_usage=first(KV_USAGE, highest),
        preemptions=first(PREEMPTIONS, sums),
        finished=first(FINISHED, sums),
    )
    if load == EngineLoad():
        raise EngineMetricsError(
            "no engine load metrics (vLLM's vllm:num_requests_waiting, "
            "vllm:kv_cache_usage_perc, ..., or SGLang's sglang:num_queue_reqs, ...)"
        )
    return load


class EngineMetrics:
    """One engine's `/metrics` URL, read on demand (`read`) or fed to a window (`feed`).

    Loopback or not, the URL is the caller's, never a request's; its password, if any, is
    never sent and never shown (`redact_url`). `timeout` bounds each
    reading; `interval` is the seconds between readings. A `url` that is not http(s), or an
    `interval` or `timeout` not > 0, raises `ConfigError`.
    """

    def __init__(
        self,
        url: str,
        *,
        interval: float = 1.0,
        timeout: float = 5.0,
        http_client: HTTPClient | None = None,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(
                f"{{url}} must be an http:// or https:// URL of an engine's metrics, got "
                f"{url!r} (e.g. http://127.0.0.1:8000/metrics)",
                parameter="url",
            )
        if not interval > 0 or not timeout > 0:
            raise ConfigError(
                f"{{interval}} and {{timeout}} must be > 0, got {interval!r}, {timeout!r}",
                parameter=("interval", "timeout"),
            )
        # A URL's userinfo is never sent (as the model client's): kept, shown and recorded
        # (errors, figures, summary.json) with its password redacted
        self.url = redact_url(url)
        self.interval = interval
        self._timeouts = Timeouts(connect=timeout, read=timeout, write=timeout)
        self._http = http_client
        self.readings = 0
        self.errors = 0
        self.last_error: str | None = None
        self.last: EngineLoad | None = None
        self.failing = False  # whether the latest reading failed (`last` is older)

    async def read(self) -> EngineLoad:
        """One reading. Raises `EngineMetricsError` (a bad status or text) or the
        transport's `HTTPError`."""
        own = self._http is None
        http = HTTPClient(timeouts=self._timeouts) if self._http is None else self._http
        try:
            response = await http.request("GET", self.url, timeouts=self._timeouts)
        finally:
            if own:
                await http.aclose()
        if response.status != 200:
            raise EngineMetricsError(f"{self.url} answered HTTP {response.status}")
        load = parse_engine_metrics(response.body.decode("utf-8", errors="replace"))
        self.readings += 1
        self.last = load
        return load

    def figures(self) -> dict[str, float | int | str | None]:
        """The last reading: `running`, `waiting`, `kv_usage` (0 to 1), `preemptions` (so
        far), None where not reported (or before the first reading); and `readings`,
        `errors` (failed readings), `last_error` and `failing` (the latest reading failed:
        the figures are older)."""
        last = self.last if self.last is not None else EngineLoad()
        return {
            "running": last.running,
            "waiting": last.waiting,
            "kv_usage": None if last.kv_usage is None else round(last.kv_usage, 4),
            "preemptions": last.preemptions,
            "readings": self.readings,
            "errors": self.errors,
            "last_error": self.last_error,
            "failing": self.failing,
        }

    async def feed(self, window: AdaptiveWindow | None) -> None:
        """Read every `interval` seconds into `window` (None: keep the readings only) until
        cancelled; a failed reading is counted and skipped (the window freezes its growth on
        stale readings). The first failure is said, once, as an `EvalWarning` naming
        `engine_metrics` (the CLI's `--engine-metrics`): a dead metrics URL otherwise left
        the window on its latency signal alone, and the run's output said nothing of it."""
        own = self._http is None
        if own:
            self._http = HTTPClient(timeouts=self._timeouts)
        try:
            while True:
                try:
                    load = await self.read()
                    self.failing = False
                    if window is not None:
                        window.engine_load(load)
                except (HTTPError, EngineMetricsError) as exc:
                    if self.errors == 0:
                        warnings.warn(
                            EvalWarning(
                                f"{{engine_metrics}} {self.url}: a reading failed ({exc}); "
                                f"the window goes on without the engine's readings until "
                                f"one succeeds",
                                parameter="engine_metrics",
                            ),
                            stacklevel=2,
                        )
                    self.errors += 1
                    self.last_error = str(exc)
                    self.failing = True
                await trio.sleep(self.interval)
        finally:
            if own and self._http is not None:
                http, self._http = self._http, None
                with trio.CancelScope(shield=True):
                    await http.aclose()

    def __repr__(self) -> str:
        return f"EngineMetrics({self.url!r}, interval={self.interval:g})"
