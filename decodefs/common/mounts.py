"""The mount table and what is mounted where: find, probe, check, clear and unmount.

The table is this process's /proc/self/mountinfo (see proc(5)); reading it
never touches the mounted filesystems, so it cannot hang on a dead one. The
command (mount, umount, stats, warm), the daemon (is a mount point live) and
the client reader (which decodefs mount holds a file) all use it. Imports
nothing of the daemon: `decodefs umount` and `stats` never load pyfuse3 or trio.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import subprocess
import threading
import time
from typing import Final, NamedTuple

from .protocol import FS_TYPE, STATS_FILE
from .status import read_status

__all__ = [
    "PROBE_TIMEOUT",
    "MountError",
    "MountInfo",
    "clear_stale",
    "daemon_mountpoint",
    "decodefs_mount_above",
    "find_mount",
    "lazy_unmount",
    "mounts",
    "prepare_mountpoint",
    "probe",
    "store_holder_hint",
    "unmount",
]

log = logging.getLogger(__name__)

_ESCAPE: Final = re.compile(r"\\([0-7]{3})")  # the kernel writes space as \040, etc.


class MountInfo(NamedTuple):
    mountpoint: str
    fstype: str  # "fuse.decodefs" for ours
    source: str
    device: tuple[int, int]  # (major, minor) of st_dev; the minor names a FUSE connection
    root: str  # the directory of the filesystem mounted here ("/" unless a bind mount)


def mounts() -> list[MountInfo]:
    """Every mount, in the order the table lists them (later ones on top)."""
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields, _, tail = line.partition(" - ")
            parts, after = fields.split(), tail.split()
            if len(parts) < 5 or len(after) < 2:
                continue
            major, _, minor = parts[2].partition(":")
            found.append(
                MountInfo(
                    _unescape(parts[4]),
                    after[0],
                    _unescape(after[1]),
                    (int(major), int(minor)),
                    _unescape(parts[3]),
                )
            )
    return found


def _unescape(field: str) -> str:
    return _ESCAPE.sub(lambda m: chr(int(m[1], 8)), field)


PROBE_TIMEOUT: Final = 5.0


class MountError(Exception):
    """A mount point problem the user must resolve (already mounted, not a directory, not empty)."""


def find_mount(mountpoint: str | os.PathLike[str]) -> MountInfo | None:
    """The mount at exactly ``mountpoint``, from /proc/self/mountinfo.

    ``os.path.ismount`` is no use here: on a dead FUSE daemon its lstat fails
    with ENOTCONN and it answers False.
    """
    target = os.path.abspath(mountpoint)
    found = [m for m in mounts() if m.mountpoint == target]
    return found[-1] if found else None  # the last one listed is the one on top


def probe(mountpoint: str) -> str:
    """'live', 'stale' (daemon gone: ENOTCONN) or 'hung' (no answer in time)."""
    outcome: list[BaseException | None] = []

    def call() -> None:
        try:
            os.statvfs(mountpoint)
            outcome.append(None)
        except OSError as exc:
            outcome.append(exc)

    # A daemon thread: a hung mount may never answer, and must not hold up exit.
    thread = threading.Thread(target=call, name="mount-probe", daemon=True)
    thread.start()
    thread.join(PROBE_TIMEOUT)
    if not outcome:
        return "hung"
    error = outcome[0]
    if isinstance(error, OSError) and error.errno in (errno.ENOTCONN, errno.ECONNABORTED):
        return "stale"
    if error is not None:
        raise error
    return "live"


def prepare_mountpoint(mountpoint: str, nonempty: bool = False) -> None:
    """Make ``mountpoint`` ready to mount on: clear a dead decodefs mount, refuse a live one.

    A directory with files in it is refused too, unless ``nonempty``: the
    mount would hide them. A dead mount is cleared first, so it never counts
    as files.
    """
    info = find_mount(mountpoint)
    ours = info is not None and info.fstype == FS_TYPE
    if info is not None:
        state = probe(mountpoint) if info.fstype.startswith("fuse") else "live"
        if state == "stale":
            log.warning(
                "clearing stale mount at %s (%s): its daemon is gone "
                "(transport endpoint is not connected)",
                mountpoint,
                info.fstype,
            )
            lazy_unmount(mountpoint)
        elif state == "hung":
            clear = "decodefs umount --lazy" if ours else "fusermount3 -u -z"
            raise MountError(
                f"{mountpoint} is mounted ({info.fstype}) but does not answer; "
                f"run `{clear} {mountpoint}` once its daemon is stopped"
            )
        elif ours:
            raise MountError(
                f"{mountpoint} is already mounted ({info.fstype} from {info.source}); "
                f"run `decodefs umount {mountpoint}` first"
            )
        else:  # decodefs umount would refuse it: not ours to unmount
            raise MountError(
                f"{mountpoint} is the mount point of another filesystem ({info.fstype} from "
                f"{info.source}); mount decodefs on another directory (or unmount that one "
                f"yourself: `umount {mountpoint}`)"
            )
    inside = decodefs_mount_above(mountpoint)
    if inside is not None:
        raise MountError(
            f"mount point {mountpoint} is inside the decodefs mount at {inside}, which is "
            "read-only; mount on a directory outside it"
        )
    if not os.path.isdir(mountpoint):
        if not os.path.lexists(mountpoint):
            raise MountError(
                f"mount point {mountpoint} does not exist: create it "
                f"(`mkdir -p {mountpoint}`), or pass --mkdir"
            )
        raise MountError(f"mount point {mountpoint} is not a directory")
    if not nonempty:
        try:
            with os.scandir(mountpoint) as entries:
                first = next(entries, None)
        except OSError as exc:
            raise MountError(f"mount point {mountpoint} cannot be listed: {exc.strerror}") from None
        if first is not None:
            raise MountError(
                f"mount point {mountpoint} is not empty (it holds {first.name!r}); the mount "
                "would hide its files: empty it, or pass --nonempty to mount over them"
            )


def decodefs_mount_above(path: str) -> str | None:
    """The decodefs mount that ``path`` lies inside (not at), if any; from the mount
    table alone, so a dead or hung mount above it cannot hang the check."""
    target = os.path.abspath(path)
    above = [m for m in mounts() if target.startswith(m.mountpoint.rstrip("/") + "/")]
    if not above:
        return None
    nearest = max(above, key=lambda m: len(m.mountpoint))
    return nearest.mountpoint if nearest.fstype == FS_TYPE else None


def daemon_mountpoint(pid: int) -> str | None:
    """The mount point that the decodefs daemon ``pid`` (a mount's holder) serves, if it
    serves a live one.

    Asks each decodefs mount's stats.json for its holder's pid; a mount that does
    not answer within PROBE_TIMEOUT is passed over.
    """
    for info in mounts():
        if info.fstype != FS_TYPE:
            continue
        try:
            if probe(info.mountpoint) != "live":
                continue
        except OSError:
            continue
        if _daemon_pid(info.mountpoint) == pid:
            return info.mountpoint
    return None


def store_holder_hint(pid: int) -> str:
    """What process ``pid`` (holding a store's lock) is: the daemon of which mount point,
    or which command; found without touching any mount that does not answer."""
    mountpoint = daemon_mountpoint(pid)
    if mountpoint is not None:
        return f"; it is the daemon of {mountpoint} (stop it: `decodefs umount {mountpoint}`)"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return ""
    words = [
        os.path.basename(os.fsdecode(a)) if i == 0 else os.fsdecode(a)
        for i, a in enumerate(argv)
        if a
    ]
    command = " ".join(words)
    return f"; pid {pid} is `{command[:200]}`" if command else ""


def clear_stale(mountpoint: str) -> bool:
    """Clear ``mountpoint`` if its daemon is gone; leave anything else alone. True if cleared."""
    info = find_mount(mountpoint)
    if info is None or not info.fstype.startswith("fuse") or probe(mountpoint) != "stale":
        return False
    log.warning("clearing stale mount at %s (%s): its daemon is gone", mountpoint, info.fstype)
    lazy_unmount(mountpoint)
    return True


def unmount(mountpoint: str, lazy: bool = False, wait: float = 30.0) -> None:
    """Unmount and wait for the daemon to exit (it releases the store lock).

    A lazy unmount returns at once: the daemon keeps serving files that are
    still open and exits when the last one is closed.
    """
    info = find_mount(mountpoint)
    if info is None:
        raise MountError(f"{mountpoint} is not mounted")
    pid = _daemon_pid(mountpoint) if info.fstype == FS_TYPE and not lazy else None
    command = ["fusermount3", "-u", *(["-z"] if lazy else []), mountpoint]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        detail = result.stderr.strip() or f"fusermount3 exited with {result.returncode}"
        hint = (
            ""
            if lazy
            else f" (close the files open there, or use `decodefs umount --lazy {mountpoint}`)"
        )
        raise MountError(f"cannot unmount {mountpoint}: {detail}{hint}")
    if pid is not None:
        deadline = time.monotonic() + wait
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)


def _daemon_pid(mountpoint: str) -> int | None:
    """The process that holds the mount (stats.json's ``holder_pid``): it exits last."""
    try:
        stats = read_status(mountpoint, STATS_FILE)
    except (OSError, ValueError):
        return None
    pid = stats.get("holder_pid", stats.get("pid"))
    return pid if isinstance(pid, int) else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child (tests) counts as gone.
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def lazy_unmount(mountpoint: str) -> None:
    result = subprocess.run(
        ["fusermount3", "-u", "-z", mountpoint], capture_output=True, text=True, check=False
    )
    if result.returncode != 0 and find_mount(mountpoint) is not None:
        raise MountError(f"cannot clear stale mount {mountpoint}: {result.stderr.strip()}")
