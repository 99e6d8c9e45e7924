"""`decodefs warm`: fill the cache ahead of training, through the mount.

Each entry is opened with O_NONBLOCK (protocol.WARM_FLAG) and closed without
being read. The daemon takes that as a warm request: it decodes and stores the
array on open (single-flight and accounting hold) on its low-priority threads,
so training readers go first, and it never evicts for it. The open succeeds
even when the store will not take the array (a reader using the flag must
get its bytes); the daemon counts it in ``warm_not_stored``, which this
module watches, and the warm stops. No data lands in this process or the
page cache. Entries already stored cost one open, so an interrupted warm
resumes when run again.
"""

from __future__ import annotations

import concurrent.futures
import errno
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from ..common.names import array_name, is_array_name, is_key, key_of
from ..common.protocol import WARM_FLAG

__all__ = ["WarmReport", "read_key_list", "warm"]

# The daemon is gone (killed, or its connection aborted): the warm stops too.
_DAEMON_GONE = frozenset({errno.ENOTCONN, errno.ECONNABORTED})


@dataclass
class WarmReport:
    total: int
    done: int = 0
    failed: dict[str, str] = field(default_factory=dict)  # key -> reason (EIO: bad original)
    missing: list[str] = field(default_factory=list)  # keys the version does not have
    seconds: float = 0.0
    interrupted: bool = False
    store_full: str | None = None  # why the store stopped taking arrays, if it did
    daemon_gone: str | None = None  # why the mount stopped answering, if it did


def read_key_list(path: Path) -> list[str]:
    """One key per line (a uuid, or a mirror version's relative path such as
    ``cat/0001``); blank lines and '#' comments skipped; "<key>.npy" accepted.

    Raises OSError or UnicodeDecodeError for a file that cannot be read as
    UTF-8 text, ValueError naming the first line that cannot be a uuid or key:
    nothing listed may lead out of the size directory.
    """
    keys = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        key = key_of(line)
        if key is None:
            key = line
        if not is_key(key):
            raise ValueError(
                f"line {number}: {line!r} is not a uuid (nor a mirror version's key: "
                "a relative path such as cat/0001, without '.' or '..')"
            )
        keys.append(key)
    return keys


_REFUSALS_SECONDS = 0.25  # how often the daemon's warm_not_stored is looked at


def warm(
    directory: Path,
    keys: Iterable[str] | None,
    jobs: int,
    progress: bool = True,
    refusals: Callable[[], int] | None = None,
) -> WarmReport:
    """Open every ``<directory>/<key>.npy`` (all there if ``keys`` is None: every
    ``.npy`` file below it, so a mirror version's folders too; a mirror's keys are
    paths such as ``cat/0001``).

    ``refusals`` reads the daemon's ``warm_not_stored`` counter: once it grows,
    the store takes no more and the warm stops.
    """
    listed = _keys_below(directory) if keys is None else list(keys)
    report = WarmReport(total=len(listed))
    started = last_look = time.monotonic()
    refused_before = refusals() if refusals is not None else 0

    def store_refuses() -> bool:
        return refusals is not None and refusals() > refused_before

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="warm")
    bar = tqdm(total=len(listed), unit="img", disable=not progress, mininterval=0.5, smoothing=0.1)
    try:
        futures = {pool.submit(_touch, directory / array_name(key)): key for key in listed}
        for future in concurrent.futures.as_completed(futures):
            key = futures[future]
            error = future.result()
            if error is None:
                report.done += 1
            elif error.errno == errno.ENOENT:
                report.missing.append(key)
            elif error.errno in _STORE_FULL:
                report.store_full = error.strerror or str(error)
                pool.shutdown(wait=True, cancel_futures=True)
                break
            elif error.errno in _DAEMON_GONE:
                report.daemon_gone = error.strerror or str(error)
                pool.shutdown(wait=True, cancel_futures=True)
                break
            else:
                report.failed[key] = error.strerror or str(error)
            bar.update(1)
            if time.monotonic() - last_look >= _REFUSALS_SECONDS:
                last_look = time.monotonic()
                if store_refuses():
                    report.store_full = _STORE_REFUSES
                    pool.shutdown(wait=True, cancel_futures=True)
                    break
    except KeyboardInterrupt:
        report.interrupted = True
        pool.shutdown(wait=True, cancel_futures=True)
    finally:
        pool.shutdown(wait=True)
        bar.close()
        report.seconds = time.monotonic() - started
    if report.store_full is None and not report.interrupted and store_refuses():
        report.store_full = _STORE_REFUSES
    return report


def _keys_below(directory: Path) -> list[str]:
    """The key of every array below ``directory``, by their paths sorted; raises
    OSError if a listing fails (the daemon gone), as one listing would. A uuid
    version lists no subdirectories (shards are not listed), so this is one
    listing there."""
    names: list[str] = []
    for top, _, files in os.walk(directory, onerror=_raise):
        prefix = os.path.relpath(top, directory) + "/" if top != str(directory) else ""
        names += (prefix + name for name in files if is_array_name(name))
    return [key for key in map(key_of, sorted(names)) if key is not None]


def _raise(error: OSError) -> None:
    raise error


_STORE_FULL = frozenset({errno.EDQUOT, errno.ENOSPC, errno.EROFS})  # from an older daemon
_STORE_REFUSES = "it is at its capacity limit, full or read-only"


def _touch(path: Path) -> OSError | None:
    try:
        os.close(os.open(path, os.O_RDONLY | WARM_FLAG))
    except OSError as exc:
        return exc
    return None
