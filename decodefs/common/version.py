"""The version of the installed package: what `decodefs --version` says."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["package_version"]


def package_version() -> str:
    try:
        return version("decodefs")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "0+unknown"
