"""The one entry check: real entry bytes judged ok, corrupt, foreign or stale, in memory and
through a descriptor alike."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given
from hypothesis import strategies as st

from decodefs.common.decode import DecodeSettings, decoder_fingerprint
from decodefs.common.entry import (
    STALE,
    EntryCheck,
    EntryKey,
    Verdict,
    check_entry,
    check_entry_file,
    check_entry_pieces,
    encode_trailer,
    layout_problem,
)
from decodefs.common.npy import npy_bytes, npy_header
from decodefs.common.protocol import STORE_FORMAT, TRAILER, TRAILER_MAGIC, TRAILER_SIZE

DIGEST = decoder_fingerprint(DecodeSettings()).digest
OTHER = decoder_fingerprint(DecodeSettings(resample="nearest")).digest
KEY = EntryKey("v1", 8, "abcdef")


def payload(size: int = 8, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    return npy_bytes(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def entry(key: EntryKey = KEY, digest: bytes = DIGEST, seed: int = 0) -> bytes:
    data = payload(key.size, seed)
    return data + encode_trailer(key, data, digest)


@contextmanager
def opened(data: bytes) -> Iterator[int]:
    """A real descriptor holding ``data`` (a memfd: no filesystem needed)."""
    fd = os.memfd_create("entry")
    try:
        os.write(fd, data)
        yield fd
    finally:
        os.close(fd)


def both(key: EntryKey, data: bytes, digest: bytes = DIGEST) -> EntryCheck:
    """The check of ``data``, in memory and through a descriptor, which must agree."""
    in_memory = check_entry(key, data, digest)
    with opened(data) as fd:
        assert check_entry_file(fd, key, digest) == in_memory
    return in_memory


def in_pieces(key: EntryKey, data: bytes, digest: bytes = DIGEST) -> EntryCheck:
    """The check of ``data`` read as ``read_array`` reads an entry file: its .npy
    header, its array (into the caller's memory) and its trailer, apart."""
    length = len(data) - TRAILER_SIZE
    header = len(npy_header(key.size))
    view = memoryview(data)
    return check_entry_pieces(key, [view[:header], view[header:length]], data[length:], digest)


def saved(array: npt.NDArray[np.uint8]) -> bytes:
    """What numpy.save writes for ``array``, whatever its layout."""
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


def test_an_intact_entry_is_ok_with_its_header_and_length() -> None:
    checked = both(KEY, entry())
    assert checked.ok and checked.verdict is Verdict.OK and checked.reason == ""
    assert checked.length == len(payload())


def test_an_entry_of_other_settings_is_stale() -> None:
    checked = both(KEY, entry(digest=OTHER))
    assert checked.verdict is Verdict.STALE and checked.reason == STALE


def test_an_entry_of_another_store_format_is_foreign() -> None:
    data = payload()
    trailer = TRAILER.pack(TRAILER_MAGIC, STORE_FORMAT + 1, DIGEST, len(data), KEY.checksum(data))
    checked = both(KEY, data + trailer)
    assert checked.verdict is Verdict.FOREIGN and str(STORE_FORMAT + 1) in checked.reason


@pytest.mark.parametrize(
    ("what", "data", "key"),
    [
        ("a plain .npy, no trailer", payload() + bytes(TRAILER_SIZE), KEY),
        ("too short for a trailer", entry()[: TRAILER_SIZE - 1], KEY),
        ("another key's file", entry(), EntryKey("v1", 8, "abcdeg")),
        ("another size's array", entry(EntryKey("v1", 9, "abcdef")), EntryKey("v1", 8, "abcdef")),
    ],
)
def test_damaged_or_misplaced_entries_are_corrupt(what: str, data: bytes, key: EntryKey) -> None:
    assert both(key, data).verdict is Verdict.CORRUPT, what


def test_a_valid_trailer_over_the_wrong_layout_is_corrupt() -> None:
    """Intact bytes whose payload is no .npy of the key's array: the layout is part of the check."""
    data = b"\x93NUMPY" + bytes(len(payload()) - 6)
    checked = both(KEY, data + encode_trailer(KEY, data, DIGEST))
    assert checked.verdict is Verdict.CORRUPT and "layout" in checked.reason
    assert layout_problem(KEY, data, len(data)) == checked.reason
    assert layout_problem(KEY, payload(), len(payload())) is None


@pytest.mark.parametrize(
    ("what", "npy"),
    [
        ("its array in Fortran order", saved(np.asfortranarray(np.zeros((8, 8, 3), np.uint8)))),
        ("another shape of as many bytes", saved(np.zeros((8, 3, 8), np.uint8))),
    ],
)
def test_an_intact_entry_of_another_npy_layout_is_corrupt_read_whole_or_in_pieces(
    what: str, npy: bytes
) -> None:
    assert len(npy) == len(payload()), what  # the same length: only the header tells
    data = npy + encode_trailer(KEY, npy, DIGEST)  # its trailer and checksum intact
    whole = both(KEY, data)
    assert whole.verdict is Verdict.CORRUPT and "layout" in whole.reason, what
    assert in_pieces(KEY, data) == whole, what


def test_an_entry_read_in_pieces_is_checked_as_one_read_whole() -> None:
    assert in_pieces(KEY, entry()) == both(KEY, entry()) and in_pieces(KEY, entry()).ok
    for data, digest in [
        (entry(digest=OTHER), DIGEST),  # stale
        (entry(), OTHER),
        (entry(EntryKey("v1", 8, "abcdeg")), DIGEST),  # another key's file
        (payload() + bytes(TRAILER_SIZE), DIGEST),  # no trailer
    ]:
        assert in_pieces(KEY, data, digest) == check_entry(KEY, data, digest)
        assert not in_pieces(KEY, data, digest).ok


@given(position=st.integers(0, len(entry()) - 1), bit=st.integers(0, 7))
def test_no_flipped_bit_read_in_pieces_is_ok(position: int, bit: int) -> None:
    damaged = bytearray(entry())
    damaged[position] ^= 1 << bit
    checked = in_pieces(KEY, bytes(damaged))
    assert not checked.ok and checked == check_entry(KEY, bytes(damaged), DIGEST)


def test_bytes_that_shrank_while_being_read_are_corrupt() -> None:
    data = entry()
    checked = check_entry(KEY, data[:-1], DIGEST, size=len(data))
    assert checked.verdict is Verdict.CORRUPT and "while being read" in checked.reason


def test_an_entry_bigger_than_one_piece_is_checked_in_pieces() -> None:
    big = EntryKey("v1", 620, "big")  # 620 * 620 * 3 bytes: more than 1 MiB
    data = entry(big)
    assert both(big, data).ok
    damaged = bytearray(data)
    damaged[len(data) // 2] ^= 0x10
    assert both(big, bytes(damaged)).verdict is Verdict.CORRUPT
    assert both(big, data[:-1]).verdict is Verdict.CORRUPT


@given(position=st.integers(0, len(entry()) - 1), bit=st.integers(0, 7))
def test_no_flipped_bit_anywhere_is_ok(position: int, bit: int) -> None:
    damaged = bytearray(entry())
    damaged[position] ^= 1 << bit
    assert not both(KEY, bytes(damaged)).ok


@given(cut=st.integers(0, len(entry()) - 1))
def test_no_truncation_is_ok(cut: int) -> None:
    assert both(KEY, entry()[:cut]).verdict is Verdict.CORRUPT


@given(extra=st.binary(min_size=1, max_size=64))
def test_no_bytes_appended_are_ok(extra: bytes) -> None:
    assert not both(KEY, entry() + extra).ok
