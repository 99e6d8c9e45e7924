"""`decodefs warm`: fill the cache ahead of training, through the mount.

Each entry is opened with O_NONBLOCK and closed without being read. The
daemon takes that as a warm request: it decodes and stores the array on open
(single-flight and accounting hold) on its low-priority threads, so training
readers go first, and it never evicts for it: a full store answers EDQUOT
(or ENOSPC, EROFS) and the warm stops. No data lands in this process or the
page cache. Entries already stored cost one open, so an interrupted warm
resumes when run again.
"""

from __future__ import annotations

import concurrent.futures
import errno
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

__all__ = ["WarmReport", "read_uuid_list", "warm"]

# The daemon is gone (killed, or its connection aborted): the warm stops too.
_DAEMON_GONE = frozenset({errno.ENOTCONN, errno.ECONNABORTED})


@dataclass
class WarmReport:
    total: int
    done: int = 0
    failed: dict[str, str] = field(default_factory=dict)  # uuid -> reason (EIO: bad original)
    missing: list[str] = field(default_factory=list)  # uuids the version does not have
    seconds: float = 0.0
    interrupted: bool = False
    store_full: str | None = None  # why the store stopped taking arrays, if it did
    daemon_gone: str | None = None  # why the mount stopped answering, if it did


def read_uuid_list(path: Path) -> list[str]:
    """One uuid per line; blank lines and '#' comments skipped; "<uuid>.npy" accepted.

    Raises OSError or UnicodeDecodeError for a file that cannot be read as
    UTF-8 text, ValueError naming the first line that cannot be a uuid.
    """
    uuids = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        uuid = line[: -len(".npy")] if line.endswith(".npy") else line
        if "/" in uuid or "\0" in uuid or uuid in (".", ".."):
            raise ValueError(f"line {number}: {line!r} is not a uuid (one file name, no '/')")
        uuids.append(uuid)
    return uuids


def warm(
    directory: Path, uuids: Iterable[str] | None, jobs: int, progress: bool = True
) -> WarmReport:
    """Open every ``<directory>/<uuid>.npy`` (all listed there if ``uuids`` is None)."""
    names = sorted(os.listdir(directory)) if uuids is None else [f"{u}.npy" for u in uuids]
    names = [n for n in names if n.endswith(".npy")]
    report = WarmReport(total=len(names))
    started = time.monotonic()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="warm")
    bar = tqdm(total=len(names), unit="img", disable=not progress, mininterval=0.5, smoothing=0.1)
    try:
        futures = {pool.submit(_touch, directory / name): name for name in names}
        for future in concurrent.futures.as_completed(futures):
            uuid = futures[future][: -len(".npy")]
            error = future.result()
            if error is None:
                report.done += 1
            elif error.errno == errno.ENOENT:
                report.missing.append(uuid)
            elif error.errno in _STORE_FULL:
                report.store_full = error.strerror or str(error)
                pool.shutdown(wait=True, cancel_futures=True)
                break
            elif error.errno in _DAEMON_GONE:
                report.daemon_gone = error.strerror or str(error)
                pool.shutdown(wait=True, cancel_futures=True)
                break
            else:
                report.failed[uuid] = error.strerror or str(error)
            bar.update(1)
    except KeyboardInterrupt:
        report.interrupted = True
        pool.shutdown(wait=True, cancel_futures=True)
    finally:
        pool.shutdown(wait=True)
        bar.close()
        report.seconds = time.monotonic() - started
    return report


_STORE_FULL = frozenset({errno.EDQUOT, errno.ENOSPC, errno.EROFS})


def _touch(path: Path) -> OSError | None:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
    except OSError as exc:
        return exc
    return None
