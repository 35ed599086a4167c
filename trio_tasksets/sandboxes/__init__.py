"""Sandboxes: where a model's commands run apart from the eval (SPEC section 14).

`Sandbox` is the protocol (`exec`, `read_file`, `write_file`, `aclose`); `ExecResult` what
`exec` gives. A backend is a *factory*: a callable of no arguments returning an async context
manager of a `Sandbox`, or an awaitable of one (`open_sandbox` opens either kind). The
project's backends:

- `local(**limits)`: commands on the host, each in its own PID namespace where the kernel
  allows one (no host process visible, nothing outlives the command or the eval);
- `bwrap(**options)`: bubblewrap: the host's root read-only, a private ``/work``, no
  network, own PID/IPC/user namespaces, limits;
- `docker(image, **options)`: a container per sandbox, where a Docker daemon is reachable.

`load("pkg.mod:factory")` imports a factory of one's own; `parse(spec)` reads the command
line's ``local|bwrap|docker:IMAGE|pkg.mod:factory``; `effective_timeout` is how a backend of
one's own cuts a command's timeout to its caller's deadline. docs/security.md says what each backend
isolates and what it does not.

`current_sandbox()` is the running rollout's box (made on first use by the env that was
given a factory, `trio_tasksets._env.boxes`), `current_or_none()` the tools' lookup, and
`using(box)` makes a box the current one for a block.

Rooms (private): `_current` (the current sandbox), `_base` (the protocol, errors, factories), `_process` (one process: spawn,
limits, timeout, kill), `_files` (paths confined to the work folder), `_state` (the owner
folder; what a SIGKILLed eval left is reaped at the next start), `_box` (what the process
backends share), `_local`, `_bwrap`, `_docker`.
"""

from ._base import (
    ExecResult,
    ExecTimeoutError,
    Sandbox,
    SandboxError,
    SandboxFactory,
    load,
    open_sandbox,
)
from ._bwrap import bwrap
from ._current import (
    NoSandboxError,
    SandboxStartError,
    current_or_none,
    current_sandbox,
    using,
)
from ._docker import docker
from ._local import local
from ._process import Limits, effective_timeout
from ._spec import parse

__all__ = [
    "ExecResult",
    "ExecTimeoutError",
    "Limits",
    "NoSandboxError",
    "Sandbox",
    "SandboxError",
    "SandboxFactory",
    "SandboxStartError",
    "bwrap",
    "current_or_none",
    "current_sandbox",
    "docker",
    "effective_timeout",
    "load",
    "local",
    "open_sandbox",
    "parse",
    "using",
]
