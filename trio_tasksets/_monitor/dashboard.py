"""The eval dashboard: live counts of a run, drawn with rich or logged as plain lines.

`Progress` holds the counts; the eval updates it as slots are planned, start and finish.
`show(progress, live=...)` displays it for the duration of an ``async with`` block:

* ``live=True`` on a terminal: a `rich.live.Live` panel (total, done, running, failed, reward
  mean, rate, elapsed and a progress bar; the rollout window's size and the model calls'
  connection limit when the run has them; a line of the named metrics' means and 95%
  intervals when the episodes carry any; with many endpoints, a row per endpoint: its
  state, calls in flight, window, calls, errors, 429s, p50 latency, and its engine's running,
  waiting, KV usage and preemptions when `--engine-metrics` reads them), redrawn by a trio
  task every
  ``1 / refresh_per_second`` seconds. rich's own refresh thread is off, so nothing runs
  outside trio and a `trio.testing.MockClock` drives the redraws.
* otherwise (``live=False``, a pipe, a file, a dumb terminal): `Progress.line` every
  ``log_every`` seconds and once at the end, as plain text.

Either way the last state is drawn once more on the way out, synchronously, on every exit path
(including cancellation and KeyboardInterrupt), and the block's own exception leaves `show`
unchanged (never wrapped in an exception group). A rendering failure stops the display; it never
reaches the eval.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import attrs
import trio
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from .._core.adaptive import AdaptiveWindow
from .._core.exceptions import ConfigError
from .._core.limits import ConnectionLimiter
from .._core.window import Window

__all__ = ["FAILED_COUNT_0", "MetricFigures", "Progress", "metrics_text", "show"]


def _fmt_elapsed(seconds: float) -> str:
    whole = int(max(seconds, 0.0))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def _fmt_rate(rate: float) -> str:
    return f"{rate:.1f}/s" if rate >= 1 or rate == 0 else f"{rate:.2f}/s"


def _fmt_reward(mean: float | None) -> str:
    return "-" if mean is None else f"{mean:.3f}"


# A mean reward counts a failed slot's reward, 0: said beside it once any slot failed.
FAILED_COUNT_0 = "failed rows count 0"

MetricFigures = dict[str, tuple[float, tuple[float, float] | None]]
"""Named metrics as the dashboard and the command line show them: per name, its mean and
its 95% interval (low, high), None with fewer than two tasks."""


def metrics_text(figures: MetricFigures) -> str | None:
    """The named metrics in one line, each with its mean and 95% interval, e.g.
    ``metrics (95% CI): exact 0.500 [0.188, 0.812], chars 9.000``; None without any."""
    if not figures:
        return None
    shown = [
        f"{name} {mean:.3f}" + ("" if ci is None else f" [{ci[0]:.3f}, {ci[1]:.3f}]")
        for name, (mean, ci) in figures.items()
    ]
    return f"metrics (95% CI): {', '.join(shown)}"


@attrs.define
class Progress:
    """Live counts of an eval, updated by the eval as slots are planned, start and finish."""

    title: str = "eval"
    total: int = 0  # slots planned so far (static: all up front; a stream: grows)
    growing: bool = False  # True while a stream may still plan more slots (shown as "12+")
    done: int = 0  # finished slots (ok or not)
    running: int = 0
    failed: int = 0  # finished with ok=False
    reward_sum: float = 0.0  # over finished slots
    carried: int = 0  # finished before this session (kept by a resume): not in the rate
    started_at: float = attrs.field(factory=time.monotonic)
    note: str | None = None  # why nothing moves, when the runner knows (e.g. no worker)
    window: Window | None = None  # the rollout window (-c): its size now is shown
    connections: ConnectionLimiter | None = None  # model calls per endpoint (--max-connections)
    sandboxes: Window | None = None  # the sandboxes' admission window (--max-sandboxes)
    stalled: int = 0  # attempts cancelled as StalledError (--stall-timeout), retried or not
    health: Callable[[], str | None] | None = None  # the scheduler's lag now, as text
    # many endpoints: their figures now, per URL (`OpenAIClient.endpoint_stats`)
    endpoints: Callable[[], dict[str, dict[str, Any]] | None] | None = None
    # the named metrics so far, each one's mean and interval (read once a redraw: O(1) each)
    metrics: Callable[[], MetricFigures] | None = None

    def planned(self, n: int = 1) -> None:
        """`n` more slots are planned (static: all at once; a stream: as tasks arrive)."""
        self.total += n

    def started(self) -> None:
        """A slot started running."""
        self.running += 1

    def finished(self, ok: bool, reward: float) -> None:
        """A slot finished: it stops running and counts as done (and failed unless `ok`)."""
        self.running = max(self.running - 1, 0)
        self.done += 1
        if not ok:
            self.failed += 1
        self.reward_sum += reward

    def stop_growing(self) -> None:
        """The stream has planned its last slot: `total` is final."""
        self.growing = False

    @property
    def reward_mean(self) -> float | None:
        """Mean reward over finished slots, a failed one's as 0 (as `summary.json`'s
        `reward_mean`), or None before the first one finishes."""
        return self.reward_sum / self.done if self.done else None

    def reward_text(self) -> str:
        """The reward mean, saying that failed slots count 0 once one failed."""
        mean = _fmt_reward(self.reward_mean)
        return f"{mean} ({FAILED_COUNT_0})" if self.failed and self.done else mean

    def metrics_text(self) -> str | None:
        """The named metrics' line (`metrics_text`), None while the episodes carry none."""
        return metrics_text(self.metrics()) if self.metrics is not None else None

    @property
    def elapsed(self) -> float:
        """Seconds since `started_at` (wall clock, `time.monotonic`)."""
        return max(time.monotonic() - self.started_at, 0.0)

    @property
    def rate(self) -> float:
        """Slots (rollouts) finished in this session per second of `elapsed`."""
        elapsed = self.elapsed
        return (self.done - self.carried) / elapsed if elapsed > 0 else 0.0

    def _total_text(self) -> str:
        return f"{self.total}+" if self.growing else str(self.total)

    def limits_text(self) -> str | None:
        """The window and connection limits now, e.g. ``window 51 (adapts 1-512),
        connections 40, sandboxes 3/4 (adapts 1-256)`` (boxes alive / their window); None
        when the run has none."""
        parts = []
        if self.window is not None:
            parts.append(f"window {_fmt_window(self.window)}")
        if self.connections is not None and not self.endpoint_figures():  # else: a row each
            windows = self.connections.windows.values()
            sizes = ", ".join(_fmt_window(w) for w in windows)
            parts.append(f"connections {sizes or _fmt_limit(self.connections)}")
        if self.sandboxes is not None:  # boxes alive now / the window
            parts.append(f"sandboxes {self.sandboxes.in_flight}/{_fmt_window(self.sandboxes)}")
        return ", ".join(parts) or None

    def line(self) -> str:
        """One plain-text status line, e.g.
        ``eval: 12/20 done, 3 running, 1 failed, reward 0.917 (failed rows count 0), 4.1/s,
        00:03; window 32``, then the named metrics' line when there are any."""
        line = (
            f"{self.title}: {self.done}/{self._total_text()} done, {self.running} running, "
            f"{self.failed} failed, reward {self.reward_text()}, "
            f"{_fmt_rate(self.rate)}, {_fmt_elapsed(self.elapsed)}"
        )
        for part in (self.limits_text(), self.health_text(), self.endpoints_text(),
                     self.metrics_text()):  # fmt: skip
            if part is not None:
                line = f"{line}; {part}"
        return line if self.note is None else f"{line}; {self.note}"

    def endpoint_figures(self) -> dict[str, dict[str, Any]]:
        """Per endpoint URL its figures now (`OpenAIClient.endpoint_stats`); empty for a
        single endpoint (the compact view)."""
        found = self.endpoints() if self.endpoints is not None else None
        return found if found and len(found) > 1 else {}

    def endpoints_text(self) -> str | None:
        """With many endpoints: how many are live, and which are not, e.g. ``endpoints 7/8
        live, 127.0.0.1:8002 ejected``; None for one endpoint."""
        found = self.endpoint_figures()
        if not found:
            return None
        live = sum(figures.get("state") == "live" for figures in found.values())
        text = f"endpoints {live}/{len(found)} live"
        down = [f"{_endpoint_name(url)} {figures.get('state')}" for url, figures in found.items()
                if figures.get("state") != "live"]  # fmt: skip
        return ", ".join([text, *down])

    def health_text(self) -> str | None:
        """Stalled attempts and the scheduler's lag, e.g. ``2 stalled (StalledError), lag
        0.4 ms (max 12 ms)``; None when there is neither."""
        parts = []
        if self.stalled:
            parts.append(f"{self.stalled} stalled (StalledError)")
        lag = self.health() if self.health is not None else None
        if lag is not None:
            parts.append(lag)
        return ", ".join(parts) or None


