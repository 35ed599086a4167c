"""Small hand-written SVG charts for the report: bars (plain or stacked), step lines, marks.

Hand-written because the report needs four plain charts and must stay one small file: the
smallest plotting library that inlines (uPlot, ~50 kB) would double the page of a small run,
and the figures are computed in Python anyway. Every chart is an accessible image (`role=img`,
a title and a text description) whose bars carry a tooltip; colours come from the page's CSS.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

import attrs

__all__ = ["Bar", "Line", "Mark", "Plot", "fmt_seconds", "nice_ticks"]

WIDTH, HEIGHT = 520, 230
LEFT, RIGHT, TOP, BOTTOM = 52, 14, 22, 40


def nice_ticks(low: float, high: float, count: int = 5, *, integer: bool = False) -> list[float]:
    """About `count` round tick values covering [low, high] (whole numbers if `integer`)."""
    if not (math.isfinite(low) and math.isfinite(high)) or high <= low:
        return [low]
    raw = (high - low) / count
    power = 10.0 ** math.floor(math.log10(raw))
    factors = (1, 2, 5, 10) if integer else (1, 2, 2.5, 5, 10)
    step = next(f * power for f in factors if f * power >= raw)
    if integer:
        step = max(step, 1.0)
    first = math.ceil(low / step - 1e-9) * step
    ticks = []
    value = first
    while value <= high + step * 1e-9:
        ticks.append(round(value, 12))
        value += step
    return ticks


def fmt_number(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 10 or float(value).is_integer():
        return f"{value:.4g}"
    return f"{value:.3g}"


def fmt_seconds(value: float) -> str:
    """A duration with a readable unit: 0, 850 µs, 12.5 ms, 3.2 s, 4 min 05 s."""
    if value == 0:
        return "0"
    if value < 1e-3:
        return f"{value * 1e6:.3g} µs"
    if value < 1:
        return f"{value * 1e3:.3g} ms"
    if value < 120:
        return f"{value:.3g} s"
    minutes, seconds = divmod(value, 60)
    return f"{minutes:.0f} min {seconds:02.0f} s"


@attrs.frozen
class Bar:
    """A bar over [x0, x1): its stacked segments (value, css class) and its tooltip."""

    x0: float
    x1: float
    segments: tuple[tuple[float, str], ...]
    tip: str


@attrs.frozen
class Line:
    """A step line through `points` (x, y): y holds from each x to the next."""

    points: tuple[tuple[float, float], ...]
    css: str
    label: str


@attrs.frozen
class Mark:
    """A vertical line at x, labelled."""

    x: float
    label: str


@attrs.define
class Plot:
    """One chart: axes from the data, then bars, lines and marks, as an SVG string."""

    title: str
    description: str
    x_label: str
    y_label: str
    ident: str
    x_range: tuple[float, float]
    y_max: float
    x_format: str = "number"  # "number" or "seconds"
    categories: Sequence[str] | None = None  # category labels: x i is the i-th
    y_integer: bool = False  # the y axis counts things: whole-number ticks
    parts: list[str] = attrs.Factory(list)

    def x(self, value: float) -> float:
        low, high = self.x_range
        span = high - low or 1.0
        return LEFT + (value - low) / span * (WIDTH - LEFT - RIGHT)

    def y(self, value: float) -> float:
        top = self.y_max or 1.0
        return HEIGHT - BOTTOM - value / top * (HEIGHT - TOP - BOTTOM)

    def _label(self, value: float) -> str:
        return fmt_seconds(value) if self.x_format == "seconds" else fmt_number(value)

    def _axes(self) -> str:
        out = []
        count = 5 if self.y_integer else 4
        for tick in nice_ticks(0, self.y_max or 1.0, count, integer=self.y_integer):
            y = self.y(tick)
            out.append(
                f'<line class="grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>'
                f'<text class="tick" x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">'
                f"{escape(fmt_number(tick))}</text>"
            )
        base = HEIGHT - BOTTOM
        if self.categories is not None:
            step = max(1, math.ceil(len(self.categories) / 12))
            for i, name in enumerate(self.categories):
                if i % step == 0:
                    x = self.x(i + 0.5)
                    out.append(
                        f'<text class="tick" x="{x:.1f}" y="{base + 15}" text-anchor="middle">'
                        f"{escape(name)}</text>"
                    )
        else:
            for tick in nice_ticks(*self.x_range, 5):
                x = self.x(tick)
                if LEFT - 1 <= x <= WIDTH - RIGHT + 1:
                    anchor = "end" if x > WIDTH - RIGHT - 16 else "middle"  # stay inside
                    out.append(
                        f'<line class="axis" x1="{x:.1f}" x2="{x:.1f}" y1="{base}" '
                        f'y2="{base + 4}"/><text class="tick" x="{x:.1f}" y="{base + 15}" '
                        f'text-anchor="{anchor}">{escape(self._label(tick))}</text>'
                    )
        out.append(
            f'<line class="axis" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{base}" y2="{base}"/>'
            f'<text class="axis-label" x="{(LEFT + WIDTH - RIGHT) / 2}" y="{HEIGHT - 6}" '
            f'text-anchor="middle">{escape(self.x_label)}</text>'
            f'<text class="axis-label" x="12" y="{(TOP + HEIGHT - BOTTOM) / 2}" '
            f'text-anchor="middle" transform="rotate(-90 12 {(TOP + HEIGHT - BOTTOM) / 2})">'
            f"{escape(self.y_label)}</text>"
        )
        return "".join(out)

    def bars(self, bars: Sequence[Bar]) -> None:
        for bar in bars:
            x0, x1 = self.x(bar.x0), self.x(bar.x1)
            gap = min(1.0, (x1 - x0) * 0.15)
            bottom = 0.0
            rects = []
            for value, css in bar.segments:
                if value <= 0:
                    continue
                y_top, y_bottom = self.y(bottom + value), self.y(bottom)
                rects.append(
                    f'<rect class="{css}" x="{x0 + gap / 2:.2f}" y="{y_top:.2f}" '
                    f'width="{max(x1 - x0 - gap, 0.5):.2f}" height="{y_bottom - y_top:.2f}"/>'
                )
                bottom += value
            if rects:
                self.parts.append(f"<g><title>{escape(bar.tip)}</title>{''.join(rects)}</g>")

    def line(self, line: Line, x_end: float) -> None:
        if not line.points:
            return
        coords = []
        for i, (x, y) in enumerate(line.points):
            nx = line.points[i + 1][0] if i + 1 < len(line.points) else x_end
            coords.append(f"{self.x(x):.1f},{self.y(y):.1f} {self.x(nx):.1f},{self.y(y):.1f}")
        self.parts.append(
            f'<polyline class="{line.css}" fill="none" points="{" ".join(coords)}">'
            f"<title>{escape(line.label)}</title></polyline>"
        )

    def mark(self, mark: Mark, row: int) -> None:
        x = self.x(mark.x)
        anchor = "end" if x > WIDTH - 40 else "start"
        dx = -3 if anchor == "end" else 3
        self.parts.append(
            f'<line class="mark" x1="{x:.1f}" x2="{x:.1f}" y1="{TOP - 4}" y2="{HEIGHT - BOTTOM}"/>'
            f'<text class="mark-label" x="{x + dx:.1f}" y="{TOP + 8 + 11 * row}" '
            f'text-anchor="{anchor}">{escape(mark.label)}</text>'
        )

    def legend(self, entries: Sequence[tuple[str, str]]) -> None:
        x = float(WIDTH - RIGHT)
        for label, css in reversed(entries):
            x -= 9 + 6.2 * len(label)
            self.parts.append(
                f'<rect class="{css} swatch" x="{x:.1f}" y="4" width="8" height="8"/>'
                f'<text class="tick" x="{x + 11:.1f}" y="12">{escape(label)}</text>'
            )
            x -= 10

    def svg(self) -> str:
        title_id, desc_id = f"{self.ident}-t", f"{self.ident}-d"
        return (
            f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
            f'aria-labelledby="{title_id} {desc_id}"><title id="{title_id}">'
            f'{escape(self.title)}</title><desc id="{desc_id}">{escape(self.description)}</desc>'
            f"{self._axes()}{''.join(self.parts)}</svg>"
        )
