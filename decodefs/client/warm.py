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
import itertools
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from tqdm import tqdm

from ..common.names import array_name, is_array_name, is_key, key_of
from ..common.protocol import WARM_FLAG

__all__ = ["REPORT_EXAMPLES", "WarmReport", "iter_key_list", "read_key_list", "warm"]

# The daemon is gone (killed, or its connection aborted): the warm stops too.
_DAEMON_GONE = frozenset({errno.ENOTCONN, errno.ECONNABORTED})


# Failures and missing keys a report names (the rest are counted): the daemon's
# failed.json (`decodefs failed`) lists every original that failed.
REPORT_EXAMPLES: Final = 100


@dataclass
class WarmReport:
    total: int | None  # arrays to warm, if known ahead
    done: int = 0
    failed: dict[str, str] = field(default_factory=dict)  # key -> reason (EIO), the first 100
    failed_count: int = 0  # every failure
    missing: list[str] = field(default_factory=list)  # keys the version lacks, the first 100
    missing_count: int = 0
    seconds: float = 0.0
    interrupted: bool = False
    store_full: str | None = None  # why the store stopped taking arrays, if it did
    daemon_gone: str | None = None  # why the mount stopped answering, if it did

    @property
    def seen(self) -> int:
        """Keys answered: warmed, failed or missing."""
        return self.done + self.failed_count + self.missing_count


def read_key_list(path: Path) -> list[str]:
    """The keys of ``path`` (``iter_key_list``), as a list."""
    return list(iter_key_list(path))


def iter_key_list(path: Path) -> Iterator[str]:
    """One key per line (a uuid, or a mirror version's relative path such as
    ``cat/0001``); blank lines and '#' comments skipped; "<key>.npy" accepted.
    Read a line at a time: a list of every key of a corpus costs no memory.

    Raises OSError or UnicodeDecodeError for a file that cannot be read as
    UTF-8 text, ValueError naming the first line that cannot be a uuid or key:
    nothing listed may lead out of the size directory.
    """
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
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
            yield key


_REFUSALS_SECONDS = 0.25  # how often the daemon's warm_not_stored is looked at


def warm(
    directory: Path,
    keys: Iterable[str] | None,
    jobs: int,
    progress: bool = True,
    refusals: Callable[[], int] | None = None,
    total: int | None = None,
) -> WarmReport:
    """Open every ``<directory>/<key>.npy`` (all there if ``keys`` is None: every
    ``.npy`` file below it, so a mirror version's folders too; a mirror's keys are
    paths such as ``cat/0001``), ``jobs`` at a time.

    At most ``2 * jobs`` opens are in flight or waiting, and keys (an iterator is
    fine) and the listing are taken as the window moves: its memory does not grow
    with the corpus. ``total``: how many there are, for the progress bar, if known.
    ``refusals`` reads the daemon's ``warm_not_stored`` counter: once it grows,
    the store takes no more and the warm stops.
    """
    listed = _keys_below(directory) if keys is None else iter(keys)
    report = WarmReport(total=total)
    started = last_look = time.monotonic()
    refused_before = refusals() if refusals is not None else 0

    def store_refuses() -> bool:
        return refusals is not None and refusals() > refused_before

    window = 2 * jobs  # enough queued that no worker waits for the next key
    base = os.fspath(directory)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="warm")
    bar = tqdm(total=total, unit="img", disable=not progress, mininterval=0.5, smoothing=0.1)
    pending: dict[concurrent.futures.Future[OSError | None], str] = {}
    try:
        while True:
            for key in itertools.islice(listed, window - len(pending)):
                # os.path, not pathlib: pathlib interns every name it parses, for good.
                pending[pool.submit(_touch, os.path.join(base, array_name(key)))] = key
            if not pending:
                break
            finished, _ = concurrent.futures.wait(
                pending, return_when=concurrent.futures.FIRST_COMPLETED
            )
            stop = False
            for future in finished:
                key = pending.pop(future)
                stop = _note(report, key, future.result()) or stop
                bar.update(1)
            if not stop and time.monotonic() - last_look >= _REFUSALS_SECONDS:
                last_look = time.monotonic()
                if store_refuses():
                    report.store_full = _STORE_REFUSES
                    stop = True
            if stop:
                break
    except KeyboardInterrupt:
        report.interrupted = True
    finally:
        for future in pending:
            future.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
        report.seconds = time.monotonic() - started
    if report.store_full is None and not report.interrupted and store_refuses():
        report.store_full = _STORE_REFUSES
    return report


def _note(report: WarmReport, key: str, error: OSError | None) -> bool:
    """Count one open's outcome in ``report``; True if the warm must stop."""
    if error is None:
        report.done += 1
    elif error.errno == errno.ENOENT:
        report.missing_count += 1
        if len(report.missing) < REPORT_EXAMPLES:
            report.missing.append(key)
    elif error.errno in _STORE_FULL:
        report.store_full = error.strerror or str(error)
        return True
    elif error.errno in _DAEMON_GONE:
        report.daemon_gone = error.strerror or str(error)
        return True
    else:
        report.failed_count += 1
        if len(report.failed) < REPORT_EXAMPLES:
            report.failed[key] = error.strerror or str(error)
    return False


def _keys_below(directory: Path) -> Iterator[str]:
    """The key of every array below ``directory``, as the listing goes (one directory
    at a time: a uuid version lists no subdirectories, so this is one listing there);
    raises OSError if a listing fails (the daemon gone)."""
    folders = [""]
    while folders:
        relative = folders.pop()
        with os.scandir(directory / relative if relative else directory) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    folders.append(f"{relative}{entry.name}/")
                elif is_array_name(entry.name):
                    key = key_of(relative + entry.name)
                    if key is not None:
                        yield key


_STORE_FULL = frozenset({errno.EDQUOT, errno.ENOSPC, errno.EROFS})  # from an older daemon
_STORE_REFUSES = "it is at its capacity limit, full or read-only"


def _touch(path: str) -> OSError | None:
    try:
        os.close(os.open(path, os.O_RDONLY | WARM_FLAG))
    except OSError as exc:
        return exc
    return None
