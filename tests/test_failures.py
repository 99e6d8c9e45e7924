"""The list of originals that failed to decode (daemon/failures.py): what it keeps, and
its bound against a corpus of bad files."""

from __future__ import annotations

import json

from decodefs.common.protocol import FailedList
from decodefs.daemon.failures import REASON_MAX, FailedOriginals


def test_a_failure_is_listed_once_with_every_size_and_goes_when_it_decodes() -> None:
    failed = FailedOriginals(clock=lambda: 1000.0)
    failed.add("v1", "abc", 224, "/data/v1/abc.jpg", "image file is truncated")
    failed.add("v1", "abc", 64, "/data/v1/abc.jpg", "image file is truncated")
    failed.add("v2", "abc", 64, "/data/v2/abc.jpg", "cannot identify image file")
    listed = failed.listed("v1")
    assert [(r.version, r.key, r.path, r.reason, r.sizes, r.time) for r in listed.failed] == [
        ("v1", "abc", "/data/v1/abc.jpg", "image file is truncated", (64, 224), 1000.0)
    ]
    assert len(failed) == 2
    failed.discard("v1", "abc")
    assert [r.version for r in failed.listed().failed] == ["v2"]
    failed.discard("v2", "abc")
    assert failed.bytes == 0 and len(failed) == 0


def test_many_bad_files_cost_a_bounded_list_and_the_rest_are_counted() -> None:
    failed = FailedOriginals(limit_bytes=64 * 1024)
    long_reason = "x" * 10_000
    for i in range(100_000):
        failed.add("v1", f"{i:08d}", 224, f"/data/v1/{i:08d}.jpg", long_reason)
    assert failed.bytes <= 64 * 1024
    assert 0 < len(failed) < 1000
    assert failed.not_listed == 100_000 - len(failed)
    assert all(len(r.reason) == REASON_MAX for r in failed.listed().failed)
    text = failed.to_json()
    assert len(text) < 2 * 64 * 1024  # the status file is as bounded as the list
    again = FailedList.from_json(json.loads(text))
    assert again == failed.listed()
    failed.discard("v1", "00000000")  # room again: the next failure is listed
    failed.add("v1", "late", 224, "/data/v1/late.jpg", "truncated")
    assert "late" in {r.key for r in failed.listed().failed}
