"""`local`: commands run on the host, as the eval's user, in the host's file system and
network, but in a PID namespace of their own where the kernel allows one.

Each command runs as ``setpriv --pdeathsig KILL unshare --pid --fork --kill-child
--mount-proc [--user --map-root-user] prlimit LIMITS INIT /bin/sh -c COMMAND`` (INIT, `init`:
a shell that runs the command as PID 2 and exits with its status, 128 + N for signal N,
which `exec` reports as ``-N``, and kills the namespace when the eval's death pipe closes):

- its own PID namespace with a fresh ``/proc``: it sees no host process (the eval's
  ``/proc/PID/environ`` included: no path to the eval's secrets), and when its first
  process ends the kernel kills every process in the namespace (a ``setsid`` daemon, a
  double fork, ``nohup``);
- the parent-death signal on its first process (set from the thread running trio, see
  `_process`) and the death pipe its init watches (which also holds when the eval dies
  before the signal is set): a SIGKILLed eval takes its commands with it;
- a clean environment (PATH, LANG, HOME), no inherited descriptors, the limits of `Limits`.

Where no PID namespace can be made (no ``unshare``, user namespaces disabled for a
non-root user), the command runs in its own session only, and the eval is made
non-dumpable (``PR_SET_DUMPABLE 0``) so that its ``/proc/PID/environ`` is not readable by
its user's other processes; a process that leaves the session can then outlive its
command (docs/security.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import trio

from .._core.exceptions import ConfigError
from ._base import Sandbox
from ._box import ProcessBox, new_workdir, signalled
from ._process import Limits
from ._state import owner_folder

__all__ = ["LocalBox", "LocalFactory", "local", "namespaces_available"]


def init(death: int) -> list[str]:
    """PID 1 of a command's namespace: a shell that runs the command as PID 2 (so that it can
    be signalled from inside, `kill $$` included) and exits with its status; beside it a
    watcher reads the death pipe `death` (whose write end only this process holds) and, at
    its end (this process gone, SIGKILL included, however early), kills every process of the
    namespace. The command runs in the background with the init's stdin given back (a
    background job would get /dev/null) and is waited for, so that the init says nothing of
    a signal (its own stderr is /dev/null: dash would report a killed foreground job)."""
    script = (  # (dash names no descriptor over 9 in a redirection: the pipe by its path)
        f"exec 3<&0 4>&2 2>/dev/null; {{ read _ < /proc/self/fd/{death}; kill -KILL -1; }} "
        f'</dev/null & "$@" <&3 2>&4 3<&- 4>&- & wait $!'
    )
    return ["/bin/sh", "-c", script, "init"]


_death_read = -1


def death_pipe() -> int:
    """The read end of this process's death pipe (made once; the write end is never written
    and never inherited: it closes only when this process ends)."""
    global _death_read
    if _death_read < 0:
        _death_read, _ = os.pipe()  # both ends close-on-exec; the read end is passed by name
    return _death_read


_probe: bool | None = None
_PR_SET_DUMPABLE = 4


_user_map = "--map-current-user"  # (util-linux >= 2.38; the probe falls back to root's)


def _namespace_prefix(user_map: str | None = None) -> list[str]:
    prefix = ["setpriv", "--pdeathsig", "KILL", "unshare", "--pid", "--fork", "--kill-child"]
    prefix.append("--mount-proc")
    if os.geteuid() != 0:  # a user namespace, where the command keeps its uid
        prefix += ["--user", user_map or _user_map]
    return prefix


async def namespaces_available() -> bool:
    """Whether commands can run in a PID namespace here (tried once per process)."""
    global _probe, _user_map
    if _probe is None:
        found = False  # (set once the probe is over: a concurrent first box waits its own)
        if all(shutil.which(tool) for tool in ("setpriv", "unshare", "prlimit")):
            for mapping in ("--map-current-user", "--map-root-user"):
                probe = await trio.run_process(
                    [*_namespace_prefix(mapping), "/bin/sh", "-c", "test $$ = 1"],
                    check=False,
                    capture_stdout=True,
                    capture_stderr=True,
                )
                if probe.returncode == 0:
                    found = True
                    break
        if _probe is None:
            _probe = found
            if found:
                _user_map = mapping
        if not _probe:
            _not_dumpable()
    return _probe


def _not_dumpable() -> None:
    """Keep this process's /proc files (environ, mem, fds) from its user's other processes."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)


class LocalBox(ProcessBox):
    name = "local"

    def __init__(self, *, isolated: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.isolated = isolated
        self.wrappers = 2 if isolated else 0  # unshare, then INIT

    def wrap(self, argv: list[str], cwd: str) -> tuple[list[str], str | None]:
        if not self.isolated:  # RLIMIT_NPROC would count every process of the user's
            if shutil.which("prlimit") is None:  # (not Linux: no limits but the output's)
                return argv, cwd
            return [*self.limits.prlimit(processes=os.geteuid() == 0), *argv], cwd
        # the limits inside the namespace: RLIMIT_NPROC then counts the box's processes
        limits = self.limits.prlimit()
        return [*_namespace_prefix(), *limits, *init(death_pipe()), *argv], cwd

    def pass_fds(self) -> tuple[int, ...]:
        return (death_pipe(),) if self.isolated else ()

    def status(self, returncode: int) -> int:
        return signalled(returncode) if self.isolated else returncode


@attrs.frozen
class LocalFactory:
    """Makes `local` sandboxes (see `local`)."""

    limits: Limits = attrs.field(factory=Limits)
    workdir: str | None = None
    env: dict[str, str] = attrs.field(factory=dict)

    def __call__(self) -> contextlib.AbstractAsyncContextManager[Sandbox]:
        return self._open()

    @contextlib.asynccontextmanager
    async def _open(self) -> AsyncIterator[Sandbox]:
        isolated = await namespaces_available()
        owner_folder()  # the first box of this process reaps what dead owners left
        if self.workdir is not None:
            workdir, owned = Path(self.workdir), False
        else:
            workdir, owned = new_workdir("local"), True
        box = LocalBox(
            isolated=isolated,
            workdir=workdir,
            inside=str(workdir),
            owned=owned,
            limits=self.limits,
            env=self.env,
        )
        try:
            yield box
        finally:
            await box.aclose()


def local(
    *,
    workdir: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    **limits: Any,
) -> LocalFactory:
    """A factory of `local` sandboxes: commands on the host, each in its own PID namespace
    where the kernel allows one (see the module), in `workdir` (default: a fresh folder
    per sandbox, removed with it; a given one is kept), with `env` added to the clean
    environment and `limits` (the fields of `Limits`: ``timeout``, ``memory``,
    ``processes``, ``file_size``, ``max_output``, ...). Raises ConfigError naming a bad
    option or a `workdir` that is not a folder."""
    if workdir is not None and not Path(workdir).is_dir():
        raise ConfigError(
            f"{{workdir}} must be an existing directory, got {str(workdir)!r}",
            parameter="workdir",
        )
    return LocalFactory(
        limits=make_limits(limits),
        workdir=None if workdir is None else os.path.realpath(workdir),
        env=dict(env or {}),
    )


def make_limits(options: Mapping[str, Any]) -> Limits:
    """`Limits` from keyword options, naming an unknown one."""
    known = {field.name for field in attrs.fields(Limits)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(
            f"{{{unknown[0]}}} is not a sandbox option (the limits are: {', '.join(sorted(known))})",
            parameter=unknown[0],
        )
    return Limits(**options)
