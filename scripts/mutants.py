"""Hand-made mutants: the broken logic the fast tests must catch, each shown killed.

Each mutant is one textual change to the package (the index cache never
reused, single flight off, ...). For each, this applies the change to a copy
of the tree, runs the in-process tests named for it, and reports "killed"
(with the tests that failed) or "SURVIVED". The unchanged copy runs first and
must pass. The working tree itself is never touched.

    .venv/bin/python scripts/mutants.py              # all of them
    .venv/bin/python scripts/mutants.py single-flight-off negative-cache-never-answers
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    path: str
    old: str  # must occur exactly once in path
    new: str
    tests: tuple[str, ...]


MUTANTS = [
    Mutant(
        "numbers-given-anew-each-start",
        "every serving process gives every original a new number (inodes change meaning)",
        "decodefs/daemon/numbers.py",
        "            number = self._numbers.get(name)\n",
        "            number = None\n",
        ("tests/test_numbers.py", "tests/test_reload.py"),
    ),
    Mutant(
        "claims-never-conflict",
        "a key another serving process is decoding is decoded here too",
        "decodefs/store/flights.py",
        "            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, _offset(key))\n",
        "            pass\n",
        ("tests/test_flights.py",),
    ),
    Mutant(
        "crash-loop-never-backed-off",
        "a serving process that keeps dying is started again at once, forever",
        "decodefs/holder/backoff.py",
        "        if beyond <= 0:\n",
        "        if True:\n",
        ("tests/test_holder.py",),
    ),
    Mutant(
        "changed-originals-never-found",
        "an original rewritten in place is never noticed",
        "decodefs/common/source.py",
        "        if sizes[i] >= 0:  # seen before, and different now\n",
        "        if False:\n",
        ("tests/test_source.py", "tests/test_reload.py"),
    ),
    Mutant(
        "carryover-ignores-the-decode",
        "what was verified for arrays decoded another way is taken over",
        "decodefs/daemon/carryover.py",
        '        if entry.get("digest") != digests.get(version):\n',
        "        if False:\n",
        ("tests/test_reload.py",),
    ),
    Mutant(
        "reload-forgets-no-gone-name",
        "names that went away stay in the kernel's cache after a reload",
        "decodefs/daemon/reload.py",
        "                for parent, child in self._gone_names(name, size):\n",
        "                for parent, child in ():\n",
        ("tests/test_reload.py",),
    ),
    Mutant(
        "index-cache-never-reused",
        "the cached source index is never loaded",
        "decodefs/common/source.py",
        "index = _load_cache(version, cache, key, root_real, layout, stamps) if cache else None",
        "index = None",
        ("tests/test_source.py", "tests/test_engine.py"),
    ),
    Mutant(
        "negative-cache-never-answers",
        "a recent decode failure is never answered from the negative cache",
        "decodefs/daemon/decodes.py",
        "reason = self.failures.get(key)",
        "reason = None",
        ("tests/test_engine.py", "tests/test_fs.py"),
    ),
    Mutant(
        "single-flight-off",
        "every opener of a cold key runs its own decode",
        "decodefs/daemon/engine.py",
        "flight = self._flights.get(key)\n",
        "flight = None\n",
        ("tests/test_engine.py",),
    ),
    Mutant(
        "checksum-not-compared",
        "a file read in pieces: the trailer's checksum is never compared with the payload's",
        "decodefs/common/entry.py",
        "        offset += len(piece)\n    if hasher.intdigest() != fields[4]:",
        "        offset += len(piece)\n    if False:",
        ("tests/test_entry.py", "tests/test_store.py", "tests/test_engine.py"),
    ),
    Mutant(
        "checksum-not-compared-in-pieces",
        "read_array_into's check: the trailer's checksum is never compared with the payload's",
        "decodefs/common/entry.py",
        "        hasher.update(piece)\n    if hasher.intdigest() != fields[4]:",
        "        hasher.update(piece)\n    if False:",
        ("tests/test_entry.py", "tests/test_mount_reader.py"),
    ),
    Mutant(
        "checksum-not-compared-whole",
        "the trailer's checksum is never compared for an entry read whole (up to 1 MiB)",
        "decodefs/common/entry.py",
        "if key.checksum(payload) != fields[4]:",
        "if False:",
        ("tests/test_entry.py", "tests/test_store.py"),
    ),
    Mutant(
        "pinned-entry-evictable",
        "eviction ignores pins",
        "decodefs/store/capacity.py",
        "        if self._pins.get(key):  # a read of one key",
        "        if False:  # a read of one key",
        ("tests/test_engine.py", "tests/test_store.py"),
    ),
    # Survivors of the mutmut run that mattered, killed since by added tests:
    Mutant(
        "eviction-stops-a-byte-short",
        "eviction stops while the store is still one byte over its limit",
        "decodefs/store/capacity.py",
        "while self._shortfall(incoming) > 0:",
        "while self._shortfall(incoming) > 1:",
        ("tests/test_engine.py",),
    ),
    Mutant(
        "warm-trips-on-a-failure",
        "the background warm reads the outcome of a decode that failed (and dies)",
        "decodefs/daemon/engine.py",
        "if outcome is not None and outcome.held is not None:\n"
        "            outcome.held.release()  # nobody reads it",
        "if outcome is None and outcome.held is not None:\n"
        "            outcome.held.release()  # nobody reads it",
        ("tests/test_engine.py",),
    ),
    Mutant(
        "warm-retries-fresh-failures",
        "the background warm decodes originals that just failed again",
        "decodefs/daemon/engine.py",
        "            or key in self._flights\n            or key in self._decodes.failures\n",
        "            or key in self._flights\n            and key in self._failures\n",
        ("tests/test_engine.py",),
    ),
    Mutant(
        "verified-bit-of-another-entry",
        "verifying one entry marks another as verified",
        "decodefs/daemon/known.py",
        "self.bits[index >> 3] |= 1 << (index & 7)",
        "self.bits[index >> 4] |= 1 << (index & 7)",
        ("tests/test_engine.py",),
    ),
    Mutant(
        "check-reads-past-the-payload",
        "an entry over 1 MiB is hashed with its trailer's bytes (so never verifies)",
        "decodefs/common/entry.py",
        "piece = os.pread(fd, min(_PIECE, length - offset), offset)",
        "piece = os.pread(fd, min(_PIECE, length + offset), offset)",
        ("tests/test_entry.py", "tests/test_engine.py"),
    ),
    Mutant(
        "queued-decodes-never-counted-down",
        "a decode that leaves the queue still counts as queued",
        "decodefs/daemon/decodes.py",
        "                self._metrics.queued_decodes -= 1\n                queued = False",
        "                queued = False",
        ("tests/test_engine.py",),
    ),
    Mutant(
        "evictions-not-forgotten",
        "an evicted entry stays verified, so its next open is a hit on a missing file",
        "decodefs/daemon/known.py",
        "            if index is not None:\n                self.not_stored(key, index)",
        "            if index is not None:\n                pass",
        ("tests/test_engine.py",),
    ),
    Mutant(
        "reclaim-drops-one-at-a-time",
        "reclaiming memory stops after dropping one cached array",
        "decodefs/daemon/memory.py",
        "        self._items.popitem()\n        return True",
        "        self._items.popitem()\n        return False",
        ("tests/test_engine.py",),
    ),
    Mutant(
        "one-unpin-frees-every-pin",
        "releasing one of two handles on an entry unpins it for both",
        "decodefs/store/capacity.py",
        "        if count > 0:\n            pins[key] = count",
        "        if count > 1:\n            pins[key] = count",
        ("tests/test_engine.py",),
    ),
    Mutant(
        "max-pixels-ignored",
        "the configured max_pixels is not passed to the decode",
        "decodefs/daemon/decodes.py",
        "array = decode_image(path, key.size, settings, max_pixels=max_pixels)",
        "array = decode_image(path, key.size, settings)",
        ("tests/test_engine.py",),
    ),
    Mutant(
        "layout-not-checked",
        "an intact entry of another .npy layout is served",
        "decodefs/common/entry.py",
        "problem = npy_layout_problem(head, length, key.size)",
        "problem = None",
        ("tests/test_entry.py", "tests/test_engine.py"),
    ),
    Mutant(
        "fingerprint-change-keeps-entries",
        "a new fingerprint does not discard the version's stored arrays",
        "decodefs/store/fingerprints.py",
        "        if recorded is not None:\n            log.warning(",
        "        if False:\n            log.warning(",
        ("tests/test_engine.py", "tests/test_store.py"),
    ),
    Mutant(
        "open-files-hold-memory",
        "an open file keeps its array's memory until closed (the hold-and-wait)",
        "decodefs/daemon/engine.py",
        "            outcome.held.release()\n            handle.in_memory = True",
        "            handle.in_memory = True",
        ("tests/test_engine.py",),
    ),
    Mutant(
        "waiting-per-user-unbounded",
        "another user may have any number of requests waiting for decodes",
        "decodefs/daemon/admission.py",
        "if self._waiting_by[uid] >= self.per_user:",
        "if False:",
        ("tests/test_engine.py",),
    ),
    Mutant(
        "refill-never-stores",
        "an array fetched again for an open file is never stored, even when the store has room",
        "decodefs/daemon/engine.py",
        "key, handle.index, Purpose.READ, may_store=handle.may_store",
        "key, handle.index, Purpose.READ, may_store=False",
        ("tests/test_engine.py",),
    ),
    # Let through by the tests of their units (the last one caught only as a 120 s hang),
    # killed since by focused tests:
    Mutant(
        "claim-array-to-the-first-at",
        "a claim's array is its name up to the first @ (a mirror file img@2x.png renews "
        "under another name and deletes its own live claim)",
        "decodefs/cluster/leases.py",
        'return self.name[len(LEASES) + 1 : self.name.rindex("@")]',
        'return self.name[len(LEASES) + 1 : self.name.index("@")]',
        ("tests/test_leases.py",),
    ),
    Mutant(
        "posix-list-ignores-the-prefix",
        "a shared directory lists every object beside the prefix (another array's claim "
        "of the same name length counts as this array's)",
        "decodefs/cluster/backends.py",
        "if entry.name.startswith(start) and entry.is_file(follow_symlinks=False):",
        "if entry.is_file(follow_symlinks=False):",
        ("tests/test_l2.py", "tests/test_leases.py"),
    ),
    Mutant(
        "resident-rounds-pages-down",
        "residency counts the pages of a range rounded down (a range with nothing "
        "resident reads as resident, so pages brought in are never dropped)",
        "decodefs/store/pagecache.py",
        "    pages = -(-(offset + length - start) // _PAGE)\n",
        "    pages = (offset + length - start) // _PAGE\n",
        ("tests/test_pagecache.py",),
    ),
    Mutant(
        "unknown-residency-owner-flipped",
        "where the store cannot check residency (a tmpfs), a verified hit's pages are "
        "dropped and those the daemon wrote are kept",
        "decodefs/daemon/entry_reads.py",
        "ours = pages is not Pages.NOT_OURS or read_ahead",
        "ours = pages is Pages.NOT_OURS or read_ahead",
        ("tests/test_pagecache.py",),
    ),
    Mutant(
        "dropper-not-woken-for-a-sooner-drop",
        "a drop due sooner than the one the dropper sleeps for does not wake it (read-in "
        "pages go after 2 s, not 0.5 s)",
        "decodefs/daemon/entry_reads.py",
        "            if before is None or (after is not None and after < before):",
        "            if before is None:",
        ("tests/test_pagecache.py",),
    ),
    Mutant(
        "pieces-layout-not-checked",
        "an entry read in pieces (read_array) is served in another .npy layout",
        "decodefs/common/entry.py",
        '    return _checked_layout(key, memoryview(payload[0]) if payload else b"", length)',
        '    return EntryCheck(Verdict.OK, "", length)',
        ("tests/test_entry.py",),
    ),
    Mutant(
        "one-more-waiting-per-user",
        "another user may have one request more than its share waiting for decodes",
        "decodefs/daemon/admission.py",
        "if self._waiting_by[uid] >= self.per_user:",
        "if self._waiting_by[uid] > self.per_user:",
        ("tests/test_admission.py", "tests/test_engine.py"),
    ),
    Mutant(
        "claim-kept-when-cancelled",
        "a claim taken for a decode that is cancelled while it looks for the array again is "
        "never let go (and renewed for leases)",
        "decodefs/cluster/tier.py",
        "        except BaseException:  # cancelled before the miss holds it: let go of it here\n"
        "            self._let_go(key, name, held)\n"
        "            raise\n",
        "",
        ("tests/test_l2.py",),
    ),
]


def copy_tree(target: Path) -> None:
    for name in ("decodefs", "tests"):
        shutil.copytree(ROOT / name, target / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", target / "pyproject.toml")


def run_tests(tree: Path, tests: tuple[str, ...]) -> tuple[int, list[str], float]:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:randomly", "-p", "no:cacheprovider",
         *tests],
        cwd=tree,
        capture_output=True,
        text=True,
    )  # fmt: skip
    failed = re.findall(r"^FAILED (\S+)", result.stdout, re.MULTILINE)
    (tree / "pytest.out").write_text(result.stdout + result.stderr)
    return result.returncode, failed, time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
    survived = 0
    with tempfile.TemporaryDirectory(prefix="decodefs-mutants-") as work:
        base = Path(work) / "tree"
        copy_tree(base)
        # The copy, not the installed package, must be what the tests import.
        where = subprocess.run(
            [sys.executable, "-c", "import decodefs; print(decodefs.__file__)"],
            cwd=base, capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        assert where.startswith(str(base)), f"the tests would import {where}"
        tests = tuple(sorted({t for m in chosen for t in m.tests}))
        code, failed, seconds = run_tests(base, tests)
        if code != 0:
            print((base / "pytest.out").read_text()[-6000:], file=sys.stderr)
            print(f"the unchanged tree fails {failed or code}: fix that first", file=sys.stderr)
            return 2
        print(f"unchanged: {len(tests)} test files pass ({seconds:.0f} s)")
        for mutant in chosen:
            tree = Path(work) / mutant.name
            copy_tree(tree)
            source = tree / mutant.path
            text = source.read_text()
            assert text.count(mutant.old) == 1, f"{mutant.name}: the change no longer applies"
            source.write_text(text.replace(mutant.old, mutant.new))
            code, failed, seconds = run_tests(tree, mutant.tests)
            if code == 0:
                survived += 1
                print(f"SURVIVED {mutant.name}: {mutant.what} ({seconds:.0f} s)")
            else:
                print(f"killed   {mutant.name}: {mutant.what} ({seconds:.0f} s), by:")
                for test in failed or [f"(pytest exit {code})"]:
                    print(f"           {test}")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
