"""Concurrent readers: one decode per key, a bounded pool, a loop that never blocks."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
from pathlib import Path

from tests.conftest import LARGE_COUNT, MountFactory
from tests.helpers import abort_fuse_connection, reference_npy

_READER = """
import hashlib, os, sys
path, gate = sys.argv[1], int(sys.argv[2])
os.read(gate, 1)  # returns (empty) for every reader at once, when the gate closes
with open(path, "rb") as f:
    print(hashlib.sha256(f.read()).hexdigest())
"""


def test_concurrent_cold_readers_cause_one_decode(mounts: MountFactory, large: list[Path]) -> None:
    mount = mounts({"v1": large[0].parents[1]}, decode_workers=2)
    original = large[0]
    entry = mount.path("v1", "224", f"{original.stem}.npy")
    want = hashlib.sha256(reference_npy(original, 224)).hexdigest()

    # A gate: every reader, threads and processes alike, blocks reading a pipe
    # until its write end closes; then all of them read at once.
    gate, opener = os.pipe()
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", _READER, str(entry), str(gate)],
            stdout=subprocess.PIPE,
            text=True,
            pass_fds=(gate,),
        )
        for _ in range(4)
    ]
    digests: list[str] = []

    def thread_reader() -> None:
        os.read(gate, 1)
        digests.append(hashlib.sha256(entry.read_bytes()).hexdigest())

    threads = [threading.Thread(target=thread_reader) for _ in range(8)]
    for thread in threads:
        thread.start()
    os.close(opener)  # open the gate
    for thread in threads:
        thread.join()
    os.close(gate)
    for process in processes:
        out, _ = process.communicate(timeout=60)
        assert process.returncode == 0
        digests.append(out.strip())

    assert digests == [want] * 12
    stats = mount.stats()
    assert stats["decodes"] == 1
    assert stats["hits"] + stats["misses"] == 12
    assert stats["coalesced"] >= 1 and stats["coalesced"] == stats["misses"] - 1


def test_decodes_run_in_a_bounded_pool_while_hits_keep_flowing(
    mounts: MountFactory, large: list[Path]
) -> None:
    mount = mounts({"v1": large[0].parents[1]}, decode_workers=2)
    hit_entry = mount.path("v1", "32", f"{large[0].stem}.npy")
    hit_bytes = reference_npy(large[0], 32)
    assert hit_entry.read_bytes() == hit_bytes

    results: dict[str, bytes] = {}

    def cold_reader(original: Path) -> None:
        results[original.stem] = mount.path("v1", "224", f"{original.stem}.npy").read_bytes()

    threads = [threading.Thread(target=cold_reader, args=(p,)) for p in large]
    for thread in threads:
        thread.start()
    running_seen, queued_seen, hits_during_decodes = [], [], 0
    while any(t.is_alive() for t in threads):
        # Both reads are answered by the daemon's event loop, between decodes.
        with open(hit_entry, "rb", buffering=0) as f:
            assert f.read() == hit_bytes
        stats = mount.stats()
        running_seen.append(stats["inflight_decodes"])
        queued_seen.append(stats["queued_decodes"])
        if stats["inflight_decodes"]:
            hits_during_decodes += 1
    for thread in threads:
        thread.join()

    assert max(running_seen) <= 2  # the pool is bounded
    assert max(queued_seen) >= 1  # and readers queued behind it
    assert hits_during_decodes >= 1  # while hits were answered
    for original in large:
        assert results[original.stem] == reference_npy(original, 224)
    stats = mount.stats()
    assert stats["decodes"] == LARGE_COUNT + 1
    assert stats["inflight_decodes"] == stats["queued_decodes"] == 0


_STREAM_AND_RECHECK = """
import os, sys, threading, time
root, seconds = sys.argv[1], float(sys.argv[2])
files = [os.path.join(root, n) for n in sorted(os.listdir(root))]
stop = time.monotonic() + seconds
def stream():
    while time.monotonic() < stop:
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # every read reaches the daemon
            while os.read(fd, 4096):
                pass
            os.close(fd)
def recheck():
    while time.monotonic() < stop:
        for path in files:
            os.close(os.open(path, os.O_RDONLY | os.O_SYNC))
threads = [threading.Thread(target=f) for f in (stream, stream, stream, recheck, recheck)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("done")
"""


def test_rechecks_while_others_stream_the_same_files_never_hang(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path]
) -> None:
    """An O_SYNC open verifies the entry again while other readers wait on READ
    replies for the same pages: the daemon must keep answering them."""
    mount = mounts({"v1": photos_dir})
    directory = mount.path("v1", "512")
    for uuid in photos:
        (directory / f"{uuid}.npy").read_bytes()  # stored
    process = subprocess.Popen(
        [sys.executable, "-c", _STREAM_AND_RECHECK, str(directory), "5"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        out, _ = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        abort_fuse_connection(mount.mountpoint)  # so that the readers and the daemon return
        process.kill()
        process.communicate()
        raise AssertionError("readers hung: the daemon stopped answering") from None
    assert process.returncode == 0 and out.strip() == "done"
    assert mount.stats()["errors"] == {}
