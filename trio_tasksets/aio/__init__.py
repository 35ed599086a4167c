"""The asyncio bridge, in two directions.

* asyncio programs call the trio runner: `run_trio`, `run_stream`, `run_eval` in trio guest
  mode (`_guest`, with `_adapters` for asyncio sources and runs awaited from the guest);
* trio programs drive an existing asyncio env: `bridge_env`, `BridgedEnv`, `AsyncioTaskset`
  and `AsyncioModelContext` (`_bridge_env`, on the loop `_loop` opens: trio-asyncio's, or
  `_host`'s stdlib loop in a thread or the asyncio host's), and `verifiers_env` for an
  existing verifiers v1 env (`_verifiers`). These rooms import without trio-asyncio and
  without verifiers; guest mode never needs either.

The design of each direction is in its (private) room's docstring (`_guest`, `_bridge_env`).
"""

from ._adapters import GuestRunStopped
from ._bridge_env import AsyncioModelContext, BridgedEnv, bridge_env
from ._feeds import AsyncioTaskset
from ._guest import run_eval, run_stream, run_trio
from ._loop import AsyncioCancelled, TrioAsyncioUnavailable
from ._verifiers import verifiers_env

__all__ = [
    "AsyncioCancelled",
    "AsyncioModelContext",
    "AsyncioTaskset",
    "BridgedEnv",
    "GuestRunStopped",
    "TrioAsyncioUnavailable",
    "bridge_env",
    "run_eval",
    "run_stream",
    "run_trio",
    "verifiers_env",
]
