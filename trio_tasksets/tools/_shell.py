"""`tt.tools.shell(...)`: a tool that runs a shell command in a sandbox.

Where a sandbox is current (`tt.current_sandbox()`: a `ToolEnv` given ``sandbox=``, or
``--sandbox``) each call runs ``/bin/sh -c COMMAND`` in it; elsewhere each call runs in a
fresh `local` sandbox of its own (`trio_tasksets.sandboxes`) in the working directory given:
its own PID namespace where the kernel allows one, so the command sees no host process
(not the eval, not its ``/proc/PID/environ``) and every process it starts, a ``setsid``
daemon or a double fork included, dies when the command ends, when the call times out or is
cancelled, and when the eval is killed (SIGKILL included). What the model gets back: the
output (stdout, then stderr, the first `max_output` bytes, then a line saying it was cut),
then the exit status when it is not 0, or the timeout, or why the command could not start
(``E2BIG`` for a command over the kernel's argument limit). POSIX only.

Deadlines travel into the command: a call made under a deadline (the enclosing
cancel scopes': the env's `tool_timeout`, `rollout_timeout`, `working_limit`, a `--via`
entry's or a served run's time left, `--time-limit`) never outlives it. With ``t`` seconds
left when the call starts, the command's effective timeout is ``min(timeout, t - g)`` with
``g = min(grace, t / 4)``: SIGTERM then, SIGKILL at the deadline at the latest (so the
command is gone by the deadline plus the time the kernel takes to reap it), and the model
reads the effective timeout it had (``[timed out after 1.5s, the time this call had left:
...]``). A cancellation before that (Ctrl-C) still gives SIGTERM `grace` seconds, cut to the
deadline.

The command's environment is *not* the eval's: by default only ``PATH``, ``LANG`` and
``HOME`` (the working directory), so the model cannot read the API keys and tokens the eval
holds; pass `env=` to add variables, or `inherit_env=True` to pass the eval's environment
(with `env=` on top). The `local` sandbox is not a security boundary for files and network:
docs/security.md says what each backend isolates.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from pathlib import Path

from .. import sandboxes
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
        base = dict(os.environ) if self.inherit_env else {}
        return {**base, **self.extra_env}

    def _local(self) -> sandboxes.SandboxFactory:
        workdir = self.cwd if self.cwd is not None else Path.cwd()
        return sandboxes.local(
            workdir=workdir,
            timeout=self.timeout,
            grace=self.grace,
            max_output=self.max_output,
            output_limit=max(self.max_output, 64 << 20),
        )

    async def run(self, command: str) -> str:
        box = _current_box()
        # stderr after stdout; `exec 2>&1` would interleave them, but also move a
        # syntax error's line number
        try:
            if box is not None:
                result = await box.exec(command, timeout=self.timeout, env=self.environment())
            else:
                async with sandboxes.open_sandbox(self._local()) as own:
                    result = await own.exec(command, env=self.environment())
        except sandboxes.ExecTimeoutError as exc:
            return self._answer(exc.result, timed_out=exc.timeout)
        except sandboxes.SandboxError as exc:
            return f"[{exc}]"
        return self._answer(result, timed_out=None)

    def _answer(self, result: sandboxes.ExecResult, *, timed_out: float | None) -> str:
        output = result.stdout + result.stderr
        truncated = result.truncated or len(output) > self.max_output
        text = output[: self.max_output].decode("utf-8", errors="replace")
        parts = [text] if text else []
        if truncated:
            parts.append(f"[output truncated: only its first {self.max_output} bytes are shown]")
        if timed_out is not None:
            if timed_out < self.timeout:
                parts.append(
                    f"[timed out after {timed_out:.3g}s, the time this call had left (the "
                    f"shell's own timeout is {self.timeout:g}s): the command was killed]"
                )
            else:
                parts.append(f"[timed out after {self.timeout:g}s: the command was killed]")
        elif result.returncode:
            parts.append(f"[exit status {status_text(result.returncode)}]")
        return "\n".join(parts) if parts else "[no output]"


def _current_box() -> sandboxes.Sandbox | None:
    """The current sandbox, where the env's lifecycle provides one (`current_or_none`)."""
    lookup = getattr(sandboxes, "current_or_none", None)
    box: sandboxes.Sandbox | None = lookup() if lookup is not None else None
    return box


effective_timeout = sandboxes.effective_timeout  # (tests/test_shell_deadlines.py reads it here)


def status_text(status: int) -> str:
    """An exit status as a person reads it (``-9 (killed by SIGKILL)``)."""
    if status < 0:
        try:
            return f"{status} (killed by {signal.Signals(-status).name})"
        except ValueError:
            return str(status)
    return str(status)
