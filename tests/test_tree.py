"""The namespace in-process: every name at every level, hostile ones included.

The originals here have the names a shared dataset directory can hold: invalid
UTF-8, U+10FFFF, one character, 251 bytes, names that look like sizes or
shards. A model built from the index says which names exist; hypothesis looks
up arbitrary byte strings, and arbitrary inode numbers, against it.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyfuse3
import pytest
import trio
from hypothesis import example, given
from hypothesis import strategies as st

from decodefs.common.config import parse_config
from decodefs.common.inodes import Kind, Node
from decodefs.common.protocol import NAME_MAX
from decodefs.common.source import restat_originals, scan_source
from decodefs.daemon.namespace import ROOT, STATUS_DIR_NODE, Tree
from tests import inprocess
from tests.conftest import needs_root
from tests.inprocess import CTX, InProcess

# File stems as bytes: what a directory of originals may hold.
HOSTILE_STEMS = [
    b"a",
    b"ab",
    b"abc",
    b"ab\xff",  # valid, then not UTF-8
    b"a\xf4\x8f\xbf\xbf",  # a, U+10FFFF: the shard "a\U0010ffff"
    b"a\xf4\x8f\xbf\xbfz",
    b"\xf4\x8f\xbf\xbf\xf4\x8f\xbf\xbf",
    b"\xf4\x8f\xbf\xbf",
    b"\xff\xfe",
    b"\xff",
    b"\xed\xa0\x80",  # an encoded surrogate: not UTF-8 either
    b"\xc3\xa91",  # e-acute, 1
    b"\xc3\xa9",
    "日本語".encode(),
    b"64",  # looks like a size
    b"0224",
    b"x.npy",
    b"a b",
    b"new\nline",
    b"back\\slash",
    b"%s%n",
    b"-dash",
    b"\x01ctrl",
    b"z" * 251,  # the longest: z...z.npy is NAME_MAX bytes
    b"0123456789abcdef0123456789abcdef",
]
SIZES = [224, 64]


@dataclass
class Model:
    """What exists, computed from the index alone (not by the tree's own code)."""

    versions: list[str]
    status: list[str]
    keys: dict[str, list[str]]
    min_size: int
    max_size: int

    def size_name(self, name: bytes) -> int | None:
        if re.fullmatch(rb"[1-9][0-9]*", name) and self.min_size <= int(name) <= self.max_size:
            return int(name)
        return None

    def shards(self, version: int) -> dict[bytes, int]:
        """Shard name -> its number: at a mount's first start, the shards in name order."""
        names = sorted({uuid[:2] for uuid in self.keys[self.versions[version]]})
        return {os.fsencode(name): number for number, name in enumerate(names)}

    def entries(self, version: int) -> dict[bytes, int]:
        uuids = self.keys[self.versions[version]]
        return {os.fsencode(u) + b".npy": i for i, u in enumerate(uuids)}

    def child(self, parent: Node, name: bytes) -> Node | None:
        if not self.exists(parent) or name in (b".", b".."):
            return None
        if parent == ROOT:
            if name == b".decodefs":
                return STATUS_DIR_NODE
            names = [v.encode() for v in self.versions]
            return Node(Kind.VERSION, names.index(name)) if name in names else None
        if parent == STATUS_DIR_NODE:
            names = [s.encode() for s in self.status]
            return Node(Kind.SPECIAL, number=3 + names.index(name)) if name in names else None
        if parent.kind == Kind.VERSION:
            size = self.size_name(name)
            return None if size is None else Node(Kind.SIZE, parent.version, size)
        if parent.kind in (Kind.SIZE, Kind.SHARD):
            index = self.entries(parent.version).get(name)
            if index is not None:
                uuids = self.keys[self.versions[parent.version]]
                shard = {n: name for name, n in self.shards(parent.version).items()}
                prefix = os.fsencode(uuids[index][:2])
                if parent.kind == Kind.SIZE or prefix == shard[parent.number]:
                    return Node(Kind.ENTRY, parent.version, parent.size, index)
                return None
            if parent.kind == Kind.SIZE and name in self.shards(parent.version):
                number = self.shards(parent.version)[name]
                return Node(Kind.SHARD, parent.version, parent.size, number)
        return None

    def exists(self, node: Node) -> bool:
        """Exactly the nodes a walk from the root by name reaches."""
        if node.kind == Kind.SPECIAL:
            return node in (ROOT, STATUS_DIR_NODE) or node in [
                Node(Kind.SPECIAL, number=3 + i) for i in range(len(self.status))
            ]
        if node.version >= len(self.versions):
            return False
        if node.kind == Kind.VERSION:
            return node == Node(Kind.VERSION, node.version)
        if not self.min_size <= node.size <= self.max_size:
            return False
        if node.kind == Kind.SIZE:
            return node.number == 0
        if node.kind == Kind.SHARD:
            return node.number in self.shards(node.version).values()
        if node.kind == Kind.FOLDER:  # only a mirror version has folders; these are uuid ones
            return False
        return node.number < len(self.keys[self.versions[node.version]])

    def is_dir(self, node: Node) -> bool:
        return node in (ROOT, STATUS_DIR_NODE) or node.kind in (Kind.VERSION, Kind.SIZE, Kind.SHARD)

    def parent(self, node: Node) -> Node:
        if node in (ROOT, STATUS_DIR_NODE) or node.kind == Kind.VERSION:
            return ROOT
        if node.kind == Kind.SPECIAL:
            return STATUS_DIR_NODE
        if node.kind == Kind.SIZE:
            return Node(Kind.VERSION, node.version)
        return Node(Kind.SIZE, node.version, node.size)


@dataclass
class Hostile:
    daemon: InProcess
    model: Model
    source: Path


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hostile]:
    base = tmp_path_factory.mktemp("hostile")
    source = base / "originals"
    source.mkdir()
    for stem in HOSTILE_STEMS:  # never decoded: lookups and listings do not read them
        os.close(os.open(os.path.join(os.fsencode(source), stem + b".jpg"), os.O_CREAT, 0o644))
    (base / "other").mkdir()
    (base / "other" / "only.png").write_bytes(b"")
    daemon = inprocess.start(
        base, {"v1": source, "v2": base / "other"}, sizes=SIZES, min_size=8, max_size=4096
    )
    try:
        model = Model(
            versions=["v1", "v2"],
            status=["stats.json", "config.json"],
            keys={v: list(daemon.sources[v].keys) for v in ("v1", "v2")},
            min_size=8,
            max_size=4096,
        )
        assert len(model.keys["v1"]) == len(HOSTILE_STEMS)  # every one indexed
        yield Hostile(daemon, model, source)
    finally:
        daemon.close()


