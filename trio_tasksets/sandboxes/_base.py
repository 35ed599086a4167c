"""The sandbox seam: `Sandbox` (the protocol every backend implements), `ExecResult`, the
errors, and factories: what makes a sandbox, how one is opened and named.

A **factory** makes one sandbox per call. It is a callable taking no arguments that returns
either

- an async context manager whose ``__aenter__`` gives the `Sandbox` (its ``__aexit__``
  destroys it), or
- an awaitable of a `Sandbox` (``async def make() -> Sandbox``): whoever opened it calls
  its ``aclose()`` when done.

`open_sandbox(factory)` takes either kind and is always an async context manager. The
project's backends (`local(...)`, `bwrap(...)`, `docker(...)`) return factories of the first
kind, reusable and picklable-by-spec; `load("pkg.mod:factory")` imports a factory of one's
own (the object named is the factory itself: a function, or a module-level
``factory = tt.sandboxes.bwrap(memory=...)``), and `parse(spec)` reads the command line's
``local|bwrap|docker:IMAGE|pkg.mod:factory``.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from .._core.exceptions import ConfigError, ConfigTypeError, TrioTasksetsError

__all__ = [
    "ExecResult",
    "ExecTimeoutError",
    "Sandbox",
    "SandboxError",
    "SandboxFactory",
    "load",
    "open_sandbox",
]


@attrs.frozen
class ExecResult:
    """What a command run in a sandbox gave: its exit status (negative: the signal that
    killed it, as `subprocess` says), what it wrote (each stream cut at the backend's
    `max_output` bytes), and whether any output was cut."""

    returncode: int
    stdout: bytes
    stderr: bytes
    truncated: bool


@runtime_checkable
class Sandbox(Protocol):
    """A place where commands run apart from the eval: `exec` a command, read and write
    files in its work folder, `aclose` it (everything it started dies). Relative paths, and
    the default working directory of `exec`, are the sandbox's work folder."""

    async def exec(
        self,
        command: str | Sequence[str],
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (SPEC 14: a command's own limit)
        input: bytes | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> ExecResult:
        """Run `command` (a string: with ``/bin/sh -c``; a sequence: as argv) and return
        its result. It never outlives `timeout` (the backend's default when None) nor the
        caller's deadline (`trio.current_effective_deadline()`): on timeout the command is
        killed and `ExecTimeoutError` raised; on cancellation it is killed and the
        cancellation propagates. Raises SandboxError when it cannot start."""
        ...

    async def read_file(self, path: str) -> bytes:
        """The bytes of the file at `path` inside the work folder. Raises SandboxError for a
        path that leaves it (``..``, an absolute path elsewhere, a symlink out), OSError
        (FileNotFoundError, ...) as the file system says."""
        ...

    async def write_file(self, path: str, data: bytes) -> None:
        """Write `data` to `path` inside the work folder (parents made). Raises
        SandboxError for a path that leaves it, OSError as the file system says."""
        ...

    async def aclose(self) -> None:
        """Destroy the sandbox: every process it started killed, its work folder removed
        (unless it was given). Idempotent. Raises nothing on a second call."""
        ...


class SandboxError(TrioTasksetsError):
    """A sandbox could not do what was asked: start a command (the cause, ``E2BIG``
    included, in the message and as ``__cause__``), reach a path outside its work folder,
    be made at all (a backend not installed, a daemon not reachable)."""


class ExecTimeoutError(SandboxError, TimeoutError):
    """A command outlived its timeout (or the time its caller had left) and was killed.
    `result` holds what it wrote until then; `timeout` the seconds it had."""

    def __init__(self, message: str, *, result: ExecResult, timeout: float) -> None:
        super().__init__(message)
        self.result = result
        self.timeout = timeout


SandboxFactory = Callable[[], Any]
"""A callable of no arguments returning an async context manager of a `Sandbox` or an
awaitable of one (the module says more)."""


@contextlib.asynccontextmanager
async def open_sandbox(factory: SandboxFactory) -> AsyncIterator[Sandbox]:
    """Make a sandbox with `factory` (either kind, see the module), yield it, destroy it
    when the block ends however it ends. Raises ConfigTypeError when `factory` is not
    callable or returns neither kind, and what the factory raises."""
    if not callable(factory):
        raise ConfigTypeError(
            f"{{sandbox}} must be a sandbox factory (a callable of no arguments), got {factory!r}",
            parameter="sandbox",
        )
    made = factory()
    if hasattr(made, "__aenter__") and hasattr(made, "__aexit__"):
        async with made as box:
            yield box
        return
    if inspect.isawaitable(made):
        box = await made
        try:
            yield box
        finally:
            await box.aclose()
        return
    raise ConfigTypeError(
        f"{{sandbox}}: the factory {factory!r} returned {type(made).__name__}, neither an "
        "async context manager nor an awaitable of a Sandbox",
        parameter="sandbox",
    )


def load(spec: str) -> SandboxFactory:
    """The factory named by `spec`, ``pkg.mod:name`` (``name`` may be dotted: an attribute
    of an attribute). Raises ConfigError naming ``sandbox`` when it does not import or is not
    callable."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ConfigError(
            f"{{sandbox}} must be local, bwrap, docker:IMAGE or pkg.mod:factory, got {spec!r}",
            parameter="sandbox",
        )
    try:
        target: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"{{sandbox}}: cannot load {spec!r}: {type(exc).__name__}: {exc}",
            parameter="sandbox",
        ) from exc
    if not callable(target):
        raise ConfigError(
            f"{{sandbox}}: {spec!r} is a {type(target).__name__}, not a sandbox factory "
            "(a callable of no arguments)",
            parameter="sandbox",
        )
    return target  # type: ignore[no-any-return]
