"""Walking a store's directories: every entry file of the given versions, with its stat.

Reads directory listings only, relative to a descriptor the caller holds,
never following a symlink; which file name is which key is entry.py's
(``EntryKey.from_store_path``). Knows nothing of what an entry holds: the
store, ``decodefs verify`` and the catalog's rebuild check what it finds.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

from ..common.entry import EntryKey
from ..common.names import is_array_name
from ..common.trusted import DIRECTORY_FLAGS

__all__ = ["iter_entries"]


def iter_entries(
    root: int, versions: Mapping[str, object]
) -> Iterator[tuple[EntryKey, os.stat_result]]:
    """Every entry file in the store open at ``root`` for ``versions``, with its stat;
    no symlink is followed."""
    for version in versions:
        for size_name, size_fd in _subdirs(root, version):
            try:
                if not size_name.isdigit():
                    continue
                for shard, shard_fd in _subdirs(size_fd, None):
                    try:
                        found = list(_entry_files(shard_fd))
                    finally:
                        os.close(shard_fd)
                    for name, st in found:
                        key = EntryKey.from_store_path(version, int(size_name), shard, name)
                        if key is not None:
                            yield key, st
            finally:
                os.close(size_fd)


def _entry_files(directory: int) -> Iterator[tuple[str, os.stat_result]]:
    """(name, stat) of each regular ``*.npy`` file in ``directory``; one removed
    while being listed is skipped."""
    try:
        with os.scandir(directory) as it:
            for entry in it:
                if is_array_name(entry.name) and entry.is_file(follow_symlinks=False):
                    with contextlib.suppress(OSError):
                        yield entry.name, entry.stat(follow_symlinks=False)
    except OSError:
        return


def _subdirs(parent: int, name: str | None) -> Iterator[tuple[str, int]]:
    """(name, descriptor) of each directory in ``parent``/``name`` not starting with '.';
    the caller closes each descriptor."""
    try:
        fd = os.open(name, DIRECTORY_FLAGS, dir_fd=parent) if name is not None else os.dup(parent)
    except OSError:
        return
    try:
        with os.scandir(fd) as it:
            names = [
                e.name for e in it if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)
            ]
        for child in names:
            try:
                yield child, os.open(child, DIRECTORY_FLAGS, dir_fd=fd)
            except OSError:
                continue
    except OSError:
        return
    finally:
        os.close(fd)