# -- strategies ----------------------------------------------------------------------------

# Every code point a file name can carry: all of Unicode but surrogates, plus the
# surrogates that stand for undecodable bytes (surrogateescape).
CHARACTERS = st.one_of(
    st.characters(exclude_categories=["Cs"]),
    st.characters(min_codepoint=0xDC80, max_codepoint=0xDCFF),
)
ANY_NAME = st.one_of(
    st.binary(max_size=NAME_MAX + 20),
    st.text(CHARACTERS, max_size=80).map(os.fsencode),
    st.integers(0, NAME_MAX + 10).map(lambda n: b"z" * n),
    st.integers(NAME_MAX - 10, NAME_MAX + 10).map(lambda n: b"z" * (n - 4) + b".npy"),
    st.sampled_from([b".", b"..", b"", b"/", b"a/b", b"\0", b"a\0.npy", b".npy", b"..npy"]),
)


def names_like(valid: list[bytes]) -> st.SearchStrategy[bytes]:
    """Arbitrary names, valid ones, and valid ones a little changed."""
    near = st.tuples(st.sampled_from(valid), st.binary(max_size=4), st.integers(0, 3)).map(
        lambda t: (t[0][: -t[2]] if t[2] else t[0]) + t[1]
    )
    return st.one_of(ANY_NAME, st.sampled_from(valid), near)


def all_names(model: Model) -> list[bytes]:
    names = [v.encode() for v in model.versions] + [b".decodefs", b"224", b"4096", b"8"]
    names += [s.encode() for s in model.status]
    for version in range(len(model.versions)):
        names += list(model.entries(version)) + list(model.shards(version))
    return sorted(set(names))


HOSTILE_NAMES = names_like(
    [s + b".npy" for s in HOSTILE_STEMS]
    + [s[:2] for s in HOSTILE_STEMS]
    + [
        b"v1",
        b"v2",
        b".decodefs",
        b"stats.json",
        b"224",
        b"64",
        b"4096",
        b"8",
        b"a\xf4\x8f\xbf\xbf",
    ]
)

