"""STUB until wt-sbx's seam is merged (SPEC 14): tt.Sandbox and tt.ExecResult."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import attrs

from ._current import NoSandboxError, SandboxStartError, current_or_none, current_sandbox, using

__all__ = [
    "ExecResult",
    "NoSandboxError",
    "Sandbox",
    "SandboxStartError",
    "current_or_none",
    "current_sandbox",
    "using",
]


@attrs.frozen
class ExecResult:
    returncode: int
    stdout: bytes
    stderr: bytes
    truncated: bool = False


@runtime_checkable
class Sandbox(Protocol):
    async def exec(
        self,
        command: str | Sequence[str],
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (the tt.Sandbox protocol's)
        input: bytes | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> ExecResult: ...

    async def read_file(self, path: str) -> bytes: ...

    async def write_file(self, path: str, data: bytes) -> None: ...

    async def aclose(self) -> None: ...
