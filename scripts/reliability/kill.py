"""Part 3, kill -9: the daemon killed during `decodefs warm` and during a stream of misses,
then mounted again on the same mount point; the store afterwards. It knows no other part."""

from __future__ import annotations

import random
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from decodefs.sample import make_sample_corpus
from tests.helpers import wait_until

from .checks import Reference, StoreAccount, Tally, read_all, store_files, verify_store
from .harness import DECODEFS, VERSION, Daemon, Harness, Part, Sizes


@dataclass
class KillTrial:
    kind: str
    size: int
    decodes_before_kill: int
    stored_at_kill: int
    at_kill: StoreAccount
    cleared_stale: bool
    temp_after_restart: int
    verify_status: int
    verify_line: str
    reads: Tally
    corrupt_entries: int
    after: StoreAccount


def miss_stream(d: Daemon, originals: Sequence[Path], size: int) -> None:
    """Read every array of ``size`` in order from two threads until the daemon dies."""
    todo = iter(originals)
    lock = threading.Lock()

    def reader() -> None:
        while True:
            with lock:
                original = next(todo, None)
            if original is None:
                return
            try:
                d.path(original.stem, size).read_bytes()
            except OSError:
                return  # the daemon is gone

    threads = [threading.Thread(target=reader, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)


class Work:
    """`decodefs warm` or a stream of misses at one size, until done or the daemon dies."""

    def __init__(self, d: Daemon, kind: str, size: int, paths: Sequence[Path]) -> None:
        self._daemon = d
        self._warm: subprocess.Popen[bytes] | None = None
        self._stream: threading.Thread | None = None
        if kind == "warm":
            self._warm = subprocess.Popen(
                [*DECODEFS, "warm", str(d.mountpoint), VERSION, str(size), "--jobs", "2"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        else:
            self._stream = threading.Thread(target=miss_stream, args=(d, paths, size), daemon=True)
            self._stream.start()

    def until_decoded(self, count: int, since: int) -> None:
        """Wait until the daemon has run ``count`` decodes more than ``since``."""
        wait_until(
            lambda: self._daemon.stats()["decodes"] - since >= count,
            120,
            f"{count} decodes since {since}",
        )

    def wait(self) -> None:
        if self._warm is not None:
            self._warm.wait(timeout=600)
        if self._stream is not None:
            self._stream.join(timeout=600)


def kill_trial(
    d: Daemon, kind: str, size: int, paths: Sequence[Path], ref: Reference, rng: random.Random
) -> KillTrial:
    """Start a warm or a miss stream at ``size``, kill -9 the daemon once it has decoded a
    random number of the arrays (and a random 0-50 ms more), restart it on the same mount
    point and check the store."""
    since = d.stats()["decodes"]
    decodes = rng.randrange(1, len(paths))
    work = Work(d, kind, size, paths)
    work.until_decoded(decodes, since)
    # Not a wait for anything: a random delay, so that kills land anywhere in a write.
    time.sleep(rng.uniform(0, 0.05))
    d.kill9()
    work.wait()
    stored_at_kill = sum(1 for f in store_files(d.store) if f[1] == size)
    at_kill = StoreAccount.of(d.store)
    said = d.mount()
    temp_after = StoreAccount.of(d.store).temp
    verify_status, verify_line = verify_store(d)
    tally = Tally()
    ref.fill(paths, size)
    read_all(tally, d, ref, paths, size)
    return KillTrial(
        kind=kind,
        size=size,
        decodes_before_kill=decodes,
        stored_at_kill=stored_at_kill,
        at_kill=at_kill,
        cleared_stale="clearing stale mount" in said,
        temp_after_restart=temp_after,
        verify_status=verify_status,
        verify_line=verify_line,
        reads=tally,
        corrupt_entries=d.stats()["corrupt_entries"],
        after=StoreAccount.of(d.store),
    )


def check_trial(part: Part, t: KillTrial) -> None:
    name = f"{t.kind} size {t.size}"
    part.check(t.cleared_stale, f"{name}: restart did not clear a stale mount")
    part.check(
        t.temp_after_restart == 0, f"{name}: {t.temp_after_restart} temp files after restart"
    )
    part.check(t.verify_status == 0, f"{name}: verify: {t.verify_line}")
    part.check(t.reads.bad == 0, f"{name}: {t.reads.examples}")
    part.check(t.corrupt_entries == 0, f"{name}: corrupt entries served")
    part.check(
        t.at_kill.files_without_row == 0 and t.after.files_without_row == 0,
        f"{name}: entry files without a catalog row ({t.at_kill}, then {t.after})",
    )


def part_kill(h: Harness, sizes: Sizes) -> Part:
    part = Part("kill", "3. kill -9")
    source = h.directory("kill-originals")
    paths = make_sample_corpus(source, sizes.kill_originals, 256, 192, seed=31)
    ref = Reference()
    d = h.daemon("kill", {VERSION: source}, sizes=[64])
    d.mount()
    rng = random.Random(3)
    trials: list[KillTrial] = []
    size = 8
    for kind in ("warm", "misses"):
        for _ in range(sizes.kill_trials):
            trials.append(kill_trial(d, kind, size, paths, ref, rng))
            size += 1
    final_status, final_line = verify_store(d)
    final = StoreAccount.of(d.store)
    part.say(
        f"{sizes.kill_trials} trials each: `kill -9` of the daemon at a random moment during "
        f"`decodefs warm MNT v1 SIZE --jobs 2` of {len(paths)} originals (JPEGs of 256x192) or "
        "during a stream of misses of them from two reader threads: once the daemon has run a "
        f"random number (1 to {len(paths) - 1}) of the decodes, plus 0-50 ms, so that every "
        "kill lands in the middle of the work, wherever a write happens to be. Each trial uses "
        "a size not read before, so it starts cold, and the store keeps every earlier trial's "
        "entries. Then `decodefs mount` on the same mount point, `decodefs verify CONFIG`, and "
        "a read of every array of the trial's size compared with `decode_image`. Catalog: the "
        "rows of `<store>/.catalog.sqlite3` (table `entries`) against the `*.npy` files under "
        "`<store>/v1/`."
    )
    rows: list[list[object]] = []
    for kind in ("warm", "misses"):
        mine = [t for t in trials if t.kind == kind]
        if not mine:
            continue
        stored = sorted(t.stored_at_kill for t in mine)
        rows.append(
            [
                f"during {'`decodefs warm`' if kind == 'warm' else 'a stream of misses'}",
                len(mine),
                f"{min(t.decodes_before_kill for t in mine)}-"
                f"{max(t.decodes_before_kill for t in mine)} decodes in",
                f"{stored[0]}/{stored[len(stored) // 2]}/{stored[-1]} of {len(paths)}",
                sum(t.cleared_stale for t in mine),
                sum(t.at_kill.temp for t in mine),
                sum(t.temp_after_restart for t in mine),
                sum(t.verify_status != 0 for t in mine),
                f"{sum(t.reads.bad for t in mine)} of {sum(t.reads.reads for t in mine):,}",
                sum(t.corrupt_entries for t in mine),
                f"{sum(t.at_kill.rows_without_file for t in mine)} / "
                f"{sum(t.at_kill.files_without_row for t in mine)}",
                f"{sum(t.after.rows_without_file for t in mine)} / "
                f"{sum(t.after.files_without_row for t in mine)}",
            ]
        )
    part.table(
        ["kill -9", "trials", "killed after", "entries at kill (min/median/max)",
         "restarts that cleared the stale mount", "temp files left by the kills",
         "temp files after restart", "`verify` failures", "arrays read wrong or failed",
         "corrupt entries found", "catalog rows without a file / files without a row, at kill",
         "the same, after the reads"],
        rows,
    )  # fmt: skip
    part.say(
        f"After all trials: `decodefs verify` exit {final_status} ({final_line}); catalog "
        f"{final.rows:,} rows, {final.files:,} files, {final.rows_without_file} rows without a "
        f"file, {final.files_without_row} files without a row."
    )
    for t in trials:
        check_trial(part, t)
    part.check(final_status == 0, f"final verify: {final_line}")
    part.check(final.files_without_row == 0, f"after all trials: {final}")
    part.check(final.temp == 0, f"after all trials: {final.temp} temp files")
    errors_logged = d.errors_logged()
    part.check(not errors_logged, f"daemon logged errors: {errors_logged[:3]}")
    part.figures.update(
        trials=len(trials),
        temp_after_restart=sum(t.temp_after_restart for t in trials),
        verify_failures=sum(t.verify_status != 0 for t in trials),
        bad_reads=sum(t.reads.bad for t in trials),
        corrupt_entries=sum(t.corrupt_entries for t in trials),
        files_without_row=sum(
            t.at_kill.files_without_row + t.after.files_without_row for t in trials
        ),
        rows_without_file_at_kill=sum(t.at_kill.rows_without_file for t in trials),
        rows_without_file_final=final.rows_without_file,
        killed_mid_work=sum(0 < t.stored_at_kill < len(paths) for t in trials),
    )
    return part