_FIELDS = st.tuples(
    st.integers(0, 15),  # kind: only 0-4 exist
    st.one_of(st.integers(0, 3), st.integers(0, 0xFFF)),
    st.one_of(st.sampled_from([0, 7, 8, 64, 224, 4096, 4097]), st.integers(0, 0x1FFF)),
    st.one_of(st.integers(0, len(HOSTILE_STEMS) + 2), st.integers(0, (1 << 35) - 1)),
)
INODES = st.one_of(
    st.integers(0, (1 << 64) - 1),
    _FIELDS.map(lambda f: (f[0] << 60) | (f[1] << 48) | (f[2] << 35) | f[3]),
)


# -- Tree.lookup at every level ---------------------------------------------------------------


def parents(hostile: Hostile) -> list[Node]:
    """A node at every level: root, status, versions, listed and unlisted sizes,
    every shard, an entry, and nodes that name nothing."""
    model = hostile.model
    found = [ROOT, STATUS_DIR_NODE, Node(Kind.VERSION, 0), Node(Kind.VERSION, 1)]
    for size in (224, 64, 8, 4096, 333):
        found.append(Node(Kind.SIZE, 0, size))
        found += [Node(Kind.SHARD, 0, size, i) for i in model.shards(0).values()]
    found += [Node(Kind.ENTRY, 0, 64, 3), Node(Kind.SHARD, 1, 64, 0)]
    found += [Node(Kind.VERSION, 7), Node(Kind.SIZE, 0, 4097), Node(Kind.SIZE, 9, 64)]
    found += [Node(Kind.SHARD, 0, 64, 2), Node(Kind.ENTRY, 0, 64, 10_000)]
    found += [Node(Kind.SPECIAL, 5, 0, 1), Node(Kind.SPECIAL, number=99)]
    return found


@given(data=st.data(), name=HOSTILE_NAMES)
@example(data=None, name=b"a\xf4\x8f\xbf\xbf")  # U+10FFFF second: no successor (was ValueError)
@example(data=None, name=b"\xf4\x8f\xbf\xbf\xf4\x8f\xbf\xbf")
@example(data=None, name=b"z" * 251 + b".npy")
@example(data=None, name=b"z" * 252 + b".npy")
def test_lookup_finds_exactly_the_names_that_exist(
    hostile: Hostile, data: st.DataObject | None, name: bytes
) -> None:
    tree, model = hostile.daemon.tree, hostile.model
    # With an explicit example, every parent; else one hypothesis picks.
    chosen = parents(hostile) if data is None else [data.draw(st.sampled_from(parents(hostile)))]
    for parent in chosen:
        assert tree.lookup(parent, name) == model.child(parent, name), (parent, name)


def test_every_name_that_exists_resolves_at_every_level(hostile: Hostile) -> None:
    tree, model = hostile.daemon.tree, hostile.model
    found = 0
    for parent in parents(hostile):
        for name in all_names(model):
            want = model.child(parent, name)
            assert tree.lookup(parent, name) == want, (parent, name)
            found += want is not None
    assert found > 2 * len(HOSTILE_STEMS) * 5  # entries under every size and shard


@given(node=INODES)
@example(node=(7 << 60))
@example(node=Node(Kind.SPECIAL, 5, 0, 1).ino)
@example(node=Node(Kind.SHARD, 0, 64, 2).ino)
def test_exists_is_exactly_what_a_walk_from_the_root_reaches(hostile: Hostile, node: int) -> None:
    try:
        parsed = Node.from_ino(node)
    except IndexError:  # no such kind
        return
    assert hostile.daemon.tree.exists(parsed) == hostile.model.exists(parsed)


@given(node=INODES)
@example(node=Node(Kind.ENTRY, 0, 64, len(HOSTILE_STEMS)).ino)  # one past the last original
@example(node=Node(Kind.ENTRY, 2, 64, 0).ino)  # no such version
@example(node=Node(Kind.ENTRY, 0, 7, 0).ino)  # a size below the bounds
def test_entry_names_exactly_the_arrays_that_exist(hostile: Hostile, node: int) -> None:
    # open's hot path resolves an inode without a Node; it must agree with the model.
    tree, model = hostile.daemon.tree, hostile.model
    try:
        parsed = Node.from_ino(node)
    except IndexError:
        parsed = None
    want = None
    if parsed is not None and parsed.kind == Kind.ENTRY and model.exists(parsed):
        want = (tree.version_name(parsed), parsed.size, parsed.number)
    assert tree.entry(node) == want


