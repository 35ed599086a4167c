"""Moved: the served path's client is in the flat API (`tt.EnvClient`, `tt.spawn_server`)."""

from ._serve.client import EnvClient
from ._serve.errors import EnvServerError
from ._serve.spawn import ServerProcess, spawn_server

__all__ = ["EnvClient", "EnvServerError", "ServerProcess", "spawn_server"]
