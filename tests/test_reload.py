"""What a new serving process carries over and tells the kernel to forget, in-process.

Across two serving processes of one mount (two loads of the mount's numbers from
one state directory, real stores and decodes): what the first verified is taken
by the second for its versions decoded the same way, by inode number though
positions moved; and a reload forgets exactly the names that went away and the
pages of the arrays whose pixels change, in every size the mount has seen. The
kernel's side is recorded here; tests/test_mount_handover.py shows it on a mount.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from decodefs.common.inodes import Kind, Node
from decodefs.common.source import SourceIndex
from decodefs.daemon.carryover import mark_verified, read_verified, save_verified
from decodefs.daemon.namespace import ROOT
from decodefs.daemon.numbers import MountNumbers
from decodefs.daemon.reload import Reload
from tests.conftest import DaemonFactory

SIZE = 64


async def test_the_next_serving_process_takes_what_the_last_one_verified(
    daemons: DaemonFactory, originals: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    store = tmp_path / "shared-store"
    first = daemons({"v1": originals}, store=store, version_keys={"sizes": [SIZE]})
    digests = first.store.digests()
    numbers, _ = MountNumbers.load(str(state), first.sources, digests, first=True)
    read = ["camera-gray", "rocket-cmyk"]
    for uuid in read:
        await first.array("v1", SIZE, uuid)
    save_verified(str(state), first.engine.known, numbers, digests)
    first.close()
    # A new original that sorts first: every position moves, no number does.
    shutil.copy(originals / "camera-gray.jpg", originals / "0-first.jpg")
    second = daemons({"v1": originals}, store=store, version_keys={"sizes": [SIZE]})
    again, _ = MountNumbers.load(str(state), second.sources, digests, first=False)
    value = read_verified(str(state))
    assert mark_verified(value, second.engine.known, again, {"v1": "decoded another way"}) == 0
    stale = {"v1": [second.index("v1", "rocket-cmyk")]}  # its original changed meanwhile
    assert mark_verified(value, second.engine.known, again, digests, stale) == 1
    verified = second.engine.known.verified_map("v1", SIZE)
    assert [uuid for uuid in second.sources["v1"].keys if verified[second.index("v1", uuid)]] == [
        "camera-gray"
    ]
    assert await second.array("v1", SIZE, "camera-gray")
    assert second.engine.metrics.hits == 1 and second.engine.metrics.decodes == 0


def index_of(version: str, keys: set[str]) -> SourceIndex:
    ordered = sorted(keys)
    return SourceIndex(version, "/nonexistent", ordered, [f"{k}.jpg" for k in ordered], 1)


def test_a_reload_forgets_what_went_away_and_the_pages_of_what_changed(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    before = {
        "v1": index_of("v1", {"ax0", "ax1", "by0"}),
        "v2": index_of("v2", {"ax0"}),
        "v3": index_of("v3", {"cz0", "cz1"}),
    }
    numbers, _ = MountNumbers.load(str(state), before, {v: "d" for v in before}, first=True)
    numbers.save_applied()  # the first serving process serves
    for version, size in [("v1", 64), ("v1", 224), ("v3", 32)]:
        numbers.save_size(version, size)
    ids = dict(numbers.ids)
    after = {"v1": index_of("v1", {"ax0", "by0", "by1"}), "v3": index_of("v3", {"cz0", "cz1"})}
    digests = {"v1": "d", "v3": "decoded another way"}
    numbers, changes = MountNumbers.load(str(state), after, digests, first=False)
    reload = Reload(numbers, changes, after, changed={"v1": [after["v1"].find("by0") or 0]})
    names: list[tuple[int, bytes]] = []
    inodes: list[tuple[int, bool]] = []

    def forget_name(parent: int, name: bytes) -> bool:
        names.append((parent, name))
        return True

    def forget_inode(inode: int, *, attributes_only: bool = False) -> bool:
        inodes.append((inode, attributes_only))
        return True

    reload.invalidate((forget_name, forget_inode))
    v1, v3 = ids["v1"], ids["v3"]
    gone = numbers.versions["v1"].shards.number("ax")
    assert gone is not None
    assert sorted(names) == sorted(
        [
            (ROOT.ino, b"v2"),  # a version removed
            *[(Node(Kind.SIZE, v1, size).ino, b"ax1.npy") for size in (64, 224)],  # an original
            *[(Node(Kind.SHARD, v1, size, gone).ino, b"ax1.npy") for size in (64, 224)],
        ]
    )
    pages = {inode for inode, attributes_only in inodes if not attributes_only}
    by0 = numbers.versions["v1"].key_numbers[after["v1"].find("by0") or 0]
    assert pages == {
        *[Node(Kind.ENTRY, v1, size, by0).ino for size in (64, 224)],  # changed in place
        *[Node(Kind.ENTRY, v3, 32, n).ino for n in numbers.versions["v3"].key_numbers],  # redecoded
    }
    assert (ROOT.ino, True) in inodes and (Node(Kind.SIZE, v1, 64).ino, True) in inodes
    assert reload.describe() == [
        "version v2 removed",
        "version v3: decode settings changed; its stored arrays are discarded and decoded again",
        "version v1: 1 originals added, 1 removed, 1 changed in place",
    ]


def test_a_mounts_first_serving_process_forgets_pages_but_no_directory_attributes(
    tmp_path: Path,
) -> None:
    """A new mount's first serving process gave every attribute the kernel holds: it
    forgets the pages of arrays changed in place (after a crash) but no directory's
    attributes, whose forgetting races the kernel's first look-ups (reload.py)."""
    state = tmp_path / "state"
    state.mkdir()
    sources = {"v1": index_of("v1", {"ax0", "ax1"})}
    numbers, _ = MountNumbers.load(str(state), sources, {"v1": "d"}, first=True)
    numbers.save_applied()
    numbers.save_size("v1", 64)
    inodes: list[tuple[int, bool]] = []

    def forget_inode(inode: int, *, attributes_only: bool = False) -> bool:
        inodes.append((inode, attributes_only))
        return True

    for first in (True, False):
        numbers, changes = MountNumbers.load(str(state), sources, {"v1": "d"}, first=first)
        changed = {"v1": [sources["v1"].find("ax1") or 0]}
        reload = Reload(numbers, changes, sources, changed=changed, directories_seen=not first)
        inodes.clear()
        reload.invalidate((lambda parent, name: True, forget_inode))
        v1 = numbers.ids["v1"]
        ax1 = numbers.versions["v1"].key_numbers[sources["v1"].find("ax1") or 0]
        assert (Node(Kind.ENTRY, v1, 64, ax1).ino, False) in inodes  # its pages, either way
        directories = [(ROOT.ino, True), (Node(Kind.VERSION, v1).ino, True)]
        directories.append((Node(Kind.SIZE, v1, 64).ino, True))
        assert all((d in inodes) is not first for d in directories), first
