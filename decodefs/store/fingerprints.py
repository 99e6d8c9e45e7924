"""Each version's fingerprint marker in the store, and the trash its discarded arrays go to.

``<store>/<version>/.fingerprint.json`` records what decoded the version's
arrays. At open, a readable marker naming another fingerprint sends the
version's directory to ``<store>/.trash/``, deleted in the background; a
missing or unreadable one is simply rewritten (each entry carries its own
fingerprint, so nothing stale is ever served either way). This module knows
markers and directories, not entries, the catalog or the store's life.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from ..common.fingerprint import Fingerprint
from ..common.trusted import DIRECTORY_FLAGS
from .root import read_small, set_file_mode, set_mode, write_json_at

if TYPE_CHECKING:
    from .capacity import SizeUsage

__all__ = [
    "FINGERPRINT_FILE",
    "TRASH",
    "Discarded",
    "check_fingerprint",
    "recorded_digest",
    "start_trash_cleanup",
]

log = logging.getLogger(__name__)

FINGERPRINT_FILE: Final = ".fingerprint.json"
TRASH: Final = ".trash"


@dataclass(frozen=True)
class Discarded:
    """A version's stored arrays sent to the trash at open: made by another fingerprint."""

    version: str
    entries: int | None  # how many (None: not known, the catalog was still to be filled)
    bytes: int | None
    was: Mapping[str, object]  # the fingerprint description they were made by
    now: Mapping[str, object]  # the one the version's arrays are made by from now on


def recorded_digest(root: int, version: str) -> bytes | None:
    """The digest ``version``'s marker in the store open at ``root`` records; None if
    there is none or it cannot be read."""
    try:
        recorded = json.loads(read_small(root, f"{version}/{FINGERPRINT_FILE}"))
        return bytes.fromhex(recorded["digest"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_fingerprint(
    root: int,
    version: str,
    expected: Fingerprint,
    *,
    where: str,
    dir_mode: int,
    file_mode: int,
    discard_rows: Callable[[str], SizeUsage | None],
) -> Discarded | None:
    """Discard ``version``'s arrays (its directory to the trash, then its catalog rows
    by ``discard_rows``, which raises OSError and returns what they counted) if its
    marker names another fingerprint; write the marker. ``where``: the store's path,
    for the log. Returns what was discarded, if anything.

    Only a readable marker naming another fingerprint discards anything. Never
    raises: a full disk must not stop the daemon (stale entries still fail
    their own check, one by one).
    """
    marker = f"{version}/{FINGERPRINT_FILE}"
    try:
        recorded = json.loads(read_small(root, marker))
    except (FileNotFoundError, NotADirectoryError):
        recorded = None
    except (OSError, ValueError) as exc:
        log.warning("unreadable %s/%s (%s); rewriting it", where, marker, exc)
        recorded = None
    if not isinstance(recorded, dict):
        recorded = None
    if recorded is not None and recorded.get("digest") == expected.hex:
        set_file_mode(root, marker, file_mode)  # the policy may have changed
        return None
    discarded = None
    try:
        if recorded is not None:
            log.warning(
                "version %s: decode settings or libraries changed (was %s, now %s); "
                "discarding its stored arrays",
                version,
                json.dumps(recorded.get("description"), sort_keys=True),
                json.dumps(expected.description, sort_keys=True),
            )
            _to_trash(root, version)
            was = recorded.get("description")
            discarded = Discarded(
                version, None, None, was if isinstance(was, dict) else {}, expected.description
            )
            usage = discard_rows(version)
            if usage is not None:
                discarded = Discarded(
                    version, usage.entries, usage.bytes, discarded.was, discarded.now
                )
        with contextlib.suppress(FileExistsError):
            os.mkdir(version, dir_mode, dir_fd=root)
        directory = os.open(version, DIRECTORY_FLAGS, dir_fd=root)
        try:
            set_mode(directory, dir_mode)
            value = {"digest": expected.hex, "description": dict(expected.description)}
            write_json_at(directory, FINGERPRINT_FILE, value, file_mode)
        finally:
            os.close(directory)
    except OSError as exc:
        log.error("version %s: cannot record its fingerprint in %s: %s", version, where, exc)
    return discarded


def start_trash_cleanup(root: int, done: Callable[[], None] = lambda: None) -> None:
    """Delete what the trash holds, in a background thread (nothing if there is none),
    then call ``done``."""
    try:
        os.stat(TRASH, dir_fd=root, follow_symlinks=False)
    except OSError:
        return

    def cleanup() -> None:
        started = time.monotonic()
        shutil.rmtree(TRASH, dir_fd=root, ignore_errors=True)
        log.info("deleted discarded arrays in %.1f s", time.monotonic() - started)
        done()

    threading.Thread(target=cleanup, name="store-trash", daemon=True).start()


def _to_trash(root: int, version: str) -> None:
    with contextlib.suppress(FileExistsError):
        os.mkdir(TRASH, 0o700, dir_fd=root)
    trash = os.open(TRASH, DIRECTORY_FLAGS, dir_fd=root)
    try:
        os.rename(version, f"{version}.{time.time_ns()}", src_dir_fd=root, dst_dir_fd=trash)
    finally:
        os.close(trash)
