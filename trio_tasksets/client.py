"""Moved: the served path's client is `trio_tasksets.serve` (`EnvClient`, `spawn_server`)."""

from .serve.client import EnvClient
from .serve.errors import EnvServerError
from .serve.spawn import ServerProcess, spawn_server

__all__ = ["EnvClient", "EnvServerError", "ServerProcess", "spawn_server"]
