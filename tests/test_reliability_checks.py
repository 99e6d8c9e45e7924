"""The reliability harness's own checks (scripts/reliability), each shown to catch what it
is there to catch: the outcome of a checked read, the fuzz's mutations, the store's files
against its catalog, the flood's invariants, and the fault-injecting filesystem's EIO."""

from __future__ import annotations

import collections
import errno
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Final

import numpy as np
import pytest

from decodefs.common.decode import DecodeSettings, decoder_fingerprint
from decodefs.common.entry import EntryKey
from decodefs.common.npy import npy_bytes, npy_header
from decodefs.store.store import Store
from scripts.reliability.checks import (
    StoreAccount,
    Tally,
    errno_name,
    percentile,
    pixels_digest,
)
from scripts.reliability.fallback import Flood, Program, flood_problems, slowest
from scripts.reliability.fuzz import (
    EIO_AS_DECODE_FAILS,
    SAME,
    fuzz_seeds,
    mount_outcome,
    mutate,
)
from scripts.reliability.harness import REPO, Part, gone, steady, task_states
from tests.conftest import needs_root
from tests.helpers import errno_of, is_mounted, unmount_quietly, wait_until

SIZE = 16
ARRAY = np.arange(SIZE * SIZE * 3, dtype=np.uint8).reshape(SIZE, SIZE, 3)


# -- checked reads ----------------------------------------------------------------------


@pytest.mark.parametrize("method", ["np.load", "open().read()", "read_array"])
def test_a_checked_read_tells_right_wrong_and_failed_apart(tmp_path: Path, method: str) -> None:
    right = tmp_path / "right.npy"
    right.write_bytes(npy_bytes(ARRAY))
    other = tmp_path / "other.npy"
    other.write_bytes(npy_bytes(ARRAY[::-1].copy()))
    want = pixels_digest(ARRAY)
    tally = Tally()
    assert tally.check(method, right, SIZE, want) == "ok"
    assert tally.check(method, other, SIZE, want) == "wrong"
    assert tally.check(method, tmp_path / "missing.npy", SIZE, want) == "ENOENT"
    assert tally.check(method, right, SIZE, None) == "wrong"  # an error was expected
    assert tally.check(method, right, SIZE + 1, want) == "ValueError"  # not a 17x17 array
    assert tally.outcomes == {"ok": 1, "wrong": 2, "ENOENT": 1, "ValueError": 1}
    assert (tally.reads, tally.bad) == (5, 4)
    assert len(tally.examples) == 4 and "missing.npy: ENOENT" in tally.examples[1]


def test_a_truncated_npy_file_is_not_an_array(tmp_path: Path) -> None:
    path = tmp_path / "short.npy"
    path.write_bytes(npy_bytes(ARRAY)[:-1])
    assert Tally().check("open().read()", path, SIZE, pixels_digest(ARRAY)) == "ValueError"


def test_errno_name() -> None:
    assert errno_name(OSError(errno.EIO, "x")) == "EIO"
    assert errno_name(OSError(errno.EAGAIN, "x")) == "EAGAIN"
    assert errno_name(OSError("no errno")) == "OSError"
    with pytest.raises(OSError) as raised:
        open("/nonexistent/relpkg")  # noqa: SIM115
    assert errno_name(raised.value) == "ENOENT"


def test_percentile_is_the_nearest_rank() -> None:
    values = [float(v) for v in range(100, 0, -1)]  # any order
    assert percentile(values, 0.5) == 51.0
    assert percentile(values, 0.99) == 100.0
    assert percentile(values, 0.0) == 1.0
    assert percentile(values, 1.0) == 100.0
    assert percentile([], 0.5) == 0.0
    assert percentile([3.0], 0.99) == 3.0


def test_steady_needs_enough_samples_within_the_bound() -> None:
    assert steady([100] * 9, within_kib=10) == 0  # too few
    assert steady([500, *[100] * 10], within_kib=10) == 100  # only the last ten count
    assert steady([*[100] * 9, 111], within_kib=10) == 0  # still moving
    assert steady([*[100] * 9, 110], within_kib=10) == 110


def test_a_part_fails_on_a_failed_check_or_a_wait_that_times_out() -> None:
    part = Part("x", "X")
    assert part.check(True, "never") and part.problems == []
    assert not part.check(0, "zero is not ok")
    seen = iter(range(1000))
    assert part.wait(lambda: next(seen) < 0, 0.05, "a negative number") is None
    assert part.wait(lambda: 7, 1, "seven") == 7
    assert part.problems[0] == "zero is not ok"
    assert "a negative number" in part.problems[1] and "last saw False" in part.problems[1]
    assert len(part.problems) == 2
    assert "Problems:" in part.markdown() and "- zero is not ok" in part.markdown()


