"""The installed version of trio_tasksets (`tt.__version__`, `trio-tasksets --version`)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["__version__"]

try:
    __version__: str = version("trio-tasksets")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
