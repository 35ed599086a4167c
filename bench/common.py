"""Shared helpers for the benchmarks: environment info, statistics, tables, goal lines."""

from __future__ import annotations

import os
import platform
import statistics
import sys
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from importlib import metadata

__all__ = [
    "Timings",
    "env_info",
    "goal_line",
    "markdown_table",
    "per_item_us",
]


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def env_info() -> list[tuple[str, str]]:
    """What a reader needs to compare figures across machines."""
    return [
        ("python", f"{platform.python_implementation()} {sys.version.split()[0]}"),
        ("platform", platform.platform()),
        ("cpus", str(os.cpu_count())),
        ("trio", _version("trio")),
        ("aiometer", _version("aiometer")),
        ("anyio", _version("anyio")),
    ]


@dataclass
class Timings:
    """Wall-clock seconds of each repeat of one contender (same N, same window)."""

    name: str
    n: int
    seconds: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)  # process CPU time of each repeat

    @property
    def contention(self) -> float:
        """Worst wall/CPU ratio over the repeats: about 1.0 on a quiet machine, more when
        another process took the CPU away (then the median is inflated; the best is safer)."""
        return max(w / c for w, c in zip(self.seconds, self.cpu_seconds, strict=True) if c > 0)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def best(self) -> float:
        return min(self.seconds)

    @property
    def median_us(self) -> float:
        return per_item_us(self.median, self.n)

    @property
    def best_us(self) -> float:
        return per_item_us(self.best, self.n)


def per_item_us(seconds: float, n: int) -> float:
    return seconds / n * 1e6


def markdown_table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], left: Collection[int] = (0,)
) -> str:
    """A GitHub-markdown table (pasteable into docs); the `left` columns align left, the rest
    right."""
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        out = [
            cell.ljust(widths[i]) if i in left else cell.rjust(widths[i])
            for i, cell in enumerate(cells)
        ]
        return "| " + " | ".join(out) + " |"

    rule = ["-" * w if i in left else "-" * (w - 1) + ":" for i, w in enumerate(widths)]
    return "\n".join([line(headers), "| " + " | ".join(rule) + " |", *(line(r) for r in rows)])


def goal_line(ok: bool, goal: str, detail: str) -> str:
    """One goal, reported (never enforced): PASS or MISS, then what was measured."""
    return f"  [{'PASS' if ok else 'MISS'}] {goal}: {detail}"


def next_request(buffer: bytes) -> tuple[bytes, bytes] | None:
    """The path of the first whole HTTP/1.1 request in `buffer` and the bytes after it, or None
    while it is incomplete: the fake model servers' parser (bodies by Content-Length only)."""
    end = buffer.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = buffer[:end].lower()
    at = head.find(b"\r\ncontent-length:")
    length = 0
    if at >= 0:
        stop = head.find(b"\r\n", at + 2)
        length = int(head[at + 17 : stop if stop > 0 else len(head)])
    if len(buffer) < end + 4 + length:
        return None
    return head.split(b" ", 2)[1], buffer[end + 4 + length :]
