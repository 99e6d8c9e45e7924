"""The stats schema: every figure of stats.json, defined once (its name, kind, unit, help).

stats.json (daemon/stats.py), the Prometheus text (metrics.py), `decodefs stats
--all` (cli/commands.py) and docs/operations.md's table all come from
``STATS``, and tests/test_stats.py checks that they agree with it and with the
Metrics and L2Metrics counters behind it. A schema, no behaviour: this module
imports nothing of decodefs.
"""

from __future__ import annotations

from typing import Final, Literal, NamedTuple

__all__ = ["STATS", "Stat", "StatKind"]

StatKind = Literal[
    "counter",  # a count since the daemon started (Prometheus: <name>_total)
    "gauge",  # a figure now
    "flag",  # true or false now (Prometheus: a gauge of 1 or 0)
    "text",  # a string (Prometheus: an info metric, <name>_info{<name>="..."} 1)
    "state",  # one of ``states`` (Prometheus: a gauge per state, 1 for the current one)
    "counter by kind",  # {kind: count} (Prometheus: <name>_total{kind="..."})
    "histogram",  # {"count", "sum", "buckets": {bound: cumulative count}}
    "per version",  # {version: {"originals", "layout", ...}} (Prometheus: originals)
    "per version and size",  # {version: {size: {"entries", "bytes"}}} (Prometheus: bytes)
]


class Stat(NamedTuple):
    """One figure of stats.json: its key, what kind of figure, its unit and what it means."""

    name: str
    kind: StatKind
    unit: str  # what it counts or measures: "opens", "bytes", "seconds", ...
    help: str
    l2: bool = False  # only with an ``l2`` configured
    daemon: bool = False  # added by the daemon, not known in-process (pid, mountpoint)
    states: tuple[str, ...] = ()  # a "state"'s possible values
    # Its Prometheus name below "decodefs_", if not ``name``: Prometheus's naming rules put
    # the unit last (before a counter's "_total"): bytes_served is decodefs_served_bytes.
    family: str = ""

    @property
    def prometheus(self) -> str:
        """Its Prometheus metric family's name (counters add ``_total`` to each sample)."""
        return f"decodefs_{self.family or self.name}"


