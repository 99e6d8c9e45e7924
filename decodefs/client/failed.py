"""The originals of a mount that failed to decode, as its ``.decodefs/failed.json`` lists them.

For a training process that leaves such items out (an array of one of them is
EIO through the mount), and for `decodefs failed`. Reads the status file
alone: no store, no config, no Pillow.
"""

from __future__ import annotations

import os

from ..common.protocol import FAILED_FILE, FailedList
from ..common.status import read_status

__all__ = ["failed_keys", "failed_originals"]


def failed_originals(mountpoint: str | os.PathLike[str], version: str | None = None) -> FailedList:
    """Every original of ``version`` (of every version if None) that failed to decode since
    the mount's serving process started and has not decoded since: ``.failed``, rows
    of version, key, path, reason, sizes and time, by version and key;
    ``.not_listed``, failures the daemon only counted, its list being at its bound.

    Raises OSError if the status file cannot be read (no decodefs mount there, the
    daemon gone), ValueError if it is not what a daemon writes (a daemon older than
    failed.json has no such file: FileNotFoundError).
    """
    value = read_status(mountpoint, FAILED_FILE)
    try:
        listed = FailedList.from_json(value)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{FAILED_FILE} of {os.fspath(mountpoint)} is not a list: {exc}") from None
    if version is None:
        return listed
    return FailedList(tuple(f for f in listed.failed if f.version == version), listed.not_listed)


def failed_keys(mountpoint: str | os.PathLike[str], version: str) -> frozenset[str]:
    """The keys of ``version`` whose originals failed to decode (``failed_originals``):
    what a dataset over ``list_keys(mountpoint, version)`` leaves out, to read no
    array that is EIO. Raises as ``failed_originals`` does."""
    return frozenset(f.key for f in failed_originals(mountpoint, version).failed)
