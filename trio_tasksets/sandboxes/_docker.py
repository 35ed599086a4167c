"""`docker`: a container per sandbox, where a Docker daemon is reachable.

The box is ``docker run -d --network none --memory M --pids-limit P --ulimit ...
--cap-drop ALL --security-opt no-new-privileges --tmpfs /work IMAGE sleep infinity``,
labelled with its owner; each `exec` is a ``docker exec`` in it, the file tools go through
``docker exec`` too, and `aclose` is ``docker rm -f``. The container is noted in the owner
folder (`_state`): after a SIGKILL of the eval the next start removes it. A timed-out or
cancelled command is killed with everything else running in the container but its init
(``kill -KILL -1`` inside): run one command at a time in a docker box when that matters.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import trio

from .._core.exceptions import ConfigError
from ._base import Sandbox, SandboxError
from ._box import ProcessBox
from ._files import relative_parts
from ._local import make_limits
from ._process import Limits, Outcome, kill_group, run
from ._state import forget, note, owner_folder

__all__ = ["DockerBox", "DockerFactory", "docker", "docker_available"]

WORK = "/work"
_numbers = itertools.count()


def _cli_env() -> dict[str, str]:
    """What the docker client needs of the eval's environment (its daemon and config)."""
    keep = ("PATH", "HOME", "XDG_RUNTIME_DIR")
    return {k: v for k, v in os.environ.items() if k in keep or k.startswith("DOCKER_")}


def docker_available(binary: str = "docker") -> str | None:
    """None when a Docker daemon answers here, else why not (for skips and errors)."""
    if shutil.which(binary) is None:
        return f"no {binary} client on PATH"
    probe = subprocess.run(
        [binary, "version", "--format", "{{.Server.Version}}"],
        capture_output=True,
        env=_cli_env(),
        timeout=30,
        check=False,
    )
    if probe.returncode != 0:
        reason = probe.stderr.decode(errors="replace").strip().splitlines()
        return f"no Docker daemon reachable ({reason[-1] if reason else 'docker version failed'})"
    return None


class DockerBox(ProcessBox):
    """`ProcessBox`'s `exec` (its checks, its timeout, its output limit), each command a
    ``docker exec`` in the container; the file tools through ``docker exec`` too."""

    name = "docker"

    def __init__(self, factory: DockerFactory, container: str) -> None:
        super().__init__(
            workdir=Path(WORK), inside=WORK, owned=False, limits=factory.limits, env=factory.env
        )
        self.factory = factory
        self.container = container

    def _docker(self, *args: str) -> list[str]:
        return [self.factory.binary, *args]

    def _kill(self, pid: int, sig: int) -> None:
        kill_group(pid, sig)  # the client
        name = "KILL" if sig == signal.SIGKILL else "TERM"
        subprocess.Popen(
            self._docker("exec", self.container, "kill", f"-{name}", "-1"),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=_cli_env(),
            start_new_session=True,
        )

    def wrap(self, argv: list[str], cwd: str) -> tuple[list[str], str | None]:
        return ["-w", cwd, self.container, *argv], None  # `_run` puts ``docker exec`` before

    # duplicates: ProcessBox._run's signature, which this overrides
    async def _run(
        self,
        wrapped: list[str],
        host_cwd: str | None,
        input: bytes | None,
        timeout: float | None,  # noqa: ASYNC109 (the command's)
        env: Mapping[str, str] | None,
    ) -> Outcome:
        flags = ["-i"] if input is not None else []
        for key, value in {**self.env, **(env or {})}.items():
            flags += ["-e", f"{key}={value}"]
        return await run(
            self._docker("exec", *flags, *wrapped),
            env=_cli_env(),
            cwd=None,
            input=input,
            timeout=self.limits.timeout if timeout is None else timeout,
            limits=self.limits,
            kill=self._kill,
        )

    async def read_file(self, path: str) -> bytes:
        parts = relative_parts(path, WORK)
        result = await self.exec(["cat", "--", "/".join(parts)])
        if result.returncode != 0:
            raise FileNotFoundError(result.stderr.decode(errors="replace").strip() or path)
        return result.stdout

    async def write_file(self, path: str, data: bytes) -> None:
        parts = relative_parts(path, WORK)
        script = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"'
        result = await self.exec(["/bin/sh", "-c", script, "sh", "/".join(parts)], input=data)
        if result.returncode != 0:
            raise SandboxError(f"cannot write {path!r}: {result.stderr.decode(errors='replace')}")

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        with trio.CancelScope(shield=True):
            await trio.run_process(
                self._docker("rm", "-f", self.container),
                env=_cli_env(),
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
            forget(self.container)


@attrs.frozen
class DockerFactory:
    """Makes `docker` sandboxes (see `docker`)."""

    image: str
    limits: Limits = attrs.field(factory=Limits)
    network: bool = False
    work_size: int = 1 << 30
    binary: str = "docker"
    env: dict[str, str] = attrs.field(factory=dict)

    def __call__(self) -> contextlib.AbstractAsyncContextManager[Sandbox]:
        return self._open()

    def run_command(self, name: str, owner: str) -> list[str]:
        limits = self.limits
        return [
            self.binary, "run", "-d", "--name", name,
            "--label", f"trio-tasksets.owner={owner}",
            "--network", "bridge" if self.network else "none",
            "--memory", str(limits.memory), "--pids-limit", str(limits.processes),
            "--ulimit", f"fsize={limits.file_size}",
            "--ulimit", f"nofile={limits.open_files}:{limits.open_files}",
            "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
            "--tmpfs", f"{WORK}:rw,exec,size={self.work_size}", "-w", WORK,
            "--entrypoint", "sleep", self.image, "infinity",
        ]  # fmt: skip

    @contextlib.asynccontextmanager
    async def _open(self) -> AsyncIterator[Sandbox]:
        why = await trio.to_thread.run_sync(docker_available, self.binary)
        if why is not None:
            raise SandboxError(f"the docker sandbox cannot run here: {why}")
        owner = owner_folder().name
        name = f"tt-{owner}-{next(_numbers)}"
        note(name, [self.binary, "rm", "-f", name])
        made = await trio.run_process(
            self.run_command(name, owner),
            env=_cli_env(),
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
        if made.returncode != 0:
            forget(name)
            raise SandboxError(
                f"docker could not start {self.image!r}: "
                + made.stderr.decode(errors="replace").strip()
            )
        box = DockerBox(self, name)
        try:
            yield box
        finally:
            await box.aclose()


def docker(
    image: str,
    *,
    network: bool = False,
    work_size: int = 1 << 30,
    binary: str = "docker",
    env: Mapping[str, str] | None = None,
    **limits: Any,
) -> DockerFactory:
    """A factory of `docker` sandboxes (see the module): containers of `image`, without
    network unless `network`, a ``/work`` tmpfs of `work_size` bytes, `limits` (the fields
    of `Limits`: ``memory`` and ``processes`` become ``--memory`` and ``--pids-limit``).
    Raises ConfigError naming a bad option; making one raises SandboxError where no daemon
    is reachable."""
    if not isinstance(image, str) or not image or image.startswith("-"):
        raise ConfigError(
            f"{{image}} must be a Docker image name, got {image!r}", parameter="image"
        )
    if isinstance(work_size, bool) or not isinstance(work_size, int) or work_size <= 0:
        raise ConfigError(
            f"{{work_size}} must be an int > 0 (bytes), got {work_size!r}", parameter="work_size"
        )
    return DockerFactory(
        image=image,
        limits=make_limits(limits),
        network=bool(network),
        work_size=work_size,
        binary=binary,
        env=dict(env or {}),
    )
