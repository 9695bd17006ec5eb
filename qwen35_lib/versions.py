"""Installed package versions, read from the installed distributions' metadata (`importlib.metadata`): the one
helper the benchmarks, the AOT sweep, the server and the notebooks' setup record or check versions with."""

from __future__ import annotations

import importlib.metadata

DISTRIBUTION = "qwen35-playbook"  # this library's own distribution name


def installed_version(name: str) -> str | None:
    """The installed version of the distribution `name` (e.g. "jax", "libtpu"), or None where it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def library_version() -> str:
    """This library's installed version, "0+unknown" where it runs uninstalled (from a source tree)."""
    return installed_version(DISTRIBUTION) or "0+unknown"