def _fmt_window(window: Window) -> str:
    if isinstance(window, AdaptiveWindow):
        return f"{window.size} (adapts {window.min}-{window.max})"
    return str(window.size)


def _fmt_limit(connections: ConnectionLimiter) -> str:
    limit = connections.limit
    if isinstance(limit, tuple):
        return f"{limit.start} (adapts {limit.min}-{limit.max})"
    return str(limit)


def _endpoint_name(url: str) -> str:
    """An endpoint as the dashboard names it: its URL without the scheme, nor a trailing
    ``/v1`` (``127.0.0.1:8001``)."""
    parts = urlsplit(url)
    path = parts.path.rstrip("/").removesuffix("/v1")
    return f"{parts.netloc}{path}" or url


def _fmt_seconds(value: Any) -> str:
    if not isinstance(value, int | float):
        return "-"
    return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.2f}s"


def _fmt_count(value: Any) -> str:
    return "-" if not isinstance(value, int | float) else f"{value:g}"


_STATE_STYLE = {"live": "green", "probing": "yellow", "ejected": "bold red"}
# endpoint, state, calls in flight, window size, calls, errors, 429s, p50 latency; and its
# engine's requests running and waiting, KV cache usage, preemptions (--engine-metrics)
_ENDPOINT_COLUMNS = ("endpoint", "state", "flight", "win", "calls", "err", "429", "p50")
_ENGINE_COLUMNS = ("run", "wait", "kv", "pre")


