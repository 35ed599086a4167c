"""The asyncio bridge (SPEC section 6), in two directions.

* asyncio programs call the trio runner: `run_trio`, `run_stream`, `run_eval` in trio guest
  mode (`guest`, with `adapters` for asyncio sources and runs awaited from the guest);
* trio programs drive an existing asyncio env: `bridge_env`, `BridgedEnv`, `AsyncioTaskset`
  and `AsyncioModelContext` (`bridge_env`, on the trio-asyncio loop of `loop`). These rooms
  import without trio-asyncio; guest mode never needs it.

The design of each direction is in its room's docstring (`guest`, `bridge_env`).
"""

from .adapters import GuestRunStopped
from .bridge_env import AsyncioModelContext, AsyncioTaskset, BridgedEnv, bridge_env
from .guest import run_eval, run_stream, run_trio
from .loop import AsyncioCancelled, TrioAsyncioUnavailable

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
]