@given(data=st.data(), name=HOSTILE_NAMES)
def test_entry_below_finds_exactly_the_arrays_lookup_finds_in_a_size_directory(
    hostile: Hostile, data: st.DataObject, name: bytes
) -> None:
    # lookup's hot path resolves <uuid>.npy in a size directory without a Node.
    tree = hostile.daemon.tree
    parent = data.draw(st.sampled_from(parents(hostile)))
    node = tree.lookup(parent, name)
    want = node.ino if node is not None and node.kind == Kind.ENTRY else None
    got = tree.entry_below(parent.ino, name)
    if parent.kind == Kind.SIZE and parent.number == 0:
        assert got == want, (parent, name)
    else:
        assert got is None, (parent, name)


# -- listings ---------------------------------------------------------------------------------


def test_the_root_status_and_version_directories_list_their_children(hostile: Hostile) -> None:
    tree, model = hostile.daemon.tree, hostile.model
    root = list(tree.children(ROOT, 0))
    assert [name for _, name, _ in root] == [b"v1", b"v2", b".decodefs"]
    for offset, name, node in root:
        assert tree.lookup(ROOT, name) == node
        assert list(tree.children(ROOT, offset)) == root[offset:]  # resumes after it
    status = list(tree.children(STATUS_DIR_NODE, 0))
    assert [name for _, name, _ in status] == [s.encode() for s in model.status]
    assert all(tree.lookup(STATUS_DIR_NODE, name) == node for _, name, node in status)
    sizes = list(tree.children(Node(Kind.VERSION, 0), 0))
    assert [name for _, name, _ in sizes] == [b"64", b"224"]  # as configured (sorted)
    assert all(tree.lookup(Node(Kind.VERSION, 0), n) == node for _, n, node in sizes)
    assert tree.array_rows(ROOT, 0) is None and tree.array_rows(Node(Kind.VERSION, 0), 0) is None


@given(start=st.integers(0, len(HOSTILE_STEMS) + 5), size=st.sampled_from([224, 64, 9, 4096]))
def test_a_size_directory_lists_every_original_once_and_resumes(
    hostile: Hostile, start: int, size: int
) -> None:
    tree, model = hostile.daemon.tree, hostile.model
    directory = Node(Kind.SIZE, 0, size)
    rows = tree.array_rows(directory, start)
    assert rows is not None
    uuids = model.keys["v1"]
    assert list(rows.rows) == list(range(start, len(uuids)))
    for i in rows.rows:  # the listed name resolves to the listed inode
        name = os.fsencode(rows.keys[i]) + b".npy"
        assert tree.lookup(directory, name) == Node(Kind.ENTRY, 0, size, i)
        assert rows.base_ino | i == Node(Kind.ENTRY, 0, size, i).ino
    assert tree.attributes(rows.sample).size == 128 + size * size * 3


def test_a_shard_lists_its_entries_only(hostile: Hostile) -> None:
    tree, model = hostile.daemon.tree, hostile.model
    uuids = model.keys["v1"]
    listed: list[str] = []
    for shard_name, first in model.shards(0).items():
        shard = tree.lookup(Node(Kind.SIZE, 0, 64), shard_name)
        assert shard == Node(Kind.SHARD, 0, 64, first)
        rows = tree.array_rows(shard, 0)
        assert rows is not None
        members = [uuids[i] for i in rows.rows]
        assert members == [u for u in uuids if os.fsencode(u[:2]) == shard_name]
        assert all(tree.lookup(shard, os.fsencode(u) + b".npy") is not None for u in members)
        rows = tree.array_rows(shard, rows.rows.stop)  # resumed past its end: nothing
        assert rows is not None and not rows.rows
        listed += members
    assert sorted(listed) == sorted(uuids)  # every original in exactly one shard


def test_attributes_and_parents(hostile: Hostile) -> None:
    tree = hostile.daemon.tree
    for node in (ROOT, STATUS_DIR_NODE, Node(Kind.VERSION, 1), Node(Kind.SIZE, 0, 64)):
        attrs = tree.attributes(node)
        assert stat.S_ISDIR(attrs.mode) and stat.S_IMODE(attrs.mode) == 0o555
    entry = tree.attributes(Node(Kind.ENTRY, 0, 64, 0))
    assert stat.S_ISREG(entry.mode) and stat.S_IMODE(entry.mode) == 0o444
    assert entry.size == 128 + 64 * 64 * 3
    for node in parents(hostile):
        if hostile.model.exists(node):
            assert tree.parent(node) == hostile.model.parent(node)


# -- the operations class: lookup and getattr with any name and inode -------------------------


