"""Where a mount's processes meet outside the mount: the runtime directory of this user.

Root's is /run/decodefs; another user's is $XDG_RUNTIME_DIR/decodefs, else
/tmp/decodefs-<uid>. It holds the store locks (store/root.py) and, per mount,
the holder's control socket and the mount's state (the inode numbers every
serving process of the mount agrees on). Each is named after what it serves, so
the command finds a mount's holder from its mount point alone. This module
knows paths only; it opens nothing.
"""

from __future__ import annotations

import hashlib
import os
from typing import Final

__all__ = [
    "holder_socket_path",
    "lock_dir",
    "mount_state_root",
    "runtime_dir",
]

_NAME_DIGITS: Final = 32  # of a sha256: a name per path, short enough for a socket's path


def runtime_dir(uid: int | None = None) -> str:
    """The runtime directory of ``uid`` (default: this process's effective user)."""
    uid = os.geteuid() if uid is None else uid
    if uid == 0:
        return "/run/decodefs"
    runtime = os.environ.get("XDG_RUNTIME_DIR") if uid == os.geteuid() else None
    return os.path.join(runtime, "decodefs") if runtime else f"/tmp/decodefs-{uid}"


def lock_dir(uid: int | None = None) -> str:
    """Where the stores' one-daemon locks live."""
    return os.path.join(runtime_dir(uid), "locks")


def holder_socket_path(mountpoint: str, uid: int | None = None) -> str:
    """The control socket of the holder of the mount at ``mountpoint`` (absolute)."""
    digest = hashlib.sha256(os.fsencode(os.path.abspath(mountpoint))).hexdigest()
    return os.path.join(runtime_dir(uid), "holders", digest[:_NAME_DIGITS] + ".sock")


def mount_state_root(uid: int | None = None) -> str:
    """The directory holding one state directory per live mount (named by its mount id)."""
    return os.path.join(runtime_dir(uid), "mounts")
