"""A live mount's status files, read and put in words for people: the `decodefs stats`
tables and what `decodefs mount` says it serves. Knows no argument and no daemon code.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Final

from ..common import status
from ..common.protocol import CONFIG_FILE, STATS_FILE, FailedList
from ..common.stats_schema import STATS, Stat

__all__ = [
    "counter",
    "failed_summary",
    "format_all_stats",
    "format_stats",
    "human_bytes",
    "l2_problem",
    "read_stats",
    "read_status",
    "serving",
]


def read_stats(mountpoint: Path) -> dict[str, object]:
    return read_status(mountpoint, STATS_FILE)


def read_status(mountpoint: Path, name: str) -> dict[str, object]:
    """One JSON status file of a mount; {} if it cannot be read or is not a JSON object."""
    try:
        return status.read_status(mountpoint, name)
    except (OSError, ValueError):
        return {}


def counter(stats: dict[str, object], key: str) -> int:
    """An integer of a stats.json snapshot; 0 if absent (an older daemon) or not one."""
    value = stats.get(key, 0)
    return value if isinstance(value, int) else 0


def human_bytes(value: int) -> str:
    amount = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if amount < 1024 or unit == "TiB":
            return f"{amount:.0f} {unit}" if unit == "B" else f"{amount:.1f} {unit}"
        amount /= 1024
    raise AssertionError("unreachable")


def serving(mountpoint: Path) -> list[str]:
    """What a live mount serves, one line per version and one for the store (its
    status files; nothing is listed but the first entry of a uuid size directory)."""
    stats, config = read_stats(mountpoint), read_status(mountpoint, CONFIG_FILE)
    served = stats.get("versions")
    configured = config.get("versions")
    if not isinstance(served, dict) or not isinstance(configured, dict):
        return []
    width = max((len(name) for name in served), default=0)
    lines = []
    for name, figures in served.items():
        settings = configured.get(name)
        if not isinstance(figures, dict) or not isinstance(settings, dict):
            continue
        sizes = settings.get("sizes") or []
        size = str(sizes[0]) if sizes else "<size>"
        directory = mountpoint / name / size
        if figures.get("layout") == "mirror":
            where = f"{directory}/<folder>/<name>.npy (mirror layout)"
        else:
            first = _first_entry(directory) if figures.get("originals") else None
            where = f"{directory}/<uuid>.npy (uuid layout{f', e.g. {first}' if first else ''})"
        left_out = figures.get("duplicates_left_out")
        skipped = f" ({left_out:,} duplicate names left out)" if left_out else ""
        lines.append(
            f"  {name:<{width}}  {figures.get('originals', 0):,} originals{skipped} from "
            f"{settings.get('source')}, sizes {', '.join(map(str, sizes))}: {where}"
        )
    limit = counter(stats, "store_max_bytes")
    lines.append(
        f"  store {config.get('store')}: {human_bytes(counter(stats, 'store_bytes'))} in "
        f"{counter(stats, 'store_entries'):,} arrays"
        + (f" (limit {human_bytes(limit)})" if limit else "")
        + ("" if stats.get("store_writable", True) else ", NOT WRITABLE")
    )
    return lines


def l2_problem(mountpoint: Path, timeout: float) -> str | None:
    """Why the mount's L2 cannot be used, once its check at start has answered (waited
    for up to two L2 call timeouts), or None if it can (or is still being checked)."""
    deadline = time.monotonic() + 2 * timeout + 2
    stats = read_stats(mountpoint)
    while stats.get("l2_check") == "checking" and time.monotonic() < deadline:
        time.sleep(0.05)
        stats = read_stats(mountpoint)
    if stats.get("l2_check") != "failing":
        return None
    return (
        f"l2 {stats.get('l2')} is configured but cannot be used: "
        f"{stats.get('l2_problem') or 'it does not answer'}; every miss decodes here until it "
        "answers (`decodefs stats` says when it does)"
    )


def _first_entry(directory: Path) -> str | None:
    """The first name a size directory lists (one READDIR), for an example path."""
    try:
        with os.scandir(directory) as entries:
            first = next(entries, None)
    except OSError:
        return None
    return None if first is None else first.name


_STAT_NAMES: Final = frozenset(stat.name for stat in STATS)


# How many failed originals `decodefs stats` names (`decodefs failed` lists them all).
FAILED_SHOWN: Final = 10


def failed_summary(listed: FailedList, version: str | None, stats: dict[str, object]) -> str:
    """The line after `decodefs failed`'s list: how many, since when, what is not listed."""
    count = len(listed.failed)
    what = f"originals of {version}" if version else "originals"
    since = _since(stats)
    if not count:
        text = f"decodefs: no {what} failed to decode{since}"
    else:
        text = (
            f"decodefs: {count:,} {what} failed to decode{since} (their arrays are EIO; "
            "a decode that succeeds later takes one off the list)"
        )
    if listed.not_listed:
        text += (
            f"; {listed.not_listed:,} more failures were not listed (the list is at its "
            "bound; the daemon's log names them)"
        )
    return text


