"""An entry file's mode, group and ACL by the policy (store/entry_modes.py); who they let
read on a real mount: tests/test_mount_access.py."""

from __future__ import annotations

import os
import stat
import struct
from pathlib import Path

import pytest

from decodefs.common.readers import Readers
from decodefs.store.entry_modes import ACL_XATTR, EntryModes
from tests.conftest import needs_root

pytestmark = needs_root  # files of other groups

OWNER, GROUP = 61234, 62345


def acl_entries(path: Path) -> dict[tuple[int, int], int]:
    """(tag, id) -> perm of ``path``'s access ACL ({} if it has none)."""
    try:
        data = os.getxattr(path, ACL_XATTR)
    except OSError:
        return {}
    return {(tag, uid): perm for tag, perm, uid in struct.iter_unpack("<HHI", data[4:])}


def test_an_entry_is_never_more_readable_than_its_original(tmp_path: Path) -> None:
    path = tmp_path / "entry.npy"
    path.write_bytes(b"x")
    fd = os.open(path, os.O_RDONLY)
    try:
        modes = EntryModes("originals")
        cases = [
            # (readers, mode, group, the owner's ACL entry: None for none)
            (Readers(OWNER, OWNER, 0o400), 0o640, OWNER, 4),  # the ACL mask shows as group
            (Readers(OWNER, GROUP, 0o440), 0o640, GROUP, 4),
            (Readers(OWNER, OWNER, 0o044), 0o644, OWNER, 0),  # everyone but its owner
            (Readers(0, GROUP, 0o440), 0o640, GROUP, None),  # root's: no one to name
            (Readers(OWNER, GROUP, 0), 0o600, 0, None),  # no one reads it
            (Readers(OWNER, GROUP, 0o444), 0o644, GROUP, 4),
            (None, 0o600, 0, None),  # not known
        ]
        for readers, mode, group, owner in cases:
            assert modes.apply(fd, readers) is True, readers
            assert modes.apply(fd, readers) is False, readers  # already so: nothing done
            st = os.stat(path)
            assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (mode, 0, group), readers
            assert acl_entries(path).get((2, OWNER)) == owner, readers
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    ("readers", "mode"),
    [
        (Readers(OWNER, GROUP, 0o444), 0o644),  # its owner reads it as others do
        (Readers(OWNER, GROUP, 0o440), 0o640),
        (Readers(OWNER, GROUP, 0o400), 0o600),  # its owner alone: through the mount
        (Readers(OWNER, GROUP, 0o044), 0o600),  # all but its owner: through the mount
    ],
)
def test_without_acls_an_entry_its_owner_would_read_otherwise_is_the_daemons(
    tmp_path: Path, readers: Readers, mode: int
) -> None:
    path = tmp_path / "entry.npy"
    path.write_bytes(b"x")
    fd = os.open(path, os.O_RDONLY)
    try:
        modes = EntryModes("originals")
        modes.apply(fd, Readers(OWNER, GROUP, 0o440))  # an ACL, from before
        modes._acls = False  # as a filesystem without ACLs says (EOPNOTSUPP)
        modes.apply(fd, readers)
    finally:
        os.close(fd)
    assert stat.S_IMODE(path.stat().st_mode) == mode
    assert (2, OWNER) in acl_entries(path)  # (the test's filesystem has ACLs)


def test_other_policies_give_their_one_mode(tmp_path: Path) -> None:
    path = tmp_path / "entry.npy"
    path.write_bytes(b"x")
    fd = os.open(path, os.O_RDONLY)
    try:
        EntryModes("originals").apply(fd, Readers(OWNER, GROUP, 0o444))
        for access, mode in (("everyone", 0o644), ("owner", 0o600)):
            EntryModes(access).apply(fd, Readers(OWNER, GROUP, 0o444))  # readers: no matter
            st = path.stat()
            assert (stat.S_IMODE(st.st_mode), st.st_gid, acl_entries(path)) == (mode, 0, {})
    finally:
        os.close(fd)
