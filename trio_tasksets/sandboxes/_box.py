"""What the process-based backends (`local`, `bwrap`) share: a work folder on the host, a
command line wrapped by the backend, `exec` through `_process.run`, the file tools through
`_files`, and `aclose` killing whatever still runs and removing the folder."""

from __future__ import annotations

import itertools
import os
import shutil
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs
import trio

from ._base import ExecResult, ExecTimeoutError, SandboxError
from ._files import read_in, relative_parts, write_in
from ._process import Limits, Outcome, kill_group, run, stop_below
from ._state import owner_folder

__all__ = ["ProcessBox", "base_env", "new_workdir", "signalled"]

_numbers = itertools.count()


def new_workdir(prefix: str) -> Path:
    """A fresh work folder inside this process's owner folder (reaped after a SIGKILL)."""
    path = owner_folder() / f"{prefix}-{next(_numbers)}"
    path.mkdir(mode=0o700)
    return path


def base_env(home: str) -> dict[str, str]:
    """The environment a command starts with: nothing of the eval's but PATH and LANG."""
    return {
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        "HOME": home,
    }


def signalled(returncode: int) -> int:
    """An init's exit status (128 + N when its command was killed by signal N) as
    `subprocess` reports a signal: -N."""
    if 128 < returncode < 128 + signal.NSIG:
        return -(returncode - 128)
    return returncode


class ProcessBox:
    """A sandbox whose commands are processes started here. Subclasses say how a command
    line is wrapped (`wrap`) and where the work folder is inside (`inside`)."""

    name = "box"

    def __init__(
        self,
        *,
        workdir: Path,
        inside: str,
        owned: bool,
        limits: Limits,
        env: Mapping[str, str],
        file_owner: tuple[int, int] | None = None,
    ) -> None:
        self.workdir = workdir
        self.inside = inside
        self.owned = owned
        self.limits = limits
        self.env = {**base_env(inside), **env}
        self.file_owner = file_owner
        self.closed = False

    def wrap(self, argv: list[str], cwd: str) -> tuple[list[str], str | None]:
        """The command line that runs `argv` in the box with working directory `cwd` (as the
        box sees it), and the host directory to start it in."""
        raise NotImplementedError

    wrappers = 0  # generations of wrapper processes above the command (`stop_below`)

    def status(self, returncode: int) -> int:
        """The command's exit status from the wrapper's."""
        return returncode

    def pass_fds(self) -> tuple[int, ...]:
        """Descriptors the wrapper needs (the others are closed)."""
        return ()

    def _cwd(self, cwd: str | None) -> str:
        if cwd is None:
            return self.inside
        if cwd.startswith("/"):
            return cwd
        return f"{self.inside.rstrip('/')}/{cwd}"

    # duplicates: Sandbox.exec's signature (SPEC 14), which this implements
    async def exec(
        self,
        command: str | Sequence[str],
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (SPEC 14: a command's own limit)
        input: bytes | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> ExecResult:
        if self.closed:
            raise SandboxError(f"the {self.name} sandbox is closed")
        if isinstance(command, str):
            argv = ["/bin/sh", "-c", command]
        else:
            argv = [str(part) for part in command]
            if not argv:
                raise SandboxError("an empty command")
        if timeout is not None and not timeout > 0:
            raise SandboxError(f"timeout must be > 0 seconds, got {timeout!r}")
        wrapped, host_cwd = self.wrap(argv, self._cwd(cwd))
        try:
            outcome = await self._run(wrapped, host_cwd, input, timeout, env)
        except ExecTimeoutError as exc:
            exc.result = attrs.evolve(exc.result, returncode=self.status(exc.result.returncode))
            raise
        result = attrs.evolve(outcome.result, returncode=self.status(outcome.result.returncode))
        if outcome.overflowed:
            note = (
                f"\n[the command wrote over {self.limits.output_limit} bytes of output "
                "(output_limit) and was killed]"
            ).encode()
            result = ExecResult(result.returncode, result.stdout, result.stderr + note, True)
        return result

    async def _run(
        self,
        wrapped: list[str],
        host_cwd: str | None,
        input: bytes | None,
        timeout: float | None,  # noqa: ASYNC109 (the command's)
        env: Mapping[str, str] | None,
    ) -> Outcome:
        return await run(
            wrapped,
            env={**self.env, **(env or {})},
            cwd=host_cwd,
            input=input,
            timeout=self.limits.timeout if timeout is None else timeout,
            limits=self.limits,
            kill=stop_below(self.wrappers) if self.wrappers else kill_group,
            pass_fds=self.pass_fds(),
        )

    def _path(self, path: str) -> list[str]:
        if self.closed:
            raise SandboxError(f"the {self.name} sandbox is closed")
        return relative_parts(path, self.inside)

    async def read_file(self, path: str) -> bytes:
        parts = self._path(path)
        return await trio.to_thread.run_sync(read_in, str(self.workdir), parts)

    async def write_file(self, path: str, data: bytes) -> None:
        parts = self._path(path)
        await trio.to_thread.run_sync(
            write_in, str(self.workdir), parts, bytes(data), self.file_owner
        )

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True  # (a command still running is its caller's: cancelling it kills it)
        if self.owned:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(shutil.rmtree, self.workdir, True)