def _endpoints_table(found: dict[str, dict[str, Any]]) -> Table:
    """A row per endpoint: state, in flight, window, calls, errors, 429s, p50 latency, and,
    when any endpoint's engine metrics are read, that engine's running, waiting, KV usage and
    preemptions."""
    engines = any("engine" in figures for figures in found.values())
    table = Table(
        box=None, padding=(0, 1), pad_edge=False, collapse_padding=True, header_style="dim"
    )
    for name in (*_ENDPOINT_COLUMNS, *(_ENGINE_COLUMNS if engines else ())):
        left = name in ("endpoint", "state")
        table.add_column(name, justify="left" if left else "right", no_wrap=True,
                         overflow="ellipsis")  # fmt: skip
    for url, figures in found.items():
        state = str(figures.get("state", "live"))
        errors = figures.get("errors", 0)
        throttled = figures.get("throttled", 0)
        cells = [
            Text(_endpoint_name(url)),
            Text(state, style=_STATE_STYLE.get(state, "")),
            Text(_fmt_count(figures.get("in_flight"))),
            Text(_fmt_count(figures.get("window")) if figures.get("window") is not None else "-"),
            Text(_fmt_count(figures.get("calls"))),
            Text(_fmt_count(errors), style="red" if errors else "dim"),
            Text(_fmt_count(throttled), style="yellow" if throttled else "dim"),
            Text(_fmt_seconds(figures.get("latency_p50_s"))),
        ]
        if engines:  # the engine's last reading; "-" while its /metrics cannot be read
            engine = figures.get("engine") or {}
            if engine.get("failing"):
                engine = {}
            kv = engine.get("kv_usage")
            cells += [
                Text(_fmt_count(engine.get("running"))),
                Text(_fmt_count(engine.get("waiting")),
                     style="yellow" if engine.get("waiting") else ""),
                Text("-" if not isinstance(kv, int | float) else f"{kv:.0%}"),
                Text(_fmt_count(engine.get("preemptions"))),
            ]  # fmt: skip
        table.add_row(*cells)
    return table


# --- the live panel ------------------------------------------------------------------------

_COLUMNS = ("total", "done", "running", "failed", "reward", "rate", "elapsed")
_COLUMN_WIDTH = 7
_WIDTH = len(_COLUMNS) * _COLUMN_WIDTH + (len(_COLUMNS) - 1) * 2  # the counts row, padded


_PANEL_EDGES = 4  # borders and padding around the panel's content


