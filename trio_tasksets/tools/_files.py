"""`tt.tools.read_file`, `write_file`, `list_dir`: file tools that run in the current sandbox.

Each is a `tt.Tool` factory. A call runs in `tt.current_sandbox()` (the rollout's box, made
on first use), with paths relative to the box's work folder: the box confines them (a path
that escapes it by ``..``, an absolute path or a symlink is refused by the backend, and the
model reads the refusal as an ``Error: ...`` text). Where no sandbox is current, the tools
work in `root`, a folder on the host, confined the same way here (a path is resolved,
symlinks included, and must stay inside `root`); with neither, a call answers the model
that there is no sandbox.

`list_dir` lists with ``ls -1Ap`` run in the box (a folder's entries, folders with a
trailing ``/``), after checking there that the folder resolves inside the work folder.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

import trio

from .._core.exceptions import ConfigError
from ..sandboxes import Sandbox, current_or_none
from ._schema import Tool, tool

__all__ = ["list_dir", "read_file", "write_file"]

DEFAULT_MAX_BYTES = 65_536


class _Place:
    """Where a file tool's call works: the current sandbox, else the host folder `root`."""

    def __init__(self, root: str | os.PathLike[str] | None, parameter: str = "root") -> None:
        if root is not None and not Path(root).is_dir():
            raise ConfigError(
                f"{{{parameter}}} must be an existing directory, got {str(root)!r}",
                parameter=parameter,
            )
        self.root = None if root is None else Path(root).resolve()

    def box(self) -> Sandbox | None:
        box = current_or_none()
        if box is None and self.root is None:
            raise PermissionError(
                "no sandbox is current and the tool was given no root folder: the env needs "
                "sandbox=... (or --sandbox), or the tool root=..."
            )
        return box

    def host_path(self, path: str) -> Path:
        """`path` inside `root`, resolved (symlinks too); PermissionError if it escapes."""
        assert self.root is not None
        found = (self.root / path).resolve()
        if found != self.root and self.root not in found.parents:
            raise PermissionError(f"{path!r} is outside the work folder")
        return found


def _check_bytes(max_bytes: int) -> None:
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ConfigError(
            f"{{max_bytes}} must be an int >= 1 (bytes), got {max_bytes!r}", parameter="max_bytes"
        )


def read_file(
    *,
    root: str | os.PathLike[str] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    name: str = "read_file",
) -> Tool:
    """A tool named `name` taking ``path`` that returns the file's text (UTF-8, undecodable
    bytes replaced), its first `max_bytes` bytes and then a line saying how much was left
    out. Runs in the current sandbox, else in `root` (see the module). Raises `ConfigError`
    naming `root` (not a folder) or `max_bytes` (not an int >= 1)."""
    _check_bytes(max_bytes)
    place = _Place(root)

    async def run(path: str) -> str:
        box = place.box()
        if box is not None:
            data = await box.read_file(path)
        else:
            data = await trio.Path(place.host_path(path)).read_bytes()
        text = data[:max_bytes].decode("utf-8", errors="replace")
        if len(data) > max_bytes:
            text += f"\n[file truncated: {len(data) - max_bytes} more bytes]"
        return text

    run.__doc__ = (
        "Read a text file of the working folder.\n\nArgs:\n    path: the file's path, "
        "relative to the working folder"
    )
    return tool(name=name)(run)


def write_file(
    *,
    root: str | os.PathLike[str] | None = None,
    max_bytes: int = 1 << 20,
    name: str = "write_file",
) -> Tool:
    """A tool named `name` taking ``path`` and ``content`` (text) that writes the file
    (creating or replacing it) and says how many bytes it wrote; content over `max_bytes`
    bytes (UTF-8) is refused. Runs in the current sandbox, else in `root` (see the module).
    Raises `ConfigError` naming `root` or `max_bytes`."""
    _check_bytes(max_bytes)
    place = _Place(root)

    async def run(path: str, content: str) -> str:
        data = content.encode()
        if len(data) > max_bytes:
            raise ValueError(f"the content is {len(data)} bytes, over the {max_bytes} allowed")
        box = place.box()
        if box is not None:
            await box.write_file(path, data)
        else:
            target = place.host_path(path)
            await trio.Path(target.parent).mkdir(parents=True, exist_ok=True)
            await trio.Path(target).write_bytes(data)
        return f"wrote {len(data)} bytes to {path}"

    run.__doc__ = (
        "Write a text file in the working folder (created or replaced).\n\nArgs:\n    path: "
        "the file's path, relative to the working folder\n    content: the file's text"
    )
    return tool(name=name)(run)


_LIST = (  # in the box: list `$1` if it resolves (symlinks too) inside the work folder
    'base=$(pwd -P) && cd -P -- "$1" && case "$(pwd -P)/" in "$base"/*) ls -1Ap ;; '
    '*) echo "outside the work folder" >&2; exit 3 ;; esac'
)


def list_dir(
    *,
    root: str | os.PathLike[str] | None = None,
    max_entries: int = 1000,
    name: str = "list_dir",
) -> Tool:
    """A tool named `name` taking ``path`` (default ``"."``) that lists a folder's entries,
    one a line, folders with a trailing ``/``, at most `max_entries` of them. Runs in the
    current sandbox (``ls`` in the box), else in `root` (see the module). Raises
    `ConfigError` naming `root` or `max_entries`."""
    if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
        raise ConfigError(
            f"{{max_entries}} must be an int >= 1, got {max_entries!r}", parameter="max_entries"
        )
    place = _Place(root)

    async def run(path: str = ".") -> str:
        if PurePosixPath(path).is_absolute() or ".." in PurePosixPath(path).parts:
            raise PermissionError(f"{path!r} is outside the work folder")
        box = place.box()
        if box is not None:
            result = await box.exec(["/bin/sh", "-c", _LIST, "sh", path])
            if result.returncode != 0:
                problem = result.stderr.decode(errors="replace").strip()
                raise OSError(problem or f"cannot list {path!r}")
            entries = result.stdout.decode(errors="replace").splitlines()
        else:
            folder = place.host_path(path)
            entries = sorted(
                entry.name + ("/" if entry.is_dir() else "") for entry in os.scandir(folder)
            )
        shown = entries[:max_entries]
        if len(entries) > max_entries:
            shown.append(f"[{len(entries) - max_entries} more entries]")
        return "\n".join(shown) if shown else "[empty folder]"

    run.__doc__ = (
        "List a folder of the working folder.\n\nArgs:\n    path: the folder's path, "
        "relative to the working folder"
    )
    return tool(name=name)(run)