# A process whose first thread has exited (exit(2) of that thread only: SYS_exit on x86_64)
# while another still runs, as a flooder's threads go on waiting in the kernel after kill -9.
_LEADER_EXITS: Final = """
import ctypes, threading, time
threading.Thread(target=time.sleep, args=(60,)).start()
print("ready", flush=True)
ctypes.CDLL(None).syscall(60, 0)
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="SYS_exit is 60 on x86_64 only")
def test_a_process_is_gone_only_once_every_thread_is() -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", _LEADER_EXITS], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None and process.stdout.readline() == "ready\n"
        wait_until(lambda: "Z" in task_states(process.pid), 30, "the first thread's exit")
        assert not gone(process.pid)  # a zombie leader, its other thread still running
        process.kill()
        wait_until(lambda: gone(process.pid), 30, "every thread gone after SIGKILL")
    finally:
        process.kill()
        process.wait(timeout=30)
    assert gone(process.pid) and task_states(process.pid) == []


# -- the fuzz ---------------------------------------------------------------------------


def test_mutations_are_the_same_for_a_seed_and_change_the_bytes() -> None:
    seeds = fuzz_seeds()
    others = [s[2] for s in seeds]
    kinds: collections.Counter[str] = collections.Counter()
    changed = 0
    for i in range(200):
        _, extension, data = seeds[i % len(seeds)]
        once = mutate(data, extension, np.random.default_rng([6, i]), others)
        again = mutate(data, extension, np.random.default_rng([6, i]), others)
        assert once == again
        kinds[once[1]] += 1
        changed += once[0] != data
    assert set(kinds) == {"bytes", "bits", "truncate", "splice", "insert", "zero", "repeat",
                          "dimensions", "several"}  # fmt: skip
    assert changed >= 190, changed  # a mutation may land where it changes nothing, rarely
    _, extension, data = seeds[0]
    outputs = {mutate(data, extension, np.random.default_rng([6, i]), others)[0] for i in range(20)}
    assert len(outputs) == 20  # another seed, another file


def test_a_dimensions_mutation_rewrites_the_png_header() -> None:
    seeds = [s for s in fuzz_seeds() if s[1] == "png"]
    rewritten = 0
    for i in range(40):
        _, _, data = seeds[i % len(seeds)]
        rng = np.random.default_rng([6, i])
        out, kind = mutate(data, "png", rng, [data])
        if kind == "dimensions":
            assert out[16:24] != data[16:24]  # IHDR's width and height
            assert out[24:] == data[24:] or out[29:33] != data[29:33]  # only the CRC besides
            rewritten += 1
    assert rewritten > 0


def test_a_read_through_the_mount_matches_decode_image_or_is_a_mismatch() -> None:
    good = npy_header(SIZE) + ARRAY.tobytes()
    want = pixels_digest(ARRAY)
    eio = OSError(errno.EIO, "Input/output error")
    assert mount_outcome(good, want, SIZE) == SAME
    assert mount_outcome(eio, None, SIZE) == EIO_AS_DECODE_FAILS
    assert mount_outcome(eio, want, SIZE) == "EIO"  # decode_image gave an array
    assert mount_outcome(good, None, SIZE) == "DIFFERENT BYTES"  # decode_image raised
    assert mount_outcome(good[:-1], want, SIZE) == "DIFFERENT BYTES"
    flipped = bytearray(good)
    flipped[-1] ^= 1
    assert mount_outcome(bytes(flipped), want, SIZE) == "DIFFERENT BYTES"
    assert mount_outcome(OSError(errno.ENOENT, "x"), None, SIZE) == "ENOENT"


# -- the store against its catalog --------------------------------------------------------


def test_the_store_account_catches_a_stray_file_a_lost_file_and_a_temp_file(
    tmp_path: Path,
) -> None:
    root = tmp_path / "store"
    store = Store(root, {"v1": decoder_fingerprint(DecodeSettings())})
    store.open()
    for uuid in ("abcdef", "abc123", "fedcba"):
        store.write(EntryKey("v1", SIZE, uuid), npy_bytes(ARRAY))
    store.close()
    clean = StoreAccount.of(root)
    assert clean == StoreAccount(files=3, rows=3, files_without_row=0, rows_without_file=0, temp=0)
    entry = root / "v1" / str(SIZE) / "ab" / "abcdef.npy"
    assert entry.exists()
    stray = entry.with_name("ab9999.npy")  # a file the catalog does not count
    stray.write_bytes(entry.read_bytes())
    assert StoreAccount.of(root).files_without_row == 1
    stray.unlink()
    entry.unlink()  # a row whose file is gone
    assert StoreAccount.of(root).rows_without_file == 1
    (root / ".tmp").mkdir(exist_ok=True)
    (root / ".tmp" / "left-by-a-kill").write_bytes(b"x")
    assert StoreAccount.of(root).temp == 1


# -- the flood ---------------------------------------------------------------------------


def flood(answers: dict[str, int], daemon_eagain: int, served: list[str]) -> Flood:
    return Flood(612, collections.Counter(answers), daemon_eagain, served)


SERVED = ["returned in 0.01 s", "returned in 0.20 s"]


def test_a_flood_that_met_eagain_while_root_was_served_passes() -> None:
    assert flood_problems(flood({"EAGAIN": 400, "opened": 30}, 400, SERVED)) == []


def test_a_flood_fails_when_no_eagain_came() -> None:
    problems = flood_problems(flood({"opened": 612}, 0, SERVED))
    assert len(problems) == 1 and "EAGAIN" in problems[0]


def test_a_flood_fails_when_root_was_not_served_or_the_counts_disagree() -> None:
    assert flood_problems(flood({"EAGAIN": 5}, 5, ["returned in 0.01 s", "no answer in 10 s"]))
    assert flood_problems(flood({"EAGAIN": 5}, 5, []))
    assert flood_problems(flood({"EAGAIN": 5}, 4, SERVED))  # the daemon missed some
    assert flood_problems(flood({"EAGAIN": 5, "EIO": 1}, 5, SERVED))


def test_slowest_names_the_slowest_read_or_the_first_failure() -> None:
    assert slowest(SERVED) == "returned in 0.20 s"
    assert slowest([*SERVED, "EIO", "no answer in 10 s"]) == "EIO"
    assert slowest([]) == "none"


@needs_root
@pytest.mark.parametrize("program", ["holder", "flooder"])
def test_the_programs_run_as_another_user_report_each_open(tmp_path: Path, program: str) -> None:
    secret = tmp_path / "secret"  # pytest's directories are root's, mode 0700
    secret.write_bytes(b"x")
    ran = Program(program, [Path("/proc/self/status"), Path("/nonexistent-relpkg"), secret])
    try:
        wait_until(lambda: ran.answered == 3, 30, f"three answers from {program}")
        assert ran.answers == {"opened": 1, "ENOENT": 1, "EACCES": 1}
    finally:
        ran.process.kill()
        ran.process.wait(timeout=30)


# -- the fault-injecting filesystem ----------------------------------------------------


@needs_root
def test_faultfs_answers_eio_to_npy_reads_only_while_told_to(tmp_path: Path) -> None:
    backing, mountpoint = tmp_path / "backing", tmp_path / "mnt"
    backing.mkdir()
    mountpoint.mkdir()
    (backing / "entry.npy").write_bytes(b"array")
    (backing / "notes.txt").write_bytes(b"text")
    (backing / "other.txt").write_bytes(b"text")
    control = tmp_path / "control"
    control.write_text("none")
    process = subprocess.Popen(
        [sys.executable, "-m", "scripts.reliability.faultfs", backing, mountpoint, control],
        cwd=REPO,
    )
    try:
        wait_until(lambda: is_mounted(mountpoint), 30, "faultfs mounted")
        # entry.npy is not read before the fault: pyfuse3 keeps the page cache across opens.
        assert (mountpoint / "notes.txt").read_bytes() == b"text"
        control.write_text("read")
        assert errno_of((mountpoint / "entry.npy").read_bytes) == errno.EIO
        assert (mountpoint / "other.txt").read_bytes() == b"text"  # not an entry
        (mountpoint / "new.npy").write_bytes(b"written")  # writes still pass
        control.write_text("none")
        assert (mountpoint / "entry.npy").read_bytes() == b"array"
    finally:
        unmount_quietly(mountpoint)
        process.wait(timeout=30)
    assert (backing / "new.npy").read_bytes() == b"written"
    counts = json.loads(Path(f"{control}.counts").read_text())
    assert counts.get("read", 0) >= 1 and "write" not in counts
