"""What a user should hear when mounting a config that will not work as meant: a version
that serves nothing, a store that fails open from the start. Said by the command on
the terminal and by the daemon in its log; knows the config and the filesystem only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .config import Config

__all__ = ["discarded_warning", "empty_version_warning", "store_warning"]


def empty_version_warning(config: Config, version: str) -> str:
    """What a user should hear about a version whose source holds no original."""
    settings = config.versions[version]
    extensions = ", ".join(sorted(settings.extensions))
    return (
        f"version {version} serves nothing: 0 originals under {settings.source} "
        f"(files ending in {extensions}, any case, found recursively); check "
        f"versions.{version}.source and extensions"
    )


def discarded_warning(version: str, discarded: Mapping[str, object]) -> str:
    """What a user should hear about a version whose stored arrays were discarded at start
    (stats.json's ``versions.<name>.discarded``): what changed, and how much will be
    decoded again."""
    now = discarded.get("now")
    was = discarded.get("was")
    changes = _changes(was, now) if isinstance(was, Mapping) and isinstance(now, Mapping) else []
    what = "; ".join(changes[:4]) + ("; ..." if len(changes) > 4 else "")
    entries, nbytes = discarded.get("entries"), discarded.get("bytes")
    if isinstance(entries, int) and isinstance(nbytes, int):
        amount = f"its {entries:,} stored arrays ({_mib(nbytes)})"
    else:
        amount = "its stored arrays (how many is not known: the store was being counted)"
    return (
        f"version {version}'s decode settings or libraries changed"
        + (f" ({what})" if what else "")
        + f": {amount} were discarded, and will be decoded again as they are read "
        "(or by `decodefs warm`)"
    )


def _changes(was: Mapping[str, object], now: Mapping[str, object], prefix: str = "") -> list[str]:
    """``key: old -> new`` for every leaf that differs between two descriptions."""
    changes = []
    for key in sorted({*was, *now}):
        old, new = was.get(key), now.get(key)
        if isinstance(old, Mapping) and isinstance(new, Mapping):
            changes += _changes(old, new, f"{prefix}{key}.")
        elif old != new:
            changes.append(f"{prefix}{key}: {old} -> {new}")
    return changes


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def store_warning(config: Config) -> str | None:
    """Why the store will fail open from the start (read-only, full, cannot be created), or None.

    Not an error: the daemon then serves every array the store lacks from
    memory, but the user should hear of it when mounting, not in a log.
    """
    existing = config.store
    while not os.path.isdir(existing) and existing != existing.parent:
        existing = existing.parent
    try:
        vfs = os.statvfs(existing)
    except OSError:
        return None  # cannot tell; the daemon logs what it finds
    smallest = min((s for v in config.versions.values() for s in v.sizes), default=config.min_size)
    if vfs.f_flag & os.ST_RDONLY:
        reason = "is on a read-only filesystem"
    elif not os.access(existing, os.W_OK | os.X_OK):
        reason = "is not writable by this user"
    elif vfs.f_bavail * vfs.f_frsize < 3 * smallest * smallest or vfs.f_favail == 0:
        reason = "is on a full filesystem"
    else:
        return None
    where = f"store {config.store}"
    if existing != config.store:
        where += f" cannot be created: {existing}"
    return (
        f"{where} {reason}; arrays not already stored will be decoded and served "
        "from memory (memory_cache_bytes)"
    )
