"""Run one process for a sandbox: spawned from the trio thread, its output capped, its time
bounded by a timeout and the caller's deadline, its whole process group killed at the end.

Why not `trio.run_process`: trio starts processes from a worker thread, and the kernel's
parent-death signal (``PR_SET_PDEATHSIG``, which `bwrap --die-with-parent` and `setpriv
--pdeathsig` set) fires when the *thread* that forked the child exits: trio's idle worker
threads exit after 10 s, which would kill a longer command. Spawned here, from the thread
running trio, the signal fires when that thread ends: the trio run, or the process, killed
by any signal (SIGKILL included). Popen uses vfork, so the spawn blocks the loop for well
under a millisecond.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence

import attrs
import trio

from .._core.exceptions import ConfigError
from ._base import ExecResult, ExecTimeoutError, SandboxError

__all__ = [
    "Limits",
    "Outcome",
    "descendants",
    "effective_timeout",
    "kill_group",
    "run",
    "stop_below",
]

READ_AFTER_EXIT = 1.0  # seconds the output may still drain once the command is gone
CHUNK = 65_536
MIB = 1 << 20


def _positive(name: str, value: object, *, integer: bool) -> None:
    bad = isinstance(value, bool) or not isinstance(value, (int, float) if not integer else int)
    if bad or not value > 0 or value != value:  # type: ignore[operator]
        kind = "an int > 0" if integer else "a number > 0"
        raise ConfigError(f"{{{name}}} must be {kind}, got {value!r}", parameter=name)


@attrs.frozen
class Limits:
    """The bounds of what a command in a sandbox may use; every one has a safe default.

    - `timeout`: seconds a command may run when `exec` is given none (60).
    - `grace`: seconds between SIGTERM and SIGKILL when a command is stopped (1).
    - `memory`: bytes of address space per process (RLIMIT_AS; 4 GiB).
    - `processes`: processes and threads (RLIMIT_NPROC of the box's user; 256).
    - `file_size`: bytes of the largest file a command may write (RLIMIT_FSIZE; 1 GiB).
    - `open_files`: file descriptors per process (RLIMIT_NOFILE; 1024).
    - `max_output`: bytes of each of stdout and stderr kept (1 MiB); more is cut
      (`ExecResult.truncated`).
    - `output_limit`: bytes of output read in all before the command is killed (64 MiB).
    """

    timeout: float = 60.0
    grace: float = 1.0
    memory: int = 4 << 30
    processes: int = 256
    file_size: int = 1 << 30
    open_files: int = 1024
    max_output: int = MIB
    output_limit: int = 64 * MIB

    def __attrs_post_init__(self) -> None:
        _positive("timeout", self.timeout, integer=False)
        if isinstance(self.grace, bool) or not self.grace >= 0:
            raise ConfigError(
                f"{{grace}} must be a number of seconds >= 0, got {self.grace!r}",
                parameter="grace",
            )
        for name in ("memory", "processes", "file_size", "open_files", "output_limit"):
            _positive(name, getattr(self, name), integer=True)
        if isinstance(self.max_output, bool) or not isinstance(self.max_output, int):
            raise ConfigError(
                f"{{max_output}} must be an int >= 0 (bytes), got {self.max_output!r}",
                parameter="max_output",
            )
        if not 0 <= self.max_output <= self.output_limit:
            raise ConfigError(
                f"{{max_output}} must be between 0 and output_limit ({self.output_limit}), "
                f"got {self.max_output!r}",
                parameter="max_output",
            )

    def prlimit(self, *, processes: bool = True) -> list[str]:
        """These limits as a `prlimit` command prefix (applied, then the rest exec'd);
        without RLIMIT_NPROC when not `processes`. (The kernel counts RLIMIT_NPROC per user
        and user namespace, and up the namespaces against the limit their creator had: set
        inside a user namespace made without it, it bounds the box's processes only.)"""
        return [
            "prlimit",
            f"--as={self.memory}",
            *([f"--nproc={self.processes}"] if processes else []),
            f"--fsize={self.file_size}",
            f"--nofile={self.open_files}",
            "--core=0",
            "--",
        ]


def effective_timeout(timeout: float, left: float, grace: float) -> float:
    """The seconds a command may run before its SIGTERM: `timeout`, cut so that SIGTERM
    comes ``min(grace, left / 4)`` seconds before the deadline `left` seconds away
    (`math.inf`: none) and SIGKILL at the deadline; 0 once the deadline has passed."""
    if left == math.inf:
        return timeout
    left = max(0.0, left)
    return max(0.0, min(timeout, left - min(grace, left / 4)))


def descendants(pid: int, below: int) -> list[int]:
    """The host pids of `pid`'s descendants more than `below` generations down (from /proc:
    how a wrapped command is found under its wrappers, whatever its namespace)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as file:
                ppid = int(file.read().rpartition(b")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found: list[int] = []
    level, depth = [pid], 0
    while level:
        level = [child for parent in level for child in children.get(parent, [])]
        depth += 1
        if depth > below:
            found += level
    return found


def stop_below(wrappers: int) -> Callable[[int, int], None]:
    """A `kill` for a command under `wrappers` generations of wrapper processes (a PID
    namespace's init, bwrap's two): SIGKILL goes to the group (the wrappers take the
    namespace down with them); another signal to the command and its descendants only,
    so that a command given SIGTERM has its grace before the namespace goes."""

    def kill(pid: int, sig: int) -> None:
        if sig == signal.SIGKILL:
            kill_group(pid, sig)
            return
        for child in descendants(pid, wrappers - 1):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(child, sig)

    return kill


def kill_group(group: int, sig: int) -> None:
    """Send `sig` to process group `group`, quietly when it is gone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, sig)


@attrs.frozen
class Outcome:
    result: ExecResult
    overflowed: bool  # killed for writing more than output_limit


def spawn_error(argv: Sequence[str], exc: OSError) -> SandboxError:
    """The cause of a failed spawn, said plainly (E2BIG with the sizes that matter)."""
    name = errno.errorcode.get(exc.errno or 0, "")
    what = f"{name}: {exc.strerror}" if name else str(exc)
    if exc.errno == errno.E2BIG:
        longest = max((len(a.encode()) for a in argv), default=0)
        total = sum(len(a.encode()) + 1 for a in argv)
        what += (
            f" (the command line is {total} bytes, its longest argument {longest}; the "
            f"kernel takes at most {_max_arg()} bytes in one argument and about "
            f"{os.sysconf('SC_ARG_MAX')} in all: pass long input with `input=` or a file)"
        )
    return SandboxError(f"could not start the command: {what}")


def _max_arg() -> int:
    return 32 * os.sysconf("SC_PAGE_SIZE")  # MAX_ARG_STRLEN


async def run(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: str | None,
    input: bytes | None,
    timeout: float,  # noqa: ASYNC109 (the command's limit, cut to the deadline)
    limits: Limits,
    kill: Callable[[int, int], None] = kill_group,
    pass_fds: tuple[int, ...] = (),
) -> Outcome:
    """Run `argv` in a new session and return its outcome. `kill(pid, sig)` stops what it
    started (default: its process group). Raises ExecTimeoutError when `timeout` (cut to the
    caller's deadline) passes, SandboxError when it cannot start, and lets a cancellation
    through once the process is dead."""
    deadline = trio.current_effective_deadline()
    budget = effective_timeout(timeout, deadline - trio.current_time(), limits.grace)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    in_r, in_w = os.pipe() if input is not None else (subprocess.DEVNULL, -1)
    try:
        process = subprocess.Popen(  # noqa: ASYNC220 (from the trio thread: see the module)
            list(argv),
            stdin=in_r,
            stdout=out_w,
            stderr=err_w,
            env=dict(env),
            cwd=cwd,
            close_fds=True,
            pass_fds=pass_fds,
            start_new_session=True,
        )
    except OSError as exc:
        for fd in (out_r, err_r, in_w):
            if fd >= 0:
                os.close(fd)
        raise spawn_error(argv, exc) from exc
    finally:
        for fd in (out_w, err_w, in_r):
            if fd >= 0:
                os.close(fd)
    pid = process.pid
    kept = [bytearray(), bytearray()]
    seen = [0, 0]
    overflowed = False
    exited = False
    streams = [trio.lowlevel.FdStream(out_r), trio.lowlevel.FdStream(err_r)]
    feed = trio.lowlevel.FdStream(in_w) if in_w >= 0 else None

    async def drain(index: int) -> None:
        nonlocal overflowed
        stream = streams[index]
        while chunk := await stream.receive_some(CHUNK):
            room = limits.max_output - len(kept[index])
            if room > 0:
                kept[index].extend(chunk[:room])
            seen[index] += len(chunk)
            if seen[0] + seen[1] > limits.output_limit and not overflowed:
                overflowed = True
                kill(pid, signal.SIGKILL)
                return

    async def send_input() -> None:
        assert feed is not None
        assert input is not None
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            view = memoryview(input)
            for start in range(0, len(view), CHUNK):
                await feed.send_all(view[start : start + CHUNK])
        await feed.aclose()

    pidfd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else -1  # Linux >= 5.3

    async def exit() -> None:
        if pidfd >= 0:
            await trio.lowlevel.wait_readable(pidfd)
        else:  # elsewhere: a thread waits (and is left behind if cancelled)
            await trio.to_thread.run_sync(process.wait, abandon_on_cancel=True)

    try:
        with trio.move_on_after(budget) as scope:
            async with trio.open_nursery() as nursery:
                readers_done = trio.Event()

                async def readers() -> None:
                    async with trio.open_nursery() as inner:
                        inner.start_soon(drain, 0)
                        inner.start_soon(drain, 1)
                    readers_done.set()

                nursery.start_soon(readers)
                if feed is not None:
                    nursery.start_soon(send_input)
                await exit()
                exited = True
                kill(pid, signal.SIGKILL)  # what it left in its group goes with it
                with trio.move_on_after(READ_AFTER_EXIT):
                    await readers_done.wait()
                nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            if not exited:
                kill(pid, signal.SIGTERM)
                left = max(0.0, deadline - trio.current_time())
                with trio.move_on_after(min(limits.grace, left)):
                    await exit()
                kill(pid, signal.SIGKILL)
                await exit()
            if pidfd >= 0:
                os.close(pidfd)
            returncode = process.wait()
            for stream in (*streams, *([feed] if feed is not None else [])):
                await stream.aclose()
    # a deadline that passed while the command was being stopped cancels the call: its
    # caller's scope ends, as it would have without the grace
    await trio.lowlevel.checkpoint_if_cancelled()
    truncated = any(seen[i] > len(kept[i]) for i in (0, 1))
    result = ExecResult(returncode, bytes(kept[0]), bytes(kept[1]), truncated)
    if scope.cancelled_caught and not exited:
        cut = budget < timeout
        raise ExecTimeoutError(
            f"the command timed out after {budget:.3g}s"
            + (f" (the time its caller had left; its own timeout was {timeout:g}s)" if cut else "")
            + ": it was killed",
            result=result,
            timeout=budget,
        )
    return Outcome(result, overflowed)
