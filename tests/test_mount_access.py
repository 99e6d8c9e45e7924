"""``access = "originals"`` on a real root mount: who may read an original may read its
array, through the mount, with ``read_array`` and straight from the store, and no
one else; entries stored under another policy are closed before they are served.

One store, two mounts: the first with ``access = "everyone"`` stores size 64 (its
entries readable by all), the second with the default (``originals``, as root)
serves it and stores size 32 itself; a chmod is applied by a reload, and a reload
that asks for another ``access`` keeps the mount's. Readers are uids and groups
that exist only for setpriv: the original's owner, a member of its group, and
anyone else.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from decodefs.common.entry import EntryKey
from decodefs.store.entry_modes import ACL_XATTR
from tests.conftest import MountFactory, needs_root
from tests.helpers import NOBODY, decodefs, reference_npy

pytestmark = needs_root

OWNER, GROUP, MEMBER = 61234, 62345, 63456  # no such users: setpriv needs none
READERS = {
    "owner": (OWNER, OWNER, ()),
    "member": (MEMBER, MEMBER, (GROUP,)),
    "other": (NOBODY, NOBODY, ()),
}
# name -> (where below the source, uid, gid, mode): who may read it
ORIGINALS = {
    "mine": ("mine.jpg", OWNER, OWNER, 0o600),  # its owner alone
    "team": ("team.jpg", 0, GROUP, 0o640),  # its group alone
    "open": ("open.jpg", 0, 0, 0o644),  # everyone
    "notme": ("notme.jpg", OWNER, OWNER, 0o044),  # everyone but its owner
    "hidden": ("private/hidden.jpg", 0, 0, 0o644),  # below a directory of root's alone
}
MAY_READ = {
    "mine": {"owner"},
    "team": {"member"},
    "open": {"owner", "member", "other"},
    "notme": {"member", "other"},
    "hidden": set(),
}

# Run as each reader: every array through the mount (open), with read_array, and
# straight from its store file; a digest of what was read, or the errno's name.
READ_EVERY_WAY = """
import errno, hashlib, json, os, sys
from decodefs import read_array
mount, store, names, sizes = sys.argv[1], sys.argv[2], sys.argv[3].split(","), sys.argv[4]
seen = {}
for size in sizes.split(","):
    for name in names:
        path = os.path.join(mount, "v1", size, name + ".npy")
        stored = os.path.join(store, "v1", size, name[:2], name + ".npy")
        ways = {  # read_array first: a closed entry's reader falls back to the mount
            "read_array": lambda: read_array(path).tobytes(),
            "mount": lambda: open(path, "rb").read(),
            "store": lambda: open(stored, "rb").read(),
        }
        for way, read in ways.items():
            try:
                seen[f"{size}/{name}/{way}"] = hashlib.sha256(read()).hexdigest()
            except OSError as exc:
                seen[f"{size}/{name}/{way}"] = errno.errorcode[exc.errno]
print(json.dumps(seen))
"""

# Run as a reader: MountDataset and BatchLoader over each array alone, at each size;
# a digest of the batch's pixels, or the errno's name.
READ_WITH_TORCH = """
import errno, hashlib, json, sys
from decodefs.torch import BatchLoader, MountDataset
mount, names, sizes = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(",")
seen = {}
for size in sizes:
    for name in names:
        dataset = MountDataset(mount, "v1", int(size), [name])
        ways = {
            "dataset": lambda: dataset.__getitems__([0])[0][0].tobytes(),
            "batches": lambda: next(iter(BatchLoader(dataset, batch_size=1)))[0].numpy().tobytes(),
        }
        for way, read in ways.items():
            try:
                seen[f"{size}/{name}/{way}"] = hashlib.sha256(read()).hexdigest()
            except OSError as exc:
                seen[f"{size}/{name}/{way}"] = errno.errorcode[exc.errno]
