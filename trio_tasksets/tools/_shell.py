"""`tt.tools.shell(...)`: a tool that runs a shell command with `trio.run_process`.

Each call runs ``/bin/sh -c COMMAND`` in its own session (a new process group), in the
working directory given, with stdin closed and stdout and stderr captured together. What the
model gets back: the output (the first `max_output` bytes, then a line saying how much was
dropped), then the exit status when it is not 0, or the timeout.

No process outlives its call: when the command ends, the rest of its process group (a
background job, a daemon it started) is killed; when the call times out or is cancelled (the
env's `tool_timeout`, the eval stopped, Ctrl-C) the whole group gets SIGTERM and, after
`grace` seconds, SIGKILL (a child that ignores SIGTERM included). POSIX only.

Deadlines travel into the command: a call made under a deadline (the enclosing
cancel scopes': the env's `tool_timeout`, `rollout_timeout`, `working_limit`, a `--via`
entry's or a served run's time left, `--time-limit`) never outlives it. With ``t`` seconds
left when the call starts, the command's effective timeout is ``min(timeout, t - g)`` with
``g = min(grace, t / 4)``: SIGTERM then, SIGKILL at the deadline at the latest (so the group
is gone by the deadline plus the time the kernel takes to reap it), and the model reads the
effective timeout it had (``[timed out after 1.5s, the time this call had left: ...]``). A
cancellation before that (Ctrl-C) still gives SIGTERM `grace` seconds, cut to the deadline.

The command's environment is *not* the eval's: by default only ``PATH``, ``LANG`` and
``HOME`` (the working directory), so the model cannot read the API keys and tokens the eval
holds; pass `env=` to add variables, or `inherit_env=True` to pass the eval's environment
(with `env=` on top).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import signal
import subprocess
from collections.abc import Mapping
from pathlib import Path

import trio

from .._core.exceptions import ConfigError
from ._schema import Tool, tool

__all__ = ["shell"]

DEFAULT_DESCRIPTION = (
    "Run a shell command (/bin/sh -c) in the working directory and return its output "
    "(stdout and stderr together) and its exit status."
)


def shell(
    *,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float = 30.0,
    max_output: int = 16_384,
    env: Mapping[str, str] | None = None,
    inherit_env: bool = False,
    grace: float = 1.0,
    name: str = "shell",
    description: str = DEFAULT_DESCRIPTION,
) -> Tool:
    """A `tt.Tool` named `name` taking one argument, ``command`` (a string), that runs it
    with ``/bin/sh -c`` in `cwd` (default: the process's working directory), for at most
    `timeout` seconds (less when the call's deadline comes first), keeping the first `max_output` bytes of its output. See the module
    for what the model gets back and how the process group is killed. Raises ValueError for
    a bad option, naming it."""
    if not timeout > 0 or timeout != timeout:
        raise ConfigError(
            f"{{timeout}} must be a number of seconds > 0, got {timeout!r}", parameter="timeout"
        )
    if isinstance(max_output, bool) or not isinstance(max_output, int) or max_output < 0:
        raise ConfigError(
            f"{{max_output}} must be an int >= 0 (bytes), got {max_output!r}",
            parameter="max_output",
        )
    if not grace >= 0:
        raise ConfigError(
            f"{{grace}} must be a number of seconds >= 0, got {grace!r}", parameter="grace"
        )
    workdir = Path(cwd) if cwd is not None else None
    if workdir is not None and not workdir.is_dir():
        raise ConfigError(
            f"{{cwd}} must be an existing directory, got {str(workdir)!r}", parameter="cwd"
        )
    runner = _Shell(workdir, timeout, max_output, dict(env or {}), inherit_env, grace)

    async def run(command: str) -> str:
        return await runner.run(command)

    run.__doc__ = description + "\n\nArgs:\n    command: the shell command to run"
    return tool(name=name)(run)


class _Shell:
    def __init__(
        self,
        cwd: Path | None,
        timeout: float,
        max_output: int,
        env: dict[str, str],
        inherit_env: bool,
        grace: float,
    ) -> None:
        self.cwd = cwd
        self.timeout = timeout
        self.max_output = max_output
        self.extra_env = env
        self.inherit_env = inherit_env
        self.grace = grace

    def environment(self) -> dict[str, str]:
        if self.inherit_env:
            base = dict(os.environ)
        else:
            home = str(self.cwd if self.cwd is not None else Path.cwd())
            base = {
                "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
                "LANG": os.environ.get("LANG", "C.UTF-8"),
                "HOME": home,
            }
        return {**base, **self.extra_env}

    async def run(self, command: str) -> str:
        kept = bytearray()
        dropped = 0
        group: int | None = None
        status: int | None = None
        now = trio.current_time()
        deadline = trio.current_effective_deadline()  # math.inf when nothing bounds the call
        budget = effective_timeout(self.timeout, deadline - now, self.grace)
        with trio.move_on_after(budget) as scope:
            try:
                async with trio.open_nursery() as nursery:
                    process: trio.Process = await nursery.start(
                        functools.partial(
                            trio.run_process,
                            ["/bin/sh", "-c", command],
                            stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT,
                            cwd=self.cwd,
                            env=self.environment(),
                            check=False,
                            start_new_session=True,
                            deliver_cancel=functools.partial(self._terminate, deadline),
                        )
                    )
                    group = process.pid
                    assert process.stdout is not None
                    stdout = process.stdout

                    async def read() -> None:
                        nonlocal dropped
                        async with stdout:
                            async for chunk in stdout:
                                room = self.max_output - len(kept)
                                if room > 0:
                                    kept.extend(chunk[:room])
                                dropped += max(0, len(chunk) - max(room, 0))

                    nursery.start_soon(read)
                    status = await process.wait()
                    # The command is over: its background jobs go too, which also ends the
                    # output (they held the pipe) so the reader sees its end.
                    _kill_group(group, signal.SIGKILL)
            finally:
                if group is not None:
                    _kill_group(group, signal.SIGKILL)  # whatever survived SIGTERM
        text = kept.decode("utf-8", errors="replace")
        parts = [text] if text else []
        if dropped:
            parts.append(f"[output truncated: {dropped} more bytes]")
        if scope.cancelled_caught:
            if budget < self.timeout:
                parts.append(
                    f"[timed out after {budget:.3g}s, the time this call had left (the shell's "
                    f"own timeout is {self.timeout:g}s): the command was killed]"
                )
            else:
                parts.append(f"[timed out after {self.timeout:g}s: the command was killed]")
        elif status:
            parts.append(f"[exit status {_status_text(status)}]")
        return "\n".join(parts) if parts else "[no output]"

    async def _terminate(self, deadline: float, process: trio.Process) -> None:
        """`run_process`'s deliver_cancel (shielded): SIGTERM to the group, SIGKILL after
        `grace` seconds or at the call's `deadline`, whichever is first."""
        _kill_group(process.pid, signal.SIGTERM)
        await trio.sleep(max(0.0, min(self.grace, deadline - trio.current_time())))
        _kill_group(process.pid, signal.SIGKILL)


def effective_timeout(timeout: float, left: float, grace: float) -> float:
    """The seconds a command may run before its SIGTERM: the shell's `timeout`, cut so that
    SIGTERM comes ``min(grace, left / 4)`` seconds before the deadline `left` seconds away
    (`math.inf`: none) and SIGKILL at the deadline; 0 once the deadline has passed."""
    if left == math.inf:
        return timeout
    left = max(0.0, left)
    return max(0.0, min(timeout, left - min(grace, left / 4)))


def _kill_group(group: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone
        os.killpg(group, sig)


def _status_text(status: int) -> str:
    if status < 0:
        try:
            return f"{status} (killed by {signal.Signals(-status).name})"
        except ValueError:
            return str(status)
    return str(status)
