"""The exceptions trio_tasksets raises, under one root.

```text
TrioTasksetsError
└── ConfigError (also ValueError)     a bad setting, found before any work starts
    └── EvalConfigError               an eval's setting (EvalConfig, the slot backend)
```

A `ConfigError` names the parameter it is about (`parameter`, the library's own name such as
``num_examples``); the command line catches `ConfigError` once and shows the flag instead.
"""

from __future__ import annotations

__all__ = ["ConfigError", "EvalConfigError", "TrioTasksetsError"]


class TrioTasksetsError(Exception):
    """The root of every exception trio_tasksets defines: ``except tt.TrioTasksetsError``
    catches what the library raises on purpose (not a bug in it, nor a user callback's own
    exception, which propagates as raised)."""


class ConfigError(TrioTasksetsError, ValueError):
    """A bad setting, found before any task is pulled or file written (CLI: exit 2).

    `parameter` names the setting as the library spells it (``num_examples``); when the
    error is about several at once, `parameters` names them all (`parameter` is the first).
    The message mentions each by that name, so the command line can show its flag."""

    def __init__(self, message: str, *, parameter: str | tuple[str, ...] | None = None) -> None:
        super().__init__(message)
        names = (parameter,) if isinstance(parameter, str) else tuple(parameter or ())
        self.parameters: tuple[str, ...] = names
        self.parameter: str | None = names[0] if names else None


class EvalConfigError(ConfigError):
    """A bad eval setting: an `EvalConfig` field, or where its slots run."""
