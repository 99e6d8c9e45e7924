"""Defects the reliability harness (python -m scripts.reliability) found, each kept as the
case that showed it.

See docs/reliability.md for the runs that found them.
"""

from __future__ import annotations

import errno
import gc
import json
import logging
import re
import shutil
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest
import trio

from decodefs.common.decode import DecodeSettings, decoder_fingerprint
from decodefs.common.entry import EntryKey
from decodefs.common.npy import npy_bytes
from decodefs.common.protocol import STORE_FORMAT
from decodefs.daemon.workers import LowPriorityPool
from decodefs.store.store import Store
from tests.conftest import MountFactory
from tests.helpers import errno_of

V1 = decoder_fingerprint(DecodeSettings())
KEY = EntryKey("v1", 16, "abcdef")
PAYLOAD = npy_bytes(np.full((16, 16, 3), 7, dtype=np.uint8))


def test_a_vanished_source_logs_one_line_not_one_per_read(
    mounts: MountFactory, tmp_path: Path, photos: dict[str, Path]
) -> None:
    # Part 5: with the source directory renamed (or unmounted) under the daemon, every
    # read of an array not stored yet logged its own WARNING line.
    source = tmp_path / "originals"
    source.mkdir()
    for path in photos.values():
        shutil.copy(path, source / path.name)
    mount = mounts({"v1": source})
    source.rename(tmp_path / "moved")
    for _ in range(3):
        for uuid in photos:
            assert errno_of(mount.path("v1", "64", f"{uuid}.npy").read_bytes) == errno.ENOENT
    assert mount.stats()["errors"]["ENOENT"] == 3 * len(photos)
    # The decode pool's line (a holder may log another mount's holder "is gone" too).
    assert len(re.findall(r"original of v1/64/\S+ is gone", mount.log_text())) == 1


def test_an_empty_store_marker_left_by_a_crash_is_written_again(tmp_path: Path) -> None:
    # Part 4: an ext4 store that failed (errors=remount-ro) shortly after it was made came
    # back from e2fsck with a 0-byte .decodefs-store (written without fsync, as everything
    # in the store), and the daemon refused the whole store from then on.
    root = tmp_path / "store"
    store = Store(root, {"v1": V1})
    store.open()
    store.write(KEY, PAYLOAD)
    store.close()
    (root / ".decodefs-store").write_bytes(b"")
    again = Store(root, {"v1": V1})
    again.open()
    checked = again.verify(KEY)
    assert checked is not None and again.read_range(KEY, 0, checked.length) == PAYLOAD
    again.close()
    assert json.loads((root / ".decodefs-store").read_text()) == {"format": STORE_FORMAT}


def test_a_store_made_again_that_cannot_be_used_is_logged_once_not_every_check(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Part 4: the daemon checks the store every 5 s; one that was made again but could not
    # be used logged the same ERROR line at every check, for as long as it lasted.
    root = tmp_path / "store"
    store = Store(root, {"v1": V1})
    store.open()
    shutil.rmtree(root)
    root.mkdir(mode=0o700)
    (root / ".decodefs-store").write_text("{not json")
    with caplog.at_level(logging.DEBUG, logger="decodefs.store.root"):
        for _ in range(4):
            store.check()
    unusable = [
        r
        for r in caplog.records
        if "cannot be used" in r.getMessage() and r.levelno >= logging.ERROR
    ]
    assert len(unusable) == 1
    (root / ".decodefs-store").unlink()  # put right: the store is used again
    assert store.check() and store.writable
    store.close()


class _Decoded:
    """Stands in for a decode's result (the whole .npy bytes of an array)."""


def test_a_finished_warm_job_frees_its_result_without_the_cycle_collector() -> None:
    # Part 2: after `decodefs warm` of 30 arrays at size 4096 the idle daemon sat at 448 MiB
    # of RSS until something made Python's cycle collector run: each warm Job and its future
    # referred to each other (the future's done-callback was the Job's bound method), so the
    # future's result, a whole decoded array, outlived the Job, outside every budget.
    results: list[weakref.ref[_Decoded]] = []
    submitted = threading.Event()

    def decode() -> _Decoded:
        submitted.wait(30)  # still running when the Job adds its done-callback
        result = _Decoded()
        results.append(weakref.ref(result))
        return result

    async def warm_one() -> None:
        pool = LowPriorityPool(1)
        try:
            job = pool.submit(decode)
            submitted.set()
            result = await job.wait()
            del job, result
        finally:
            pool.shutdown()

    gc.disable()
    try:
        trio.run(warm_one)
        assert results[0]() is None
    finally:
        gc.enable()