def _since(stats: dict[str, object]) -> str:
    started = stats.get("started")
    if not isinstance(started, int | float):
        return ""
    return " since the daemon started at " + time.strftime(
        "%Y-%m-%d %H:%M:%S", time.localtime(started)
    )


def format_stats(stats: dict[str, object], failed: FailedList | None = None) -> str:
    """The human table printed by `decodefs stats`: every counter a user acts on; with
    ``failed`` (failed.json), the first originals that failed to decode."""

    def n(key: str) -> int:
        assert key in _STAT_NAMES, key  # every figure shown is one of stats_schema.STATS
        return counter(stats, key)

    if "hits" not in stats:  # no serving process answers: what its holder says
        return _table(_served_by(stats))
    reads = n("hits") + n("direct_hits") + n("misses")
    latency = stats.get("decode_seconds")
    decode_count = latency.get("count", 0) if isinstance(latency, dict) else 0
    decode_sum = latency.get("sum", 0.0) if isinstance(latency, dict) else 0.0
    mean_ms = f"{1000 * decode_sum / decode_count:.0f} ms" if decode_count else "-"
    rows = [
        *_served_by(stats),
        ("hits", f"{n('hits'):,} through the mount"),
        ("direct hits", f"{n('direct_hits'):,} read straight from the store by read_array"),
        ("misses", f"{n('misses'):,} ({n('coalesced'):,} joined a decode already running)"),
        (
            "hit ratio",
            f"{100 * (n('hits') + n('direct_hits')) / reads:.1f}%" if reads else "-",
        ),
        (
            "decodes",
            f"{n('decodes'):,} (mean {mean_ms}); {n('warm_decodes'):,} for warm requests, "
            f"{n('background_decodes'):,} by the background warm",
        ),
        ("decode errors", _decode_errors(stats, failed)),
        ("corrupt entries rebuilt", f"{n('corrupt_entries'):,}"),
        (
            "store",
            f"{human_bytes(n('store_bytes'))} in {n('store_entries'):,} entries"
            + (f" of {human_bytes(n('store_max_bytes'))}" if n("store_max_bytes") else "")
            + ("" if stats.get("store_usage_complete", True) else " (still counting)")
            + ("" if stats.get("store_writable", True) else ", NOT WRITABLE"),
        ),
        ("evictions", f"{n('evictions'):,}"),
        ("warm not stored", f"{n('warm_not_stored'):,} (the store would not take them)"),
        (
            "memory fallbacks",
            f"{n('memory_fallbacks'):,} ({n('store_write_errors'):,} store write errors; "
            f"{human_bytes(n('memory_cache_bytes'))} held)",
        ),
        (
            "memory waits",
            f"{n('memory_waits'):,} (memory_cache_bytes), "
            f"{n('decode_memory_waits'):,} (decode_memory_bytes)",
        ),
        ("bytes served", human_bytes(n("bytes_served"))),
        ("decodes in flight", f"{n('inflight_decodes'):,} ({n('queued_decodes'):,} queued)"),
    ]
    errors = stats.get("errors")
    counts = sorted(errors.items()) if isinstance(errors, dict) else []
    rows.append(("errors", ", ".join(f"{k} {v:,}" for k, v in counts) or "none"))
    versions = stats.get("versions")
    stored = stats.get("store_by_size")
    if isinstance(versions, dict):
        for name, figures in sorted(versions.items()):
            if isinstance(figures, dict):
                left = figures.get("duplicates_left_out")
                held = stored.get(name) if isinstance(stored, dict) else None
                usage = _usage_text({name: held}, named=False) if held else "nothing"
                rows.append(
                    (
                        f"version {name}",
                        f"{figures.get('originals', 0):,} originals ({figures.get('layout')} "
                        "layout)"
                        + (f", {left:,} duplicate names left out" if left else "")
                        + f"; stored: {usage}",
                    )
                )
    if "l2" in stats:  # the cluster's L2 (cluster/tier.py)
        problem = stats.get("l2_problem")
        rows.append(
            (
                "L2",
                f"{stats['l2']} ({stats.get('l2_state')}): {n('l2_hits'):,} hits, "
                f"{n('l2_misses'):,} misses, {n('l2_publishes'):,} published, "
                f"{n('l2_lease_waits'):,} lease waits, {n('l2_corrupt'):,} corrupt"
                + (f"; CANNOT BE USED: {problem}" if problem else ""),
            )
        )
    return _table(rows)


