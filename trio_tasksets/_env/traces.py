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
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import orjson
import trio

from .._core.runner import pick_one

__all__ = ["TraceWriter", "open_traces", "read_rows", "write_atomic"]


def _encode(row: dict[str, Any]) -> bytes:
    # orjson: a row is encoded on the eval's hot path, ~0.4 us against ~5 us for json.dumps.
    # What it refuses (an int beyond 64 bits, a tuple key) goes through json with str().
    try:
        return orjson.dumps(
            row, default=str, option=orjson.OPT_APPEND_NEWLINE | orjson.OPT_NON_STR_KEYS
        )
    except TypeError:
        return (json.dumps(row, ensure_ascii=False, default=str) + "\n").encode()


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


def read_rows(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The whole rows of a trace file, and how many lines could not be read.

    A torn last line (a killed writer) is expected; an unreadable line elsewhere is counted
    too, never raised, so a resume keeps what is whole.
    """
    rows: list[dict[str, Any]] = []
    bad = 0
    if not path.exists():
        return rows, bad
    for line in path.read_bytes().split(b"\n"):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad += 1
    return rows, bad


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