def fuse_errno(fn: object, *args: object) -> tuple[int, pyfuse3.EntryAttributes | None]:
    """(0, result) or (errno, None) of an operation, run in a fresh trio loop."""
    try:
        return 0, trio.run(fn, *args)  # type: ignore[arg-type]
    except pyfuse3.FUSEError as exc:
        return exc.errno, None


@given(
    parent=st.one_of(st.sampled_from([n.ino for n in (ROOT, STATUS_DIR_NODE)]), INODES),
    name=HOSTILE_NAMES,
)
@example(parent=Node(Kind.SIZE, 0, 64).ino, name=b"a\xf4\x8f\xbf\xbf")
@example(parent=Node(Kind.SIZE, 0, 64).ino, name=b"z" * 256)
@example(parent=Node(Kind.SIZE, 9, 64).ino, name=b"a.npy")  # no such version
@example(parent=7 << 60, name=b"v1")  # no such kind
@example(parent=ROOT.ino, name=b"..")
def test_fs_lookup_answers_the_right_node_or_a_clean_errno(
    hostile: Hostile, parent: int, name: bytes
) -> None:
    ops, model = hostile.daemon.ops, hostile.model
    code, attrs = fuse_errno(ops.lookup, parent, name, CTX)
    try:
        node = Node.from_ino(parent)
    except IndexError:
        node = None
    if node is None or not model.exists(node):
        assert code == errno.ENOENT
    elif len(name) > NAME_MAX:
        assert code == errno.ENAMETOOLONG
    else:
        if name == b".":
            want: Node | None = node
        elif name == b"..":
            want = model.parent(node)
        else:
            want = model.child(node, name)
        if want is None:
            assert code == errno.ENOENT, (node, name)
        else:
            assert code == 0 and attrs is not None
            assert attrs.st_ino == want.ino
            assert stat.S_ISDIR(attrs.st_mode) == model.is_dir(want)
    assert "unexpected" not in hostile.daemon.stats()["errors"]


@given(inode=INODES)
@example(inode=7 << 60)
@example(inode=(1 << 64) - 1)
@example(inode=Node(Kind.VERSION, 9).ino)
@example(inode=Node(Kind.ENTRY, 0, 64, 10_000).ino)
@example(inode=Node(Kind.SHARD, 0, 64, 2).ino)
def test_fs_getattr_of_any_inode_is_its_attributes_or_enoent(hostile: Hostile, inode: int) -> None:
    ops, model = hostile.daemon.ops, hostile.model
    code, attrs = fuse_errno(ops.getattr, inode, CTX)
    try:
        node: Node | None = Node.from_ino(inode)
    except IndexError:
        node = None
    if node is not None and model.exists(node):
        assert code == 0 and attrs is not None and attrs.st_ino == inode
        assert stat.S_ISDIR(attrs.st_mode) == model.is_dir(node)
    else:
        assert code == errno.ENOENT
    assert "unexpected" not in hostile.daemon.stats()["errors"]


@needs_root
def test_with_access_originals_a_mirrors_folders_show_their_source_directories() -> None:
    base = Path(tempfile.mkdtemp(prefix="decodefs-tree-"))  # every user may pass it
    try:
        os.chmod(base, 0o755)
        for folder, owner, group, mode in (("cat", 61234, 62345, 0o750), ("dog", 0, 0, 0o700)):
            (base / folder).mkdir()
            (base / folder / "0001.jpg").write_bytes(b"never decoded here")
            os.chown(base / folder, owner, group)
            os.chmod(base / folder, mode)
        config = parse_config(
            {"store": "/nonexistent", "access": "originals",
             "versions": {"v1": {"source": str(base), "layout": "mirror"}}},
            base_dir=base,
        )  # fmt: skip
        index = scan_source("v1", base, {"jpg"}, layout="mirror")
        restat_originals(index)
        tree = Tree(config, {"v1": index})
        size = tree.lookup(Node(Kind.VERSION, 0), b"224")
        assert size is not None
        seen = {}
        for name in (b"cat", b"dog"):
            node = tree.lookup(size, name)
            assert node is not None and node.kind == Kind.FOLDER
            attrs = tree.attributes(node)
            seen[name] = (attrs.uid, attrs.gid, stat.S_IMODE(attrs.mode))
        assert seen == {b"cat": (61234, 62345, 0o550), b"dog": (0, 0, 0o500)}
        attrs = tree.attributes(size)  # the source itself
        assert (attrs.uid, stat.S_IMODE(attrs.mode)) == (0, 0o555)
    finally:
        shutil.rmtree(base, ignore_errors=True)
