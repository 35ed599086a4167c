"""`RunDirLock`: one eval at a time writes a run dir.

An advisory lock (``flock``) on ``<run dir>/.lock``, taken before a ``--resume`` reads the
run dir (and by a fresh run once it made it), held until `run_eval` returns. A second eval
of the same run dir meanwhile (two ``--resume`` of one run would both run every owed slot)
is refused with `EvalConfigError` naming the holder (its pid, host and start time, which
the holder writes into the file). The kernel drops the lock when its holder exits, however
it exits (SIGKILL included), so a stale file never blocks a resume. No lock where the
platform has no ``fcntl`` (Windows).
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Self

from .config import EvalConfigError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".lock"


class RunDirLock:
    """Holds the lock of at most one run dir (`take`), until `release` or the end of its
    ``with`` block. Taking the one it holds again does nothing."""

    def __init__(self) -> None:
        self._file: IO[str] | None = None
        self.run_dir: Path | None = None

    def take(self, run_dir: Path) -> None:
        """Lock `run_dir` (which exists); `EvalConfigError` naming the holder if another
        process holds it."""
        if self._file is not None and self.run_dir == run_dir:
            return
        if fcntl is None:  # pragma: no cover - Windows
            return
        self.release()
        handle = open(run_dir / LOCK_NAME, "a+", encoding="utf-8")  # noqa: SIM115
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "a process that has not said which"
            handle.close()
            raise EvalConfigError(
                f"{run_dir} is in use by another eval ({holder}): two evals of one run dir "
                f"would both run its owed slots; wait for that one to end (or stop it), then "
                f"{{resume}}",
                parameter="resume",
            ) from None
        except BaseException:
            handle.close()
            raise
        handle.seek(0)
        handle.truncate()
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}, since {since}\n")
        handle.flush()
        self._file, self.run_dir = handle, run_dir

    def release(self) -> None:
        """Let the run dir go (idempotent). The file stays: removing it could let two
        processes lock two different files."""
        handle, self._file = self._file, None
        if handle is not None:
            handle.close()  # closing drops the flock

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
