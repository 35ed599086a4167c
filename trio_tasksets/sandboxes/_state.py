"""What sandboxes leave on the host, kept where the next start finds it.

Every process that makes sandboxes owns one folder, ``$TMPDIR/trio-tasksets-sandboxes-UID/
PID-START`` (START: the process's start time in clock ticks since boot, so a reused pid is
another owner). Its boxes' work folders live inside it, and a backend that leaves something
outside the file system (a Docker container) notes it there as a file under ``leftovers/``
(removed when the box is destroyed). A process killed with SIGKILL cannot clean up: the first
sandbox the next process makes reaps every owner folder whose owner is gone (running each
leftover's cleanup, then removing the folder). Processes need no reaping: the backends tie
them to their owner with the parent-death signal and a PID namespace (docs/security.md).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from ._base import SandboxError

__all__ = ["forget", "note", "owner_folder", "reap"]

_lock = threading.Lock()
_mine: Path | None = None


def _start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]  # field 22: starttime


def _root() -> Path:
    root = Path(tempfile.gettempdir()) / f"trio-tasksets-sandboxes-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        root.mkdir()
        root.chmod(0o711)  # others may pass through (a box's own user), not list or write
    info = root.lstat()
    if not root.is_dir() or root.is_symlink() or info.st_uid != os.getuid() or info.st_mode & 0o066:
        raise SandboxError(
            f"{root} must be a folder of this user's with mode 0711 (it holds the sandboxes' "
            "work folders): remove it and start again"
        )
    return root


def owner_folder() -> Path:
    """This process's owner folder, made (and the dead owners' reaped) on first call."""
    global _mine
    with _lock:
        if _mine is not None and _mine.is_dir() and _mine.name.startswith(f"{os.getpid()}-"):
            return _mine
        root = _root()
        reap(root)
        mine = root / f"{os.getpid()}-{_start_time(os.getpid())}"
        mine.mkdir(exist_ok=True)
        mine.chmod(0o711)
        (mine / "leftovers").mkdir(exist_ok=True)
        _mine = mine
        return mine


def reap(root: Path) -> list[str]:
    """Remove what dead owners left under `root`; the names of the folders reaped."""
    reaped = []
    for folder in root.iterdir():
        pid, _, start = folder.name.partition("-")
        if not pid.isdigit() or _start_time(int(pid)) == start:
            continue  # alive (or not ours to judge)
        for leftover in sorted((folder / "leftovers").glob("*")):
            with contextlib.suppress(OSError):
                command = leftover.read_text().split("\0")
                if command and command[0]:
                    subprocess.run(command, capture_output=True, timeout=30, check=False)
        shutil.rmtree(folder, ignore_errors=True)
        reaped.append(folder.name)
    return reaped


def note(name: str, cleanup: list[str]) -> Path:
    """Record that `cleanup` (a command) removes what the box `name` left outside."""
    path = owner_folder() / "leftovers" / name
    path.write_text("\0".join(cleanup))
    return path


def forget(name: str) -> None:
    """The box `name` cleaned up after itself."""
    with contextlib.suppress(FileNotFoundError):
        (owner_folder() / "leftovers" / name).unlink()
