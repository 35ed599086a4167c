"""Files inside a work folder, never outside it: each path is walked one component at a
time from the folder's descriptor with ``O_NOFOLLOW``, so neither ``..``, an absolute path
elsewhere, nor a symlink (made by a command in the box, even while the walk runs) leads out.
Symlinks are not followed at all, inside the folder either: the box's commands can follow
their own links."""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import stat
from collections.abc import Iterator

from ._base import SandboxError

__all__ = ["read_in", "relative_parts", "write_in"]

MAX_READ = 256 << 20  # a read_file larger than this is refused


def relative_parts(path: str, inside: str) -> list[str]:
    """The components of `path` below the work folder, which the box calls `inside` (an
    absolute path there, such as ``/work``). Raises SandboxError for a path that leaves it."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise SandboxError(f"not a file path: {path!r}")
    if path.startswith("/"):
        norm = posixpath.normpath(path)
        base = inside.rstrip("/") or "/"
        if norm != base and not norm.startswith(base.rstrip("/") + "/"):
            raise SandboxError(
                f"{path!r} is outside the sandbox's work folder {inside!r}: give a path "
                "relative to it, or under it"
            )
        path = norm[len(base) :].lstrip("/")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise SandboxError(f"{path!r} has a '..' component: paths stay inside the work folder")
    if not parts:
        raise SandboxError(f"{path!r} names the work folder itself, not a file")
    return parts


@contextlib.contextmanager
def _fd(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        os.close(fd)


def _walk(root: str, parts: list[str], *, create: bool, owner: tuple[int, int] | None) -> int:
    """A descriptor of the folder holding `parts[-1]`, made (when `create`) as needed."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                child = os.open(part, flags, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
                    if owner is not None:
                        os.chown(part, *owner, dir_fd=fd, follow_symlinks=False)
                child = os.open(part, flags, dir_fd=fd)
            except OSError as exc:
                raise _refused(parts, exc) from exc
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _refused(parts: list[str], exc: OSError) -> OSError | SandboxError:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return SandboxError(
            f"{'/'.join(parts)!r} goes through a symlink or a file: the file tools follow no "
            "symlinks (they could lead out of the work folder)"
        )
    return exc


_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # NONBLOCK: a FIFO never blocks the open


def _regular(fd: int, parts: list[str]) -> os.stat_result:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise SandboxError(f"{'/'.join(parts)!r} is not a regular file")
    return info


def read_in(root: str, parts: list[str]) -> bytes:
    """The bytes of the regular file `parts` under `root`. Raises SandboxError on a symlink
    or a file over 256 MiB, OSError as the file system says."""
    with _fd(_walk(root, parts, create=False, owner=None)) as folder:
        try:
            fd = os.open(parts[-1], os.O_RDONLY | _FLAGS, dir_fd=folder)
        except OSError as exc:
            raise _refused(parts, exc) from exc
        with open(fd, "rb") as file:
            _regular(file.fileno(), parts)
            os.set_blocking(file.fileno(), True)
            if os.fstat(file.fileno()).st_size > MAX_READ:
                raise SandboxError(f"{'/'.join(parts)!r} is over {MAX_READ} bytes")
            data = file.read(MAX_READ + 1)
            if len(data) > MAX_READ:
                raise SandboxError(f"{'/'.join(parts)!r} is over {MAX_READ} bytes")
            return data


def write_in(root: str, parts: list[str], data: bytes, owner: tuple[int, int] | None) -> None:
    """Write `data` to `parts` under `root` (folders made; owned by `owner` when given)."""
    with _fd(_walk(root, parts, create=True, owner=owner)) as folder:
        try:
            fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | _FLAGS, 0o644, dir_fd=folder)
        except OSError as exc:
            raise _refused(parts, exc) from exc
        with open(fd, "wb") as file:
            if _regular(file.fileno(), parts).st_nlink > 1:
                raise SandboxError(
                    f"{'/'.join(parts)!r} has other hard links: writing it could change a "
                    "file outside the work folder"
                )
            os.set_blocking(file.fileno(), True)
            file.truncate(0)
            if owner is not None:
                os.fchown(file.fileno(), *owner)
            file.write(data)
