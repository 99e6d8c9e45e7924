"""The store's catalog: usage totals and LRU order in SQLite."""

from __future__ import annotations

from pathlib import Path

from decodefs.store.catalog import Catalog


def test_rows_totals_and_lru_order(tmp_path: Path) -> None:
    catalog, empty = Catalog.open(str(tmp_path / "catalog.sqlite3"))
    assert empty
    assert catalog.put("v1", 224, "a", 100, now=3.0)
    assert catalog.put("v1", 224, "b", 100, now=1.0)
    assert catalog.put("v1", 64, "a", 10, now=2.0)
    assert not catalog.put("v1", 224, "a", 100, now=4.0)  # a rewrite, not a new row
    assert catalog.totals() == (3, 210)
    assert [(r.size, r.key) for r in catalog.oldest(10)] == [(224, "b"), (64, "a"), (224, "a")]
    catalog.touch([("v1", 224, "b", 5.0), ("v1", 224, "gone", 9.0)])
    assert [r.key for r in catalog.oldest(2)] == ["a", "a"]
    assert [r.key for r in catalog.oldest(10, skip=2)] == ["b"]
    assert catalog.remove("v1", 224, "b") == 100
    assert catalog.remove("v1", 224, "b") is None
    assert catalog.contains("v1", 64, "a") and not catalog.contains("v1", 224, "b")
    assert catalog.keys("v1", 224) == {"a"}
    catalog.close()


def test_it_survives_a_reopen_and_remembers_being_filled(tmp_path: Path) -> None:
    path = str(tmp_path / "catalog.sqlite3")
    catalog, empty = Catalog.open(path)
    catalog.fill([("v1", 8, "x", 1, 1.0), ("v1", 8, "y", 2, 2.0)])
    catalog.mark_filled()
    catalog.close()
    again, empty = Catalog.open(path)
    assert not empty
    assert again.totals() == (2, 3)
    again.fill([("v1", 8, "x", 999, 9.0)])  # a scan never overrides what is known
    assert again.totals() == (2, 3)
    again.close()


def test_non_utf8_uuids_round_trip(tmp_path: Path) -> None:
    catalog, _ = Catalog.open(str(tmp_path / "c.sqlite3"))
    odd = b"caf\xe9".decode("utf-8", "surrogateescape")  # a Latin-1 file name
    catalog.put("v1", 8, odd, 5, now=1.0)
    assert catalog.keys("v1", 8) == {odd}
    assert catalog.oldest(1)[0].key == odd
    catalog.close()


def test_a_damaged_catalog_is_moved_aside_and_rebuilt(tmp_path: Path) -> None:
    path = tmp_path / "catalog.sqlite3"
    path.write_bytes(b"this is not a database" * 100)
    catalog, empty = Catalog.open(str(path))
    assert empty and catalog.totals() == (0, 0)
    assert (tmp_path / "catalog.sqlite3.damaged").exists()
    catalog.close()


def test_damaged_pages_are_caught_by_quick_check(tmp_path: Path) -> None:
    path = tmp_path / "catalog.sqlite3"
    catalog, _ = Catalog.open(str(path))
    catalog.fill([("v1", 224, f"u{i:05d}", 150_000, float(i)) for i in range(3000)])
    catalog.close()
    data = bytearray(path.read_bytes())
    for offset in range(3 * 4096, 3 * 4096 + 64):  # a b-tree page header and cell pointers
        data[offset] ^= 0x5A
    path.write_bytes(bytes(data))
    again, empty = Catalog.open(str(path))
    assert empty and again.totals() == (0, 0)  # moved aside and started afresh
    assert (tmp_path / "catalog.sqlite3.damaged").exists()
    again.close()


def test_rows_are_synced_before_files_are_renamed(tmp_path: Path) -> None:
    catalog, _ = Catalog.open(str(tmp_path / "catalog.sqlite3"))
    (mode,) = catalog._db.execute("PRAGMA synchronous").fetchone()
    assert mode == 2  # FULL: the superset invariant survives a power cut
    catalog.close()