def _table(rows: list[tuple[str, str]]) -> str:
    width = max((len(label) for label, _ in rows), default=0)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def _decode_errors(stats: dict[str, object], failed: FailedList | None) -> str:
    """The decode errors row: the count, and the first failed originals, one a line."""
    text = f"{counter(stats, 'decode_errors'):,}"
    if failed is None or not (failed.failed or failed.not_listed):
        return text + " (originals that failed: `decodefs failed` lists them)"
    listed = len(failed.failed)
    text += f"; {listed:,} originals fail now (`decodefs failed` lists them)"
    for row in failed.failed[:FAILED_SHOWN]:
        text += f"\n    {row.version} {row.key}: {row.path}: {row.reason}"
    if listed > FAILED_SHOWN:
        text += f"\n    ... and {listed - FAILED_SHOWN:,} more"
    if failed.not_listed:
        text += f"\n    {failed.not_listed:,} more failures not listed (the list is at its bound)"
    return text


def _usage_text(value: object, *, named: bool = True) -> str:
    """A store_by_size figure in words: ``v1/224 4.6 MiB in 32, v1/64 ...``."""
    parts = []
    for version, sizes in sorted(value.items()) if isinstance(value, dict) else []:
        if not isinstance(sizes, dict):
            continue
        for size, held in sorted(sizes.items(), key=lambda item: int(item[0])):
            if isinstance(held, dict):
                where = f"{version}/{size}" if named else f"{size}"
                parts.append(
                    f"{where} {human_bytes(int(held.get('bytes', 0)))} in "
                    f"{int(held.get('entries', 0)):,}"
                )
    return ", ".join(parts)


def _served_by(stats: dict[str, object]) -> list[tuple[str, str]]:
    """The row naming the process that serves the mount: its version, pid and start."""
    version, started, pid = stats.get("version"), stats.get("started"), stats.get("pid")
    when = "at an unknown time"
    if isinstance(started, int | float):
        when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started))
    rows: list[tuple[str, str]] = []
    if version is not None:
        rows.append(("serving", f"decodefs {version} (pid {pid}), started {when}"))
    holder = stats.get("holder_pid")
    if holder is not None:
        crashes, handovers = counter(stats, "crashes"), counter(stats, "handovers")
        since = stats.get("mount_started")
        mounted = (
            time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(since))
            if isinstance(since, int | float)
            else "an unknown time"
        )
        rows.append(
            (
                "holder",
                f"{holder} (decodefs {stats.get('holder_version')}): "
                f"{stats.get('holder_state')}, mounted since {mounted}; {handovers:,} "
                f"handover{'s' if handovers != 1 else ''}, {crashes:,} "
                f"crash{'es' if crashes != 1 else ''}, "
                f"{counter(stats, 'handovers_refused'):,} refused",
            )
        )
        problem = stats.get("last_problem")
        if problem:
            rows.append(("last problem", str(problem)))
        if stats.get("holder_state") == "backing off":
            rows.append(("", "no serving process runs: every request is answered EIO"))
    return rows


def format_all_stats(stats: dict[str, object]) -> str:
    """`decodefs stats --all`: every figure of stats_schema.STATS the daemon reported, one a
    line: its name, its value with its unit, and what it means."""
    rows = [
        (stat.name, _figure_text(stat, stats[stat.name]), stat.help)
        for stat in STATS
        if stat.name in stats
    ]
    name_width = max((len(name) for name, _, _ in rows), default=0)
    value_width = max((len(value) for _, value, _ in rows), default=0)
    return "\n".join(
        f"{name:<{name_width}}  {value:<{value_width}}  {meaning}" for name, value, meaning in rows
    )


def _figure_text(stat: Stat, value: object) -> str:
    """One figure as `decodefs stats --all` shows it."""
    if value is None:
        return "none"
    if stat.kind == "flag":
        return "yes" if value else "no"
    if stat.kind == "counter by kind":
        counts = sorted(value.items()) if isinstance(value, dict) else []
        return ", ".join(f"{kind} {count:,}" for kind, count in counts) or "none"
    if stat.kind == "histogram":
        figures = value if isinstance(value, dict) else {}
        count, total = figures.get("count", 0), figures.get("sum", 0.0)
        return f"{count:,} (mean {1000 * total / count:.0f} ms)" if count else "0"
    if stat.kind == "per version and size":
        return _usage_text(value) or "none"
    if stat.kind == "per version":
        versions = sorted(value.items()) if isinstance(value, dict) else []
        return ", ".join(
            f"{name}: {figures.get('originals', 0):,} originals ({figures.get('layout')})"
            for name, figures in versions
            if isinstance(figures, dict)
        )
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if stat.unit == "bytes":
        return f"{value:,} bytes ({human_bytes(int(value))})"
    if stat.unit == "seconds":
        return f"{value:,.1f} s"
    return f"{value:,} {stat.unit}".rstrip()
