"""layout = "mirror", in process: the index of relative paths, the namespace, the store's
paths for keys with "/", the reader's protocol, and an engine serving a mirror entry."""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import trio

from decodefs.client.warm import read_key_list
from decodefs.common.config import DEFAULT_EXTENSIONS, ConfigError, load_config, parse_config
from decodefs.common.decode import DecodeSettings, decoder_fingerprint
from decodefs.common.entry import EntryKey
from decodefs.common.npy import npy_bytes, npy_file_size
from decodefs.common.protocol import StoreStatus
from decodefs.common.source import SourceError, SourceIndex, scan_source
from decodefs.daemon.engine import Engine
from decodefs.daemon.namespace import ROOT, Kind, Node, Tree
from decodefs.store.store import CorruptEntry, Store
from decodefs.store.walk import iter_entries
from tests.helpers import SKIMAGE_DATA, reference_npy

V1 = decoder_fingerprint(DecodeSettings())


def touch(path: Path, data: bytes = b"x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def make_old(root: Path) -> None:
    """Give every directory under ``root`` an mtime the index cache trusts."""
    old = time.time() - 60
    for directory, _, _ in os.walk(root):
        os.utime(directory, (old, old))


def classes(root: Path) -> Path:
    """Class folders whose file names repeat, nested folders, odd names, litter."""
    for name in [
        "cat/0001.jpg",
        "cat/0002.PNG",  # upper-case extension
        "dog/0001.jpg",  # the same name in another class
        "dog/0002.jpeg",
        "0001.jpg",  # and at the top
        "a/b/c/x.jpg",
        "with space/two words.jpg",
        "cat/.hidden.jpg",
        ".git/objects/1.jpg",
        "cat/notes.txt",
        "docs/readme.md",  # a folder with no originals is still a folder
    ]:
        touch(root / name)
    (root / "empty").mkdir()
    return root


def mirror(root: Path, **kwargs: object) -> SourceIndex:
    return scan_source("v1", root, DEFAULT_EXTENSIONS, layout="mirror", **kwargs)  # type: ignore[arg-type]


# -- the index ---------------------------------------------------------------------


def test_keys_are_relative_paths_and_every_folder_is_one(tmp_path: Path) -> None:
    index = mirror(classes(tmp_path / "src"))
    assert index.layout == "mirror"
    assert list(index.keys) == [
        "0001",
        "a/b/c/x",
        "cat/0001",
        "cat/0002",
        "dog/0001",
        "dog/0002",
        "with space/two words",
    ]
    assert index.relpaths[index.find("cat/0002") or 0] == "cat/0002.PNG"
    assert index.original_path(index.find("dog/0001") or 0) == str(tmp_path / "src/dog/0001.jpg")
    assert index.mirror is not None
    assert index.mirror.paths == [
        "",
        "a",
        "a/b",
        "a/b/c",
        "cat",
        "docs",
        "dog",
        "empty",
        "with space",
    ]
    folders = index.mirror.folders
    assert folders[0].subfolders == (
        ("a", 1),
        ("cat", 4),
        ("docs", 5),
        ("dog", 6),
        ("empty", 7),
        ("with space", 8),
    )
    for number, folder in enumerate(folders):
        # Each folder's originals are one run of indices, sorted by name.
        inside = [k for k in index.keys if k.rpartition("/")[0] == folder.path]
        assert [index.keys[i] for i in folder.files] == sorted(inside)
        for name, child in folder.subfolders:
            assert folders[child].parent == number
            assert folders[child].path == f"{folder.path}/{name}".lstrip("/")
    assert folders[index.mirror.find("empty") or 0].files == range(0)
    assert index.mirror.find("cat/0001") is None and index.mirror.find(".git") is None


def test_a_uuid_version_of_the_same_source_refuses_the_repeated_names(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="'0001'"):
        scan_source("v1", classes(tmp_path / "src"), DEFAULT_EXTENSIONS)


def test_a_clash_in_one_folder_is_an_error_or_left_out(tmp_path: Path) -> None:
    root = tmp_path / "src"
    touch(root / "cat" / "0001.jpg")
    touch(root / "cat" / "0001.png")
    touch(root / "dog" / "0001.jpg")
    with pytest.raises(SourceError) as info:
        mirror(root)
    message = str(info.value)
    assert "key(s)" in message and "'cat/0001'" in message
    assert "cat/0001.jpg" in message and "cat/0001.png" in message
    index = mirror(root, duplicates="skip")
    assert list(index.keys) == ["dog/0001"]
    assert index.duplicates == {"cat/0001": ["cat/0001.jpg", "cat/0001.png"]}
    assert index.mirror is not None and index.mirror.paths == ["", "cat", "dog"]


def test_a_folder_named_like_an_original_s_array_clashes_with_it(tmp_path: Path) -> None:
    root = tmp_path / "src"
    touch(root / "cat" / "x.jpg")  # <size>/cat/x.npy
    touch(root / "cat" / "x.npy" / "y.jpg")  # <size>/cat/x.npy/ too
    with pytest.raises(SourceError, match=r"cat/x\.npy/"):
        mirror(root)
    index = mirror(root, duplicates="skip")
    assert list(index.keys) == ["cat/x.npy/y"]


def test_symlinked_directories_show_under_the_link_never_below_themselves(
    tmp_path: Path,
) -> None:
    root = tmp_path / "src"
    outside = tmp_path / "outside"
    touch(outside / "leak.jpg")
    touch(root / "cat" / "0001.jpg")
    touch(root / "cat" / "deep" / "0002.jpg")
    (root / "dog").mkdir()
    (root / "dog" / "kitty").symlink_to("../cat")  # inside: cat's files again, under kitty/
    (root / "cat" / "deep" / "up").symlink_to("../..")  # an ancestor: a cycle, not entered
    (root / "away").symlink_to(outside)  # outside: not followed
    (root / "best.jpg").symlink_to("cat/0001.jpg")
    index = mirror(root)
    assert list(index.keys) == [
        "best",
        "cat/0001",
        "cat/deep/0002",
        "dog/kitty/0001",
        "dog/kitty/deep/0002",
    ]
    assert index.mirror is not None
    assert index.mirror.paths == ["", "cat", "cat/deep", "dog", "dog/kitty", "dog/kitty/deep"]
    assert index.symlinks_outside == 1
    real = str(root / "cat" / "deep" / "0002.jpg")
    assert index.original_path(index.find("dog/kitty/deep/0002") or 0) == real


def test_keys_too_long_for_a_store_file_name_are_skipped(tmp_path: Path) -> None:
    root = tmp_path / "src"
    # The store names a key with "/" by the key, "/" escaped as "%2F", plus ".npy".
    fits = "d" * 124 + "/" + "e" * 124  # 124 + 3 + 124 + 4 = 255 bytes
    too_long = "f" * 125 + "/" + "g" * 124  # 256
    touch(root / f"{fits}.jpg")
    touch(root / f"{too_long}.jpg")
    index = mirror(root)
    assert list(index.keys) == [fits]
    assert index.skipped_names == 1
    key = EntryKey("v1", 16, fits)
    assert len(key.file_name) == 255
    with opened_store(tmp_path / "store") as store:
        store.write(key, npy_bytes(np.zeros((16, 16, 3), np.uint8)))
        assert store.verify(key) is not None


def test_the_mirror_index_is_cached_apart_from_the_uuid_index(tmp_path: Path) -> None:
    root = tmp_path / "src"
    for name in ["cat/1.jpg", "dog/2.jpg", "3.jpg"]:
        touch(root / name)
    (root / "empty").mkdir()
    (root / "dog" / "kitty").symlink_to("../cat")
    make_old(root)
    cache = tmp_path / "cache"
    cache.mkdir()
    first = mirror(root, cache_dir=str(cache))
    again = mirror(root, cache_dir=str(cache))
    assert not first.from_cache and again.from_cache
    assert list(again.keys) == list(first.keys) and list(again.relpaths) == list(first.relpaths)
    assert again.mirror is not None and first.mirror is not None
    assert again.mirror.folders == first.mirror.folders
    # The layout is part of the cache's key: the uuid index of one source is another.
    uuid = scan_source("v1", root, DEFAULT_EXTENSIONS, cache_dir=str(cache), duplicates="skip")
    assert not uuid.from_cache and uuid.layout == "uuid" and list(uuid.keys) == ["1", "2", "3"]
    assert not mirror(root, cache_dir=str(cache)).from_cache
    # Retargeting a symlinked directory is a change like any other.
    assert mirror(root, cache_dir=str(cache)).from_cache
    (root / "dog" / "kitty").unlink()
    (root / "dog" / "kitty").symlink_to("../empty")
    os.utime(root / "dog", (time.time() - 60,) * 2)
    changed = mirror(root, cache_dir=str(cache))
    assert not changed.from_cache and "dog/kitty/1" not in changed.keys


@pytest.mark.parametrize(
    "tamper",
    [
        lambda c: c["uuids"].__setitem__(0, "../1"),  # a key outside
        lambda c: c["relpaths"].__setitem__(0, "../../etc/1.jpg"),  # a path not its key's
        lambda c: c["relpaths"].__setitem__(0, "3.jpg/../../x.jpg"),
        lambda c: c["folders"].append("../up"),  # a folder outside
        lambda c: c["folders"].append("cat/.hidden"),
        lambda c: c["folders"].remove("cat"),  # a key in a folder that is not one
        lambda c: (c["uuids"].insert(0, "nope/0"), c["relpaths"].insert(0, "nope/0.jpg")),
        lambda c: c["uuids"].reverse(),  # out of order
        lambda c: c["uuids"].__setitem__(1, c["uuids"][0]),  # twice
        lambda c: c["folders"].__setitem__(0, "cat"),  # no root
        lambda c: c.__setitem__("folders", "cat"),
    ],
)
def test_a_mirror_cache_this_code_could_not_have_written_is_ignored(
    tmp_path: Path, tamper: object
) -> None:
    root = tmp_path / "src"
    for name in ["cat/1.jpg", "dog/2.jpg", "3.jpg"]:
        touch(root / name)
    make_old(root)
    fresh = mirror(root, cache_dir=str(tmp_path))
    cached = json.loads((tmp_path / "v1.json").read_text())
    assert cached["uuids"] == ["3", "cat/1", "dog/2"]
    tamper(cached)  # type: ignore[operator]
    (tmp_path / "v1.json").write_text(json.dumps(cached))
    index = mirror(root, cache_dir=str(tmp_path))
    assert not index.from_cache
    assert list(index.keys) == list(fresh.keys)


def test_layout_is_a_checked_per_version_setting(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    version = {"source": "src", "layout": "mirror"}
    table = {"store": "store", "versions": {"v1": version}}
    config = parse_config(table, base_dir=tmp_path)
    assert config.versions["v1"].layout == "mirror"
    described = config.as_dict()["versions"]
    assert isinstance(described, dict) and described["v1"]["layout"] == "mirror"
    del version["layout"]
    assert parse_config(table, base_dir=tmp_path).versions["v1"].layout == "uuid"
    path = tmp_path / "c.toml"
    path.write_text('store = "s"\n[versions.v1]\nsource = "src"\nlayout = "tree"\n')
    with pytest.raises(ConfigError, match=r"versions\.v1\.layout: 'tree' is not one of"):
        load_config(path)


# -- the store ---------------------------------------------------------------------


class opened_store:  # noqa: N801 - used as a context manager, like open()
    def __init__(self, root: Path) -> None:
        self.store = Store(root, {"v1": V1})

    def __enter__(self) -> Store:
        self.store.open()
        return self.store

    def __exit__(self, *_: object) -> None:
        self.store.close()


def payload(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    return npy_bytes(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8))


ODD_KEYS = [
    "cat/0001",
    "a b/c%d/x y",  # spaces, and a "%" to escape
    "100%/25",
    "a/b",
    "a%2Fb",  # no "/": a uuid that looks like an escaped key
    "%2F",
    "%",
    "x",
    "é/ü",
    "deep/er/and/deeper/still",
]


def test_keys_with_slashes_percents_and_spaces_round_trip(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with opened_store(root) as store:
        for i, uuid in enumerate(ODD_KEYS):
            store.write(EntryKey("v1", 16, uuid), payload(i))
        for i, uuid in enumerate(ODD_KEYS):
            key = EntryKey("v1", 16, uuid)
            checked = store.verify(key)
            assert checked is not None
            assert store.read_range(key, 0, checked.length) == payload(i)
        files = {str(p.relative_to(root)) for p in root.glob("v1/16/*/*.npy")}
        assert len(files) == len(ODD_KEYS)  # one file per key
        assert "v1/16/a%/a%2Fb.npy" in files and "v1/16/x/x.npy" in files
        slashed = EntryKey("v1", 16, "a/b")
        assert slashed.relpath == f"v1/16/{slashed.shard}/a%2Fb.npy"
        assert len(slashed.shard) == 3 and slashed.shard.startswith("%")
        assert EntryKey("v1", 16, "a b/c%d/x y").file_name == "a b%2Fc%25d%2Fx y.npy"
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            rebuilt = sorted(key.key for key, _ in iter_entries(fd, {"v1": V1}))
        finally:
            os.close(fd)
        assert rebuilt == sorted(ODD_KEYS)
        # Removing (as eviction does) takes exactly the key's file.
        store.remove(EntryKey("v1", 16, "a/b"))
        assert store.verify(EntryKey("v1", 16, "a/b")) is None
        assert store.verify(EntryKey("v1", 16, "a%2Fb")) is not None


def test_a_catalog_filled_from_disk_knows_mirror_keys(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with opened_store(root) as store:
        for i, uuid in enumerate(ODD_KEYS):
            store.write(EntryKey("v1", 16, uuid), payload(i))
    (root / ".catalog.sqlite3").unlink()
    with opened_store(root) as store:
        usage = store.wait_for_usage()
        assert usage.entries == len(ODD_KEYS)
        assert store.stored_keys("v1", 16) == set(ODD_KEYS)


@pytest.mark.parametrize(
    ("shard", "name"),
    [
        ("%00", "cat%2f0001.npy"),  # not the canonical escape
        ("%00", "cat%410001.npy"),
        ("%00", "cat0001.npy"),  # no "/" after all
        ("%00", "cat%2F0001"),  # not an entry file
    ],
)
def test_a_file_name_no_key_has_gives_no_key(shard: str, name: str) -> None:
    assert EntryKey.from_store_path("v1", 16, shard, name) is None


def test_a_file_in_another_keys_shard_gives_no_key() -> None:
    key = EntryKey("v1", 16, "cat/0001")
    assert EntryKey.from_store_path("v1", 16, key.shard, key.file_name) == key
    other = "%00" if key.shard != "%00" else "%01"
    assert EntryKey.from_store_path("v1", 16, other, key.file_name) is None


def test_eviction_removes_a_mirror_entry_by_its_key(tmp_path: Path) -> None:
    entry_bytes = len(payload(0)) + 40
    ticks = iter(range(1_000_000))
    store = Store(
        tmp_path / "store", {"v1": V1}, max_bytes=2 * entry_bytes, clock=lambda: next(ticks)
    )
    store.open()
    try:
        cat, dog, bird = (EntryKey("v1", 16, f"{c}/0001") for c in ("cat", "dog", "bird"))
        store.write(cat, payload(1))
        store.write(dog, payload(2))
        store.capacity.record_access(cat)  # dog is now the least recently used
        store.write(bird, payload(3))
        root = Path(store.root)
        assert not (root / dog.relpath).exists()
        assert (root / cat.relpath).exists() and (root / bird.relpath).exists()
        assert list(store.capacity.evicted) == [dog]
        assert store.stored_keys("v1", 16) == {"cat/0001", "bird/0001"}
    finally:
        store.close()


def test_an_entry_moved_to_another_keys_path_fails(tmp_path: Path) -> None:
    with opened_store(tmp_path / "store") as store:
        cat, dog = EntryKey("v1", 16, "cat/0001"), EntryKey("v1", 16, "dog/0001")
        store.write(cat, payload(1))
        store.write(dog, payload(2))
        (Path(store.root) / dog.relpath).write_bytes((Path(store.root) / cat.relpath).read_bytes())
        with pytest.raises(CorruptEntry, match="checksum"):
            store.verify(dog)


# -- the namespace -----------------------------------------------------------------


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[tuple[Tree, Engine, Path]]:
    source = classes(tmp_path / "src")
    plain = tmp_path / "plain"
    for uuid in ["ab1", "ab2", "cd3"]:
        touch(plain / f"{uuid}.jpg")
    config = parse_config(
        {
            "store": "store",
            "sizes": [64],
            "access": "owner",  # the tree's names; who may read: test_tree.py, test_fs.py
            "versions": {
                "m": {"source": "src", "layout": "mirror"},
                "u": {"source": "plain"},
            },
        },
        base_dir=tmp_path,
    )
    store = Store(config.store, {"m": V1, "u": V1})
    store.open()
    sources = {
        "m": scan_source("m", source, DEFAULT_EXTENSIONS, layout="mirror"),
        "u": scan_source("u", plain, DEFAULT_EXTENSIONS),
    }
    engine = Engine(config, sources, store)
    try:
        yield Tree(config, sources, ["stats.json"]), engine, source
    finally:
        engine.close()
        store.close()


def walk(tree: Tree, *names: str) -> Node | None:
    node: Node | None = ROOT
    for name in names:
        assert node is not None
        node = tree.parent(node) if name == ".." else tree.lookup(node, os.fsencode(name))
    return node


def listing(tree: Tree, node: Node, start: int = 0) -> list[tuple[int, str, Node]]:
    """(next offset, name, node) as fs.readdir replies them, from offset ``start``."""
    rows = [(n, os.fsdecode(name), child) for n, name, child in tree.children(node, start)]
    arrays = tree.array_rows(node, start)
    if arrays is not None:
        for i in arrays.rows:
            name = arrays.keys[i][arrays.strip :] + ".npy"
            ino = arrays.base_ino | i
            rows.append((i + arrays.offset_delta, name, Node.from_ino(ino)))
    return rows


def test_lookup_names_the_source_s_paths(tree: tuple[Tree, Engine, Path]) -> None:
    t, _, _ = tree
    size = walk(t, "m", "64")
    assert size is not None and size.kind == Kind.SIZE
    cat = walk(t, "m", "64", "cat")
    assert cat is not None and cat.kind == Kind.FOLDER and t.is_dir(cat)
    for key in ["cat/0001", "dog/0001", "0001", "a/b/c/x", "with space/two words"]:
        folders, _, name = key.rpartition("/")
        node = walk(t, "m", "64", *filter(None, folders.split("/")), f"{name}.npy")
        assert node is not None and node.kind == Kind.ENTRY, key
        assert t.key(node) == key
        assert t.exists(node) and not t.is_dir(node)
        attributes = t.attributes(node)
        assert attributes.mode == stat.S_IFREG | 0o444 and attributes.size == npy_file_size(64)
    assert walk(t, "m", "64", "cat", "0001.npy") != walk(t, "m", "64", "dog", "0001.npy")
    # Any size resolves, and names the same originals.
    other = walk(t, "m", "100", "cat", "0001.npy")
    assert other is not None and other.size == 100
    # ".." climbs folder by folder to the size directory.
    assert walk(t, "m", "64", "a", "b", "c", "..", "..", "..") == size
    assert walk(t, "m", "64", "a", "b", "..") == walk(t, "m", "64", "a")
    assert walk(t, "m", "64", "..") == walk(t, "m")
    directory = t.attributes(cat)
    assert directory.mode == stat.S_IFDIR | 0o555


@pytest.mark.parametrize(
    "path",
    [
        "cat/9999.npy",
        "cat/0001.jpg",
        "cat/0001",  # a key is no folder
        "cat/.hidden.npy",
        "cat/notes.npy",
        ".git",
        "nope",
        "empty/0001.npy",
        "a/x.npy",  # a/b/c/x is deeper
        "ca",  # no shard directories in a mirror
        "%97",
        "0001",
        ".npy",
        "cat/0001.npy/x",
        "a b",
    ],
)
def test_names_that_do_not_exist(tree: tuple[Tree, Engine, Path], path: str) -> None:
    t, _, _ = tree
    parts = path.split("/")
    parent = walk(t, "m", "64", *parts[:-1]) if parts[:-1] else walk(t, "m", "64")
    if parent is None or not t.is_dir(parent):
        return  # a parent that does not exist, or is a file: already ENOENT/ENOTDIR
    assert t.lookup(parent, os.fsencode(parts[-1])) is None, path


def test_folders_list_their_subfolders_then_their_arrays(
    tree: tuple[Tree, Engine, Path],
) -> None:
    t, _, source = tree
    for directory, dirs, files in os.walk(source):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        relative = Path(directory).relative_to(source).parts
        node = walk(t, "m", "64", *relative)
        assert node is not None, relative
        names = [name for _, name, _ in listing(t, node)]
        arrays = sorted(
            f"{f.rpartition('.')[0]}.npy"
            for f in files
            if not f.startswith(".") and f.rpartition(".")[2].lower() in DEFAULT_EXTENSIONS
        )
        assert names == sorted(dirs) + arrays, relative
        for _, name, child in listing(t, node):
            assert walk(t, "m", "64", *relative, name) == child  # listed = looked up


def test_a_listing_resumes_at_any_offset(tree: tuple[Tree, Engine, Path]) -> None:
    t, _, _ = tree
    for path in [(), ("cat",), ("a",), ("empty",), ("dog",)]:
        node = walk(t, "m", "64", *path)
        assert node is not None
        full = listing(t, node)
        offsets = [0] + [n for n, _, _ in full]
        assert offsets == sorted(set(offsets)), "offsets increase"
        for k, offset in enumerate(offsets):
            assert listing(t, node, offset) == full[k:], (path, offset)


def test_inodes_the_kernel_holds_stay_valid(tree: tuple[Tree, Engine, Path]) -> None:
    t, _, source = tree
    cat = walk(t, "m", "64", "cat")
    assert cat is not None and t.exists(cat)
    mirror = scan_source("m", source, DEFAULT_EXTENSIONS, layout="mirror").mirror
    assert mirror is not None
    assert not t.exists(Node(Kind.FOLDER, cat.version, 64, len(mirror)))
    assert not t.exists(Node(Kind.FOLDER, cat.version, 64, 0))  # that one is the size dir
    assert not t.exists(Node(Kind.SHARD, cat.version, 64, 0))  # a mirror has no shards
    u = walk(t, "u", "64")
    assert u is not None
    assert not t.exists(Node(Kind.FOLDER, u.version, 64, 1))


def test_a_uuid_version_beside_it_keeps_its_shards(tree: tuple[Tree, Engine, Path]) -> None:
    t, _, _ = tree
    size = walk(t, "u", "64")
    assert size is not None
    assert [name for _, name, _ in listing(t, size)] == ["ab1.npy", "ab2.npy", "cd3.npy"]
    shard = walk(t, "u", "64", "ab")
    assert shard is not None and shard.kind == Kind.SHARD
    assert walk(t, "u", "64", "ab", "ab2.npy") == walk(t, "u", "64", "ab2.npy")


def test_an_engine_serves_a_mirror_entry_and_stores_it_under_its_key(tmp_path: Path) -> None:
    source = tmp_path / "src"
    for folder in ["cat", "dog"]:
        (source / folder).mkdir(parents=True)
    (source / "cat" / "0001.png").write_bytes((SKIMAGE_DATA / "coffee.png").read_bytes())
    (source / "dog" / "0001.png").write_bytes((SKIMAGE_DATA / "chelsea.png").read_bytes())
    config = parse_config(
        {
            "store": "store",
            "versions": {"v1": {"source": "src", "layout": "mirror", "sizes": [32]}},
        },
        base_dir=tmp_path,
    )
    store = Store(config.store, {"v1": V1})
    store.open()
    index = scan_source("v1", source, DEFAULT_EXTENSIONS, layout="mirror")
    engine = Engine(config, {"v1": index}, store)

    async def read(key: str) -> bytes:
        handle = await engine.open("v1", 32, index.find(key) or 0)
        try:
            return bytes(await engine.read(handle, 0, 1 << 20))
        finally:
            engine.release(handle)

    try:
        for key in ["cat/0001", "dog/0001", "cat/0001"]:
            data = trio.run(read, key)
            assert data == reference_npy(source / f"{key}.png", 32), key
        assert engine.metrics.decodes == 2 and engine.metrics.hits == 1
        stored = Path(store.root) / EntryKey("v1", 32, "cat/0001").relpath
        assert stored.parent.name.startswith("%") and stored.name == "cat%2F0001.npy"
        assert stored.exists()
    finally:
        engine.close()
        store.close()


def test_a_warm_list_takes_keys_but_nothing_that_leaves_the_size_directory(
    tmp_path: Path,
) -> None:
    listing = tmp_path / "keys.txt"
    listing.write_text("cat/0001\nwild/big cats/lion 01.npy  # a comment\n\n0001\n")
    assert read_key_list(listing) == ["cat/0001", "wild/big cats/lion 01", "0001"]
    for bad in ["../x", "cat/../../x", "/etc/passwd", "cat//x", "cat/./x", "cat/", ".."]:
        listing.write_text(f"ok\n{bad}\n")
        with pytest.raises(ValueError, match=r"line 2: .* is not a uuid"):
            read_key_list(listing)


# -- what a reader learns from store.json -------------------------------------------


def test_store_json_lists_mirror_versions_apart() -> None:
    status = StoreStatus(
        store="/s",
        digests={"m": "aa", "u": "bb"},
        version_order=("m", "u"),
        inode_layout=1,
        min_size=8,
        max_size=4096,
        access_socket=None,
        mirrors=frozenset({"m"}),
    )
    value = json.loads(status.to_json())
    # A reader that predates layouts finds no fingerprint for "m" and reads through the mount.
    assert value["versions"] == {"u": "bb"} and value["mirror_versions"] == {"m": "aa"}
    assert StoreStatus.from_json(status.to_json()) == status
    del value["mirror_versions"]  # as a daemon that predates layouts writes it
    older = StoreStatus.from_json(json.dumps(value).encode())
    assert older.mirrors == frozenset() and older.digests == {"u": "bb"}


def test_a_changed_layout_discards_the_stored_arrays(tmp_path: Path) -> None:
    # "0001" names the stem of an original anywhere in a uuid version, but the
    # top-level 0001.jpg in a mirror version: one must never be served as the other.
    from decodefs.common.config import VersionConfig
    from decodefs.common.decode import DecodeSettings
    from decodefs.store.store import Store

    def version(layout: str) -> VersionConfig:
        return VersionConfig(
            "v1",
            tmp_path,
            (16,),
            DecodeSettings(),
            frozenset({"jpg"}),
            "error",
            layout=layout,  # type: ignore[arg-type]
        )

    uuid_fp, mirror_fp = version("uuid").fingerprint(), version("mirror").fingerprint()
    assert uuid_fp.digest != mirror_fp.digest
    key = EntryKey("v1", 16, "0001")
    first = Store(tmp_path / "store", {"v1": uuid_fp})
    first.open()
    first.write(key, b"x" * 100)
    first.close()
    again = Store(tmp_path / "store", {"v1": mirror_fp})
    again.open()
    assert again.verify(key) is None  # discarded with the version's old arrays
    again.close()