def _render(progress: Progress, max_width: int) -> RenderableType:
    """The live panel: a progress bar over a row of counts, at a fixed width (no jitter), or
    over a column of counts when the console is too narrow for the row."""
    growing = progress.growing
    total = progress._total_text()
    width = max(min(_WIDTH, max_width - _PANEL_EDGES), 1)
    if growing:
        bar = ProgressBar(total=None)  # indeterminate: a pulse
        percent = ""
    else:
        bar = ProgressBar(
            total=max(progress.total, 1), completed=min(progress.done, progress.total)
        )
        percent = f"{progress.done / progress.total if progress.total else 0.0:.0%}"
    bar_row = Table.grid(padding=(0, 1))
    bar_row.width = width
    bar_row.add_column(ratio=1)
    bar_row.add_column(justify="right", min_width=2 * len(total) + 1)
    bar_row.add_column(justify="right", width=4)
    bar_row.add_row(bar, Text(f"{progress.done}/{total}", style="bold"), Text(percent, "cyan"))

    values = (
        Text(total, style="bold"),
        Text(str(progress.done), style="green"),
        Text(str(progress.running), style="yellow" if progress.running else "dim"),
        Text(str(progress.failed), style="bold red" if progress.failed else "dim"),
        Text(_fmt_reward(progress.reward_mean), style="magenta"),
        Text(_fmt_rate(progress.rate)),
        Text(_fmt_elapsed(progress.elapsed)),
    )
    if width >= _WIDTH:
        counts = Table(box=None, padding=(0, 1), pad_edge=False, header_style="dim")
        for name in _COLUMNS:
            counts.add_column(name, justify="right", min_width=_COLUMN_WIDTH)
        counts.add_row(*values)
    else:
        counts = Table.grid(padding=(0, 2))
        counts.add_column(style="dim")
        counts.add_column(justify="right")
        for name, value in zip(_COLUMNS, values, strict=True):
            counts.add_row(name, value)
    title = Text(progress.title, style="bold")
    if growing:
        title.append("  (streaming)", style="dim italic")
    rows: list[RenderableType] = [bar_row, Text(""), counts]
    if progress.failed and progress.done:
        rows += [Text(f"reward: {FAILED_COUNT_0}", style="dim")]
    metrics = progress.metrics_text()
    if metrics is not None:
        rows += [Text(metrics, style="magenta")]
    limits = progress.limits_text()
    if limits is not None:
        rows += [Text(limits, style="dim")]
    health = progress.health_text()
    if health is not None:
        rows += [Text(health, style="bold yellow" if progress.stalled else "dim")]
    endpoints = progress.endpoint_figures()
    if endpoints:
        rows += [Text(""), _endpoints_table(endpoints)]
    if progress.note is not None:
        rows += [Text(""), Text(progress.note, style="bold yellow")]
    return Panel(
        Group(*rows),
        title=title,
        title_align="left",
        border_style="blue",
        expand=False,
        padding=(0, 1),
    )


@attrs.frozen
class _Dashboard:
    """Renders `progress` afresh, fitted to the console's width, each time rich draws it."""

    progress: Progress

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield _render(self.progress, options.max_width)


def _start_live(progress: Progress, console: Console) -> Live | None:
    """A started Live panel, or None if it cannot draw (the caller falls back to lines)."""
    live: Live | None = None
    try:
        live = Live(
            console=console,
            auto_refresh=False,  # no rich thread: the trio task in `show` redraws
            transient=False,  # the last frame stays on screen
            get_renderable=lambda: _Dashboard(progress),
        )
        live.start(refresh=True)
    except Exception:
        if live is not None:
            with contextlib.suppress(Exception):
                live.stop()
        return None
    return live


def _print_line(console: Console, progress: Progress) -> None:
    console.print(Text(progress.line()), soft_wrap=True)


@trio.lowlevel.enable_ki_protection
async def _every(period: float, draw: Callable[[], None]) -> None:
    """Call `draw` every `period` seconds until cancelled; stop quietly if drawing fails.
    KI-protected: a Ctrl-C reaches the eval's own task, never lands half-way through a draw."""
    while True:
        await trio.sleep(period)
        try:
            draw()
        except Exception:
            return


@trio.lowlevel.enable_ki_protection
def _final(draw: Callable[[], None]) -> None:
    with contextlib.suppress(Exception):
        draw()


@asynccontextmanager
async def show(
    progress: Progress,
    *,
    live: bool,
    console: Console | None = None,
    refresh_per_second: float = 4.0,
    log_every: float = 5.0,
) -> AsyncIterator[None]:
    """Display `progress` while the block runs: a live rich panel when `live` and `console` is
    a terminal, else `progress.line()` every `log_every` seconds. The last state is drawn once
    more on every exit. `console` defaults to ``Console(stderr=True)``."""
    if not refresh_per_second > 0:
        raise ConfigError(
            f"{{refresh_per_second}} must be > 0, got {refresh_per_second!r}",
            parameter="refresh_per_second",
        )
    if not log_every > 0:
        raise ConfigError(f"{{log_every}} must be > 0, got {log_every!r}", parameter="log_every")
    if console is None:
        console = Console(stderr=True)
    panel: Live | None = None
    if live and console.is_terminal and not console.is_dumb_terminal:
        panel = _start_live(progress, console)
    if panel is not None:
        period, draw, last = 1.0 / refresh_per_second, panel.refresh, panel.stop
    else:

        def draw() -> None:
            _print_line(console, progress)

        period, last = log_every, draw

    body_exc: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_every, period, draw)
            try:
                yield
            except BaseException as exc:
                # Re-raised below, outside the nursery, so it leaves unchanged (a strict nursery
                # would wrap it in an ExceptionGroup).
                body_exc = exc
            finally:
                nursery.cancel_scope.cancel()
    finally:
        _final(last)
    if body_exc is not None:
        try:
            raise body_exc
        finally:
            body_exc = None
