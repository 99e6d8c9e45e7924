"""Part 7, security: what another local user (uid 65534) can do to a root daemon's mount
and store with allow_other off and on, and stores prepared by someone else, which the
daemon must refuse. It knows no other part."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from decodefs import decode_image, npy_header
from decodefs.sample import make_sample_corpus
from tests.helpers import NOBODY, as_nobody, is_mounted

from .harness import REPO, VERSION, Harness, Part, Sizes

# What another user may do with allow_other on; everything else is refused, and with
# allow_other off everything is.
READS_ALLOWED = (
    "list the mount (`ls MNT`)",
    "read a stored array (`cat`)",
    "read a cold array (`cat`; decoded for them)",
    "`read_array` of a stored array",
    "read `.decodefs/stats.json`",
    "read a size no version lists (100)",
    "list the store (`ls STORE`)",
    "read a store entry file (`cat`)",
)


def outcome_of(result: subprocess.CompletedProcess[bytes], want: bytes | None = None) -> str:
    """Whether it worked ("yes", and whether the bytes are right) or the error it met."""
    if result.returncode == 0:
        if want is None:
            return "yes"
        return "yes, right bytes" if result.stdout == want else "yes, WRONG BYTES"
    text = result.stderr.decode(errors="replace")
    for needle, name in (
        ("Permission denied", "EACCES"),
        ("PermissionError", "EACCES"),
        ("Read-only file system", "EROFS"),
        ("Operation not permitted", "EPERM"),
        ("No such file", "ENOENT"),
    ):
        if needle in text:
            return f"no: {name}"
    return f"no: {text.strip().splitlines()[-1] if text.strip() else result.returncode}"


def check_columns(part: Part, columns: dict[bool, dict[str, str]]) -> None:
    """Nothing written with allow_other off or on; reads exactly as allow_other says."""
    for allow_other, cells in columns.items():
        for action, cell in cells.items():
            if action == "the store entry afterwards":
                part.check(cell == "intact", f"allow_other={allow_other}: a store entry changed")
            elif allow_other and action in READS_ALLOWED:
                part.check(cell.startswith("yes"), f"allow_other on: {action}: {cell}")
                part.check("WRONG" not in cell, f"allow_other on: {action}: {cell}")
            else:
                part.check(cell.startswith("no"), f"allow_other={allow_other}: {action}: {cell}")
    unlisted = columns[True]["read a size no version lists (100)"]
    part.check(unlisted.endswith("not stored"), f"another user's unlisted size: {unlisted}")


def part_security(h: Harness, sizes: Sizes) -> Part:
    part = Part("security", "7. Security: another local user (uid 65534)")
    source = h.directory("security-originals")
    paths = make_sample_corpus(source, 3, 256, 192, seed=71)
    ref = {p.stem: decode_image(p, 64) for p in paths}
    want_npy = {u: npy_header(64) + a.tobytes() for u, a in ref.items()}
    stored, cold, other = (p.stem for p in paths)
    columns: dict[bool, dict[str, str]] = {}
    for allow_other in (False, True):
        d = h.daemon(
            f"security-{allow_other}", {VERSION: source}, sizes=[64], allow_other=allow_other
        )
        d.mount()
        d.path(stored, 64).read_bytes()  # stored by root
        entry = d.entry(stored, 64)
        entries_before = d.stats()["store_entries"]
        unlisted = outcome_of(as_nobody("cat", d.path(other, 100)), want_npy_100(paths, other))
        entries_after = d.stats()["store_entries"]
        if unlisted.startswith("yes"):
            unlisted += ", stored" if entries_after > entries_before else ", not stored"
        cells = {
            "list the mount (`ls MNT`)": outcome_of(as_nobody("ls", d.mountpoint)),
            "read a stored array (`cat`)": outcome_of(
                as_nobody("cat", d.path(stored, 64)), want_npy[stored]
            ),
            "read a cold array (`cat`; decoded for them)": outcome_of(
                as_nobody("cat", d.path(cold, 64)), want_npy[cold]
            ),
            "`read_array` of a stored array": outcome_of(
                as_nobody(
                    sys.executable,
                    "-m",
                    "scripts.reliability.print_array",
                    d.path(stored, 64),
                    cwd=REPO,
                ),
                ref[stored].tobytes(),
            ),
            "read `.decodefs/stats.json`": outcome_of(
                as_nobody("cat", d.mountpoint / ".decodefs/stats.json")
            ),
            "read a size no version lists (100)": unlisted,
            "list the store (`ls STORE`)": outcome_of(as_nobody("ls", d.store)),
            "read a store entry file (`cat`)": outcome_of(as_nobody("cat", entry)),
            "list `STORE/.index`": outcome_of(as_nobody("ls", d.store / ".index")),
            "create a file in the mount": outcome_of(
                as_nobody("touch", d.mountpoint / VERSION / "64" / "new.npy")
            ),
            "append to an array": outcome_of(
                as_nobody("sh", "-c", f"echo x >> '{d.path(stored, 64)}'")
            ),
            "remove an array": outcome_of(as_nobody("rm", "-f", d.path(stored, 64))),
            "make a directory in the mount": outcome_of(
                as_nobody("mkdir", d.mountpoint / VERSION / "x")
            ),
            "create a file in the store": outcome_of(
                as_nobody("touch", d.store / VERSION / "planted")
            ),
            "plant a symlink in the store": outcome_of(
                as_nobody("ln", "-s", "/etc", d.store / VERSION / "64" / "zz")
            ),
            "append to a store entry file": outcome_of(
                as_nobody("sh", "-c", f"echo x >> '{entry}'")
            ),
        }
        intact = entry.read_bytes()[: len(want_npy[stored])] == want_npy[stored]
        cells["the store entry afterwards"] = "intact" if intact else "CHANGED"
        columns[allow_other] = cells
        errors_logged = d.errors_logged()
        part.check(not errors_logged, f"daemon logged errors: {errors_logged[:3]}")
        d.stop()
    actions = list(columns[False])
    part.say(
        "Each action is run with `setpriv --reuid=65534 --regid=65534 --clear-groups`, against "
        "a root daemon mounted with allow_other off and on (the store's modes follow it: "
        "0700/0600 off, 0755/0644 on)."
    )
    part.table(
        ["as uid 65534", "allow_other = false", "allow_other = true"],
        [[a, columns[False][a], columns[True][a]] for a in actions],
    )
    check_columns(part, columns)
    part.figures["columns"] = {str(k): v for k, v in columns.items()}

    refusals = security_refusals(h, source)
    part.say(
        "Stores prepared by someone else: `decodefs mount` (as root) of a config whose store "
        "is set up as below, each next to a directory of root's that holds one file (the "
        "victim)."
    )
    part.table(["store set-up", "exit", "what it said", "mounted", "victim"], refusals)
    for row in refusals:
        part.check(row[1] == 1, f"{row[0]}: exit {row[1]}")
        part.check(str(row[2]).startswith("`decodefs: error: "), f"{row[0]}: said {row[2]}")
        part.check(row[3] == "no", f"{row[0]}: it mounted")
        part.check(row[4] == "untouched", f"{row[0]}: the victim changed")
    part.figures["refusals"] = [[str(c) for c in row] for row in refusals]
    return part


def want_npy_100(paths: Sequence[Path], uuid: str) -> bytes:
    original = next(p for p in paths if p.stem == uuid)
    return npy_header(100) + decode_image(original, 100).tobytes()


def security_refusals(h: Harness, source: Path) -> list[list[object]]:
    def precreated(base: Path, victim: Path) -> Path:
        store = base / "store"
        store.mkdir()
        (store / ".tmp").symlink_to(victim)
        (store / VERSION).symlink_to(victim)
        for path in (store, store / ".tmp", store / VERSION):
            os.chown(path, NOBODY, NOBODY, follow_symlinks=False)
        return store

    def symlinked(base: Path, victim: Path) -> Path:
        store = base / "store"
        store.symlink_to(victim)
        os.chown(store, NOBODY, NOBODY, follow_symlinks=False)
        return store

    def planted(base: Path, victim: Path) -> Path:
        store = base / "store"
        store.mkdir(mode=0o700)
        (store / VERSION).symlink_to(victim)
        return store

    def world_writable(base: Path, victim: Path) -> Path:
        store = base / "store"
        store.mkdir()
        os.chmod(store, 0o777)
        return store

    def open_parent(base: Path, victim: Path) -> Path:
        parent = base / "shared"
        parent.mkdir()
        os.chmod(parent, 0o777)  # not sticky: anyone may swap what is in it
        return parent / "store"

    setups: list[tuple[str, Callable[[Path, Path], Path]]] = [
        ("pre-created by uid 65534 in a sticky directory, `.tmp` and `v1` symlinks to the victim",
         precreated),
        ("the store path is a symlink of uid 65534 to the victim", symlinked),
        ("root's store with a symlink planted in it (`v1` -> the victim)", planted),
        ("root's store, mode 0777", world_writable),
        ("under a directory anyone may write to (0777, not sticky)", open_parent),
    ]  # fmt: skip
    rows: list[list[object]] = []
    for i, (label, setup) in enumerate(setups):
        base = h.directory(f"refuse-{i}")
        os.chmod(base, 0o1777)  # like /tmp
        victim = h.directory(f"refuse-{i}-victim")
        (victim / "precious").write_text("keep me")
        store = setup(base, victim)
        d = h.daemon(f"refuse-{i}-daemon", {VERSION: source}, store=store, sizes=[64])
        result = d.try_mount()
        line = (result.stderr.strip().splitlines() or ["(nothing)"])[0]
        line = line.replace(str(h.root), "RUN")
        rows.append(
            [
                label,
                result.returncode,
                f"`{line}`",
                "YES" if is_mounted(d.mountpoint) else "no",
                "untouched" if os.listdir(victim) == ["precious"] else "CHANGED",
            ]
        )
    return rows
