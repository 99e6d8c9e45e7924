"""Who may read an entry file straight from the store: its mode, group and ACL, by the policy.

``access = "owner"``: ``0600``; ``"everyone"``: ``0644``; ``"originals"``: the
daemon's file, of the original's group, with the original's group and other read
bits (readers.py), and the original's owner named in a POSIX ACL entry with the
original's owner read bit (``user:<uid>:r--``, or ``---`` to refuse the owner what
group or other bits would give). An entry stays the daemon's: its original's
owner must never be able to rewrite what others read. Where the filesystem has no
ACLs, an entry whose owner may read no more than others keeps the group and other
bits, and any other is ``0600``: a reader it refuses reads through the mount,
where the kernel decides. A file is made no more readable than its original at
every step (first ``0600``, then the group, then the mode or ACL). Nothing is known
here of sources, keys or FUSE.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import struct
from typing import Final

from ..common.readers import Readers

__all__ = ["EntryModes"]

log = logging.getLogger(__name__)

ACL_XATTR: Final = "system.posix_acl_access"
# The kernel's ACL xattr: a version, then (tag, perm, id) per entry, sorted by tag.
_ACL_HEADER: Final = struct.pack("<I", 2)
_ACL_ENTRY: Final = struct.Struct("<HHI")
_USER_OBJ, _USER, _GROUP_OBJ, _MASK, _OTHER = 0x01, 0x02, 0x04, 0x10, 0x20
_NO_ID: Final = 0xFFFFFFFF
_READ, _WRITE = 4, 2
_NO_ACL_ERRNOS: Final = frozenset({errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})


class EntryModes:
    """Gives entry files the policy's mode, group and ACL. Thread-safe (no state but
    whether the store's filesystem takes ACLs, learnt once)."""

    def __init__(self, access: str) -> None:
        self.access = access
        self._uid, self._gid = os.geteuid(), os.getegid()
        self._acls = True  # until the filesystem says otherwise

    @property
    def default_mode(self) -> int:
        """An entry's mode when who may read its original is not known (or not asked)."""
        return 0o644 if self.access == "everyone" else 0o600

    def apply(self, fd: int, readers: Readers | None) -> bool:
        """Give the entry open at ``fd`` what the policy says (``readers``: its original's,
        with "originals"; None: unknown, the daemon alone); True if anything changed.
        Raises OSError (a read-only store: the caller decides)."""
        st = os.fstat(fd)
        if self.access != "originals" or readers is None or not readers.bits:
            return self._set(fd, st, self._gid, self.default_mode, None)
        gid = readers.gid
        owner_reads = bool(readers.bits & 0o400)
        shared_bits = readers.bits & 0o044
        if readers.uid == self._uid:  # the daemon's own original: no one else to name
            return self._set(fd, st, gid if shared_bits else self._gid, 0o600 | shared_bits, None)
        if self._acls:
            acl = _acl(readers.uid, owner_reads, bool(shared_bits & 0o040), bool(shared_bits & 4))
            try:
                return self._set(fd, st, gid, None, acl)
            except OSError as exc:
                if exc.errno not in _NO_ACL_ERRNOS:
                    raise
                log.info("the store's filesystem has no POSIX ACLs: %s; an entry whose "
                         "original's owner alone may read it is the daemon's alone, "
                         "read through the mount", exc.strerror)  # fmt: skip
                self._acls = False
        # No ACL: the owner reads the entry as the group or others do, so keep those
        # bits only if the owner may read the original too.
        bits = shared_bits if owner_reads else 0
        return self._set(fd, st, gid if bits else self._gid, 0o600 | bits, None)

    def _set(
        self, fd: int, st: os.stat_result, gid: int, mode: int | None, acl: bytes | None
    ) -> bool:
        """Give ``fd`` the group ``gid`` and ``mode`` (no ACL), or the ACL ``acl``,
        never letting anyone more in on the way; True if anything changed."""
        same_mode = acl is None and st.st_gid == gid and stat.S_IMODE(st.st_mode) == mode
        if same_mode and not self._has_acl(fd):
            return False
        if acl is not None and st.st_gid == gid and self._acl_of(fd) == acl:
            return False
        os.fchmod(fd, 0o600)  # first the daemon's alone (an ACL's mask too)
        if st.st_gid != gid:
            os.fchown(fd, -1, gid)
        if acl is not None:
            os.setxattr(fd, ACL_XATTR, acl)
        else:
            if self._has_acl(fd):
                os.removexattr(fd, ACL_XATTR)
            assert mode is not None
            os.fchmod(fd, mode)
        return True

    def _has_acl(self, fd: int) -> bool:
        return self._acls and self._acl_of(fd) is not None

    def _acl_of(self, fd: int) -> bytes | None:
        try:
            return os.getxattr(fd, ACL_XATTR)
        except OSError as exc:
            if exc.errno == errno.ENODATA:
                return None
            if exc.errno in _NO_ACL_ERRNOS:
                self._acls = False
                return None
            raise


def _acl(uid: int, owner: bool, group: bool, other: bool) -> bytes:
    """The access ACL of an entry: the daemon reads and writes it; ``uid`` (the
    original's owner) reads it if ``owner``; its group and others if ``group``/``other``."""
    read = {True: _READ, False: 0}
    mask = _READ if owner or group else 0
    entries = [
        (_USER_OBJ, _READ | _WRITE, _NO_ID),
        (_USER, read[owner], uid),
        (_GROUP_OBJ, read[group], _NO_ID),
        (_MASK, mask, _NO_ID),
        (_OTHER, read[other], _NO_ID),
    ]
    return _ACL_HEADER + b"".join(_ACL_ENTRY.pack(*entry) for entry in entries)
