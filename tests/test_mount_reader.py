"""read_array(): direct, verified reads of stored arrays, and every way back to the mount."""

from __future__ import annotations

import errno
import io
import multiprocessing
import os
import shutil
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from decodefs import read_array
from decodefs.client import discovery, hits
from decodefs.common.protocol import TRAILER_SIZE
from tests.conftest import MountFactory, Tmpfs, needs_root
from tests.helpers import (
    Mount,
    decodefs,
    reference_npy,
    unmount_quietly,
    wait_until,
    write_config,
)


def as_npy(array: npt.NDArray[np.uint8]) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def entry_file(store: Path, size: int, uuid: str) -> Path:
    return store / "v1" / str(size) / uuid[:2] / f"{uuid}.npy"


def test_same_arrays_as_np_load_and_hits_skip_the_daemon(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path]
) -> None:
    mount = mounts({"v1": photos_dir})
    for uuid, path in photos.items():  # misses: through the mount, which decodes and stores
        array = read_array(mount.path("v1", "224", f"{uuid}.npy"))
        assert as_npy(array) == reference_npy(path, 224)
    after_misses = mount.stats()
    assert after_misses["decodes"] == after_misses["misses"] == len(photos)

    for uuid, path in photos.items():  # hits: straight from the store, both layouts
        for flat in (True, False):
            file = (
                mount.path("v1", "224", f"{uuid}.npy")
                if flat
                else mount.path("v1", "224", uuid[:2], f"{uuid}.npy")
            )
            array = read_array(file)
            assert array.dtype == np.uint8 and array.shape == (224, 224, 3)
            assert array.flags.writeable and array.flags.c_contiguous
            assert as_npy(array) == reference_npy(path, 224)
            assert np.array_equal(array, np.load(file))
    after_hits = mount.stats()
    # np.load above went through the daemon; read_array's hits did not.
    assert after_hits["hits"] - after_misses["hits"] == 2 * len(photos)
    assert after_hits["decodes"] == len(photos)


def test_direct_hits_are_reported_for_lru(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path]
) -> None:
    entry = 128 + 64 * 64 * 3 + TRAILER_SIZE
    mount = mounts({"v1": photos_dir}, max_store_bytes=3 * entry)
    first, *others = sorted(photos)
    for uuid in [first, others[0], others[1]]:
        read_array(mount.path("v1", "64", f"{uuid}.npy"))
    read_array(mount.path("v1", "64", f"{first}.npy"))  # a direct hit
    hits.flush_reports()  # reported now, not at the reader's next report
    wait_until(lambda: mount.stats()["direct_hits"] >= 1, 10, "the report to arrive")
    read_array(mount.path("v1", "64", f"{others[2]}.npy"))  # a miss that evicts the oldest
    store = mount.config.parent / "store"
    assert entry_file(store, 64, first).exists()  # recently read directly: kept
    assert not entry_file(store, 64, others[0]).exists()


def test_a_damaged_entry_is_never_returned_and_gets_repaired(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path]
) -> None:
    mount = mounts({"v1": photos_dir})
    uuid, original = next(iter(photos.items()))
    target = mount.path("v1", "224", f"{uuid}.npy")
    read_array(target)  # stored, and verified by the daemon in its life
    stored = entry_file(mount.config.parent / "store", 224, uuid)
    data = bytearray(stored.read_bytes())
    data[1000] ^= 0x01
    stored.write_bytes(bytes(data))
    with open(stored, "rb") as f:  # on the disk alone: no page-cache rescue (but on a tmpfs)
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    assert as_npy(read_array(target)) == reference_npy(original, 224)
    assert mount.stats()["corrupt_entries"] == 1  # the daemon checked again (O_SYNC) and rebuilt
    assert stored.read_bytes()[:-TRAILER_SIZE] == reference_npy(original, 224)


def test_an_evicted_or_missing_entry_falls_back_to_the_mount(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path]
) -> None:
    mount = mounts({"v1": photos_dir})
    uuid, original = next(iter(photos.items()))
    read_array(mount.path("v1", "96", f"{uuid}.npy"))
    entry_file(mount.config.parent / "store", 96, uuid).unlink()  # as an eviction would
    assert as_npy(read_array(mount.path("v1", "96", f"{uuid}.npy"))) == reference_npy(original, 96)


