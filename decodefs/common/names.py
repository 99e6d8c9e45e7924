"""An array's name and its key, each from the other (``<key>.npy``), and what a key may be:
the one rule for the mount, its clients and the store; knows names only, not mounts or stores.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "ARRAY_SUFFIX",
    "ARRAY_SUFFIX_BYTES",
    "array_name",
    "is_array_name",
    "is_key",
    "key_of",
    "key_of_bytes",
]

# A key names one original: its file stem in the uuid layout (``0a1b2c``), its
# path without the extension below ``<version>/<size>/`` in the mirror layout
# (``cat/0001``). Its array's name there is the key with ARRAY_SUFFIX.
ARRAY_SUFFIX: Final = ".npy"
ARRAY_SUFFIX_BYTES: Final = ARRAY_SUFFIX.encode()  # names as the kernel gives them


def array_name(key: str) -> str:
    """The name (a mirror key: the path) of ``key``'s array below ``<mount>/<version>/<size>/``."""
    return key + ARRAY_SUFFIX


def is_array_name(name: str) -> bool:
    """Whether ``name`` (a file name, or a path below a size directory) is an array's."""
    return name.endswith(ARRAY_SUFFIX)


def key_of(name: str) -> str | None:
    """The key whose array is ``name`` (a file name, or a ``/``-separated path below
    ``<mount>/<version>/<size>/``): ``name`` without ".npy"; None if it is no array's."""
    return name[: -len(ARRAY_SUFFIX)] if is_array_name(name) else None


def is_key(key: str) -> bool:
    """Whether ``key`` can be a key: nothing that leads outside ``<version>/<size>/``
    (not empty, no NUL, no ``.``, ``..`` or empty path component)."""
    return "\0" not in key and all(part not in ("", ".", "..") for part in key.split("/"))


def key_of_bytes(name: bytes) -> bytes | None:
    """``key_of`` for a name as the kernel gives it (bytes); None too for ".npy" alone."""
    if len(name) > len(ARRAY_SUFFIX_BYTES) and name.endswith(ARRAY_SUFFIX_BYTES):
        return name[: -len(ARRAY_SUFFIX_BYTES)]
    return None
