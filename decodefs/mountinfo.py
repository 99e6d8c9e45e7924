"""This process's mount table, from /proc/self/mountinfo (see proc(5)).

Used by the daemon (is a mount point live, which FUSE connection is ours),
and by the client reader (which decodefs mount holds a file). Reading the
table never touches the mounted filesystems, so it cannot hang on a dead one.
"""

from __future__ import annotations

import re
from typing import Final, NamedTuple

__all__ = ["MountInfo", "mounts"]

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