def test_worker_processes_read_too(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path]
) -> None:
    mount = mounts({"v1": photos_dir})
    paths = [str(mount.path("v1", "128", f"{uuid}.npy")) for uuid in sorted(photos)]
    read_array(paths[0])  # the parent has a mount context and a report socket before forking
    with multiprocessing.get_context("fork").Pool(3) as pool:
        sums = pool.map(_checksum, paths * 2)
    for uuid, total in zip(sorted(photos) * 2, sums, strict=True):
        assert total == int(
            np.load(io.BytesIO(reference_npy(photos[uuid], 128))).astype(np.int64).sum()
        )


def _checksum(path: str) -> int:
    return int(read_array(path).astype(np.int64).sum())


def test_paths_outside_decodefs_are_np_load(tmp_path: Path) -> None:
    array = np.arange(60, dtype=np.uint8).reshape(2, 10, 3)
    np.save(tmp_path / "plain.npy", array)
    assert np.array_equal(read_array(tmp_path / "plain.npy"), array)


@pytest.fixture
def shared_dir(shared_tmp: Path) -> Iterator[Path]:
    """A directory every user can reach, in this test's tmp_path; unmounted at the end."""
    try:
        yield shared_tmp
    finally:
        unmount_quietly(shared_tmp / "mnt")


@needs_root
def test_a_user_who_may_not_read_the_store_reads_through_the_mount(
    photos_dir: Path, photos: dict[str, Path], shared_dir: Path, tmp_path: Path
) -> None:
    store = tmp_path / "store"  # under root-only tmp_path: other users cannot read it
    config = write_config(tmp_path / "c.toml", store, {"v1": photos_dir}, access="everyone")
    (shared_dir / "mnt").mkdir(mode=0o755)
    assert (
        decodefs(
            "mount", shared_dir / "mnt", "--config", config, "--log-file", tmp_path / "log"
        ).returncode
        == 0
    )
    mount = Mount(shared_dir / "mnt", config, tmp_path / "log")
    uuid, original = next(iter(photos.items()))
    target = mount.path("v1", "64", f"{uuid}.npy")
    read_array(target)  # stored
    script = (
        "import sys; from decodefs import read_array; "
        "sys.stdout.buffer.write(read_array(sys.argv[1]).tobytes())"
    )
    result = subprocess.run(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            sys.executable,
            "-c",
            script,
            str(target),
        ],
        capture_output=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == np.load(io.BytesIO(reference_npy(original, 64))).tobytes()
    assert decodefs("umount", shared_dir / "mnt").returncode == 0


def test_garbage_on_the_report_socket_changes_nothing(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path]
) -> None:
    mount = mounts({"v1": photos_dir})
    uuid, original = next(iter(photos.items()))
    read_array(mount.path("v1", "64", f"{uuid}.npy"))  # stored
    address = str(mount.config.parent / "store" / ".access.sock")
    garbage = [
        b"v1\t" + b"9" * 5000 + b"\t" + uuid.encode(),  # int() refuses that many digits
        b"v1\t0064\t" + uuid.encode(),  # not the canonical name of a size
        b"v1\t4097\t" + uuid.encode(),  # above max_size
        b"v1\t64\tno-such-uuid\nnope\t64\t" + uuid.encode(),
        b"v1\t0064\tno-such-uuid\t" + uuid.encode(),  # many keys, a size not canonical
        b"\xff\xfe\t\x00\t\x80\n" * 100,
        os.urandom(60000),
        b"",
    ]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        for datagram in garbage:
            sock.sendto(datagram, address)
        # The one real report, in a line of several keys as a batch's hits are reported
        sock.sendto(f"v1\t64\tno-such-uuid\t{uuid}\n".encode(), address)
    wait_until(lambda: mount.stats()["direct_hits"] >= 1, 10, "the one real report")
    assert mount.stats()["direct_hits"] == 1
    assert np.array_equal(
        np.load(mount.path("v1", "96", f"{uuid}.npy")),
        np.load(io.BytesIO(reference_npy(original, 96))),
    )


