"""The short version of scripts/reliability (--quick): each part's invariants, on real mounts.

The script mounts its own daemons through the CLI and checks every invariant itself (each
part's "problems"); these tests run it once and assert the figures a maintainer quotes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from decodefs.common.mounts import mounts
from tests.conftest import needs_root

# The script mounts a dozen daemons in turn: minutes under load, not the usual 120 s.
pytestmark = [needs_root, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("reliability") / "report.json"
    result = subprocess.run(
        [sys.executable, "-m", "scripts.reliability", "--quick", "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert out.exists(), result.stdout + result.stderr
    data: dict[str, Any] = json.loads(out.read_text())
    data["output"] = result.stdout + result.stderr
    return data


def figures(report: dict[str, Any], key: str) -> dict[str, Any]:
    part = report["parts"][key]
    assert part["problems"] == [], part["markdown"]
    found: dict[str, Any] = part["figures"]
    return found


def test_load_reads_every_array_right_with_bounded_descriptors_and_memory(
    report: dict[str, Any],
) -> None:
    f = figures(report, "load")
    assert f["reads"] == 4 * 150
    assert f["errors"] == 0 and f["wrong"] == 0
    assert f["misses"] > 0  # the capped store made some reads cold
    assert f["fds_after"] <= f["fds_before"]
    assert f["rss_peak_kib"] < 1792 * 1024
    assert f["verify_status"] == 0 and f["daemon_errors_logged"] == 0


def test_hostile_opens_stay_within_the_memory_budgets(report: dict[str, Any]) -> None:
    f = figures(report, "memory")
    for phase in f["phases"]:
        assert phase["held"] == phase["opens"] and not phase["errors"] and not phase["hung"]
        assert phase["wrong_chunks"] == 0
        assert phase["peak_kib"] <= f["bound_kib"]
    assert f["big_peak_kib"] <= f["bound_kib"]
    assert f["big_after_kib"] <= f["idle_kib"] + 64 * 1024  # freed decode memory went back


def test_kill_9_leaves_no_corrupt_entry_no_temp_file_and_no_uncounted_file(
    report: dict[str, Any],
) -> None:
    f = figures(report, "kill")
    assert f["trials"] == 2
    assert f["temp_after_restart"] == 0 and f["verify_failures"] == 0
    assert f["bad_reads"] == 0 and f["corrupt_entries"] == 0
    assert f["files_without_row"] == 0


def test_store_faults_never_fail_a_read_and_the_store_recovers(report: dict[str, Any]) -> None:
    f = figures(report, "store")
    assert len(f["cases"]) == 4
    for case in f["cases"].values():
        assert case["bad_during"] == 0 and case["bad_after"] == 0
        assert case["recovered_in"] is not None and case["verify_status"] == 0


def test_a_vanished_source_serves_stored_arrays_and_fails_misses_quietly(
    report: dict[str, Any],
) -> None:
    f = figures(report, "sources")
    for scenario in ("unmounted", "renamed"):
        assert f[scenario]["hits_ok"] == f[scenario]["hits"]
        assert set(f[scenario]["misses"]) == {"ENOENT"}
        assert f[scenario]["log_lines"] <= 3 and f[scenario]["alive"]


def test_fuzzed_originals_are_decode_images_array_or_eio(report: dict[str, Any]) -> None:
    f = figures(report, "fuzz")
    assert f["files"] == 300
    assert f["mismatches"] == 0 and f["other_exceptions"] == 0
    assert f["deaths"] == 0 and f["alive"]
    assert f["peak_kib"] <= f["bound_kib"]


def test_another_user_writes_nothing_and_prepared_stores_are_refused(
    report: dict[str, Any],
) -> None:
    f = figures(report, "security")
    off, on = f["columns"]["False"], f["columns"]["True"]
    assert off["read a stored array (`cat`)"] == "no: EACCES"
    assert on["read a stored array (`cat`)"] == "yes, right bytes"
    for cells in (off, on):
        writes = [a for a in cells if a.split()[0] in ("create", "append", "remove", "make")]
        assert writes and all(cells[a].startswith("no") for a in writes)
    assert len(f["refusals"]) == 5
    assert all(row[1] == "1" and row[3] == "no" for row in f["refusals"])


def test_every_mount_and_run_directory_is_gone(report: dict[str, Any]) -> None:
    left = [
        m.mountpoint for m in mounts() for run in report["run_directories"] if run in m.mountpoint
    ]
    assert left == []
    assert not any(Path(run).exists() for run in report["run_directories"])


def test_files_held_open_of_arrays_the_store_does_not_take_starve_no_one(
    report: dict[str, Any],
) -> None:
    # docs/reliability.md, defect 1: these opens used to hang the daemon for good.
    f = figures(report, "memory")["fallback"]
    assert f["opened"] == f["total"] and f["bystander"].startswith("returned")
    # The flood of another user's opens met the per-user limit, and root was served.
    assert f["flood_eagain"] > 0 and f["daemon_eagain"] >= f["flood_eagain"]
    assert f["hit_while_flooded"].startswith("returned")
    assert f["stats_while_flooded"].startswith("returned")
    assert all(read.startswith("returned") for read in f["served"])
    assert f["stuck_after_kill"] == 0 and f["stopped_on_sigterm"]
