"""The served path's server: an env in its own process(es) behind HTTP and a WebSocket.

* **Server** (`trio-tasksets serve TASKSET`): an ASGI app on hypercorn's trio worker with
  ``GET /health``, ``POST /run`` (one slot, its episode row back) and the WebSocket ``/ws``
  (many runs multiplexed, answered by id; `serve.session`). `env.serving()` is held for the
  server's life. ``--workers K`` runs K worker processes that share one listening socket,
  bound once by a supervisor process (see `docs/serve.md`).
* **Cancellation**: on ``/ws`` by a ``{"op": "cancel", "id": ...}`` item (a closed WebSocket
  cancels all its runs); on ``POST /run`` by disconnect: the handler races the episode
  against the ASGI ``receive()`` that returns ``http.disconnect``.
* **Death pipe**: a server started with its stdin on a pipe stops when the pipe reaches EOF,
  so a child spawned by `spawn_server` dies with its parent, also when
  the parent is SIGKILLed (and a pool's supervisor does the same to its workers). Not
  ``PR_SET_PDEATHSIG``: it fires when the parent *thread* exits, and trio spawns from a
  worker thread that retires when idle, which would stop a healthy child.

Rooms: `wire` (the JSON wire format and its constants), `policy` (who may call, what a run
may reach, limits), `asgi`, `app` (the ASGI app) and `session` (one WebSocket), `process`
(serving processes), `transport`, `errors` and `client` (`EnvClient`), `spawn`
(`spawn_server`), `slots` (the eval's slots on a server: `--serve`, `--server-url`).
The command is `trio_tasksets._cli.serve`.
"""

from .client import EnvClient
from .errors import EnvServerError
from .slots import ServedBackend
from .spawn import ServerProcess, spawn_server

__all__ = ["EnvClient", "EnvServerError", "ServedBackend", "ServerProcess", "spawn_server"]
