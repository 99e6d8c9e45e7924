"""Which decodefs mount a device is, where its store is, and whether this process may trust
that store; knows the mount table and store.json, not entries, keys or the daemon.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Final

from ..common.inodes import INODE_LAYOUT
from ..common.mounts import mounts
from ..common.protocol import FS_TYPE, STORE_FILE, StoreStatus
from ..common.status import read_status_bytes
from ..common.trusted import owned_alone

__all__ = ["Mount", "current_mount", "forget_mounts", "readable_mount"]

# A store is trusted only when the device is a ``fuse.decodefs`` mount in this
# process's mount table whose store.json this decodefs release understands
# (its inode layout), and the store directory belongs to the mount's owner and
# nobody else may write to it. Mounts are remembered by device, and checked
# against the mount point's mtime: the kernel reuses a device number after an
# unmount.

log = logging.getLogger(__name__)

_NOT_A_MOUNT_SECONDS: Final = 10.0  # how long "this device is no decodefs mount" is believed
_STATUS_ERRORS: Final = (
    OSError,
    ValueError,
    KeyError,
    TypeError,
    AttributeError,
    ArithmeticError,
    RecursionError,
)


@dataclass(frozen=True)
class Mount:
    """What a process needs to read a mount's store directly (from its store.json)."""

    root: str  # the mount point, as this process's mount table names it
    root_mtime_ns: int  # when its daemon mounted it: tells this mount from a later one
    owner: int  # the uid the daemon runs as (the mount root's owner)
    store: str
    versions: tuple[str, ...]  # by the version id in inode numbers ("": no version)
    digests: dict[str, bytes]
    min_size: int
    max_size: int
    access_socket: str | None
    mirrors: frozenset[str]  # versions whose keys are paths below <version>/<size>/


@dataclass(frozen=True)
class _Refused:
    """A decodefs mount whose store this process must not read directly."""

    root: str
    root_mtime_ns: int


def readable_mount(device: int) -> Mount | None:
    """The mount on ``device`` now, if this process may read its store directly."""
    mount = _mount_of(device)
    if mount is not None and not _current(mount, device):
        # Another mount since: the kernel reuses a device number after an unmount.
        mount = _mount_of(device, again=True)
    return mount if isinstance(mount, Mount) else None


def current_mount(device: int, root_device: int, root_mtime_ns: int) -> Mount | None:
    """The mount known to be on ``device``, if a stat of its root just taken (its
    ``st_dev`` and ``st_mtime_ns``) says it still is (no system call); else None, and
    ``readable_mount`` finds out."""
    with _lock:
        known = _mounts.get(device)
    if isinstance(known, Mount) and _describes(known, device, root_device, root_mtime_ns):
        return known
    return None


def forget_mounts() -> None:
    """Read every mount's store.json again (a daemon restarted with other settings)."""
    with _lock:
        _mounts.clear()


_lock = threading.Lock()
# st_dev -> its decodefs mount, or when it was found to be none (time.monotonic).
_mounts: dict[int, Mount | _Refused | float] = {}


def _mount_of(device: int, again: bool = False) -> Mount | _Refused | None:
    """The mount of ``device``: one whose store may be read, one whose store may
    not (its identity only), or None (no decodefs mount, believed for a while)."""
    with _lock:
        known = _mounts.get(device)
    if isinstance(known, (Mount, _Refused)) and not again:
        return known
    if isinstance(known, float) and time.monotonic() - known < _NOT_A_MOUNT_SECONDS:
        return None
    mount = _find_mount(device)
    with _lock:
        known = _mounts.get(device)
        if mount is not None and known == mount:
            # Another thread found the same mount meanwhile: one object for it, since a
            # reader takes a different one for another mount (and lets go of its files).
            return known
        _mounts[device] = mount if mount is not None else time.monotonic()
    return mount


def _current(mount: Mount | _Refused, device: int) -> bool:
    """Whether ``mount`` still describes the mount on ``device`` (a cached stat)."""
    try:
        st = os.stat(mount.root)
    except OSError:
        return False
    return _describes(mount, device, st.st_dev, st.st_mtime_ns)


def _describes(mount: Mount | _Refused, device: int, root_device: int, root_mtime_ns: int) -> bool:
    """Whether a stat of ``mount``'s root says it is still the mount on ``device``."""
    return root_device == device and root_mtime_ns == mount.root_mtime_ns


def _find_mount(device: int) -> Mount | _Refused | None:
    """The decodefs mount of ``device``, and whether this process may trust its store."""
    for root in _decodefs_mount_points(device):
        try:
            root_st = os.stat(root)
            if root_st.st_dev != device:
                continue  # hidden by a later mount on the same path
            status = StoreStatus.from_json(read_status_bytes(root, STORE_FILE, device=device))
            refused = _Refused(root, root_st.st_mtime_ns)
            if status.inode_layout != INODE_LAYOUT:
                return refused  # another decodefs release: read through the mount
            mount = Mount(
                root=root,
                root_mtime_ns=root_st.st_mtime_ns,
                owner=root_st.st_uid,
                store=status.store,
                versions=status.version_order,
                digests={v: bytes.fromhex(d) for v, d in status.digests.items()},
                min_size=status.min_size,
                max_size=status.max_size,
                access_socket=status.access_socket,
                mirrors=status.mirrors,
            )
            store_st = os.stat(mount.store)
        except _STATUS_ERRORS:
            continue
        if not owned_alone(store_st, mount.owner):
            log.debug("not reading the store %s directly: not the mount owner's alone", mount.store)
            return refused
        return mount
    return None


def _decodefs_mount_points(device: int) -> list[str]:
    try:
        table = mounts()
    except (OSError, ValueError):
        return []
    wanted = (os.major(device), os.minor(device))
    return [
        m.mountpoint for m in table if m.device == wanted and m.root == "/" and m.fstype == FS_TYPE
    ]


def _after_fork() -> None:
    global _lock
    _lock = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_after_fork)
