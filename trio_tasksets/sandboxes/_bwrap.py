"""`bwrap`: a bubblewrap sandbox per box, each command entered into it.

Making a box starts one ``[setpriv --reuid U --regid G --clear-groups] bwrap --die-with-parent
--new-session --unshare-all --unshare-user --disable-userns ... -- /bin/sh -c "echo ready;
read _"`` (its *keeper*, reading a death pipe only the eval holds) in a new root made of:

- the host's top-level folders bound read-only (or those of a given `root`), but
  `hide` (default ``/home``, ``/root``, ``/run``, ``/var/run``, ``/sys``, ``/mnt``,
  ``/media``, ``/srv``: where secrets and sockets live) which are left out;
- ``/work``: the box's work folder, private and writable, bound from a fresh host folder
  (removed with the box); ``/tmp``: a private tmpfs of `tmp_size` bytes; a minimal
  ``/dev``; a fresh ``/proc``;
- the root itself remounted read-only.

Its own user, PID, IPC, network, UTS and cgroup namespaces (`network=True` shares the
host's network): no 127.0.0.1, no interface but an unconfigured loopback; it sees only its
own processes. Each `exec` is ``prlimit LIMITS nsenter --target INIT --user --mount --pid
--ipc --net --uts --root --wd --setuid U --setgid U -- COMMAND``: a fork and an exec, no new
root per command. What a command leaves running (a ``setsid`` daemon, a double fork,
``nohup``) lives until the box is closed: closing it kills bwrap, its init (PID 1) and so
every process of the namespace. A SIGKILLed eval takes the box with it: bwrap's
parent-death signal (set from the trio thread, see `_process`), and the keeper's death pipe
(which also holds when the eval dies before the signal is set).

Run by root, the box runs as a uid of its own (`user` to choose one) after dropping root
with ``setpriv``, without capabilities: the process limit (RLIMIT_NPROC, which the kernel
does not apply to root) holds, per box, and the work folder is chowned to that uid. Run by
a user, it runs as that user in its user namespace, and each command is a bubblewrap of its
own (`BwrapEachBox`: a user's nsenter has no rights over the namespaces bwrap nests): what a
command leaves running then dies with the command, and a command costs a new root.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from .._core.exceptions import ConfigError
from ._base import Sandbox, SandboxError
from ._box import ProcessBox, new_workdir, signalled
from ._local import make_limits
from ._process import Limits

__all__ = ["BwrapBox", "BwrapEachBox", "BwrapFactory", "bwrap"]

WORK = "/work"
_BOX_UIDS = 2_000_000_000
_boxes = itertools.count()
DEFAULT_HIDE = ("/home", "/root", "/run", "/var/run", "/sys", "/mnt", "/media", "/srv")
_SKIP = {"proc", "dev", "tmp", "lost+found"}


def _root_entries(root: str, hide: Sequence[str]) -> list[str]:
    """bwrap arguments that lay the top level of `root` read-only into the box."""
    args: list[str] = []
    hidden = {h.rstrip("/") for h in hide}
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        dest = "/" + entry.name
        if entry.name in _SKIP or dest in hidden or dest == WORK:
            continue
        if entry.is_symlink():
            args += ["--symlink", os.readlink(entry.path), dest]
        elif entry.is_dir():
            args += ["--ro-bind", entry.path, dest]
            for sub in sorted(h for h in hidden if h.startswith(dest + "/")):
                if os.path.isdir(os.path.join(root, sub.lstrip("/"))) and not os.path.islink(
                    os.path.join(root, sub.lstrip("/"))
                ):
                    args += ["--tmpfs", sub]
    return args


class BwrapBox(ProcessBox):
    """A bwrap sandbox: one bubblewrap process for the box's life (its namespaces, its
    root, its init), and each command entered into it with ``nsenter``."""

    name = "bwrap"
    wrappers = 1  # nsenter, which forks the command inside

    def __init__(self, *, keeper: list[str], identity: tuple[int, int], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.keeper_argv = keeper
        self.identity = identity
        self.keeper: subprocess.Popen[bytes] | None = None
        self.death_pipe = -1
        self.target = 0
        self.enter: list[str] = []

    async def start(self) -> None:
        """Start the box's bwrap and learn its init's pid (``--info-fd``)."""
        info_r, info_w = os.pipe()
        keep_r, self.death_pipe = os.pipe()  # the keeper reads it: EOF when we are gone
        argv = [*self.keeper_argv[:-1], "--chdir", WORK, "--info-fd", str(info_w), "--"]
        argv += ["/bin/sh", "-c", "echo ready; read _"]  # said once the box is all set up
        try:
            self.keeper = subprocess.Popen(  # noqa: ASYNC220 (the trio thread: see _process)
                argv,
                stdin=keep_r,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                close_fds=True,
                pass_fds=(info_w,),
                start_new_session=True,
                env=self.env,
            )
        except OSError as exc:
            os.close(info_r)
            raise SandboxError(f"could not start bwrap: {exc}") from exc
        finally:
            os.close(info_w)
            os.close(keep_r)
        assert self.keeper.stdout is not None
        text = ready = b""
        async with trio.lowlevel.FdStream(info_r) as info:
            ready_stream = trio.lowlevel.FdStream(os.dup(self.keeper.stdout.fileno()))
            self.keeper.stdout.close()
            async with ready_stream:
                with trio.move_on_after(30):
                    while chunk := await info.receive_some(4096):
                        text += chunk
                        if text.rstrip().endswith(b"}"):
                            break
                    while b"\n" not in ready and (chunk := await ready_stream.receive_some(64)):
                        ready += chunk
        try:
            self.target = int(json.loads(text)["child-pid"]) if ready == b"ready\n" else 0
        except (ValueError, KeyError):
            self.target = 0
        if not self.target:
            await self._stop_keeper()
            assert self.keeper.stderr is not None
            why = self.keeper.stderr.read().decode(errors="replace").strip()
            raise SandboxError(f"bwrap could not make the sandbox: {why or text!r}")
        uid, gid = self.identity
        self.enter = [
            *self.limits.prlimit(), "nsenter", f"--target={self.target}", "--user", "--mount",
            "--pid", "--ipc", "--net", "--uts", "--root", "--wd",
            f"--setuid={uid}", f"--setgid={gid}", "--",
        ]  # fmt: skip

    def status(self, returncode: int) -> int:
        return signalled(returncode)  # nsenter exits 128 + N for some signals N

    def wrap(self, argv: list[str], cwd: str) -> tuple[list[str], str | None]:
        if cwd != WORK:  # nsenter starts in the box's work folder
            argv = ["/bin/sh", "-c", 'cd -- "$0" && exec "$@"', cwd, *argv]
        return [*self.enter, *argv], None

    async def _stop_keeper(self) -> None:
        keeper = self.keeper
        if keeper is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(keeper.pid, signal.SIGKILL)  # bwrap: its init and the box go with it
        if self.death_pipe >= 0:
            os.close(self.death_pipe)
            self.death_pipe = -1
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(keeper.wait)
            if keeper.stderr is not None:
                keeper.stderr.close()

    async def aclose(self) -> None:
        if self.closed:
            return
        await self._stop_keeper()
        await super().aclose()


class BwrapEachBox(ProcessBox):
    """A bwrap sandbox run by a user (not root): each command a bubblewrap of its own (a
    user's nsenter has no rights over the namespaces bwrap nests), its limits applied
    inside (so that RLIMIT_NPROC counts the box's processes, not all of the user's).
    What a command leaves running dies with it."""

    name = "bwrap"
    wrappers = 2  # bwrap, then its init (PID 1)

    def __init__(self, *, prefix: list[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.prefix = prefix

    def status(self, returncode: int) -> int:
        return signalled(returncode)  # bwrap's init exits 128 + N for signal N

    def wrap(self, argv: list[str], cwd: str) -> tuple[list[str], str | None]:
        prefix = self.prefix[:-1]  # (without its "--")
        return [*prefix, "--chdir", cwd, "--", *self.limits.prlimit(), *argv], None


@attrs.frozen
class BwrapFactory:
    """Makes `bwrap` sandboxes (see `bwrap`)."""

    limits: Limits = attrs.field(factory=Limits)
    root: str = "/"
    hide: tuple[str, ...] = DEFAULT_HIDE
    network: bool = False
    tmp_size: int = 256 << 20
    user: int | None = None
    env: dict[str, str] = attrs.field(factory=dict)

    def __call__(self) -> contextlib.AbstractAsyncContextManager[Sandbox]:
        return self._open()

    def _identity(self) -> tuple[int, int] | None:
        """The uid and gid the box runs as, when root drops to them (None: not root)."""
        if os.geteuid() != 0:
            return None  # bwrap runs as the eval's user, in a user namespace
        if self.user is not None:
            return (self.user, self.user) if self.user != 0 else None
        # a uid of the box's own, so that its process limit is its own (RLIMIT_NPROC counts
        # per user): far above the system's and login users' ranges
        uid = _BOX_UIDS + (os.getpid() % 100_000) * 1000 + next(_boxes) % 1000
        return (uid, uid)

    def command_prefix(self, workdir: Path, identity: tuple[int, int] | None) -> list[str]:
        # (no limits on the box itself: its user namespace is then made without a process
        # limit, so the one each command gets counts the box's processes, not its user's)
        prefix: list[str] = []
        if identity is not None:
            uid, gid = identity
            prefix += ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]
            prefix += ["--inh-caps=-all", "--bounding-set=-all"]
        prefix += ["bwrap", "--die-with-parent", "--new-session", "--unshare-all"]
        prefix.append("--unshare-user")
        if identity is not None:
            # no nested user namespaces (bwrap nests one more to forbid them: nsenter, run by
            # root, enters it; a user's nsenter would have no rights over the outer one)
            prefix.append("--disable-userns")
        if self.network:
            prefix.append("--share-net")
        prefix += _root_entries(self.root, self.hide)
        prefix += ["--dev", "/dev", "--proc", "/proc"]
        prefix += ["--size", str(self.tmp_size), "--tmpfs", "/tmp"]
        prefix += ["--dir", WORK, "--bind", str(workdir), WORK]
        prefix += ["--hostname", "sandbox", "--remount-ro", "/", "--"]
        return prefix

    @contextlib.asynccontextmanager
    async def _open(self) -> AsyncIterator[Sandbox]:
        if shutil.which("bwrap") is None:
            raise SandboxError(
                "the bwrap sandbox needs bubblewrap: install it (apt-get install bubblewrap, "
                "dnf install bubblewrap) or use another backend (local, docker:IMAGE)"
            )
        workdir = new_workdir("bwrap")
        owner = self._identity()
        if owner is None:  # run by a user: a bubblewrap per command
            each = BwrapEachBox(
                prefix=self.command_prefix(workdir, None),
                workdir=workdir,
                inside=WORK,
                owned=True,
                limits=self.limits,
                env=self.env,
            )
            try:
                yield each
            finally:
                await each.aclose()
            return
        os.chown(workdir, *owner)
        box = BwrapBox(
            keeper=self.command_prefix(workdir, owner),
            identity=owner,
            workdir=workdir,
            inside=WORK,
            owned=True,
            limits=self.limits,
            env=self.env,
            file_owner=owner,
        )
        try:
            await box.start()
            yield box
        finally:
            await box.aclose()


def bwrap(
    *,
    root: str | os.PathLike[str] = "/",
    hide: Sequence[str] = DEFAULT_HIDE,
    network: bool = False,
    tmp_size: int = 256 << 20,
    user: int | None = None,
    env: Mapping[str, str] | None = None,
    **limits: Any,
) -> BwrapFactory:
    """A factory of `bwrap` sandboxes (see the module): `root`'s top-level folders
    read-only but `hide`, a private ``/work`` and ``/tmp`` (`tmp_size` bytes), no network
    unless `network`, as `user` (a uid; default 65534 when the eval is root), with `env`
    added to the clean environment and `limits` (the fields of `Limits`). Raises ConfigError
    naming a bad option."""
    if not Path(root).is_dir():
        raise ConfigError(
            f"{{root}} must be an existing directory, got {str(root)!r}", parameter="root"
        )
    if isinstance(hide, str):
        raise ConfigError(
            f"{{hide}} must be a list of absolute paths, got the string {hide!r}",
            parameter="hide",
        )
    for path in hide:
        if not isinstance(path, str) or not path.startswith("/"):
            raise ConfigError(f"{{hide}} must hold absolute paths, got {path!r}", parameter="hide")
    if isinstance(tmp_size, bool) or not isinstance(tmp_size, int) or tmp_size <= 0:
        raise ConfigError(
            f"{{tmp_size}} must be an int > 0 (bytes), got {tmp_size!r}", parameter="tmp_size"
        )
    if user is not None and (isinstance(user, bool) or not isinstance(user, int) or user < 0):
        raise ConfigError(f"{{user}} must be a uid (an int >= 0), got {user!r}", parameter="user")
    return BwrapFactory(
        limits=make_limits(limits),
        root=str(root),
        hide=tuple(hide),
        network=bool(network),
        tmp_size=tmp_size,
        user=user,
        env=dict(env or {}),
    )