def test_only_names_the_mount_has_are_read(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path]
) -> None:
    mount = mounts({"v1": photos_dir})
    uuid = next(iter(photos))
    read_array(mount.path("v1", "224", f"{uuid}.npy"))  # stored as 224
    for name in (("0224", f"{uuid}.npy"), ("224", "xx", f"{uuid}.npy"), ("224", "absent.npy")):
        with pytest.raises(FileNotFoundError):
            read_array(mount.path("v1", *name))
    # Each says what is missing, not only that something is.
    missing = {
        ("v1", "5000", f"{uuid}.npy"): r"v1 has no size 5000: .* \(8 to 4096\)",
        ("v9", "224", f"{uuid}.npy"): r"has no version 'v9' \(it has: v1\)",
        ("v1", "224", "absent.npy"): r"v1 has no original 'absent' \(decodefs.list_keys",
        ("v1", "0224", f"{uuid}.npy"): r"v1 has no size '0224'",
    }
    for name, reason in missing.items():
        with pytest.raises(FileNotFoundError, match=reason) as raised:
            read_array(mount.path(*name))
        assert raised.value.errno == errno.ENOENT and raised.value.filename == str(
            mount.path(*name)
        )
    with pytest.raises(FileNotFoundError, match=r"No such file or directory") as raised:
        read_array(mount.mountpoint.parent / "absent.npy")  # on no mount: as open() says


def test_an_original_gone_at_a_remount_is_gone_for_read_array(
    mounts: MountFactory, tmp_path: Path, photos: dict[str, Path]
) -> None:
    source = tmp_path / "originals"
    source.mkdir()
    uuid, original = next(iter(photos.items()))
    shutil.copy(original, source / original.name)
    mount = mounts({"v1": source})
    target = mount.path("v1", "64", f"{uuid}.npy")
    read_array(target)
    read_array(target)  # a direct hit: the mount is known to this process
    mount.stop()
    (source / original.name).unlink()
    mounts({"v1": source})  # the same mount point and store: the entry is still stored
    assert entry_file(mount.config.parent / "store", 64, uuid).exists()
    with pytest.raises(FileNotFoundError):
        read_array(target)


def test_a_store_json_outside_a_decodefs_mount_is_not_trusted(
    mounts: MountFactory, tmp_path: Path, photos_dir: Path, photos: dict[str, Path]
) -> None:
    """A directory laid out like a mount, with a store.json pointing at a real
    store whose entry differs from the file there: read_array reads the file."""
    mount = mounts({"v1": photos_dir})
    uuid = next(iter(photos))
    read_array(mount.path("v1", "64", f"{uuid}.npy"))  # a genuine stored entry
    status = mount.path(".decodefs", "store.json").read_bytes()
    fake = tmp_path / "fake"
    (fake / ".decodefs").mkdir(parents=True)
    (fake / ".decodefs" / "store.json").write_bytes(status)
    (fake / "v1" / "64").mkdir(parents=True)
    decoy = np.zeros((64, 64, 3), dtype=np.uint8)
    np.save(fake / "v1" / "64" / f"{uuid}.npy", decoy)
    assert np.array_equal(read_array(fake / "v1" / "64" / f"{uuid}.npy"), decoy)


def test_symlinked_roots_and_uuids_like_size_names_read_directly(
    mounts: MountFactory, tmp_path: Path, photos: dict[str, Path]
) -> None:
    source = tmp_path / "originals"
    source.mkdir()
    original = next(iter(photos.values()))
    uuid = "64" + original.stem  # starts with the name of the size it is read at
    shutil.copy(original, source / f"{uuid}{original.suffix}")
    mount = mounts({"v1": source})
    link = tmp_path / "dataset"
    link.symlink_to(mount.path("v1"))
    want = np.load(io.BytesIO(reference_npy(original, 64)))
    read_array(mount.path("v1", "64", f"{uuid}.npy"))  # a miss: stored
    hits = mount.stats()["hits"]
    for path in (
        mount.path("v1", "64", f"{uuid}.npy"),
        mount.path("v1", "64", "64", f"{uuid}.npy"),
        link / "64" / f"{uuid}.npy",
    ):
        assert np.array_equal(read_array(path), want)
    assert mount.stats()["hits"] == hits  # all three straight from the store


