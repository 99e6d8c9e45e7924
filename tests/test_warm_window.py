"""`decodefs warm` keeps a bounded window of opens in flight: its memory does not grow with
the corpus (measured with tracemalloc over plain directories of 2,000 and 20,000 arrays,
which it opens as it would a mount's)."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

from decodefs.client.warm import REPORT_EXAMPLES, warm


def corpus(directory: Path, count: int) -> Path:
    directory.mkdir()
    for i in range(count):
        (directory / f"{i:032x}.npy").touch()
    return directory


def peak_of_warm(directory: Path, keys: list[str] | None = None) -> tuple[int, int]:
    tracemalloc.start()
    try:
        report = warm(directory, keys, jobs=4, progress=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return report.done, peak


def test_the_warms_memory_does_not_grow_with_the_corpus(tmp_path: Path) -> None:
    small = corpus(tmp_path / "small", 2_000)
    large = corpus(tmp_path / "large", 20_000)
    done_small, peak_small = peak_of_warm(small)
    done_large, peak_large = peak_of_warm(large)
    assert (done_small, done_large) == (2_000, 20_000)
    # Ten times the arrays, not more memory: a future per key cost ~2 KiB each (39 MB for
    # 20,000), pathlib's interned names ~50 bytes each; now ~50 KB whatever the count.
    assert peak_large < peak_small + 200 * 1024, (peak_small, peak_large)


def test_failures_and_missing_keys_are_counted_and_the_first_named(tmp_path: Path) -> None:
    directory = corpus(tmp_path / "arrays", 10)
    keys = iter([f"{i:032x}" for i in range(10)] + [f"missing-{i}" for i in range(500)])
    report = warm(directory, keys, jobs=2, progress=False, total=510)
    assert (report.done, report.missing_count, report.seen) == (10, 500, 510)
    assert len(report.missing) == REPORT_EXAMPLES