STATS: Final = (
    Stat("hits", "counter", "opens", "Opens served from a stored or memory-held array"),
    Stat(
        "misses",
        "counter",
        "opens",
        "Opens that needed a decode, including ones that joined another's",
    ),
    Stat("decodes", "counter", "decodes", "Decodes that ran, failed ones and rebuilds included"),
    Stat("decode_errors", "counter", "originals", "Originals that failed to decode"),
    Stat(
        "failed_originals",
        "gauge",
        "originals",
        "Originals listed in failed.json: failed to decode, and not decoded since",
    ),
    Stat(
        "failed_not_listed",
        "counter",
        "failures",
        "Decode failures left out of failed.json because its list was at its bound",
    ),
    Stat(
        "coalesced",
        "counter",
        "opens",
        "Opens that joined a decode already running for the same file",
    ),
    Stat(
        "corrupt_entries",
        "counter",
        "entries",
        "Stored entries that failed verification and were rebuilt",
    ),
    Stat("store_bytes", "gauge", "bytes", "Bytes of stored entries"),
    Stat(
        "store_by_size",
        "per version and size",
        "bytes",
        "Stored entries and their bytes, by version and size",
        family="stored_bytes",
    ),
    Stat("store_entries", "gauge", "entries", "Stored entries"),
    Stat(
        "store_usage_complete",
        "flag",
        "",
        "True once the store is counted (false while a scan fills a new catalog)",
    ),
    Stat("store_writable", "flag", "", "True if the store accepts new entries"),
    Stat(
        "store_max_bytes",
        "gauge",
        "bytes",
        "The configured store limit (max_store_bytes; none: null, and no sample in Prometheus)",
    ),
    Stat(
        "evictions",
        "counter",
        "entries",
        "Stored entries evicted to stay within the capacity limits",
    ),
    Stat(
        "store_write_errors",
        "counter",
        "arrays",
        "Arrays the store refused (full, read-only, at its limit)",
    ),
    Stat(
        "memory_fallbacks",
        "counter",
        "arrays",
        "Arrays kept in memory because the store refused them",
    ),
    Stat(
        "memory_cache_bytes",
        "gauge",
        "bytes",
        "Bytes of arrays held in memory because the store did not take them",
    ),
    Stat(
        "memory_cache_entries",
        "gauge",
        "arrays",
        "Arrays held in memory because the store did not take them",
    ),
    Stat(
        "memory_bytes",
        "gauge",
        "bytes",
        "Bytes of arrays in memory: decodes in flight and arrays served from memory",
    ),
    Stat(
        "memory_limit_bytes",
        "gauge",
        "bytes",
        "The budget for arrays in memory (memory_cache_bytes)",
    ),
    Stat("memory_waits", "counter", "decodes", "Decodes that waited for the memory budget"),
    Stat(
        "memory_refills",
        "counter",
        "reads",
        "Reads of an open file whose array the memory cache had dropped",
    ),
    Stat(
        "decode_memory_bytes",
        "gauge",
        "bytes",
        "Bytes that decodes running now may take (decode_peak_bytes)",
    ),
    Stat(
        "decode_memory_limit_bytes",
        "gauge",
        "bytes",
        "The budget for decodes running at once (decode_memory_bytes)",
    ),
    Stat("decode_memory_waits", "counter", "decodes", "Decodes that waited for decode memory"),
    Stat(
        "unlisted_not_stored",
        "counter",
        "arrays",
        "Arrays of sizes their version does not list, served from memory, not stored",
    ),
    Stat(
        "bytes_served",
        "counter",
        "bytes",
        "Bytes delivered in READ replies",
        family="served_bytes",
    ),
    Stat("inflight_decodes", "gauge", "decodes", "Decodes running in the pool"),
    Stat("queued_decodes", "gauge", "decodes", "Decodes waiting for a pool slot"),
    Stat(
        "background_decodes",
        "counter",
        "decodes",
        "Decodes run by the daemon's own background warm",
    ),
    Stat(
        "warm_decodes",
        "counter",
        "decodes",
        "Decodes that warm requests (decodefs warm, O_NONBLOCK opens) ran",
    ),
    Stat(
        "warm_not_stored", "counter", "arrays", "Warm requests whose array the store would not take"
    ),
    Stat(
        "direct_hits",
        "counter",
        "arrays",
        "Arrays read_array() read straight from the store, as reported by readers",
    ),
    Stat(
        "store_reads_inline",
        "counter",
        "reads",
        "READs served from resident store pages on the request loop",
    ),
    Stat(
        "store_reads_threaded", "counter", "reads", "READs of the store served by a worker thread"
    ),
    Stat(
        "page_drops",
        "counter",
        "entries",
        "Entry files whose page cache the daemon brought in, then dropped",
    ),
    Stat("errors", "counter by kind", "errors", "Errors answered or met, by kind"),
    Stat(
        "decode_seconds", "histogram", "seconds", "Time to decode, resize and serialize one array"
    ),
    Stat("uptime_seconds", "gauge", "seconds", "Seconds since the daemon started"),
    Stat(
        "versions", "per version", "originals", "Originals indexed, by version", family="originals"
    ),
    Stat("pid", "gauge", "", "The serving process's id", daemon=True),
    Stat("mountpoint", "text", "", "Where the daemon is mounted", daemon=True),
    Stat(
        "version",
        "text",
        "",
        "The decodefs the serving process runs (+g<commit> when from a clone)",
        daemon=True,
        family="build",
    ),
    Stat(
        "log",
        "text",
        "",
        "Where the serving process's log lines go: its file, or the journal",
        daemon=True,
    ),
    Stat(
        "started",
        "gauge",
        "seconds",
        "When the serving process started (Unix time)",
        daemon=True,
        family="start_time_seconds",
    ),
    Stat(
        "claim_waits",
        "counter",
        "decodes",
        "Misses that waited while another serving process of the mount decoded the array",
    ),
    # -- the mount's holder (holder/): the same for every serving process of the mount --
    Stat("holder_pid", "gauge", "", "The process that holds the mount", daemon=True),
    Stat(
        "holder_state",
        "state",
        "",
        "What the holder is doing: serving, switching (a reload or restart), backing off "
        "(serving processes keep dying: requests are answered EIO), starting, stopping",
        daemon=True,
        states=("serving", "switching", "backing off", "starting", "stopping", "none"),
    ),
    Stat("holder_version", "text", "", "The decodefs the holder runs", daemon=True),
    Stat(
        "mount_started",
        "gauge",
        "seconds",
        "When the mount was mounted (Unix time)",
        daemon=True,
        family="mount_start_time_seconds",
    ),
    Stat(
        "handovers",
        "counter",
        "switches",
        "Serving processes that took the mount over (reloads, restarts, crashes)",
        daemon=True,
    ),
    Stat("crashes", "counter", "processes", "Serving processes that died", daemon=True),
    Stat(
        "handovers_refused",
        "counter",
        "switches",
        "Switches refused (the new process answered the kernel's INIT differently)",
        daemon=True,
    ),
    Stat(
        "remounts",
        "counter",
        "mounts",
        "Times the holder mounted afresh because a crash could not be handed over",
        daemon=True,
    ),
    Stat(
        "holder_eio_answers",
        "counter",
        "requests",
        "Requests the holder answered EIO while no serving process could run",
        daemon=True,
    ),
    Stat("holder_rss_bytes", "gauge", "bytes", "The holder's resident memory", daemon=True),
    Stat(
        "standby_pid",
        "gauge",
        "",
        "The serving process ready to take over if the serving one dies (standby = true)",
        daemon=True,
    ),
    Stat(
        "switch_pause_seconds",
        "gauge",
        "seconds",
        "How long the last switch kept requests unread: from the old serving process told "
        "to stop reading (or found dead) until the new one served",
        daemon=True,
    ),
    Stat(
        "longest_switch_pause_seconds",
        "gauge",
        "seconds",
        "The longest such pause in the mount's life",
        daemon=True,
    ),
    Stat(
        "decodes_before",
        "counter",
        "decodes",
        "Decodes run by the mount's serving processes before this one, as each last said",
        daemon=True,
    ),
    Stat(
        "mount_decodes",
        "counter",
        "decodes",
        "Decodes run in the mount's life, by every serving process (decodes_before + decodes)",
        daemon=True,
    ),
    Stat(
        "last_problem",
        "text",
        "",
        "The holder's last crash or refused switch, if any",
        daemon=True,
    ),
    # -- the cluster's L2 tier (cluster/tier.py) --
    Stat("l2", "text", "", "The L2 tier (its URL or directory)", l2=True),
    Stat(
        "l2_check",
        "state",
        "",
        "Whether L2 can be used: checking (at start), ok (its last call answered), failing",
        l2=True,
        states=("checking", "ok", "failing"),
    ),
    Stat(
        "l2_problem",
        "text",
        "",
        "Why L2 cannot be used (credentials, unreachable, ...), empty while it answers",
        l2=True,
    ),
    Stat(
        "l2_state",
        "state",
        "",
        "The L2 circuit breaker's state",
        l2=True,
        states=("closed", "open", "half-open"),
    ),
    Stat("l2_breaker_opens", "counter", "times", "Times the L2 circuit breaker opened", l2=True),
    Stat(
        "l2_hits",
        "counter",
        "arrays",
        "Arrays fetched from L2 and verified instead of decoded",
        l2=True,
    ),
    Stat(
        "l2_misses",
        "counter",
        "arrays",
        "Arrays L2 could not give (absent, bad or unreachable), decoded here",
        l2=True,
    ),
    Stat(
        "l2_bypassed",
        "counter",
        "arrays",
        "Arrays decoded without asking L2 while its circuit breaker was open",
        l2=True,
    ),
    Stat("l2_leases", "counter", "claims", "Claims this node took to decode an array", l2=True),
    Stat(
        "l2_lease_renewals",
        "counter",
        "claims",
        "Claims this node renewed while decoding and publishing",
        l2=True,
    ),
    Stat(
        "l2_lease_waits",
        "counter",
        "waits",
        "Times this node waited for another node's claim",
        l2=True,
    ),
    Stat(
        "l2_lease_timeouts",
        "counter",
        "waits",
        "Claim waits that ran out before the holder published",
        l2=True,
    ),
    Stat("l2_publishes", "counter", "objects", "Objects this node created in L2", l2=True),
    Stat(
        "l2_publish_exists",
        "counter",
        "objects",
        "Publishes that found the object in L2 already",
        l2=True,
    ),
    Stat(
        "l2_publish_dropped",
        "counter",
        "arrays",
        "Publishes given up (queue full, L2 failing)",
        l2=True,
    ),
    Stat("l2_publish_queue", "gauge", "arrays", "Arrays waiting to be published to L2", l2=True),
    Stat(
        "l2_publish_queue_bytes",
        "gauge",
        "bytes",
        "Bytes of arrays waiting to be published to L2",
        l2=True,
    ),
    Stat(
        "l2_corrupt",
        "counter",
        "objects",
        "L2 objects that failed verification (never served; replaced)",
        l2=True,
    ),
    Stat(
        "l2_bytes_fetched",
        "counter",
        "bytes",
        "Bytes of verified objects fetched from L2",
        l2=True,
        family="l2_fetched_bytes",
    ),
    Stat("l2_errors", "counter by kind", "calls", "Failed L2 calls, by kind", l2=True),
    Stat(
        "l2_fetch_seconds",
        "histogram",
        "seconds",
        "Time of one L2 fetch (a GET, found or not)",
        l2=True,
    ),
)
