"""Claims to decode an array of the cluster's L2, one call at a time: over a real shared
directory (PosixL2 in tmp_path), with the time passed in as the calls take it. The
claims' life with several nodes and the S3 backend is in tests/test_l2.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from decodefs.cluster.backends import PosixL2, object_name
from decodefs.cluster.leases import Claim, claim_name, claims, renew, take
from decodefs.common.decode import DecodeSettings, decoder_fingerprint
from decodefs.common.entry import EntryKey

SIZE = 32
FINGERPRINT = decoder_fingerprint(DecodeSettings()).hex


@pytest.fixture
def backend(tmp_path: Path) -> PosixL2:
    """An empty shared directory, as every node of a cluster mounts it."""
    (tmp_path / "shared").mkdir()
    return PosixL2(tmp_path / "shared")


def name_of(uuid: str) -> str:
    return object_name(EntryKey("v1", SIZE, uuid), FINGERPRINT)


@given(name=st.text(alphabet="ab@%/.2x", min_size=1), term=st.integers(1, 10**18 - 1))
@example(name=name_of("cat/img@2x"), term=1)
def test_a_claim_names_the_array_it_claims_whatever_its_name_holds(name: str, term: int) -> None:
    assert Claim(claim_name(name, term), term, "a", 0.0).array == name


def test_a_claim_on_an_array_whose_name_has_an_at_sign_is_renewed_under_that_name(
    backend: PosixL2,
) -> None:
    name = name_of("cat/img@2x")  # a mirror version's cat/img@2x.png
    mine = take(backend, name, "a", now=100.0, seconds=10)
    assert mine == Claim(claim_name(name, 1), 1, "a", 110.0)
    renewed = renew(backend, mine, now=105.0, seconds=10)
    assert renewed == Claim(claim_name(name, 2), 2, "a", 115.0)
    assert claims(backend, name) == [renewed]  # the old term let go, the new one there
    # Another node cold on the same array finds A's renewed claim live, and waits for it.
    assert take(backend, name, "b", now=112.0, seconds=10) == renewed


def test_another_arrays_claim_with_a_name_as_long_is_not_this_arrays(backend: PosixL2) -> None:
    # Two uuids of one shard and one length (as every uuid of a version is): their
    # claims lie side by side in one directory of the shared filesystem.
    mine, theirs = name_of("ab0001"), name_of("ab0002")
    held = take(backend, theirs, "b", now=100.0, seconds=10)
    assert held == Claim(claim_name(theirs, 1), 1, "b", 110.0)
    assert claims(backend, mine) == []
    # Nobody holds this array: the node claims it and decodes, rather than wait on B.
    assert take(backend, mine, "a", now=101.0, seconds=10) == Claim(
        claim_name(mine, 1), 1, "a", 111.0
    )
    assert claims(backend, theirs) == [held]
