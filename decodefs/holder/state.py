"""The mount's state directory: what every serving process of one mount shares.

One directory per mount, named by the mount's id, under the runtime
directory's ``mounts/`` (common/runtime.py), the holder's user's alone. The
holder makes it before the first serving process starts and removes it when
the mount ends; the serving processes keep in it what must outlive each of
them while the mount lives (the inode numbers, what was verified). A
directory whose holder is gone (killed) is removed by the next holder that
starts (one still without its holder's pid is another holder's being made,
unless it is older than a minute: that holder died making it). The holder
never reads what the servers write here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import time
from typing import Final

from ..common.runtime import mount_state_root
from ..common.trusted import CREATE_FLAGS, DIRECTORY_FLAGS, open_trusted_dir

__all__ = ["MountState"]

log = logging.getLogger(__name__)

_HOLDER_FILE: Final = "holder.pid"
# How long a state directory without a holder's pid is taken for one being made (between
# its mkdir and its holder.pid) by a holder starting beside this one.
_MAKING_SECONDS: Final = 60.0


class MountState:
    """The state directory of one mount: ``path``, made at ``create``, gone at ``remove``."""

    def __init__(self, mount_id: str, path: str) -> None:
        self.mount_id = mount_id
        self.path = path

    @classmethod
    def create(cls) -> MountState:
        root = mount_state_root()
        root_fd = open_trusted_dir(root, create_mode=0o700)
        try:
            _remove_orphans(root_fd, root, time.time())
            mount_id = secrets.token_hex(8)
            os.mkdir(mount_id, 0o700, dir_fd=root_fd)
            directory = os.open(mount_id, DIRECTORY_FLAGS, dir_fd=root_fd)
            try:
                fd = os.open(_HOLDER_FILE, os.O_WRONLY | CREATE_FLAGS, 0o600, dir_fd=directory)
            finally:
                os.close(directory)
            with open(fd, "w", encoding="ascii") as f:
                f.write(f"{os.getpid()}\n")
        finally:
            os.close(root_fd)
        return cls(mount_id, os.path.join(root, mount_id))

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(self.path)


def _remove_orphans(root_fd: int, root: str, now: float) -> None:
    """Remove the state of mounts whose holder is no longer running (``now``: time.time())."""
    for name in os.listdir(root_fd):
        try:
            directory = os.open(name, DIRECTORY_FLAGS, dir_fd=root_fd)
        except OSError:
            continue
        made = 0.0
        try:
            made = os.fstat(directory).st_mtime
            with open(os.open(_HOLDER_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                              dir_fd=directory), encoding="ascii") as f:  # fmt: skip
                pid = int(f.read().strip() or "0")
        except (OSError, ValueError):
            pid = 0
        finally:
            os.close(directory)
        if pid > 0 and _running(pid):
            continue
        if pid == 0 and now - made < _MAKING_SECONDS:
            continue  # another holder is making it (its pid not written yet)
        log.info("removing the state of a mount whose holder is gone: %s/%s", root, name)
        with contextlib.suppress(OSError):
            shutil.rmtree(name, dir_fd=root_fd)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