def test_a_store_or_entry_others_may_write_to_is_not_read_directly(
    mounts: MountFactory, photos_dir: Path, photos: dict[str, Path]
) -> None:
    mount = mounts({"v1": photos_dir})
    (first, original), (second, _) = list(photos.items())[:2]
    for uuid in (first, second):
        read_array(mount.path("v1", "64", f"{uuid}.npy"))  # stored
    store = mount.config.parent / "store"
    assert stat.S_IMODE(os.stat(entry_file(store, 64, first)).st_mode) == 0o600  # root's originals

    os.chmod(entry_file(store, 64, first), 0o620)  # a group may rewrite it
    hits = mount.stats()["hits"]
    assert as_npy(read_array(mount.path("v1", "64", f"{first}.npy"))) == reference_npy(original, 64)
    read_array(mount.path("v1", "64", f"{second}.npy"))  # still direct
    assert mount.stats()["hits"] == hits + 1  # the first went through the daemon

    os.chmod(store, 0o777)
    discovery.forget_mounts()  # as a new process would: read store.json again
    read_array(mount.path("v1", "64", f"{second}.npy"))
    assert mount.stats()["hits"] == hits + 2


def test_the_kernels_answer_decides_the_version_not_the_paths_text(
    mounts: MountFactory, tmp_path: Path, photos: dict[str, Path]
) -> None:
    """A symlink retargeted from one version to another, and ``..`` after a
    symlink: read_array reads what open() would."""
    (uuid, first), (_, second) = list(photos.items())[:2]
    sources = {}
    for version, original in (("v1", first), ("v2", second)):  # one uuid, other pixels
        sources[version] = tmp_path / version
        sources[version].mkdir()
        shutil.copy(original, sources[version] / f"{uuid}{original.suffix}")
    mount = mounts(sources)
    want = {
        v: np.load(io.BytesIO(reference_npy(o, 64))) for v, o in (("v1", first), ("v2", second))
    }
    link = tmp_path / "current"
    link.symlink_to(mount.path("v1", "64"))
    assert np.array_equal(read_array(link / f"{uuid}.npy"), want["v1"])
    assert np.array_equal(read_array(link / f"{uuid}.npy"), want["v1"])  # a direct hit
    link.unlink()
    link.symlink_to(mount.path("v2", "64"))
    assert np.array_equal(read_array(link / f"{uuid}.npy"), want["v2"])
    assert np.array_equal(read_array(link / f"{uuid}.npy"), want["v2"])

    # <mount>/v2/64/../64 by the kernel's rules, not <tmp>/64 by the text's.
    dotdot = f"{link}/../64/{uuid}.npy"
    assert np.array_equal(read_array(dotdot), np.load(dotdot))


@needs_root  # it holds device numbers with tmpfs mounts
def test_a_new_mount_on_a_reused_device_number_is_noticed(
    mounts: MountFactory, tmp_path: Path, photos_dir: Path, photos: dict[str, Path], tmpfs: Tmpfs
) -> None:
    """Same mount point, another store: direct hits read, and report to, the new one."""
    uuid = next(iter(photos))
    first = mounts({"v1": photos_dir}, store=tmp_path / "store-1")
    target = first.path("v1", "64", f"{uuid}.npy")
    read_array(target)
    read_array(target)  # this process now knows the first mount and its store
    device = os.stat(first.mountpoint).st_dev
    first.stop()
    for attempt in range(1, 6):  # another process's mount may take the number first
        leave_the_lowest_free(device, tmpfs)
        second = mounts({"v1": photos_dir}, store=tmp_path / "store-2")
        if os.stat(second.mountpoint).st_dev == device or attempt == 5:
            break
        second.stop()
    read_array(target)  # a miss in the new store: decoded and stored there
    read_array(target)  # a direct hit in store-2
    hits.flush_reports()
    wait_until(lambda: second.stats()["direct_hits"] >= 1, 10, "the report to the new mount")
    assert second.stats()["direct_hits"] == 1
    if os.stat(second.mountpoint).st_dev != device:
        pytest.skip("another process's mount took the device number between the two mounts")


