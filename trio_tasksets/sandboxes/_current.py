"""The current sandbox: the box the tools of this task (and of the tasks it starts) run in.

`tt.current_sandbox()` is the running rollout's box. An env given a sandbox factory
(`tt.ToolEnv(..., sandbox=...)`, `--sandbox`) makes it the current one for each rollout (or
each group) through `using`, as a handle that makes the box on first use
(`trio_tasksets._env.boxes`); `tt.tools.shell` and the file tools look it up here
(`current_or_none`), and so may a reward or a rollout loop of your own.
"""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING

from .._core.exceptions import TrioTasksetsError
from ._base import SandboxError

if TYPE_CHECKING:
    from ._base import Sandbox

__all__ = ["NoSandboxError", "SandboxStartError", "current_or_none", "current_sandbox", "using"]

_current: contextvars.ContextVar[Sandbox | None] = contextvars.ContextVar(
    "trio_tasksets_sandbox", default=None
)


class NoSandboxError(TrioTasksetsError, LookupError):
    """`tt.current_sandbox()` was called where no sandbox is current: outside a rollout of
    an env given one (`sandbox=` / `--sandbox`) and outside `tt.sandboxes.using(box)`."""


class SandboxStartError(SandboxError):
    """A rollout's sandbox could not be made (its factory raised or timed out, three times,
    or its scope had ended): an episode error like any other, retried per the env's
    policy."""


def current_sandbox() -> Sandbox:
    """The sandbox of the running rollout (or group): made on first use (its first `exec`,
    `read_file` or `write_file`) and destroyed when the rollout's scope ends.

    Raises:
        NoSandboxError: when no sandbox is current (the env was given none: pass
            ``sandbox=tt.sandboxes.local()`` to the env, or ``--sandbox local``).
    """
    box = _current.get()
    if box is None:
        raise NoSandboxError(
            "no sandbox is current: give the env one (tt.ToolEnv(..., "
            "sandbox=tt.sandboxes.bwrap()), or --sandbox bwrap on the command line), or "
            "run the block under tt.sandboxes.using(box)"
        )
    return box


def current_or_none() -> Sandbox | None:
    """The current sandbox, or None where there is none (the tools' lookup: they run on the
    host, each call in a box of its own, when there is none)."""
    return _current.get()


class using:  # lower case: it reads as a call in `with tt.sandboxes.using(box):`
    """``with tt.sandboxes.using(box):`` within the block (in this task and the tasks it
    starts) `box` is the current sandbox: the tools run in it. It does not close `box`."""

    __slots__ = ("_box", "_token")

    def __init__(self, box: Sandbox) -> None:
        self._box = box

    def __enter__(self) -> Sandbox:
        self._token = _current.set(self._box)
        return self._box

    def __exit__(self, *exc_info: object) -> None:
        _current.reset(self._token)
