"""Part 4, store faults: the store full, made read-only by an ext4 error, removed, and
answering EIO (faultfs.py under it), each on its own daemon; reads during and after, and
whether the store came back. It knows no other part."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from decodefs.sample import make_sample_corpus
from tests.helpers import decodefs, unmount_quietly, wait_until

from .checks import Reference, Tally, read_all, verify_store
from .harness import VERSION, Daemon, Harness, HarnessError, Part, Sizes, run

# A store's ERROR lines that a fault is expected to cause: the daemon saying so.
_STORE_LOST = "was removed or replaced while in use"


@dataclass
class FaultCase:
    key: str
    label: str
    store: Path
    inject: Callable[[Daemon], None]
    restore: Callable[[Daemon], None]
    injected: Callable[[], str] = lambda: ""


@dataclass
class FaultOutcome:
    key: str
    fault: str
    during: Tally
    writable_during: bool
    errors: dict[str, int]
    memory_fallbacks: int
    injected: str
    recovered_in: float | None
    stored_after: int
    bad_after: int
    corrupt_entries: int
    verify_status: int
    errors_logged: list[str]

    def row(self, n: int) -> list[object]:
        recovered = "NOT RECOVERED" if self.recovered_in is None else f"{self.recovered_in:.1f} s"
        return [
            self.fault,
            f"{self.during.reads:,}",
            f"{self.during.bad}" + (f" ({self.during.summary()})" if self.during.bad else ""),
            "yes" if self.writable_during else "no",
            ", ".join(f"{k} {v}" for k, v in sorted(self.errors.items())) or "-",
            f"{self.memory_fallbacks:,}",
            self.injected or "-",
            recovered,
            f"{self.stored_after} of {n}",
            self.bad_after,
            self.corrupt_entries,
            f"exit {self.verify_status}",
            len(self.errors_logged),
        ]


def fault_case(
    h: Harness, case: FaultCase, source: Path, paths: Sequence[Path], ref: Reference, n: int
) -> FaultOutcome:
    """Reads during one fault and after it is undone; whether the store came back."""
    d = h.daemon(f"faults-{case.key}", {VERSION: source}, store=case.store, sizes=[64])
    d.mount()
    hits, fresh = paths[:n], paths[n:]
    # Stored, but never read: nothing of them is in the page cache, so reading them
    # during the fault reads the store.
    warm_list = d.directory / "hits.txt"
    warm_list.write_text("".join(f"{p.stem}\n" for p in hits))
    warmed = decodefs("warm", d.mountpoint, VERSION, 64, "--uuids", warm_list, timeout=600)
    if warmed.returncode != 0:
        raise HarnessError(f"decodefs warm: {warmed.stderr.strip()}")
    case.inject(d)
    during = Tally()
    read_all(during, d, ref, hits, 64)  # stored before the fault
    read_all(during, d, ref, fresh[:n], 65)  # misses during the fault
    read_all(during, d, ref, fresh[:n], 65)  # ... read again
    stats = d.stats()
    case.restore(d)
    # Recovered: the daemon says the store is writable, and a new array lands in it. Each
    # try reads an array not read before (a read the store cannot take is kept in memory).
    after = Tally()
    spare: Iterator[Path] = iter(fresh[n:])

    def recovered() -> bool:
        if not d.stats()["store_writable"]:
            return False
        original = next(spare)  # StopIteration, once all are spent, is the last value seen
        after.check("open().read()", d.path(original.stem, 66), 66, ref.digest(original, 66))
        return d.entry(original.stem, 66).exists()

    started = time.monotonic()
    recovered_in: float | None = None
    with contextlib.suppress(AssertionError):  # not recovered: checked by the part
        wait_until(recovered, 30, f"{case.key}: the store writable again and taking a new array")
        recovered_in = time.monotonic() - started
    read_all(after, d, ref, paths[:n], 67)
    stored_after = sum(d.entry(p.stem, 67).exists() for p in paths[:n])
    read_all(after, d, ref, hits, 64)
    corrupt = d.stats()["corrupt_entries"]
    verify_status, _ = verify_store(d)
    d.stop()
    return FaultOutcome(
        key=case.key,
        fault=case.label,
        during=during,
        writable_during=stats["store_writable"],
        errors=stats["errors"],
        memory_fallbacks=stats["memory_fallbacks"],
        injected=case.injected(),
        recovered_in=recovered_in,
        stored_after=stored_after,
        bad_after=after.bad,
        corrupt_entries=corrupt,
        verify_status=verify_status,
        errors_logged=d.errors_logged(),
    )


def fault_cases(h: Harness) -> list[FaultCase]:
    """The four faults, each with its own store, how to cause it and how to undo it."""
    full_fs = h.tmpfs("faults-full-fs", "16m")

    def fill(_: Daemon) -> None:
        subprocess.run(["dd", "if=/dev/zero", f"of={full_fs}/filler", "bs=64k"],
                       capture_output=True, check=False)  # fmt: skip

    def unfill(_: Daemon) -> None:
        (full_fs / "filler").unlink()

    ro_fs, ro_image = h.ext4("faults-ro-fs", "64M")

    def fail_read_only(_: Daemon) -> None:
        device = run("findmnt", "-n", "-o", "SOURCE", ro_fs).strip()
        Path("/sys/fs/ext4", os.path.basename(device), "trigger_fs_error").write_text("1")

    def replace_read_only(_: Daemon) -> None:
        # ext4 refuses remount,rw once its journal is aborted: as an admin would, unmount,
        # check a copy of the image, and mount it again at the same place.
        unmount_quietly(ro_fs)
        fixed = ro_image.with_suffix(".fixed.img")
        shutil.copyfile(ro_image, fixed)
        subprocess.run(["e2fsck", "-fy", str(fixed)], capture_output=True, check=False)
        run("mount", "-o", "loop,errors=remount-ro", fixed, ro_fs)

    removed_parent = h.directory("faults-removed-parent")

    def remove(d: Daemon) -> None:
        subprocess.run(["rm", "-rf", str(d.store)], check=True)

    eio_fs, control = h.faultfs("faults-eio-fs")
    counts = Path(str(control) + ".counts")

    def eio_on(_: Daemon) -> None:
        control.write_text("read,write")

    def eio_off(_: Daemon) -> None:
        control.write_text("none")

    def eio_counts() -> str:
        with contextlib.suppress(OSError, ValueError):
            injected = json.loads(counts.read_text())
            return ", ".join(f"{v:,} {k}s" for k, v in sorted(injected.items()))
        return ""

    return [
        FaultCase("full", "full (16 MiB tmpfs filled by another file)", full_fs / "store",
                  fill, unfill),
        FaultCase("ro", "read-only at runtime (ext4 error, errors=remount-ro)", ro_fs / "store",
                  fail_read_only, replace_read_only),
        FaultCase("removed", "removed at runtime (`rm -rf` of the store)",
                  removed_parent / "store", remove, lambda _: None),
        FaultCase("eio", "EIO from the device (reads and writes of entries, fault-injecting "
                  "FUSE filesystem under the store)", eio_fs / "store", eio_on, eio_off,
                  injected=eio_counts),
    ]  # fmt: skip


def part_store(h: Harness, sizes: Sizes) -> Part:
    part = Part("store", "4. Store faults")
    n = sizes.fault_reads
    source = h.directory("faults-originals")
    paths = make_sample_corpus(source, 3 * n + 40, 256, 192, seed=41)
    ref = Reference()
    outcomes: list[FaultOutcome] = []
    for case in fault_cases(h):
        try:
            outcomes.append(fault_case(h, case, source, paths, ref, n))
        except HarnessError as exc:
            part.check(False, f"{case.label}: set-up failed: {exc}")
    part.say(
        f"Each fault on its own daemon and store: {n} arrays are stored first (`decodefs warm`, "
        "which reads nothing, so none of them is in the page cache); during the fault those "
        f"{n} are read (stored hits, read from the store) along with {n} new arrays, "
        "twice (misses, then memory hits); the fault is then undone, and the store counts as "
        "recovered once stats say `store_writable` and a new array's entry file exists; then "
        f"{n} more new arrays are read and must all be stored, and the first {n} are read "
        "again. Reads take turns with np.load, open().read() and read_array, each compared "
        "with `decode_image`."
    )
    part.table(
        ["fault", "reads during", "wrong or failed during", "store_writable during",
         "errors counted (stats)", "memory fallbacks", "EIO injected",
         "recovered (writable, new entry) after", "new arrays stored after",
         "wrong or failed after", "corrupt entries rebuilt", "`verify` after",
         "ERROR lines logged"],
        [o.row(n) for o in outcomes],
    )  # fmt: skip
    part.say(
        "The ext4 store is made read-only by `echo 1 > /sys/fs/ext4/<loop>/trigger_fs_error` "
        "(errors=remount-ro). ext4 refuses `mount -o remount,rw` once its journal is aborted, "
        "so it comes back as an admin would bring it back: `umount -l`, e2fsck of (a copy of) "
        "the image, mount again at the same path; the daemon takes it as a store replaced "
        "under it. Entries written shortly before the error were never synced and come back "
        "empty: they are the corrupt entries rebuilt. The `rm -rf` store is made again at "
        "once, because the first write after it fails with ENOENT and checks the store; "
        "otherwise the check runs every 5 s (STORE_CHECK_SECONDS). The ERROR lines are the "
        f'daemon saying the store "{_STORE_LOST}"; any other fails the part.'
    )
    part.say(
        'This kernel has no device-mapper (`dmsetup targets`: "/dev/mapper/control: open '
        'failed: No such device"; no dm `error` or `flakey` target) and no block-layer fault '
        "injection (no `fail_make_request` in debugfs, no `make-it-fail` in sysfs), so I/O "
        "errors come from a pass-through FUSE filesystem (pyfuse3, scripts/reliability/"
        "faultfs.py) mounted under the store, which answers EIO to read and write requests on "
        "`*.npy` files (entries and temp files) while the fault is on. It fails the data path "
        "the way a failing device does; it does not fail the catalog's fsync or metadata "
        "operations."
    )
    part.check(len(outcomes) == 4, f"{len(outcomes)} of 4 faults ran")
    for o in outcomes:
        part.check(o.errors, f"{o.fault}: the daemon counted no error: the fault did not bite")
        part.check(o.during.bad == 0, f"{o.fault}: {o.during.summary()} during the fault")
        part.check(o.recovered_in is not None, f"{o.fault}: the store did not recover")
        part.check(o.stored_after == n, f"{o.fault}: {o.stored_after} of {n} stored after")
        part.check(o.bad_after == 0, f"{o.fault}: reads failed or were wrong after the fault")
        part.check(o.verify_status == 0, f"{o.fault}: verify failed after")
        part.check(o.key != "eio" or o.injected, f"{o.fault}: no EIO was injected")
        unexpected = [line for line in o.errors_logged if _STORE_LOST not in line]
        part.check(not unexpected, f"{o.fault}: daemon logged errors: {unexpected[:3]}")
    part.figures["cases"] = {
        o.fault: {
            "bad_during": o.during.bad,
            "recovered_in": o.recovered_in,
            "stored_after": o.stored_after,
            "bad_after": o.bad_after,
            "verify_status": o.verify_status,
        }
        for o in outcomes
    }
    return part
