"""The exceptions trio_tasksets raises, under one root (as httpx's `_exceptions`).

Every exception class the package defines derives from `TrioTasksetsError`; those that are
also a builtin kind say so (a `ConfigError` is a ValueError, `RolloutTimeoutError` a
TimeoutError), so ``except ValueError`` keeps working. Where each class lives:

```text
TrioTasksetsError
├── ConfigError (ValueError)            a bad setting, found before any work (CLI: exit 2)
│   ├── ConfigTypeError (TypeError)     an argument of the wrong kind (not callable, not an int)
│   ├── EvalConfigError                 an eval's setting: EvalConfig, the slot backend
│   ├── WindowArgumentError             a window's size or bounds (window)
│   ├── TargetError                     a TASKSET / object spec that does not resolve (loading)
│   ├── TravelError                     an env or model client that cannot go to a server
│   ├── UnsupportedProxy                a proxy setting the transport cannot use
│   ├── VerifiersUsageError             a bad vf: command line (aio.verifiers)
│   └── ReportError                     a run dir the report cannot read (report)
├── EmptyEvalError (ValueError)         an eval that plans no slot (eval; CLI: exit 1)
├── LoadError (ValueError)              an object spec that failed to import (loading)
├── EngineMetricsError (ValueError)     an engine's /metrics that cannot be read (models.engine)
├── GroupFailedError                    a group's rollout failed after its retries (groups)
├── ResultRefused                       a fan-out's result refused (runner; groups catch it)
├── ModelError                          talking to a model server (models)
│   ├── ModelConnectionError
│   ├── ModelTimeoutError
│   ├── ModelHTTPError                  .status: the HTTP status
│   └── ModelResponseError
├── RolloutTimeoutError (TimeoutError)  an attempt outlasted rollout_timeout (env)
├── StalledError (TimeoutError)         an attempt made no progress for stall_timeout (env)
├── DeadlineExceededError (TimeoutError) a slot's deadline passed before or while it ran (env)
├── HTTPError                           the project's HTTP client (transport)
│   ├── ConnectError
│   │   └── ProxyError
│   ├── ConnectionClosed
│   ├── ProtocolError
│   ├── HTTPTimeout (TimeoutError)
│   ├── ResponseTooLarge
│   └── DecodingError
├── SendFailed, ResponseTooLargeSignal  inside the transport (never reach a caller)
├── RequestCut                          a request its caller cut (a policy update's abort)
├── EnvServerError                      the served path's client (.status: the server's)
├── WireError (ValueError)              a malformed request or reply on the wire (serve.wire)
│   └── Forbidden                       a run that asks for what the server does not allow
├── RequestRefused                      a request the server refuses before reading it
├── HandshakeRefused                    a WebSocket handshake answered with an HTTP status
├── WSGone, TooLarge                    the served transport's connection ended / overflowed
├── RedisError                          the Redis connection (redis.resp)
│   ├── ReplyError
│   ├── Unreachable
│   └── OddServer                       a server that answers what no Redis answers
├── Stopped                             a Redis call told to stop while waiting to retry
├── MalformedEntry (ValueError)         a stream entry that holds no task (redis.entries)
│   └── EntryRefused                    an entry declared for another env
├── ViaError (RuntimeError)             a worker refused a slot of an --via eval
├── DatasetError (ValueError)           a record that cannot be a task, a dataset unread (datasets)
├── ToolArgumentError (ValueError)      arguments that do not fit a tool's schema (tools)
├── NoSandboxError (LookupError)        tt.current_sandbox() where none is current (sandboxes)
├── SandboxError                        a sandbox cannot start a command, reach a path, be made
│   ├── ExecTimeoutError (TimeoutError) a command outlived its timeout (.result: its output)
│   └── SandboxStartError               a rollout's sandbox could not be made (sandboxes)
├── ScriptExhausted (RuntimeError)      a ScriptedClient called past its script (testing)
├── CommandError                        a command-line failure (cli; exit 1)
│   └── UsageError                      a bad command line (exit 2)
├── GuestRunStopped (RuntimeError)      the trio guest run ended early (aio)
├── AsyncioCancelled (RuntimeError)     the asyncio side was cancelled (aio.loop)
├── TrioAsyncioUnavailable (ImportError)
└── VerifiersUnavailable (ImportError)

EvalWarning (UserWarning)               a setting that works, but not as written
```

A `ConfigError` (and an `EvalWarning`) names the parameters it is about (`parameter`,
`parameters`: the library's own names such as ``num_examples``); the command line catches
`ConfigError` once and shows each parameter's flag instead (``-n/--num-examples``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = [
    "ConfigError",
    "ConfigTypeError",
    "EmptyEvalError",
    "EvalConfigError",
    "EvalWarning",
    "TrioTasksetsError",
]


class TrioTasksetsError(Exception):
    """The root of every exception trio_tasksets defines: ``except tt.TrioTasksetsError``
    catches what the library raises on purpose (not a bug in it, nor a user callback's own
    exception, which propagates as raised)."""


class _Spelled(Exception):
    """A message written with marks (``{num_examples}``) for the parameters it names."""

    def __init__(
        self,
        message: str,
        *,
        parameter: str | tuple[str, ...] | None = None,
        fix: str | None = None,
    ) -> None:
        names = (parameter,) if isinstance(parameter, str) else tuple(parameter or ())
        self.parameters: tuple[str, ...] = names
        self.parameter: str | None = names[0] if names else None
        self.template = message
        self.fix = fix  # what to do about it (marked like the message), if there is a rule
        super().__init__(self.spelled({}))

    def spelled(self, spelling: Mapping[str, str]) -> str:
        """The message with each parameter's mark spelled as `spelling` says (a name it
        lacks: the name itself)."""
        return _spell(self.template, self.parameters, spelling)

    def spelled_fix(self, spelling: Mapping[str, str]) -> str | None:
        """`fix`, spelled as `spelled` spells the message."""
        return None if self.fix is None else _spell(self.fix, self.parameters, spelling)


def _spell(template: str, parameters: tuple[str, ...], spelling: Mapping[str, str]) -> str:
    def spell(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in parameters:
            return match.group(0)  # braces that are not a mark (a value's repr)
        return spelling.get(name, name)

    return _MARK.sub(spell, template)


class ConfigError(_Spelled, TrioTasksetsError, ValueError):
    """A bad setting, found before any task is pulled or file written (CLI: exit 2).

    `parameter` names the setting as the library spells it (``num_examples``); when the
    error is about several at once, `parameters` names them all (`parameter` is the first).
    The message is written with a mark ``{num_examples}`` wherever it names one: `str()`
    shows the names, and `spelled(flags)` the same message with each spelled otherwise (the
    command line's ``-n/--num-examples``)."""


_MARK = re.compile(r"\{(\w+)\}")


class ConfigTypeError(ConfigError, TypeError):
    """A `ConfigError` for an argument of the wrong kind (a `run` that is not callable, an
    `n` that is not an int): also a TypeError, as Python's own check of an argument is, so
    ``except TypeError`` keeps working."""


class EvalConfigError(ConfigError):
    """A bad eval setting: an `EvalConfig` field, or where its slots run."""


class EmptyEvalError(_Spelled, TrioTasksetsError, ValueError):
    """An eval that plans no slot at all: ``num_examples=0``, a static taskset whose `load()`
    gives no task (an empty data file), or a stream that ends before its first task.

    `run_eval` raises it before it writes anything (a stream, once it has taken back what it
    wrote), so no run dir is left; the command line exits 1: an eval that evaluated nothing
    is not a pass. `parameter` is ``num_examples`` when that planned nothing, else None;
    `fix` says what to do. A ``resume`` with nothing owed is not one (it plans its slots, all
    kept). A ValueError, as ``max([])`` raises one; not a `ConfigError` (whose exit is 2)."""


class EvalWarning(_Spelled, UserWarning):
    """A setting that works, but not as written (`num_examples` larger than a static
    taskset); it names its parameters as a `ConfigError` does."""


class MalformedEntry(TrioTasksetsError, ValueError):
    """An entry that does not hold a task this worker can run: acknowledged without running
    it (Redis: moved to the dead-letter stream) and logged."""


class EntryRefused(MalformedEntry):
    """An entry this worker will not run (declared for another env): acknowledged without
    running it, and the reason sent to its producer if it waits for the answer."""
