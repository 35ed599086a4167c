"""Durable trace files: one JSON episode per line, appended as each completes.

A row is written with a single `write()` on an O_APPEND descriptor, so a killed process leaves
only whole lines (at most one torn last line). Rows reach the OS at once (a SIGKILL loses
nothing written); `fsync` runs at most every `fsync_interval` seconds while rows are pending, and
on close (group commit), so a burst of rows costs one fsync, not one each. The fsync runs on the
event loop's thread, not in a worker thread: a worker thread would let a MockClock autojump
past deadlines while it runs, and one fsync per interval is a small, bounded pause.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import orjson
import trio

from .._core.runner import pick_one

__all__ = [
    "BadLine",
    "TraceRows",
    "TraceWriter",
    "decode_line",
    "open_traces",
    "read_rows",
    "write_atomic",
]


def _encode(row: dict[str, Any]) -> bytes:
    # orjson: a row is encoded on the eval's hot path, ~0.4 us against ~5 us for json.dumps.
    # What it refuses (an int beyond 64 bits, a tuple key, a str that is not Unicode: a lone
    # surrogate such as "\ud800", which Python's json reads from any file) goes through json
    # with str() and every non-ASCII character escaped: ASCII always encodes, so writing a row
    # never raises for its text, and the escape reads back as the same str (`read_rows`).
    try:
        return orjson.dumps(
            row, default=str, option=orjson.OPT_APPEND_NEWLINE | orjson.OPT_NON_STR_KEYS
        )
    except TypeError:
        pass
    try:
        return (json.dumps(row, default=str) + "\n").encode()
    except (ValueError, RecursionError):  # nested past the encoders' depth, or a cycle
        return (json.dumps(_writable(row), default=str) + "\n").encode()


def _writable(row: dict[str, Any]) -> dict[str, Any]:
    """`row` with each field that cannot be encoded (nested too deep, a cycle) replaced by a
    text saying why: the row is written, and reads back as a row that is not an episode
    (counted by whoever reads it), never a writer that raises mid-run."""
    kept: dict[str, Any] = {}
    for key, value in row.items():
        try:
            json.dumps(value, default=str)
        except (ValueError, RecursionError) as exc:
            value = f"<not written: {type(exc).__name__}: {exc}>"
        kept[str(key)] = value
    return kept


class TraceWriter:
    """Appends rows to an open trace file; made by `open_traces`."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._dirty = False
        self.rows = 0

    def write(self, row: dict[str, Any]) -> None:
        """Append one row now (sync: safe inside a shielded or finally block)."""
        data = memoryview(_encode(row))
        while data:
            written = os.write(self._fd, data)
            data = data[written:]
        self._dirty = True
        self.rows += 1

    def write_rows(self, rows: Iterable[dict[str, Any]]) -> None:
        """Append `rows` together, in one `write()` (a group's rows, written together: one system call
        for the group, and a kill leaves them whole but for at most a torn last line, as
        `write` does for one row). Sync, like `write`."""
        encoded = [_encode(row) for row in rows]
        data = memoryview(b"".join(encoded))
        while data:
            written = os.write(self._fd, data)
            data = data[written:]
        self._dirty = True
        self.rows += len(encoded)

    def sync(self) -> None:
        if self._dirty:
            os.fsync(self._fd)
            self._dirty = False

    async def _sync_loop(self, interval: float) -> None:
        while True:
            await trio.sleep(interval)
            self.sync()


