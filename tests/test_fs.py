"""The operations class in-process: what the kernel asks, and the errno it gets back.

``DecodeFS`` is called as pyfuse3 would call it, over a real tree, engine and
store; readdir needs a token only the kernel can make, so listings are tested
through the tree (test_tree.py) and through mounts.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import stat
import struct
import tempfile
from pathlib import Path

import pyfuse3
import pytest

from decodefs.common.inodes import Kind, Node
from decodefs.common.npy import npy_file_size
from decodefs.common.protocol import RECHECK_FLAG, TRAILER_SIZE, WARM_FLAG
from decodefs.daemon.lifecycle import changed_in_place
from decodefs.daemon.numbers import MountNumbers
from decodefs.store.entry_modes import ACL_XATTR
from tests.conftest import DaemonFactory, needs_root
from tests.helpers import reference_npy, write_bad_originals
from tests.inprocess import CTX, InProcess

SIZE = 48


async def fuse_errno(call: object, *args: object) -> int:
    """The errno an operation answers (the test fails if it succeeds)."""
    try:
        await call(*args)  # type: ignore[operator]
    except pyfuse3.FUSEError as exc:
        return exc.errno
    raise AssertionError(f"{call}{args} succeeded")


async def read_file(
    d: InProcess, inode: int, flags: int = os.O_RDONLY, chunk: int = 1 << 17
) -> bytes:
    """open, read to the end in ``chunk``-byte requests, release: as the kernel does
    (the handle is taken from the FileInfo at once, as pyfuse3 does: the next open
    may reuse it)."""
    fh = (await d.ops.open(inode, flags, CTX)).fh
    try:
        pieces = []
        offset = 0
        while piece := bytes(await d.ops.read(fh, offset, chunk)):
            pieces.append(piece)
            offset += len(piece)
        return b"".join(pieces)
    finally:
        await d.ops.release(fh)


async def test_a_path_resolves_and_reads_the_reference_array(
    daemons: DaemonFactory, originals: Path
) -> None:
    d = daemons({"v1": originals})
    attrs = await d.lookup_path("v1", str(SIZE), "camera-tiff.npy")
    assert stat.S_ISREG(attrs.st_mode) and stat.S_IMODE(attrs.st_mode) == 0o444
    assert attrs.st_size == npy_file_size(SIZE) and attrs.st_nlink == 1
    assert attrs.entry_timeout > 0 and attrs.attr_timeout > 0  # the kernel may cache it
    assert d.stats()["decodes"] == 0  # metadata never decodes
    want = reference_npy(originals / "camera-tiff.TIFF", SIZE)
    assert await read_file(d, attrs.st_ino, chunk=4093) == want
    sharded = await d.lookup_path("v1", str(SIZE), "ca", "camera-tiff.npy")
    assert sharded.st_ino == attrs.st_ino  # one inode, one page cache
    assert await read_file(d, sharded.st_ino) == want
    stats = d.stats()
    assert stats["decodes"] == stats["misses"] == 1 and stats["hits"] == 1
    assert stats["bytes_served"] == 2 * len(want)


async def test_reads_at_any_offset(daemons: DaemonFactory, originals: Path) -> None:
    d = daemons({"v1": originals})
    want = reference_npy(originals / "chelsea-444.JPG", SIZE)
    attrs = await d.lookup_path("v1", str(SIZE), "chelsea-444.npy")
    info = await d.ops.open(attrs.st_ino, os.O_RDONLY, CTX)
    try:
        for offset, size in [(0, 10), (127, 2), (len(want) - 10, 100), (len(want), 10)]:
            assert bytes(await d.ops.read(info.fh, offset, size)) == want[offset : offset + size]
        assert bytes(await d.ops.read(info.fh, len(want) + 5, 10)) == b""
    finally:
        await d.ops.release(info.fh)
    assert d.engine.memory.used == 0 and not d.store.capacity.pinned(
        d.key("v1", SIZE, "chelsea-444")
    )


async def test_errno_for_names_that_do_not_exist(daemons: DaemonFactory, originals: Path) -> None:
    d = daemons({"v1": originals})
    size_dir = (await d.lookup_path("v1", str(SIZE))).st_ino
    ctx = CTX
    assert await fuse_errno(d.ops.lookup, size_dir, b"missing.npy", ctx) == errno.ENOENT
    assert await fuse_errno(d.ops.lookup, size_dir, b"a" * 256, ctx) == errno.ENAMETOOLONG
    assert await fuse_errno(d.ops.lookup, pyfuse3.ROOT_INODE, b"v3", ctx) == errno.ENOENT
    version = (await d.lookup_path("v1")).st_ino
    for bad in [b"0", b"7", b"4097", b"064", b"+64", b" 64", b"64 "]:
        assert await fuse_errno(d.ops.lookup, version, bad, ctx) == errno.ENOENT, bad
    assert await fuse_errno(d.ops.getattr, 7 << 60, ctx) == errno.ENOENT
    assert (await d.ops.lookup(size_dir, b"..", ctx)).st_ino == version
    assert (await d.ops.lookup(size_dir, b".", ctx)).st_ino == size_dir
    assert "unexpected" not in d.stats()["errors"]


async def test_errno_for_what_the_mount_refuses(daemons: DaemonFactory, originals: Path) -> None:
    d = daemons({"v1": originals})
    entry = (await d.lookup_path("v1", str(SIZE), "coffee-webp.npy")).st_ino
    size_dir = (await d.lookup_path("v1", str(SIZE))).st_ino
    for flags in (os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_TRUNC, os.O_WRONLY | os.O_APPEND):
        assert await fuse_errno(d.ops.open, entry, flags, CTX) == errno.EROFS, flags
    assert await fuse_errno(d.ops.open, size_dir, os.O_RDONLY, CTX) == errno.EISDIR
    assert await fuse_errno(d.ops.opendir, entry, CTX) == errno.ENOTDIR
    assert await d.ops.opendir(size_dir, CTX) == size_dir
    assert await fuse_errno(d.ops.unlink, size_dir, b"coffee-webp.npy", CTX) == errno.EROFS
    assert await fuse_errno(d.ops.mkdir, size_dir, b"x", 0o755, CTX) == errno.EROFS
    assert await fuse_errno(d.ops.create, size_dir, b"x.npy", 0o644, os.O_WRONLY, CTX) == (
        errno.EROFS
    )
    assert await fuse_errno(d.ops.write, 1, 0, b"x") == errno.EROFS
    assert await fuse_errno(d.ops.rename, size_dir, b"a", size_dir, b"b", 0, CTX) == errno.EROFS
    assert await fuse_errno(d.ops.setxattr, entry, b"user.x", b"1", CTX) == errno.EROFS
    assert await fuse_errno(d.ops.flush, 1) == errno.ENOSYS
    assert d.stats()["decodes"] == 0


async def test_errno_for_originals_that_fail(daemons: DaemonFactory, originals: Path) -> None:
    bad = write_bad_originals(originals / "bad", originals / "astronaut-baseline.jpg")
    d = daemons({"v1": originals}, error_cache_seconds=60)
    for uuid in bad:
        entry = (await d.lookup_path("v1", str(SIZE), f"{uuid}.npy")).st_ino
        assert await fuse_errno(d.ops.open, entry, os.O_RDONLY, CTX) == errno.EIO, uuid
        assert await fuse_errno(d.ops.open, entry, os.O_RDONLY, CTX) == errno.EIO, uuid
    stats = d.stats()
    assert stats["decode_errors"] == stats["decodes"] == len(bad)  # the second: cached
    assert stats["errors"]["EIO"] == 2 * len(bad)

    gone = (await d.lookup_path("v1", str(SIZE), "logo-alpha.npy")).st_ino
    (originals / "logo-alpha.png").unlink()
    assert await fuse_errno(d.ops.open, gone, os.O_RDONLY, CTX) == errno.ENOENT
    assert d.stats()["errors"]["ENOENT"] == 1
    # Everything else is still served.
    ok = (await d.lookup_path("v1", str(SIZE), "rocket-cmyk.npy")).st_ino
    assert await read_file(d, ok) == reference_npy(originals / "rocket-cmyk.jpg", SIZE)
    assert "unexpected" not in d.stats()["errors"]


async def test_open_flags_ask_for_a_warm_or_a_recheck(
    daemons: DaemonFactory, originals: Path
) -> None:
    d = daemons({"v1": originals})
    entry = (await d.lookup_path("v1", str(SIZE), "coffee-progressive.npy")).st_ino
    want = reference_npy(originals / "coffee-progressive.jpeg", SIZE)
    info = await d.ops.open(entry, os.O_RDONLY | WARM_FLAG, CTX)
    await d.ops.release(info.fh)
    assert d.stats()["warm_decodes"] == 1 and d.stats()["misses"] == 0
    path = d.entry_path("v1", SIZE, "coffee-progressive")
    assert await read_file(d, entry) == want  # verified in this life now
    data = bytearray(path.read_bytes())
    data[500] ^= 0x04
    path.write_bytes(bytes(data))
    assert await read_file(d, entry, os.O_RDONLY | RECHECK_FLAG) == want
    assert d.stats()["corrupt_entries"] == 1
    assert path.read_bytes()[:-TRAILER_SIZE] == want


async def test_verified_hits_take_the_hot_path_with_a_handle_each(
    daemons: DaemonFactory, originals: Path
) -> None:
    now = [1000.0]  # the store's wall clock, for last-access times
    d = daemons({"v1": originals}, store_clock=lambda: now[0])
    uuid = "camera-gray"
    entry = (await d.lookup_path("v1", str(SIZE), f"{uuid}.npy")).st_ino
    want = reference_npy(originals / "camera-gray.jpg", SIZE)
    assert await read_file(d, entry) == want  # a miss: stored, verified in this life
    key, capacity = d.key("v1", SIZE, uuid), d.store.capacity
    capacity.flush_accesses()
    now[0] = 2000.0
    fhs = [(await d.ops.open(entry, os.O_RDONLY, CTX)).fh for _ in range(3)]
    # A file handle is the array's inode: a READ or RELEASE means the same to any
    # serving process of the mount. Each open holds its own pin all the same.
    assert fhs == [entry] * 3
    assert capacity.pinned(key)  # eviction cannot take it while any is open
    for fh in fhs:
        assert bytes(await d.ops.read(fh, 0, len(want) + 10)) == want
    for fh in fhs[:2]:
        await d.ops.release(fh)
    assert capacity.pinned(key)
    await d.ops.release(fhs[2])
    assert not capacity.pinned(key)
    stats = d.stats()
    assert stats["hits"] == 3 and stats["misses"] == stats["decodes"] == 1
    capacity.flush_accesses()  # the hits order the LRU: their time reached the catalog
    catalog = capacity.detach()
    assert catalog is not None and catalog.oldest(1)[0].last_access == 2000.0
    capacity.attach(catalog, filled=True)


async def test_lookups_of_arrays_take_the_hot_path_with_the_same_answers(
    daemons: DaemonFactory, originals: Path
) -> None:
    d = daemons({"v1": originals})
    size_dir = (await d.lookup_path("v1", str(SIZE))).st_ino
    names = sorted(f"{p.stem}.npy".encode() for p in originals.iterdir())
    fields = ("st_mode", "st_size", "st_nlink", "st_mtime_ns", "entry_timeout", "attr_timeout")

    def seen(attrs: pyfuse3.EntryAttributes) -> tuple[object, ...]:
        return (attrs.st_ino, *(getattr(attrs, f) for f in fields))

    first = seen(await d.ops.lookup(size_dir, names[0], CTX))  # the whole way: noted
    assert size_dir in d.ops._array_attrs
    answers = [seen(await d.ops.lookup(size_dir, n, CTX)) for n in names]  # the hot path
    assert answers[0] == first
    for name, answer in zip(names, answers, strict=True):
        node = d.tree.lookup(Node.from_ino(size_dir), name)
        assert node is not None and answer[0] == node.ino
        assert answer[1:] == first[1:]  # alike but for the inode
    assert await fuse_errno(d.ops.lookup, size_dir, b"missing.npy", CTX) == errno.ENOENT
    shard = await d.ops.lookup(size_dir, names[0][:2], CTX)  # not an array: the whole way
    assert stat.S_ISDIR(shard.st_mode)


async def test_an_eviction_the_engine_has_not_noted_sends_an_open_the_whole_way(
    daemons: DaemonFactory, originals: Path
) -> None:
    # The store evicts in its own threads; until the engine notes it, a verified bit
    # may name a file that is gone. The hot path must not trust it then.
    d = daemons({"v1": originals}, max_store_bytes=npy_file_size(SIZE) + TRAILER_SIZE)
    first, second = "camera-gray", "chelsea-bmp"
    entry = (await d.lookup_path("v1", str(SIZE), f"{first}.npy")).st_ino
    assert await read_file(d, entry) == reference_npy(originals / "camera-gray.jpg", SIZE)
    await d.array("v1", SIZE, second)  # evicts the first; the engine notes it at its next open
    assert not d.entry_path("v1", SIZE, first).exists()
    assert len(d.store.capacity.evicted) == 1
    assert await read_file(d, entry) == reference_npy(originals / "camera-gray.jpg", SIZE)
    stats = d.stats()
    assert stats["decodes"] == 3  # decoded again, as a miss: no read of a file that is gone
    assert stats["misses"] == 3 and stats["hits"] == 0 and stats["memory_refills"] == 0


async def test_statfs_and_status_files(daemons: DaemonFactory, originals: Path) -> None:
    d = daemons({"v1": originals})
    for uuid in ("camera-gray", "chelsea-bmp"):
        await d.array("v1", SIZE, uuid)
    vfs = await d.ops.statfs(CTX)
    assert vfs.f_files == 2 and vfs.f_namemax == 255
    assert vfs.f_blocks == 2 * (npy_file_size(SIZE) + TRAILER_SIZE) // 4096
    attrs = await d.lookup_path(".decodefs", "stats.json")
    assert stat.S_ISREG(attrs.st_mode) and attrs.entry_timeout == attrs.attr_timeout == 0
    served = d.stats()["bytes_served"]
    stats = json.loads(await read_file(d, attrs.st_ino))
    assert stats["decodes"] == 2 and stats["store_entries"] == 2
    assert stats["bytes_served"] == served == d.stats()["bytes_served"]  # arrays only


async def test_an_unexpected_exception_is_eio_and_logged_once_not_per_call(
    daemons: DaemonFactory,
    originals: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("DECODEFS_FAILPOINT_OPEN", "camera-gray")  # read when DecodeFS starts
    d = daemons({"v1": originals})
    entry = (await d.lookup_path("v1", str(SIZE), "camera-gray.npy")).st_ino
    caplog.set_level(logging.DEBUG, logger="decodefs")
    for _ in range(1000):
        assert await fuse_errno(d.ops.open, entry, os.O_RDONLY, CTX) == errno.EIO
    assert d.stats()["errors"]["unexpected"] == 1000
    lines = [
        r for r in caplog.records if r.name == "decodefs.daemon.fs" and r.levelno >= logging.ERROR
    ]
    assert len(lines) == 1  # the first, with its traceback; the rest are folded
    assert lines[0].exc_info is not None and "unexpected error in open" in lines[0].getMessage()
    assert "failpoint" in caplog.text and "Traceback" in caplog.text
    # Another request is answered as usual.
    other = (await d.lookup_path("v1", str(SIZE), "camera-tiff.npy")).st_ino
    assert await read_file(d, other) == reference_npy(originals / "camera-tiff.TIFF", SIZE)


async def test_every_handle_is_released(daemons: DaemonFactory, originals: Path) -> None:
    d = daemons({"v1": originals}, max_store_bytes=1)  # the store takes nothing: all in memory
    inodes = [
        (await d.lookup_path("v1", str(SIZE), f"{p.stem}.npy")).st_ino
        for p in sorted(originals.iterdir())
    ]
    infos = [await d.ops.open(ino, os.O_RDONLY, CTX) for ino in inodes]
    assert all(d.store.capacity.pinned(d.key("v1", SIZE, p.stem)) for p in originals.iterdir())
    for info in infos:
        await d.ops.release(info.fh)
    await d.ops.release(123_456)  # one the kernel never had: nothing happens
    assert not any(d.store.capacity.pinned(d.key("v1", SIZE, p.stem)) for p in originals.iterdir())
    assert d.engine.memory.used == d.stats()["memory_cache_bytes"]
    assert Node.from_ino(inodes[0]).kind == Kind.ENTRY


@needs_root
async def test_with_access_originals_an_array_shows_its_originals_readers(
    daemons: DaemonFactory, photos: dict[str, Path]
) -> None:
    """Owner, group and read bits, from the original and the directories above it; a
    chmod is seen at the next start of a serving process (changed_in_place), and given
    to the stored entry too."""
    base = Path(tempfile.mkdtemp(prefix="decodefs-fs-"))  # every user may pass it
    try:
        os.chmod(base, 0o755)
        (base / "private").mkdir(mode=0o700)
        jpeg = next(p for p in photos.values() if p.suffix == ".jpg")
        for name, owner, group, mode in (
            ("team.jpg", 61234, 62345, 0o640),
            ("private/hidden.jpg", 61234, 62345, 0o644),
        ):
            shutil.copyfile(jpeg, base / name)
            os.chown(base / name, owner, group)
            os.chmod(base / name, mode)
        d = daemons({"v1": base}, access="originals", sizes=[SIZE])
        size_dir = await d.lookup_path("v1", str(SIZE))
        assert (size_dir.st_uid, stat.S_IMODE(size_dir.st_mode)) == (0, 0o555)  # the source's
        team = await d.lookup_path("v1", str(SIZE), "team.npy")
        assert (team.st_uid, team.st_gid, stat.S_IMODE(team.st_mode)) == (61234, 62345, 0o440)
        hidden = await d.ops.lookup(size_dir.st_ino, b"hidden.npy", CTX)  # the hot path
        assert (hidden.st_uid, stat.S_IMODE(hidden.st_mode)) == (61234, 0)  # in root's dir
        assert await read_file(d, team.st_ino) == reference_npy(jpeg, SIZE)  # stored
        entry = d.entry_path("v1", SIZE, "team")
        assert (entry.stat().st_gid, stat.S_IMODE(entry.stat().st_mode)) == (62345, 0o640)

        os.chmod(base / "team.jpg", 0o600)  # its group may no longer read it
        numbers = MountNumbers.positions(d.sources)
        changed, readers_changed = changed_in_place(d.config, d.store, d.sources, numbers)
        assert changed == {} and readers_changed == {"v1": [d.index("v1", "team")]}
        team = await d.ops.getattr(team.st_ino, CTX)
        assert (team.st_gid, stat.S_IMODE(team.st_mode)) == (62345, 0o400)
        assert stat.S_IMODE(entry.stat().st_mode) == 0o640  # the ACL's mask: its owner alone
        acl = os.getxattr(entry, ACL_XATTR)
        assert acl[4:] and all(
            perm == 0 for tag, perm, _ in struct.iter_unpack("<HHI", acl[4:]) if tag == 4
        )  # its group: nothing
    finally:
        shutil.rmtree(base, ignore_errors=True)
