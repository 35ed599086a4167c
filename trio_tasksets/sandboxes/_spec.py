"""The command line's name of a sandbox backend, read into a factory."""

from __future__ import annotations

from .._core.exceptions import ConfigError
from ._base import SandboxFactory, load
from ._bwrap import bwrap
from ._docker import docker
from ._local import local

__all__ = ["parse"]


def parse(spec: str) -> SandboxFactory:
    """The factory `spec` names: ``local``, ``bwrap``, ``docker:IMAGE`` (default options)
    or ``pkg.mod:factory`` (`load`). Raises ConfigError naming ``sandbox``."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(
            f"{{sandbox}} must be local, bwrap, docker:IMAGE or pkg.mod:factory, got {spec!r}",
            parameter="sandbox",
        )
    spec = spec.strip()
    if spec == "local":
        return local()
    if spec == "bwrap":
        return bwrap()
    if spec == "docker" or spec.startswith("docker:"):
        image = spec.partition(":")[2]
        if not image:
            raise ConfigError(
                "{sandbox}: docker needs an image: docker:IMAGE (docker:python:3.12-slim)",
                parameter="sandbox",
            )
        return docker(image)
    return load(spec)
