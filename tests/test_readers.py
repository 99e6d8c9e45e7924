"""Who may read an original (readers.py): never more than POSIX lets read it."""

from __future__ import annotations

import os
import stat

from hypothesis import given
from hypothesis import strategies as st

from decodefs.common.readers import DAEMON_ONLY, Readers, directory_readers, file_readers

UIDS = st.sampled_from([0, 1, 2, 3])
GIDS = st.sampled_from([0, 10, 11])
MODES = st.integers(0, 0o777)


def stat_of(kind: int, mode: int, uid: int, gid: int) -> os.stat_result:
    return os.stat_result((kind | mode, 1, 1, 1, uid, gid, 0, 0, 0, 0))


directories = st.builds(lambda m, u, g: stat_of(stat.S_IFDIR, m, u, g), MODES, UIDS, GIDS)
files = st.builds(lambda m, u, g: stat_of(stat.S_IFREG, m, u, g), MODES, UIDS, GIDS)
users = st.tuples(st.sampled_from([1, 2, 3]), st.frozensets(GIDS))


def may(st_: os.stat_result, uid: int, groups: frozenset[int], bit: int) -> bool:
    """POSIX's check of ``bit`` (4: read, 1: search) for a user who is not root."""
    if uid == st_.st_uid:
        return bool(st_.st_mode >> 6 & bit)
    if st_.st_gid in groups:
        return bool(st_.st_mode >> 3 & bit)
    return bool(st_.st_mode & bit)


def shown(readers: Readers, uid: int, groups: frozenset[int]) -> bool:
    """Whether the mount (default_permissions) lets this user read, from ``readers``."""
    mode = readers.file_mode
    return may(stat_of(stat.S_IFREG, stat.S_IMODE(mode), readers.uid, readers.gid), uid, groups, 4)


@given(files, st.lists(directories, max_size=4), st.lists(users, min_size=1, max_size=4))
def test_no_user_may_read_an_array_whose_original_they_may_not_read(
    original: os.stat_result, above: list[os.stat_result], readers: list[tuple[int, frozenset[int]]]
) -> None:
    found = file_readers(original, list(above))
    assert found.bits & ~original.st_mode & 0o777 == 0  # never a bit the file lacks
    for uid, groups in readers:
        if shown(found, uid, groups):
            assert all(may(d, uid, groups, 1) for d in above), (uid, groups)
            assert may(original, uid, groups, 4), (uid, groups)


def test_a_bit_stays_where_every_directory_lets_its_class_through() -> None:
    original = stat_of(stat.S_IFREG, 0o644, 1, 10)
    open_path = [stat_of(stat.S_IFDIR, 0o755, 0, 0), stat_of(stat.S_IFDIR, 0o755, 1, 10)]
    assert file_readers(original, open_path) == Readers(1, 10, 0o444)
    root_only = [*open_path, stat_of(stat.S_IFDIR, 0o700, 0, 0)]
    assert file_readers(original, root_only) == Readers(1, 10, 0)
    team = [*open_path, stat_of(stat.S_IFDIR, 0o750, 1, 10)]  # its owner and group pass
    assert file_readers(original, team) == Readers(1, 10, 0o440)
    assert file_readers(original, [*open_path, None]) == Readers(1, 10, 0)  # not stat'ed
    folder = stat_of(stat.S_IFDIR, 0o750, 1, 10)
    assert directory_readers(folder, open_path) == Readers(1, 10, 0o440)
    assert directory_readers(folder, open_path).directory_mode == stat.S_IFDIR | 0o550
    assert DAEMON_ONLY.file_mode == stat.S_IFREG
