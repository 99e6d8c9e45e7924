"""Who may read an original (``access = "originals"``): its owner, its group, and the read
bits that its own mode and every directory above it let through.

The mount shows an array with these (the kernel enforces them), and its store file
is made no more readable. A bit stays only if every user of its class may search
each directory from ``/`` down to the original: where a user's class in a directory
is unknown (whether they own it, or are in its group), each bit that could apply
must allow it. Root reads everything. POSIX ACLs of the originals are not read: an
original's group bits are then its ACL's mask, so an ACL that grants more than the
mode shows is not followed, and one whose named entries grant less is not either.
This module knows stat results, not the index, the store or FUSE.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from typing import Final, NamedTuple

__all__ = ["DAEMON_ONLY", "Readers", "directory_readers", "file_readers", "search_mask"]

_OWNER_R, _GROUP_R, _OTHER_R = 0o400, 0o040, 0o004
_READ_BITS: Final = _OWNER_R | _GROUP_R | _OTHER_R


class Readers(NamedTuple):
    """An owner, a group and read bits (``0o444`` at most): who may read."""

    uid: int
    gid: int
    bits: int

    @property
    def file_mode(self) -> int:
        """The mode the mount shows for an array of this original."""
        return stat.S_IFREG | self.bits

    @property
    def directory_mode(self) -> int:
        """The mode the mount shows for a directory of this source directory: each read
        bit with its search bit, never a write bit."""
        return stat.S_IFDIR | self.bits | self.bits >> 2


# What is shown where nothing is known yet (an original not stat'ed): the daemon alone.
DAEMON_ONLY: Final = Readers(0, 0, 0)


def search_mask(directory: os.stat_result, uid: int, gid: int) -> int:
    """The read bits, of a file owned by ``uid`` and ``gid``, whose users may all search
    ``directory``."""
    mode, owner = directory.st_mode, directory.st_uid
    if not stat.S_ISDIR(mode):
        return 0
    user_x, group_x, other_x = mode & 0o100, mode & 0o010, mode & 0o001
    # The file's owner is the directory's owner, or in its group, or not: unknown.
    owner_ok = user_x if owner == uid else group_x and other_x
    # Members of the file's group, and everyone else, may own it (unless root does)
    # or be in its group; the file's group is the directory's own, or may not be.
    any_owner_ok = user_x or owner == 0
    group_ok = any_owner_ok and group_x and (directory.st_gid == gid or other_x)
    other_ok = any_owner_ok and group_x and other_x
    return (
        (_OWNER_R if owner_ok else 0)
        | (_GROUP_R if group_ok else 0)
        | (_OTHER_R if other_ok else 0)
    )


def file_readers(st: os.stat_result, above: Sequence[os.stat_result | None]) -> Readers:
    """Who may read the file ``st`` below the directories ``above`` (from ``/`` down to
    its own directory; None: one that could not be stat'ed, which lets nothing through)."""
    bits = st.st_mode & _READ_BITS if stat.S_ISREG(st.st_mode) else 0
    for directory in above:
        if not bits:
            break
        bits &= search_mask(directory, st.st_uid, st.st_gid) if directory is not None else 0
    return Readers(st.st_uid, st.st_gid, bits)


def directory_readers(st: os.stat_result, above: Sequence[os.stat_result | None]) -> Readers:
    """Who may list and search the directory ``st`` below the directories ``above``."""
    searchable = search_mask(st, st.st_uid, st.st_gid)
    bits = st.st_mode & _READ_BITS & searchable
    for directory in above:
        if not bits:
            break
        bits &= search_mask(directory, st.st_uid, st.st_gid) if directory is not None else 0
    return Readers(st.st_uid, st.st_gid, bits)