def leave_the_lowest_free(device: int, tmpfs: Tmpfs) -> None:
    """Make ``device`` (a mount's, now unmounted) the lowest free anonymous device number,
    the one the kernel gives the next mount: other tests' mounts come and go meanwhile,
    and any lower number they freed is taken by a tmpfs, held until the test ends."""
    while True:
        probe = tmpfs("4k")
        got = os.stat(probe).st_dev
        if os.minor(got) >= os.minor(device):  # none lower is free: this one, or it is taken
            subprocess.run(["umount", str(probe)], check=True)
            return


def test_a_mount_found_by_two_threads_at_once_is_one_object(
    mounts: MountFactory, photos_dir: Path
) -> None:
    """A reader keeps its files while the mount is the same object: two threads that
    both find a restarted mount anew must not make it two (the loser lets go of its
    files)."""
    mount = mounts({"v1": photos_dir})
    device = os.stat(mount.mountpoint).st_dev
    found = discovery.readable_mount(device)
    assert found is not None and found.root == str(mount.mountpoint)
    # What the second thread does: it too saw the old mount gone and looks again.
    assert discovery._mount_of(device, again=True) is found
    assert discovery.readable_mount(device) is found


def test_reports_go_in_datagrams_the_daemon_reads_whole(tmp_path: Path) -> None:
    # In process: a real datagram socket stands where the daemon listens.
    from decodefs.common.entry import EntryKey
    from decodefs.common.protocol import ACCESS_REPORT_MAX, encode_accesses, parse_access_report

    address = str(tmp_path / "access.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(address)
        keys = [EntryKey("v1", 224, f"{i:032x}") for i in range(3000)]
        keys.append(EntryKey("v1", 224, "deep/" * 700 + "x"))  # a long key
        reporter = hits.HitReporter()
        for key in keys:
            reporter.report(address, key)  # the 1024th sends what came so far
        batch = [EntryKey("v1", 96, f"{i:032x}") for i in range(64)]  # a batch's hits, one line
        head = b"v1\t96\t"
        reporter.report_lines(address, encode_accesses(head, [k.key.encode() for k in batch]), 64)
        reporter.flush()
        listener.setblocking(False)
        datagrams = []
        while True:
            try:
                datagrams.append(listener.recv(ACCESS_REPORT_MAX + 1))
            except BlockingIOError:
                break
    assert all(0 < len(d) <= ACCESS_REPORT_MAX for d in datagrams)
    assert len(datagrams) >= 3000 * 42 // ACCESS_REPORT_MAX
    got = [EntryKey(*line) for d in datagrams for line in parse_access_report(d)]
    assert got == keys + batch


def test_a_report_line_of_many_keys_leaves_out_keys_no_line_can_hold() -> None:
    from decodefs.common.protocol import (
        ACCESS_LINE_MAX,
        encode_accesses,
        parse_access_groups,
    )

    head = b"v1\t224\t"
    keys = [b"a", b"b/c d", b"tab\there", b"line\nbreak", b"cr\rhere", "\u00e9".encode(), b"\xff"]
    report = encode_accesses(head, keys)
    assert report.count(b"\n") == 1  # one line for the batch
    want = ["a", "b/c d", "\u00e9", os.fsdecode(b"\xff")]  # the tab, \n and \r keys left out
    assert parse_access_groups(report) == {("v1", 224): want}
    assert encode_accesses(head, [b"x\ty", b"\n"]) == b""  # nothing left: no line
    long = [b"k" * 1000 for _ in range(2 * ACCESS_LINE_MAX // 1000)]  # past a line: one each
    report = encode_accesses(head, long)
    assert report.count(b"\n") == len(long)
    assert parse_access_groups(report) == {("v1", 224): [k.decode() for k in long]}
    # One key per line, as read_array reports, and lines of many keys mix in a datagram.
    mixed = b"v1\t224\ta\nv1\t96\tb\tc\nv1\t224\td\te\n"
    assert parse_access_groups(mixed) == {("v1", 224): ["a", "d", "e"], ("v1", 96): ["b", "c"]}
