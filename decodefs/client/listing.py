"""A mount directory listed once instead of a lookup per key: which of a reader's keys the
listing names as arrays of that directory; knows listings and inode numbers, not the store.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Final

import numpy as np
import numpy.typing as npt

from ..common.inodes import Kind, Node
from ..common.names import ARRAY_SUFFIX

__all__ = ["CHUNK", "LISTED_PER_LOOKUP", "among", "list_below", "names_entry"]

# A listing costs the mount about a twentieth of a lookup per entry (~90,000 entries/s
# against ~5,000 lookups/s of names the kernel forgot, 2 CPUs): up to 16 entries are
# listed per key still to look up.
LISTED_PER_LOOKUP: Final = 16


def list_below(
    directory: str,
    budget: int,
    ours: Callable[[os.stat_result], bool],
    found: Callable[[list[str], list[int]], None],
) -> int:
    """List ``directory`` and the folders below it, up to ``budget`` entries in all; how
    many were listed. The regular files directly in ``directory`` go to ``found`` by
    name with their inode numbers, ``CHUNK`` at a time (none if ``ours`` refuses the
    stat of the directory listed: not the one meant)."""
    listed = 0
    folders = [directory]
    top = True
    while folders and listed < budget:
        folder = folders.pop()
        names: list[str] = []
        inos: list[int] = []
        try:
            # A folder below is not followed if it became a symlink since it was listed.
            flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (0 if top else os.O_NOFOLLOW)
            fd = os.open(folder, flags)
        except OSError:
            top = False
            continue  # its keys are looked up one by one, as without a listing
        try:
            named = top and ours(os.fstat(fd))
            top = False
            with os.scandir(fd) as entries:
                for entry in entries:
                    listed += 1
                    if listed >= budget:
                        break
                    if entry.is_dir(follow_symlinks=False):
                        folders.append(os.path.join(folder, entry.name))
                    elif named and entry.is_file(follow_symlinks=False):
                        names.append(entry.name)
                        inos.append(entry.inode())
                        if len(names) == CHUNK:
                            found(names, inos)
                            names, inos = [], []
        except OSError:
            pass  # what it listed stands; its other keys are looked up one by one
        finally:
            os.close(fd)
        if names:
            found(names, inos)
    return listed


CHUNK: Final = 4096  # listed names matched at a time


def among(
    wanted: npt.NDArray[np.bytes_], names: list[str], inos: list[int]
) -> tuple[list[int], list[int]]:
    """The listed array names whose key is in ``wanted`` (sorted keys): each one's
    key's position there, and its inode number."""
    width = wanted.dtype.itemsize
    keys: list[bytes] = []
    numbers: list[int] = []
    for name, ino in zip(names, inos, strict=True):
        if name.endswith(ARRAY_SUFFIX):
            key = os.fsencode(name[: -len(ARRAY_SUFFIX)])
            if len(key) <= width:  # a longer one is no key (cut short, it could match one)
                keys.append(key)
                numbers.append(ino)
    if not keys or not len(wanted):
        return [], []
    listed = np.array(keys, dtype=wanted.dtype)
    at = np.minimum(np.searchsorted(wanted, listed), len(wanted) - 1)
    hit = wanted[at] == listed
    return at[hit].tolist(), np.array(numbers, np.uint64)[hit].tolist()


def names_entry(ino: int, version: int, size: int) -> bool:
    """Whether a listed file's inode number ``ino`` is an array of ``version`` (its id in
    inode numbers) at ``size``, as reader.locate would find it."""
    try:
        node = Node.from_ino(ino)
    except IndexError:
        return False
    return node.kind == Kind.ENTRY and node.version == version and node.size == size
