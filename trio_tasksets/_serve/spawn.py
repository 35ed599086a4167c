"""`spawn_server`: the env server as a child process that dies with its parent."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import IO, Any

import attrs
import trio

from .._env.env import Env
from .._env.spec import EnvSpec
from .client import EnvClient
from .errors import EnvServerError
from .process import stop_process
from .wire import API_KEY_VAR, READY_PREFIX, TOKEN_VAR

# === spawning a server child =================================================================


@attrs.define(eq=False)
class ServerProcess:
    """A server child started by `spawn_server`: its `url`, `token` and process."""

    url: str
    token: str
    process: trio.Process
    _stderr: IO[bytes]

    @property
    def pid(self) -> int:
        return self.process.pid

    def stderr_tail(self, limit: int = 4000) -> str:
        """The last `limit` bytes the child wrote to stderr."""
        self._stderr.flush()
        size = self._stderr.seek(0, os.SEEK_END)
        self._stderr.seek(max(0, size - limit))
        return self._stderr.read().decode(errors="replace").strip()

    def describe_exit(self) -> str:
        """A line on how the child ended (or that it runs), with its stderr tail."""
        code = self.process.returncode
        state = "is still running" if code is None else f"exited with code {code}"
        tail = self.stderr_tail()
        return f"the env server child (pid {self.pid}) {state}" + (
            f"; its stderr ends:\n{tail}" if tail else ""
        )


def _child_env(token: str, api_key: str | None) -> dict[str, str]:
    environ = dict(os.environ)
    environ[TOKEN_VAR] = token
    environ.pop(API_KEY_VAR, None)  # the child's key is the one given, or none
    if api_key is not None:
        environ[API_KEY_VAR] = api_key
    # The child imports the same modules: give it this process's import path.
    paths = [os.getcwd() if p == "" else p for p in sys.path]
    environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return environ


async def _read_ready_line(proc: trio.Process) -> str | None:
    """The URL the child announces on stdout; None if its stdout ends first."""
    assert proc.stdout is not None
    buffer = b""
    while b"\n" not in buffer:
        chunk = await proc.stdout.receive_some(4096)
        if not chunk:
            return None
        buffer += chunk
    line = buffer.split(b"\n", 1)[0].decode(errors="replace").strip()
    return line.removeprefix(READY_PREFIX) if line.startswith(READY_PREFIX) else None


async def _wait_healthy(server: ServerProcess) -> None:
    """Poll ``/health`` until it answers ok; EnvServerError if the child exits first."""
    async with EnvClient(server.url, token=server.token, connect_timeout=2.0) as client:
        while True:
            if server.process.returncode is not None:
                raise EnvServerError(
                    f"env server {server.url} died while starting: {server.describe_exit()}",
                    url=server.url,
                )
            with contextlib.suppress(EnvServerError):
                if (await client.health()).get("ok") is True:
                    return
            await trio.sleep(0.05)


async def _start(server: ServerProcess, startup_timeout: float) -> None:
    with trio.move_on_after(startup_timeout) as scope:
        url = await _read_ready_line(server.process)
        if url is None:
            await server.process.wait()
            raise EnvServerError(
                f"the env server failed to start: {server.describe_exit()}", url="(not started)"
            )
        server.url = url
        await _wait_healthy(server)
    if scope.cancelled_caught:
        raise EnvServerError(
            f"the env server did not become healthy within {startup_timeout:g}s: "
            f"{server.describe_exit()}",
            url=server.url or "(not started)",
        )


@asynccontextmanager
async def spawn_server(
    env: Env[Any],
    *,
    workers: int = 1,
    api_key: str | None = None,
    allow_base_urls: Sequence[str] = (),
    startup_timeout: float = 60.0,
    grace: float = 5.0,
) -> AsyncIterator[ServerProcess]:
    """Start `trio-tasksets serve` for `env` as a child process on 127.0.0.1 (a free port, a
    random bearer token) and yield it once ``/health`` answers; stop it on exit (stdin
    closed, SIGTERM, SIGKILL after `grace` seconds).

    The child rebuilds the env from `EnvSpec.of(env)` (`TravelError` first if it cannot); it
    dies with this process even on SIGKILL (the death pipe on its stdin), and so do its
    workers. Runs may reach the model endpoints `allow_base_urls` (``--allow-base-url``;
    none: echo only) with `api_key`, which is put in the child's environment as
    ``TT_SERVE_API_KEY`` (``--api-key-var TT_SERVE_API_KEY``). A child that dies or stalls
    while starting raises `EnvServerError` with its stderr tail.
    """
    spec = EnvSpec.of(env)
    token = secrets.token_urlsafe(32)
    # The env travels as data (its spec's JSON), never re-encoded as flags.
    cmd = [sys.executable, "-m", "trio_tasksets", "serve", spec.taskset, "--env-spec",
           spec.to_json(), "--host", "127.0.0.1",
           "--port", "0", "--workers", str(workers), "--token-var", TOKEN_VAR,
           "--die-with-parent"]  # fmt: skip
    if api_key is not None:
        cmd += ["--api-key-var", API_KEY_VAR]
    for url in allow_base_urls:
        cmd.append(f"--allow-base-url={url}")
    with tempfile.TemporaryFile() as stderr:
        proc = await trio.lowlevel.open_process(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
            env=_child_env(token, api_key), start_new_session=True,
        )  # fmt: skip
        server = ServerProcess("", token, proc, stderr)
        try:
            await _start(server, startup_timeout)
            yield server
        finally:
            await stop_process(proc, grace)
