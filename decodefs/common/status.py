"""Reading a mount's status files (``<mount>/.decodefs/<name>``, protocol.STATUS_DIR): the one
reader of them on the client side; knows where they are and that they are JSON, not their figures.
"""

from __future__ import annotations

import json
import os

from .protocol import STATUS_DIR

__all__ = [
    "StatusElsewhere",
    "holder_figures",
    "parse_status",
    "read_status",
    "read_status_bytes",
]


class StatusElsewhere(OSError):
    """The status file is on another filesystem than the mount asked for (one mounted
    over the mount point since the caller looked at it)."""


def read_status_bytes(
    mountpoint: str | os.PathLike[str], name: str, *, device: int | None = None
) -> bytes:
    """The bytes of ``<mountpoint>/.decodefs/<name>`` (``name``: one of protocol's
    STATUS_FILES), read whole, unbuffered: a status file's size is not known ahead.

    Raises OSError if it cannot be read (no such file, no mount there, the daemon
    gone: ENOTCONN), and StatusElsewhere (an OSError) if ``device`` is given and
    the file is not on it.
    """
    path = os.path.join(os.fspath(mountpoint), STATUS_DIR, name)
    with open(path, "rb", buffering=0) as f:
        if device is not None and os.fstat(f.fileno()).st_dev != device:
            raise StatusElsewhere(f"{path} is not on the mount's filesystem")
        return f.read()


def read_status(mountpoint: str | os.PathLike[str], name: str) -> dict[str, object]:
    """``<mountpoint>/.decodefs/<name>`` as the JSON object it holds.

    Raises OSError as ``read_status_bytes`` does, and ValueError if the file is not
    a JSON object (not JSON, not UTF-8, nested too deep to parse, or another value).
    """
    return parse_status(read_status_bytes(mountpoint, name), name)


def holder_figures(holder: dict[str, object]) -> dict[str, object]:
    """A holder's status (what its control socket answers) as the figures of stats.json
    (stats_schema.STATS): what every serving process of the mount reports of it, and
    what `decodefs stats` shows when no serving process answers."""
    return {
        "holder_pid": holder.get("pid"),
        "holder_state": holder.get("state", "none"),
        "holder_version": holder.get("version"),
        "mount_started": holder.get("started"),
        "handovers": holder.get("handovers", 0),
        "crashes": holder.get("crashes", 0),
        "handovers_refused": holder.get("refused", 0),
        "remounts": holder.get("remounts", 0),
        "holder_eio_answers": holder.get("eio_answers", 0),
        "holder_rss_bytes": holder.get("rss_bytes"),
        "last_problem": holder.get("last_problem"),
        "decodes_before": holder.get("decodes_before", 0),
        "standby_pid": holder.get("standby_pid"),
        "switch_pause_seconds": holder.get("last_pause", 0.0),
        "longest_switch_pause_seconds": holder.get("longest_pause", 0.0),
    }


def parse_status(data: bytes, name: str) -> dict[str, object]:
    """The JSON object a status file ``name`` holds; ValueError if it is not one."""
    try:
        value = json.loads(data)
    except RecursionError:
        raise ValueError(f"{name} is nested too deep to be a status file") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} holds a JSON {type(value).__name__}, not an object")
    return value
