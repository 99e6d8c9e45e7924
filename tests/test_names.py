"""The one file name <-> key rule (common/names.py) and the one reader of status files
(common/status.py), in process: no mount."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from decodefs.common.names import array_name, is_array_name, is_key, key_of
from decodefs.common.protocol import CONFIG_FILE, STATS_FILE, STATUS_DIR
from decodefs.common.status import StatusElsewhere, read_status, read_status_bytes

component = st.text(st.characters(blacklist_characters="/\0"), min_size=1).filter(
    lambda name: name not in (".", "..")
)


@given(st.lists(component, min_size=1, max_size=4).map("/".join))
@example("0a1b2c")
@example("cat/0001")
@example("x.npy")  # a key may end with ".npy": its name ends with two
def test_a_key_is_its_arrays_name_without_npy(key: str) -> None:
    assert is_key(key)
    assert is_array_name(array_name(key))
    assert key_of(array_name(key)) == key


@pytest.mark.parametrize(
    "key", ["", "/", "a/", "/a", "a//b", ".", "..", "a/./b", "a/../b", "../x", "a\0b"]
)
def test_nothing_that_leads_out_of_the_size_directory_is_a_key(key: str) -> None:
    assert not is_key(key)


@pytest.mark.parametrize("name", ["abc", "abc.np", "abc.NPY", "cat/0001.jpg", "abc.npy/"])
def test_a_name_without_npy_names_no_array(name: str) -> None:
    assert not is_array_name(name)
    assert key_of(name) is None


def _status_file(mountpoint: Path, name: str, data: bytes) -> None:
    (mountpoint / STATUS_DIR).mkdir(exist_ok=True)
    (mountpoint / STATUS_DIR / name).write_bytes(data)


def test_a_status_file_is_read_whole_and_parsed(tmp_path: Path) -> None:
    _status_file(tmp_path, CONFIG_FILE, b'{"min_size": 8, "max_size": 4096}\n')
    assert read_status(tmp_path, CONFIG_FILE) == {"min_size": 8, "max_size": 4096}
    assert read_status_bytes(str(tmp_path), CONFIG_FILE).startswith(b'{"min_size"')


@pytest.mark.parametrize("data", [b"not json", b"[1, 2]", b"\xff", b"[" * 100_000])
def test_a_status_file_that_is_no_json_object_raises_value_error(
    tmp_path: Path, data: bytes
) -> None:
    _status_file(tmp_path, STATS_FILE, data)
    with pytest.raises(ValueError):
        read_status(tmp_path, STATS_FILE)


def test_a_missing_status_file_raises_os_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_status(tmp_path, STATS_FILE)


def test_a_status_file_on_another_device_than_asked_is_refused(tmp_path: Path) -> None:
    _status_file(tmp_path, STATS_FILE, b"{}")
    device = os.stat(tmp_path).st_dev
    assert read_status_bytes(tmp_path, STATS_FILE, device=device) == b"{}"
    with pytest.raises(StatusElsewhere):
        read_status_bytes(tmp_path, STATS_FILE, device=device + 1)
