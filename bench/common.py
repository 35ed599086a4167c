"""Shared helpers for the benchmarks: environment info, statistics, tables, goal lines, a
redis-server of the benchmark's own."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import redis

__all__ = [
    "Timings",
    "env_info",
    "goal_line",
    "markdown_table",
    "per_item_us",
    "redis_server",
    "wait_until",
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
        ("hiredis", _version("hiredis")),
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


def wait_until(predicate: Callable[[], bool], what: str, timeout: float) -> None:
    """Poll `predicate` every 5 ms; RuntimeError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


@contextlib.contextmanager
def redis_server(bench: str) -> Iterator[tuple[str, redis.Redis]]:
    """A redis-server of `bench`'s own (loopback, a free port, no persistence), up: its URL and
    a redis-py client of it (`decode_responses`); stopped on the way out."""
    import redis

    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit(f"{bench} needs redis-server on PATH (apt-get install redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    url = f"redis://127.0.0.1:{port}/0"

    def pings() -> bool:
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False

    with tempfile.TemporaryDirectory() as directory:
        server = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
             "no", "--dir", directory],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        client = redis.Redis.from_url(url, decode_responses=True)
        try:
            wait_until(pings, "redis-server", 10)
            yield url, client
        finally:
            client.close()
            server.terminate()
            server.wait(timeout=10)