print(json.dumps(seen))
"""


def as_reader(reader: str, *command: str | Path) -> subprocess.CompletedProcess[bytes]:
    uid, gid, groups = READERS[reader]
    group_option = f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups"
    return subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={gid}", group_option, *map(str, command)],
        capture_output=True,
        timeout=120,
    )


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def originals(photos: dict[str, Path]) -> Iterator[tuple[Path, dict[str, Path]]]:
    """The source, in a directory every user may pass (pytest's tmp_path is root's
    alone): real photographs, owned and moded as ORIGINALS says."""
    base = Path(tempfile.mkdtemp(prefix="decodefs-access-"))
    try:
        os.chmod(base, 0o755)
        source = base / "originals"
        (source / "private").mkdir(parents=True)
        os.chmod(source, 0o755)
        os.chmod(source / "private", 0o700)
        jpegs = sorted(p for p in photos.values() if p.suffix.lower() in (".jpg", ".jpeg"))
        paths = {}
        for (name, (where, uid, gid, mode)), photo in zip(ORIGINALS.items(), jpegs, strict=False):
            path = source / where
            shutil.copyfile(photo, path)
            os.chown(path, uid, gid)
            os.chmod(path, mode)
            paths[name] = path
        assert len(paths) == len(ORIGINALS), "too few JPEGs among the photos"
        yield source, paths
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_only_who_may_read_an_original_reads_its_array_by_any_path(
    public_mounts: MountFactory, originals: tuple[Path, dict[str, Path]]
) -> None:
    source, paths = originals
    names = sorted(ORIGINALS)
    want = {(size, name): reference_npy(paths[name], size) for size in (64, 32) for name in names}

    # Size 64 stored under access = "everyone": its entries readable by all.
    everyone = public_mounts({"v1": source}, name="everyone", access="everyone", sizes=[64])
    for name in names:
        assert everyone.path("v1", "64", f"{name}.npy").read_bytes() == want[64, name]
    store = everyone.config.parent / "store"
    assert stat.S_IMODE((store / EntryKey("v1", 64, "mine").relpath).stat().st_mode) == 0o644
    everyone.stop()

    # The default, as root: the originals decide.
    mount = public_mounts({"v1": source}, sizes=[64, 32])
    assert stat.S_IMODE(store.stat().st_mode) == 0o711  # passed, never listed
    for name in names:  # closed before anything was served
        entry = store / EntryKey("v1", 64, name).relpath
        assert stat.S_IMODE(entry.stat().st_mode) == 0o600, name

    # What `ls -l` shows: the original's owner, group and read bits; "hidden" lies
    # below a directory only root may pass.
    shown = {name: mount.path("v1", "64", f"{name}.npy").stat() for name in names}
    for name, (_, uid, gid, mode) in ORIGINALS.items():
        st = shown[name]
        bits = 0o400 if name == "hidden" else mode & 0o444
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (uid, gid, bits), name
    version = mount.path("v1").stat()
    assert (version.st_uid, stat.S_IMODE(version.st_mode)) == (0, 0o555)  # the source's r-x

    # A listing says the same (the kernel takes attributes from READDIRPLUS).
    listed = {e.name: e.stat() for e in os.scandir(mount.path("v1", "32"))}
    for name, st in shown.items():
        again = listed[f"{name}.npy"]
        assert (again.st_uid, again.st_gid, again.st_mode) == (st.st_uid, st.st_gid, st.st_mode)

    # Root reads everything: size 32 is stored now, each entry given its readers.
    for name in names:
        assert mount.path("v1", "32", f"{name}.npy").read_bytes() == want[32, name]
    mine = store / EntryKey("v1", 32, "mine").relpath
    assert stat.S_IMODE(mine.stat().st_mode) == 0o640  # the ACL's mask: its owner, named
    assert os.getxattr(mine, ACL_XATTR)  # user:61234:r--

    # Each reader, every array, every way (the size-64 entries closed until served);
    # then again, as hits.
    for _ in range(2):
        for reader in READERS:
            result = as_reader(
                reader, sys.executable, "-c", READ_EVERY_WAY, mount.mountpoint, store,
                ",".join(names), "64,32",
            )  # fmt: skip
            assert result.returncode == 0, result.stderr.decode()
            seen = json.loads(result.stdout)
            for (size, name), npy in want.items():
                allowed = reader in MAY_READ[name]
                for way in ("mount", "read_array", "store"):
                    got = seen[f"{size}/{name}/{way}"]
                    if not allowed:
                        assert got == "EACCES", (reader, size, name, way, got)
                    elif way == "mount":
                        assert got == digest(npy), (reader, size, name, way)
                    elif way == "read_array":
                        assert got == digest(_pixels(npy)), (reader, size, name, way)
                    else:  # given its original's readers when served (64: just now)
                        assert got == digest(_entry(store, size, name)), (reader, size, name)

    # The datasets read as read_array does (hits from the store, the rest through the mount).
    result = as_reader(
        "member", sys.executable, "-c", READ_WITH_TORCH, mount.mountpoint, ",".join(names), "64,32"
    )
    assert result.returncode == 0, result.stderr.decode()
    seen = json.loads(result.stdout)
    for (size, name), npy in want.items():
        for way in ("dataset", "batches"):
            got = seen[f"{size}/{name}/{way}"]
            expected = digest(_pixels(npy)) if "member" in MAY_READ[name] else "EACCES"
            assert got == expected, (size, name, way, got)

    # The status files tell nothing of pixels; the list of failed originals (paths) is root's.
    failed = mount.path(".decodefs", "failed.json")
    assert stat.S_IMODE(failed.stat().st_mode) == 0o400
    result = as_reader("other", "cat", failed)
    assert result.returncode != 0 and b"Permission denied" in result.stderr
    assert as_reader("other", "cat", mount.path(".decodefs", "stats.json")).returncode == 0

    # A chmod is applied by a reload: the kernel forgets the attributes it held, and
    # the stored entries get the new readers; the pixels stay stored.
    os.chmod(paths["team"], 0o600)  # its group may no longer read it
    reloaded = decodefs("reload", mount.mountpoint)
    assert reloaded.returncode == 0, reloaded.stderr
    assert stat.S_IMODE(mount.path("v1", "64", "team.npy").stat().st_mode) == 0o400
    result = as_reader(
        "member", sys.executable, "-c", READ_EVERY_WAY, mount.mountpoint, store, "team", "64,32"
    )
    assert result.returncode == 0, result.stderr.decode()
    assert set(json.loads(result.stdout).values()) == {"EACCES"}
    assert mount.stats()["decodes"] == 0  # (the new serving process's): none decoded again

    # access decides the mount's options: a reload keeps the mount's, and says so.
    mount.config.write_text('access = "everyone"\n' + mount.config.read_text())
    reloaded = decodefs("reload", mount.mountpoint)
    assert reloaded.returncode == 0, reloaded.stderr
    assert "access stays 'originals' until a remount" in reloaded.stdout + reloaded.stderr
    result = as_reader(
        "other", sys.executable, "-c", READ_EVERY_WAY, mount.mountpoint, store, "mine", "64,32"
    )
    assert result.returncode == 0, result.stderr.decode()
    assert set(json.loads(result.stdout).values()) == {"EACCES"}


def _pixels(npy: bytes) -> bytes:
    return bytes(np.load(io.BytesIO(npy)).tobytes())


def _entry(store: Path, size: int, name: str) -> bytes:
    return (store / EntryKey("v1", size, name).relpath).read_bytes()