@asynccontextmanager
async def open_traces(path: Path, *, fsync_interval: float = 0.5) -> AsyncIterator[TraceWriter]:
    """Open `path` for appending rows; on exit (any exit) the rows are fsynced and it is closed."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    writer = TraceWriter(fd)
    error: BaseException | None = None
    try:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(writer._sync_loop, fsync_interval)
                try:
                    yield writer
                finally:
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            error = pick_one(group)  # what the block raised, bare, its own cause kept
        if error is not None:
            raise error
    finally:
        try:
            writer.sync()
        finally:
            os.close(fd)


@attrs.frozen
class BadLine:
    """A line of a trace file that is not a row: its 1-based number and why."""

    line: int
    reason: str


def decode_line(line: bytes) -> tuple[Any, str | None]:
    """One trace line's JSON value, or (None, why it cannot be read). orjson first (fast);
    what it refuses but a row may hold is tried with json: a lone surrogate's escape, NaN
    and Infinity (as json writes them). Nesting beyond orjson's depth (1,024) is refused
    without recursing; invalid UTF-8 too."""
    try:
        return orjson.loads(line), None
    except orjson.JSONDecodeError as exc:
        first = str(exc)
    if first.startswith("depth limit"):
        return None, f"nested deeper than {MAX_DEPTH} levels"
    try:
        return json.loads(line.decode("utf-8")), None
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 ({exc.reason} at byte {exc.start})"
    except (ValueError, RecursionError):
        return None, f"not JSON ({first})"


MAX_DEPTH = 1024  # orjson's bound on nesting, and so a trace row's


class TraceRows:
    """The rows of a trace file, read as they are iterated (one line at a time: memory does
    not grow with the file): `(line number, row)` for each JSON object. A line that is not
    one (not JSON, not UTF-8, nested too deep, not an object) is counted in `bad`, with its
    number and why, never raised; blank lines are skipped, and a torn last line (a killed
    writer's: no newline, not JSON) is left out as `torn`, expected.
    `accept(row)` may refuse a row with a reason (counted too). A missing file has no rows.
    """

    KEPT = 10  # bad lines whose number and reason are kept (all are counted)

    def __init__(self, path: Path, accept: Callable[[dict[str, Any]], str | None] | None = None):
        self.path = path
        self.accept = accept
        self.bad = 0
        self.first_bad: list[BadLine] = []
        self.torn = False  # the last line was cut short (no newline) and is left out

    def refuse(self, line: int, reason: str) -> None:
        """Count line `line` as not a row, for `reason`."""
        self.bad += 1
        if len(self.first_bad) < self.KEPT:
            self.first_bad.append(BadLine(line, reason))

    def __iter__(self) -> Iterator[tuple[int, dict[str, Any]]]:
        try:
            file = self.path.open("rb")
        except FileNotFoundError:
            return
        with file:
            for number, line in enumerate(file, 1):
                if not line.strip():
                    continue
                row, why = decode_line(line)
                if why is None and type(row) is not dict:
                    why = f"a {type(row).__name__}, not a JSON object"
                if why is None and self.accept is not None:
                    why = self.accept(row)
                if why is not None:
                    if line.endswith(b"\n"):
                        self.refuse(number, why)
                    else:  # the last line, torn by a killed writer: expected, not counted
                        self.torn = True
                    continue
                yield number, row

    def describe(self) -> str:
        """The bad lines in one sentence naming the file and the first lines ("" for none)."""
        if not self.bad:
            return ""
        shown = "; ".join(f"line {b.line}: {b.reason}" for b in self.first_bad)
        more = ", ..." if self.bad > len(self.first_bad) else ""
        lines = "line" if self.bad == 1 else "lines"
        return f"{self.path}: {self.bad:,} {lines} skipped, not rows ({shown}{more})"


def read_rows(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The whole rows of a trace file, and how many lines could not be read (`TraceRows`,
    kept in a list: for a small file; a large one is iterated with `TraceRows`).

    A torn last line (a killed writer) is expected; an unreadable line elsewhere is counted
    too, never raised, so a resume keeps what is whole.
    """
    rows = TraceRows(path)
    found = [row for _line, row in rows]
    return found, rows.bad + rows.torn


def write_atomic(path: Path, rows: Iterable[dict[str, Any]] | None = None, text: str = "") -> None:
    """Replace `path` with `rows` (as JSON lines) or `text`, atomically and durably. The new
    file keeps the mode of the one it replaces (a new one gets 0o644 less the umask, as
    `open_traces` makes it)."""
    tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "wb") as out:
            with contextlib.suppress(FileNotFoundError):
                os.fchmod(out.fileno(), stat.S_IMODE(os.stat(path).st_mode))
            if rows is not None:
                for row in rows:
                    out.write(_encode(row))
            else:
                out.write(text.encode())
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
