"""The mount's inode numbers across rescans: a number never changes meaning while the mount lives.

Each step is a serving process of one mount: it scans sources that gained and
lost originals (and versions), loads the mount's numbers from the state
directory, and builds the tree. Whatever the kernel was told an inode number
means by any step, every later step answers it the same way, or ENOENT once
the name is gone; a name that comes back gets its old number.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decodefs.common.config import parse_config
from decodefs.common.inodes import Node
from decodefs.common.source import SourceIndex, scan_source
from decodefs.daemon.namespace import ROOT, Tree
from decodefs.daemon.numbers import MountNumbers, NumbersLost

SIZES = (64, 224)
KEYS = [f"{a}{b}{c}" for a in "ab" for b in "xy" for c in "0123"]  # shared prefixes: shards
VERSIONS = ["v1", "v2", "v3"]


def index_of(version: str, keys: set[str]) -> SourceIndex:
    ordered = sorted(keys)
    return SourceIndex(version, "/nonexistent", ordered, [f"{k}.jpg" for k in ordered], 1)


def tree_of(
    state: Path,
    sources: dict[str, SourceIndex],
    *,
    first: bool,
    digests: dict[str, str] | None = None,
) -> Tree:
    raw = {
        "store": "/nonexistent",
        "versions": {name: {"source": "/", "sizes": list(SIZES)} for name in sources},
    }
    config = parse_config(raw, Path("/"))
    digests = digests or {name: "d0" for name in sources}
    numbers, _ = MountNumbers.load(str(state), sources, digests, first=first)
    return Tree(config, sources, numbers=numbers)


def path_ino(tree: Tree, *names: bytes) -> int | None:
    node = ROOT
    for name in names:
        found = tree.lookup(node, name)
        if found is None:
            return None
        node = found
    return node.ino


STEPS = st.lists(
    st.dictionaries(st.sampled_from(VERSIONS), st.sets(st.sampled_from(KEYS)), min_size=1),
    min_size=1,
    max_size=6,
)


@settings(max_examples=60)
@given(steps=STEPS)
def test_a_number_means_one_name_for_the_life_of_the_mount(
    tmp_path_factory: pytest.TempPathFactory, steps: list[dict[str, set[str]]]
) -> None:
    state = tmp_path_factory.mktemp("state")
    meaning: dict[int, tuple[str, ...]] = {}  # inode -> the path the kernel was told
    given_to: dict[tuple[str, ...], int] = {}  # path -> its inode, once given
    for step, versions in enumerate(steps):
        sources = {v: index_of(v, keys) for v, keys in versions.items()}
        tree = tree_of(state, sources, first=step == 0)
        for version, keys in versions.items():
            for size in SIZES:
                for key in KEYS:
                    name = f"{key}.npy".encode()
                    for path in [
                        (version, str(size), key),
                        (version, str(size), key[:2], key),
                    ]:
                        parts = [p.encode() for p in path[:-1]] + [name]
                        ino = path_ino(tree, *parts)
                        if key not in keys:
                            assert ino is None, path
                            continue
                        assert ino is not None, path
                        what = (version, str(size), key)  # both paths: one array, one inode
                        assert meaning.setdefault(ino, what) == what, "a number changed meaning"
                        assert given_to.setdefault(what, ino) == ino, "a name changed number"
        # Every number given out so far: its name now, or nothing (ENOENT).
        for ino, (version, size_name, key) in meaning.items():
            entry = tree.entry(ino)
            if version in versions and key in versions[version]:
                assert entry is not None and entry[0] == version and entry[1] == int(size_name)
                assert sources[version].keys[entry[2]] == key
            else:
                assert entry is None
                assert not tree.exists(Node.from_ino(ino))


def test_versions_keep_their_ids_and_a_new_one_never_takes_a_gone_ones(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    first = tree_of(
        state, {"v1": index_of("v1", {"ax0"}), "v2": index_of("v2", {"ax0"})}, first=True
    )
    v2 = path_ino(first, b"v2")
    assert v2 is not None
    second = tree_of(
        state, {"v1": index_of("v1", {"ax0"}), "v3": index_of("v3", {"ax0"})}, first=False
    )
    assert path_ino(second, b"v2") is None and not second.exists(Node.from_ino(v2))
    v3 = path_ino(second, b"v3")
    assert v3 is not None and v3 != v2
    assert path_ino(second, b"v1") == path_ino(first, b"v1")
    third = tree_of(state, {"v2": index_of("v2", {"ax0", "by1"})}, first=False)
    assert path_ino(third, b"v2") == v2  # back, with the id it had
    listing = [name for _, name, _ in third.children(ROOT, 0)]
    assert listing == [b"v2", b".decodefs"]


def test_a_later_serving_process_refuses_to_serve_without_the_mounts_numbers(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    sources = {"v1": index_of("v1", {"ax0"})}
    tree_of(state, sources, first=True)
    (state / "numbers.json").unlink()
    with pytest.raises(NumbersLost):
        tree_of(state, sources, first=False)
    (state / "numbers.json").write_text("[]")
    with pytest.raises(NumbersLost):
        tree_of(state, sources, first=False)


def test_changes_since_the_last_serving_process(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    both = {"v1": index_of("v1", {"ax0", "ay1"}), "v2": index_of("v2", {"ax0"})}
    serving, changes = MountNumbers.load(str(state), both, {"v1": "a", "v2": "b"}, first=True)
    assert changes.added == ["v1", "v2"] and not changes.removed and not changes.redecoded
    serving.save_applied()  # it serves: what changed is acted on
    after = {"v1": index_of("v1", {"ax0", "bx2"})}
    # A process that prepares with the new config and is let go (a standby, at a reload)
    # leaves what changed to the next: its loading is not acting on it.
    new_keys = []
    for _ in range(2):
        numbers, changes = MountNumbers.load(str(state), after, {"v1": "c"}, first=False)
        assert changes.added == [] and [name for name, _ in changes.removed] == ["v2"]
        assert changes.redecoded == ["v1"]  # its decoder fingerprint changed
        assert [key for key, _ in numbers.versions["v1"].gone_keys] == ["ay1"]
        new_keys.append(numbers.versions["v1"].new_keys)
    assert new_keys == [1, 0]  # given by the first: numbers are kept at once
    assert numbers.note_size("v1", 64)
    numbers.save_size("v1", 64)
    assert not numbers.note_size("v1", 64)
    numbers.save_applied()
    again, changes = MountNumbers.load(str(state), after, {"v1": "c"}, first=False)
    assert again.sizes_seen("v1") == {64}
    assert not (changes.added or changes.removed or changes.redecoded)  # all applied
    recorded = json.loads((state / "numbers.json").read_text())
    assert set(recorded["versions"]) == {"v1", "v2"}  # the gone version keeps its id


def test_mirror_folders_keep_their_numbers(tmp_path: Path) -> None:
    source = tmp_path / "pets"
    for path in ["cat/1.jpg", "cat/2.jpg", "dog/1.jpg", "dog/young/1.jpg"]:
        (source / path).parent.mkdir(parents=True, exist_ok=True)
        (source / path).write_bytes(b"")
    state = tmp_path / "state"
    state.mkdir()

    def tree(first: bool) -> Tree:
        index = scan_source("pets", source, ["jpg"], layout="mirror")
        raw = {
            "store": "/nonexistent",
            "versions": {"pets": {"source": str(source), "layout": "mirror", "sizes": [64]}},
        }
        numbers, _ = MountNumbers.load(str(state), {"pets": index}, {"pets": "d"}, first=first)
        return Tree(parse_config(raw, Path("/")), {"pets": index}, numbers=numbers)

    before = tree(True)
    young = path_ino(before, b"pets", b"64", b"dog", b"young")
    one = path_ino(before, b"pets", b"64", b"dog", b"young", b"1.npy")
    assert young is not None and one is not None
    (source / "ant").mkdir()  # a folder that sorts first
    (source / "ant" / "1.jpg").write_bytes(b"")
    os.unlink(source / "cat" / "1.jpg")
    after = tree(False)
    assert path_ino(after, b"pets", b"64", b"dog", b"young") == young
    assert path_ino(after, b"pets", b"64", b"dog", b"young", b"1.npy") == one
    assert path_ino(after, b"pets", b"64", b"cat", b"1.npy") is None
    assert path_ino(after, b"pets", b"64", b"ant", b"1.npy") not in (None, young, one)


def test_a_size_the_serving_process_saves_keeps_what_the_next_one_gave(tmp_path: Path) -> None:
    """One serving process prepares (giving a new version its id) while the one before
    still serves, and records a size looked up for the first time: neither loses the other's."""
    state = tmp_path / "state"
    state.mkdir()
    one = {"v1": index_of("v1", {"ax0"})}
    two = {**one, "v2": index_of("v2", {"by1"})}
    serving, _ = MountNumbers.load(str(state), one, {"v1": "d"}, first=True)
    preparing, _ = MountNumbers.load(str(state), two, {"v1": "d", "v2": "d"}, first=False)
    assert serving.note_size("v1", 64)
    serving.save_size("v1", 64)  # from its view of before v2
    preparing.save_applied()  # it took over
    after, changes = MountNumbers.load(str(state), two, {"v1": "d", "v2": "d"}, first=False)
    assert after.ids == preparing.ids and not changes.added
    assert after.sizes_seen("v1") == {64}
    preparing.refresh_sizes()
    assert preparing.sizes_seen("v1") == {64}
