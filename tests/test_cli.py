"""What the CLI prints when all goes well: the stats table and make-sample's help."""

from __future__ import annotations

import pytest

from decodefs.cli import main
from decodefs.cli.status import format_stats


def test_the_stats_table_shows_every_counter_a_user_acts_on() -> None:
    stats = {
        "hits": 42,
        "direct_hits": 120,
        "misses": 38,
        "coalesced": 7,
        "decodes": 31,
        "decode_seconds": {"count": 31, "sum": 3.1},
        "warm_decodes": 11,
        "background_decodes": 5,
        "decode_errors": 3,
        "corrupt_entries": 2,
        "store_bytes": 3 << 20,
        "store_entries": 29,
        "store_max_bytes": 1 << 30,
        "evictions": 13,
        "warm_not_stored": 17,
        "memory_fallbacks": 19,
        "store_write_errors": 23,
        "memory_waits": 37,
        "decode_memory_waits": 41,
        "errors": {"EIO": 3, "ENOENT": 9},
        "versions": {"v1": {"originals": 200, "layout": "uuid", "duplicates_left_out": 4}},
    }
    table = rows(format_stats(stats))
    assert table["hits"] == "42 through the mount"
    assert table["direct hits"] == "120 read straight from the store by read_array"
    assert table["misses"] == "38 (7 joined a decode already running)"
    assert table["hit ratio"] == "81.0%"  # (42 + 120) / 200: read_array's hits count
    assert table["decodes"] == "31 (mean 100 ms); 11 for warm requests, 5 by the background warm"
    assert table["decode errors"].startswith("3 ")
    assert table["corrupt entries rebuilt"] == "2"
    assert table["store"] == "3.0 MiB in 29 entries of 1.0 GiB"
    assert table["evictions"] == "13"
    assert table["warm not stored"].startswith("17 ")
    assert table["memory fallbacks"].startswith("19 (23 store write errors")
    assert table["memory waits"] == "37 (memory_cache_bytes), 41 (decode_memory_bytes)"
    assert table["errors"] == "EIO 3, ENOENT 9"
    assert table["version v1"] == (
        "200 originals (uuid layout), 4 duplicate names left out; stored: nothing"
    )
    assert rows(format_stats({"hits": 1}))["errors"] == "none"  # shown when there are none


def rows(table: str) -> dict[str, str]:
    """label -> value of each line of the table (two spaces or more between them)."""
    pairs = (line.split("  ", 1) for line in table.splitlines())
    return {label.strip(): value.strip() for label, value in pairs}


def test_make_sample_help_says_what_each_option_does_and_its_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["make-sample", "--help"])
    assert exit_.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    for option, default in [("--count", 32), ("--width", 1600), ("--height", 1200), ("--seed", 0)]:
        assert f"{option} {option[2:].upper()}" in help_text
        assert f"(default: {default})" in help_text
