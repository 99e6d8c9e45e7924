"""Moving a file into the store in place (``decodefs adopt --move``): no copy on flash.

The file's payload gets its trailer appended where it lies, and the store
renames it to its key's entry path, as a write does (``Store.place``). Only a
file that nobody but the store's user can change or keep a way into is moved:
a regular file of this user alone (not a symlink), with one link, in a
directory of this user alone, on the store's filesystem. This module knows the
rules for taking a file; where entries live and how they are counted is the
store's.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..common.entry import EntryKey, check_entry, encode_trailer
from ..common.protocol import TRAILER_SIZE
from ..common.trusted import owned_alone
from .root import read_all

if TYPE_CHECKING:
    from .store import Store

__all__ = ["CannotMove", "move_in"]


class CannotMove(Exception):
    """A file may not be moved into the store (``Store.move_in``); nothing was changed."""


def move_in(
    store: Store,
    key: EntryKey,
    directory: int,
    name: str,
    payload_length: int,
    *,
    may_evict: bool,
) -> bool:
    """``Store.move_in``: make the file ``name`` in the directory open at ``directory``
    the entry of ``key``; False if another file took the entry's name meanwhile.
    Raises CannotMove (nothing changed) or StoreWriteError (the file is then as
    it was)."""
    device = store.device(key)
    digest = store.digest(key.version)
    try:
        named = os.stat(name, dir_fd=directory, follow_symlinks=False)
        if not stat.S_ISREG(named.st_mode):
            raise CannotMove("not a regular file")  # never opened for writing
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fd = os.open(name, flags, dir_fd=directory)
    except OSError as exc:
        raise CannotMove(f"cannot open it for writing: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        problem = _move_problem(st, os.fstat(directory), device)
        if (st.st_dev, st.st_ino) != (named.st_dev, named.st_ino):
            problem = "replaced while being opened"
        if problem is not None:
            raise CannotMove(problem)
        nbytes = payload_length + TRAILER_SIZE
        data = read_all(fd, st.st_size)
        trailer: bytes | None = None
        if len(data) == payload_length:
            trailer = encode_trailer(key, data, digest)
        elif len(data) != nbytes or not check_entry(key, data, digest).ok:
            # Else a move interrupted before its rename: the file is whole already.
            raise CannotMove(f"{len(data)} bytes: not a payload of {payload_length}")
        try:
            append = _appending(fd, trailer, payload_length)
            store.place(key, nbytes, fd, (directory, name), may_evict=may_evict, prepare=append)
        except BaseException:
            if trailer is not None and _same_file(st, directory, name):  # not moved
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, payload_length)  # as it was
            raise
    finally:
        os.close(fd)
    placed = store.entry_stat(key)
    return placed is not None and (placed.st_dev, placed.st_ino) == (st.st_dev, st.st_ino)


def _appending(fd: int, trailer: bytes | None, offset: int) -> Callable[[], None]:
    """Write ``trailer`` (if any) at ``offset`` of ``fd``: a payload's end."""

    def append() -> None:
        if trailer is not None and os.pwrite(fd, trailer, offset) != len(trailer):
            raise OSError(errno.ENOSPC, "the trailer was written in part")

    return append


def _move_problem(st: os.stat_result, directory: os.stat_result, store_device: int) -> str | None:
    """Why a file (``st``, in ``directory``) may not be moved into the store, or None."""
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_dev != store_device:
        return "on another filesystem than the store"
    if st.st_nlink != 1:
        return f"{st.st_nlink} links to it"
    if not owned_alone(st, os.geteuid()):
        return f"owned by uid {st.st_uid} with mode {stat.filemode(st.st_mode)}"
    if not owned_alone(directory, os.geteuid()):
        return f"in a directory of uid {directory.st_uid}, mode {stat.filemode(directory.st_mode)}"
    return None


def _same_file(st: os.stat_result, directory: int, name: str) -> bool:
    """Whether ``name`` in ``directory`` is still the file ``st`` describes."""
    try:
        now = os.stat(name, dir_fd=directory, follow_symlinks=False)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)
