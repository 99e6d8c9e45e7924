"""Indexing originals: recursion, extensions, stems, duplicates, symlinks."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from decodefs.common import source as source_module
from decodefs.common.config import DEFAULT_EXTENSIONS
from decodefs.common.source import (
    OriginalMissing,
    SourceError,
    changed_originals,
    restat_originals,
    save_stamps,
    scan_source,
)
from tests.conftest import needs_root_because


def touch(path: Path, data: bytes = b"x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_recursive_scan_by_extension_any_case(tmp_path: Path) -> None:
    root = tmp_path / "src"
    for name in [
        "a.jpg",
        "b.JPEG",
        "deep/er/c.png",
        "d.webp",
        "e.Bmp",
        "f.tif",
        "g.TIFF",
        "h.jpeg",
    ]:
        touch(root / name)
    for name in [
        "notes.txt",
        "i.gif",
        "noext",
        "j.jpg.bak",
        ".hidden.jpg",
        ".cache/k.jpg",
        "Thumbs.db",
    ]:
        touch(root / name)
    index = scan_source("v1", root, DEFAULT_EXTENSIONS)
    assert list(index.keys) == ["a", "b", "c", "d", "e", "f", "g", "h"]
    assert index.original_path(index.find("c") or 0) == str(root / "deep/er/c.png")
    assert index.find("notes") is None and index.find("k") is None


def test_uuid_is_the_stem(tmp_path: Path) -> None:
    root = tmp_path / "src"
    touch(root / "2f9e.v2.final.jpg")
    index = scan_source("v1", root, DEFAULT_EXTENSIONS)
    assert list(index.keys) == ["2f9e.v2.final"]


def test_duplicate_stems_are_an_error_naming_them(tmp_path: Path) -> None:
    root = tmp_path / "src"
    touch(root / "a" / "x.jpg")
    touch(root / "b" / "x.png")
    touch(root / "y.jpg")
    with pytest.raises(SourceError) as info:
        scan_source("v1", root, DEFAULT_EXTENSIONS)
    message = str(info.value)
    assert "versions.v1.source" in message and "'x'" in message
    assert "a/x.jpg" in message and "b/x.png" in message
    assert 'duplicates = "skip"' in message


def test_duplicates_skip_leaves_every_clashing_uuid_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "src"
    touch(root / "a" / "x.jpg")
    touch(root / "b" / "x.png")
    touch(root / "y.jpg")
    index = scan_source("v1", root, DEFAULT_EXTENSIONS, duplicates="skip")
    assert list(index.keys) == ["y"]
    assert index.duplicates == {"x": ["a/x.jpg", "b/x.png"]}
    assert "uuid 'x' has 2 originals" in caplog.text


def test_symlinks_inside_are_followed_outside_are_not(tmp_path: Path) -> None:
    root = tmp_path / "src"
    outside = tmp_path / "outside"
    touch(outside / "secret.jpg")
    touch(outside / "dir" / "leak.jpg")
    touch(root / "real" / "inner.jpg")
    (root / "escape.jpg").symlink_to(outside / "secret.jpg")
    (root / "escape-dir").symlink_to(outside / "dir")
    (root / "alias.jpg").symlink_to(root / "real" / "inner.jpg")
    (root / "linked-dir").symlink_to(root / "real")  # same files again: not duplicates
    (root / "loop").symlink_to(root)
    (root / "dangling.jpg").symlink_to(root / "gone.jpg")
    index = scan_source("v1", root, DEFAULT_EXTENSIONS)
    assert list(index.keys) == ["alias", "inner"]
    assert index.symlinks_outside == 2


def test_original_path_refuses_a_symlink_swapped_to_the_outside(tmp_path: Path) -> None:
    root = tmp_path / "src"
    target = touch(root / "a.jpg")
    index = scan_source("v1", root, DEFAULT_EXTENSIONS)
    target.unlink()
    with pytest.raises(OriginalMissing, match="no longer exists"):
        index.original_path(0)
    target.symlink_to(touch(tmp_path / "outside.jpg"))
    with pytest.raises(OriginalMissing, match="outside the source"):
        index.original_path(0)


def test_names_too_long_for_a_file_name_are_skipped(tmp_path: Path) -> None:
    root = tmp_path / "src"
    # Only an extension shorter than "npy" can make <uuid>.npy longer than its original.
    touch(root / ("a" * 251 + ".jp"))  # "a"*251 + ".npy" is 255 bytes: fine
    touch(root / ("b" * 252 + ".jp"))  # would be 256
    index = scan_source("v1", root, ["jp"])
    assert list(index.keys) == ["a" * 251]
    assert index.skipped_names == 1


def test_prefix_ranges_are_the_sharded_layout(tmp_path: Path) -> None:
    root = tmp_path / "src"
    for uuid in ["a", "ab", "abc", "abd", "ac", "b0", "é1", "éz"]:
        touch(root / f"{uuid}.jpg")
    index = scan_source("v1", root, DEFAULT_EXTENSIONS)

    def shard(prefix: str) -> list[str]:
        return [index.keys[i] for i in index.prefix_range(prefix)]

    assert shard("a") == ["a"]
    assert shard("ab") == ["ab", "abc", "abd"]
    assert shard("b0") == ["b0"]
    assert shard("é1") == ["é1"]
    assert shard("zz") == [] and shard("") == [] and shard("abc") == []
    for uuid in index.keys:
        assert uuid in shard(uuid[:2])


def test_missing_source_is_a_source_error(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match=r"versions\.v1\.source"):
        scan_source("v1", tmp_path / "absent", DEFAULT_EXTENSIONS)


def test_the_index_is_cached_and_reused_while_the_tree_is_unchanged(tmp_path: Path) -> None:
    root = tmp_path / "src"
    for name in ["a/1.jpg", "a/2.jpg", "b/c/3.png", "4.jpg"]:
        touch(root / name)
    cache = tmp_path / "cache"
    cache.mkdir()
    old = time.time() - 60  # trust these directories' mtimes (see _MTIME_SLACK_NS)
    for directory in [root, root / "a", root / "b", root / "b" / "c"]:
        os.utime(directory, (old, old))
    first = scan_source("v1", root, DEFAULT_EXTENSIONS, cache_dir=str(cache))
    assert not first.from_cache and (cache / "v1.json").exists()
    again = scan_source("v1", root, DEFAULT_EXTENSIONS, cache_dir=str(cache))
    assert again.from_cache
    assert list(again.keys) == list(first.keys) == ["1", "2", "3", "4"]
    assert again.original_path(again.find("3") or 0) == str(root / "b/c/3.png")
    # Another key (extensions) never reuses it.
    assert not scan_source("v1", root, ["jpg"], cache_dir=str(cache)).from_cache


@pytest.mark.parametrize(
    "change",
    [
        lambda root: touch(root / "b" / "c" / "new.jpg"),  # added deep down
        lambda root: (root / "a" / "1.jpg").unlink(),  # removed
        lambda root: (root / "a" / "2.jpg").rename(root / "a" / "renamed.jpg"),
        lambda root: (root / "b" / "c").rename(root / "b" / "d"),  # a directory moved
        lambda root: touch(root / "e" / "new-dir.jpg"),  # a new directory
    ],
)
def test_any_change_to_the_tree_invalidates_the_cache(tmp_path: Path, change: object) -> None:
    root = tmp_path / "src"
    for name in ["a/1.jpg", "a/2.jpg", "b/c/3.png"]:
        touch(root / name)
    old = time.time() - 60
    for directory in [root, root / "a", root / "b", root / "b" / "c"]:
        os.utime(directory, (old, old))
    cache = str(tmp_path)
    before = scan_source("v1", root, DEFAULT_EXTENSIONS, cache_dir=cache)
    change(root)  # type: ignore[operator]
    after = scan_source("v1", root, DEFAULT_EXTENSIONS, cache_dir=cache)
    assert not after.from_cache
    assert list(after.keys) != list(before.keys) or list(after.relpaths) != list(before.relpaths)


def test_a_tree_changed_just_before_the_scan_is_not_trusted(tmp_path: Path) -> None:
    root = tmp_path / "src"
    touch(root / "1.jpg")  # the directory's mtime is now: within the mtime slack
    scan_source("v1", root, DEFAULT_EXTENSIONS, cache_dir=str(tmp_path))
    assert not scan_source("v1", root, DEFAULT_EXTENSIONS, cache_dir=str(tmp_path)).from_cache


def test_a_damaged_cache_is_ignored(tmp_path: Path) -> None:
    root = tmp_path / "src"
    touch(root / "1.jpg")
    (tmp_path / "v1.json").write_text('{"key": ')
    index = scan_source("v1", root, DEFAULT_EXTENSIONS, cache_dir=str(tmp_path))
    assert list(index.keys) == ["1"] and not index.from_cache


def make_old(*directories: Path) -> None:
    """Give directories an mtime the cache trusts (see _MTIME_SLACK_NS)."""
    old = time.time() - 60
    for directory in directories:
        os.utime(directory, (old, old))


def test_a_walk_that_could_not_list_a_directory_is_not_cached(tmp_path: Path) -> None:
    root = tmp_path / "src"
    touch(root / "1.jpg")
    # A directory whose path is longer than PATH_MAX: listing it fails, even for root.
    fd = os.open(root, os.O_RDONLY)
    try:
        for _ in range(24):
            os.mkdir("d" * 200, dir_fd=fd)
            inner = os.open("d" * 200, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = inner
    finally:
        os.close(fd)
    make_old(root)
    first = scan_source("v1", root, DEFAULT_EXTENSIONS, cache_dir=str(tmp_path))
    assert list(first.keys) == ["1"]
    assert not (tmp_path / "v1.json").exists()
    assert not scan_source("v1", root, DEFAULT_EXTENSIONS, cache_dir=str(tmp_path)).from_cache


@pytest.mark.parametrize("dangling", [False, True])
def test_a_symlinks_target_directory_is_watched_too(tmp_path: Path, dangling: bool) -> None:
    root = tmp_path / "src"
    target = root / ".originals" / "target.jpg"  # a hidden directory: never listed itself
    touch(target)
    (root / "a").mkdir()
    (root / "a" / "alias.jpg").symlink_to(target)
    if dangling:
        target.unlink()
    make_old(root, root / "a", root / ".originals")
    first = scan_source("v1", root, DEFAULT_EXTENSIONS, cache_dir=str(tmp_path))
    assert list(first.keys) == ([] if dangling else ["alias"])
    assert scan_source("v1", root, DEFAULT_EXTENSIONS, cache_dir=str(tmp_path)).from_cache
    if dangling:
        touch(target)  # the link now leads somewhere
    else:
        target.unlink()
    again = scan_source("v1", root, DEFAULT_EXTENSIONS, cache_dir=str(tmp_path))
    assert not again.from_cache
    assert list(again.keys) == (["alias"] if dangling else [])


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("relpaths", ["../../outside.jpg", "b.jpg"]),
        ("relpaths", ["/etc/passwd", "b.jpg"]),
        ("uuids", ["../a", "b"]),
        ("uuids", [".hidden", "b"]),
        ("uuids", ["b", "a"]),
        ("uuids", ["a", "a"]),
        ("uuids", ["a"]),
        ("uuids", ["a" * 252, "b"]),
        ("dirs", {"../..": [1, 2]}),
        ("dirs", {"": ["1", 2]}),
    ],
)
def test_a_cache_that_this_code_could_not_have_written_is_ignored(
    tmp_path: Path, field: str, value: object
) -> None:
    root = tmp_path / "src"
    touch(root / "a.jpg")
    touch(root / "b.jpg")
    make_old(root)
    scan_source("v1", root, DEFAULT_EXTENSIONS, cache_dir=str(tmp_path))
    cache = tmp_path / "v1.json"
    cached = json.loads(cache.read_text())
    cached[field] = value
    cache.write_text(json.dumps(cached))
    index = scan_source("v1", root, DEFAULT_EXTENSIONS, cache_dir=str(tmp_path))
    assert not index.from_cache
    assert list(index.keys) == ["a", "b"] and list(index.relpaths) == ["a.jpg", "b.jpg"]


@needs_root_because("giving a file to another user")
def test_a_cache_owned_by_another_user_is_ignored(tmp_path: Path) -> None:
    root = tmp_path / "src"
    touch(root / "a.jpg")
    make_old(root)
    scan_source("v1", root, DEFAULT_EXTENSIONS, cache_dir=str(tmp_path))
    assert scan_source("v1", root, DEFAULT_EXTENSIONS, cache_dir=str(tmp_path)).from_cache
    os.chown(tmp_path / "v1.json", 65534, 65534)
    assert not scan_source("v1", root, DEFAULT_EXTENSIONS, cache_dir=str(tmp_path)).from_cache


def test_originals_changed_in_place_are_found_by_size_and_mtime(tmp_path: Path) -> None:
    source, cache = tmp_path / "src", tmp_path / "cache"
    cache.mkdir()
    for name in ("a", "b", "c"):
        touch(source / "d" / f"{name}.jpg", name.encode())
    make_old(source, source / "d")  # a tree the cached index is trusted for
    index = scan_source("v1", source, DEFAULT_EXTENSIONS, cache_dir=str(cache))
    assert changed_originals(index) == []  # first seen: nothing to compare with
    os.utime(source / "d" / "b.jpg", ns=(1, 1))  # touched: another mtime
    (source / "d" / "c.jpg").write_bytes(b"longer now")  # rewritten in place
    assert changed_originals(index) == [index.find("b"), index.find("c")]
    assert changed_originals(index) == []  # what it saw is what it compares with now
    (source / "d" / "a.jpg").write_bytes(b"A")  # in place: its directory is unchanged
    again = scan_source("v1", source, DEFAULT_EXTENSIONS, cache_dir=str(cache))
    assert again.from_cache and changed_originals(again) == [again.find("a")]  # kept in the cache
    touch(source / "d" / "e.jpg")  # the tree changed: walked again, what it saw kept
    (source / "d" / "b.jpg").write_bytes(b"bb")
    walked = scan_source("v1", source, DEFAULT_EXTENSIONS, cache_dir=str(cache))
    assert not walked.from_cache and changed_originals(walked) == [walked.find("b")]
    # Found by a process that does not act on it (a standby let go at a reload): not
    # saved, so the next one finds it too; saved once acted on.
    (source / "d" / "c.jpg").write_bytes(b"c, once more")
    assert restat_originals(walked, save=False).changed == [walked.find("c")]
    nextone = scan_source("v1", source, DEFAULT_EXTENSIONS, cache_dir=str(cache))
    assert restat_originals(nextone, save=False).changed == [nextone.find("c")]
    save_stamps(nextone)  # (without it, the next finds c changed again)
    last = scan_source("v1", source, DEFAULT_EXTENSIONS, cache_dir=str(cache))
    assert changed_originals(last) == []


def test_who_may_read_an_original_counts_the_directories_its_path_and_a_symlink_lead_through() -> (
    None
):
    base = Path(tempfile.mkdtemp(prefix="decodefs-source-"))  # every user may pass it
    try:
        os.chmod(base, 0o755)
        (base / "private").mkdir(mode=0o700)
        (base / "open.jpg").write_bytes(b"x")
        (base / "private" / "hidden.jpg").write_bytes(b"x")
        (base / "link.jpg").symlink_to(base / "private" / "hidden.jpg")  # inside the source
        (base / "private.d").symlink_to(base / "private")
        for path in (base / "open.jpg", base / "private" / "hidden.jpg"):
            os.chmod(path, 0o644)
        index = scan_source("v1", base, {"jpg"})
        assert sorted(index.keys) == ["hidden", "link", "open"]
        found = restat_originals(index)
        assert found.changed == [] and sorted(found.readers_changed) == [0, 1, 2]  # first seen
        me = os.getuid(), os.getgid()
        assert index.readers(index.keys.index("open")) == (*me, 0o444)
        assert index.readers(index.keys.index("hidden")) == (*me, 0o400)  # its directory: 0700
        assert index.readers(index.keys.index("link")) == (*me, 0o400)  # where it leads: the same
        assert index.folder("") == (*me, 0o444)
        assert restat_originals(index) == ([], [])  # nothing changed since

        os.chmod(base / "private", 0o755)
        assert restat_originals(index).readers_changed == [
            index.keys.index("hidden"),
            index.keys.index("link"),
        ]
        assert index.readers(index.keys.index("link")).bits == 0o444
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("threads", [1, 4])
def test_restat_finds_the_same_in_one_thread_or_several(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    # Which path is taken depends on how long a stat takes here: each is forced.
    monkeypatch.setattr(source_module, "_PROBE_STATS", 7)
    monkeypatch.setattr(source_module, "_STAT_THREADS", ((0.0, threads),))
    source = tmp_path / "src"
    names = [f"{i:03d}" for i in range(100)]
    for name in names:
        touch(source / name[:2] / f"{name}.jpg", name.encode())
    index = scan_source("v1", source, DEFAULT_EXTENSIONS)
    first = restat_originals(index)
    assert first.changed == [] and len(first.readers_changed) == len(names)
    rewritten = names[3::9]  # in the probe and past it, in each thread's share
    for name in rewritten:
        (source / name[:2] / f"{name}.jpg").write_bytes(b"rewritten")
    (source / "05" / "055.jpg").unlink()  # gone: left as it was
    again = restat_originals(index)
    assert again.changed == [index.find(name) for name in rewritten]
    assert again.readers_changed == []
