"""Part 1, load: reader processes x random checked reads through the mount, with the store
capped so that about 30% of reads are cold. It knows nothing of the other parts."""

from __future__ import annotations

import collections
import multiprocessing
import queue
import random
import time
from dataclasses import dataclass
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from pathlib import Path

from decodefs import npy_file_size
from decodefs.common.protocol import TRAILER_SIZE
from decodefs.sample import make_sample_corpus
from tests.helpers import decodefs

from .checks import METHODS, Reference, Tally, percentile, verify_store
from .harness import BOUND_KIB, VERSION, Harness, Part, Sampler, Sizes, mib


@dataclass(frozen=True)
class LoadJob:
    directory: str
    keys: list[str]
    digests: list[str | None]
    size: int
    reads: int
    seed: int


@dataclass
class LoadResult:
    methods: dict[str, int]
    outcomes: dict[str, int]
    examples: list[str]
    latencies: list[float]
    finished: float  # time.monotonic() (CLOCK_MONOTONIC is the same in every process)


def load_reader(job: LoadJob, go: Event, results: Queue[LoadResult]) -> None:
    """One reader process: once told to go, random arrays, each read with a random method,
    each checked."""
    rng = random.Random(job.seed)
    tally = Tally()
    methods: collections.Counter[str] = collections.Counter()
    latencies = []
    go.wait(timeout=600)
    for _ in range(job.reads):
        i = rng.randrange(len(job.keys))
        method = METHODS[rng.randrange(len(METHODS))]
        started = time.perf_counter()
        tally.check(method, Path(job.directory, f"{job.keys[i]}.npy"), job.size, job.digests[i])
        latencies.append(time.perf_counter() - started)
        methods[method] += 1
    results.put(
        LoadResult(dict(methods), dict(tally.outcomes), tally.examples, latencies, time.monotonic())
    )


def part_load(h: Harness, sizes: Sizes) -> Part:
    part = Part("load", "1. Load")
    size = 64
    source = h.directory("load-originals")
    paths = make_sample_corpus(source, sizes.load_originals, 256, 192, seed=11)
    uuids = [p.stem for p in paths]
    digests = Reference().fill(paths, size)
    entry = npy_file_size(size) + TRAILER_SIZE
    stored = round(len(paths) * (1 - sizes.load_cold))
    d = h.daemon("load", {VERSION: source}, sizes=[size], max_store_bytes=stored * entry)
    d.mount()
    warm_list = h.root / "load-warm.txt"
    warm_list.write_text("".join(f"{u}\n" for u in uuids[:stored]))
    warmed = decodefs("warm", d.mountpoint, VERSION, size, "--keys", warm_list, timeout=600)
    part.check(warmed.returncode == 0, f"decodefs warm failed: {warmed.stderr.strip()}")

    before = d.stats()
    rss_before, fds_before = d.kib("VmRSS"), d.fds()
    d.reset_peak()
    context = multiprocessing.get_context("fork")
    results: Queue[LoadResult] = context.Queue()
    go = context.Event()
    directory = str(d.mountpoint / VERSION / str(size))
    readers = [
        context.Process(
            target=load_reader,
            args=(LoadJob(directory, uuids, digests, size, sizes.load_reads, seed), go, results),
            daemon=True,
        )
        for seed in range(sizes.load_readers)
    ]
    for reader in readers:
        reader.start()
    finished: list[LoadResult] = []
    with Sampler(d) as sampler:
        started = time.monotonic()
        go.set()
        deadline = started + 60 + 0.05 * sizes.load_reads * sizes.load_readers
        while len(finished) < len(readers) and time.monotonic() < deadline:
            try:
                finished.append(results.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                break
    if not part.check(
        len(finished) == len(readers),
        f"{len(readers) - len(finished)} readers did not finish in time (a hang?)",
    ):
        d.kill9()
        return part
    for reader in readers:
        reader.join(timeout=30)
    seconds = max(r.finished for r in finished) - started
    # Readers have exited: every descriptor a request opened must be closed again. (The
    # count is the one the wait saw: the daemon's upkeep may hold one a moment later.)
    counted = [fds_before + 1]

    def fds_back() -> bool:
        counted.append(d.fds())
        return counted[-1] <= fds_before

    part.wait(fds_back, 30, f"the daemon's descriptors back to {fds_before}")
    fds_after = counted[-1]
    after = d.stats()
    peak, rss_after = d.kib("VmHWM"), d.kib("VmRSS")
    verify_status, verify_line = verify_store(d)

    outcomes: collections.Counter[str] = collections.Counter()
    methods: collections.Counter[str] = collections.Counter()
    latencies: list[float] = []
    examples: list[str] = []
    for r in finished:
        outcomes.update(r.outcomes)
        methods.update(r.methods)
        latencies += r.latencies
        examples += r.examples
    reads = sum(outcomes.values())
    misses = after["misses"] - before["misses"]
    wrong = outcomes["wrong"]
    errors = reads - outcomes["ok"] - wrong
    errors_logged = d.errors_logged()
    part.figures.update(
        reads=reads, errors=errors, wrong=wrong, misses=misses, cold_share=misses / max(1, reads),
        rss_before_kib=rss_before, rss_peak_kib=peak, rss_after_kib=rss_after,
        fds_before=fds_before, fds_peak=sampler.fds, fds_after=fds_after,
        verify_status=verify_status, seconds=seconds, daemon_errors_logged=len(errors_logged),
    )  # fmt: skip
    part.say(
        f"{sizes.load_readers} reader processes x {sizes.load_reads:,} random reads of "
        f"{len(paths):,} originals (photo-like JPEGs of 256x192) at size {size}, each read with "
        "np.load, open().read() or read_array at random and compared with the sha256 of "
        "`decode_image`'s array. The store is capped at "
        f"{stored:,} entries ({100 * stored / len(paths):.0f}% of the arrays, warmed first), so "
        "the least recently used entries are evicted and read cold again: the share of cold "
        "reads below is measured, not set."
    )
    part.table(
        ["figure", "value"],
        [
            ["reads", f"{reads:,} ({', '.join(f'{m} {n:,}' for m, n in sorted(methods.items()))})"],
            ["errors", f"{errors:,}"],
            ["wrong arrays", f"{wrong:,}"],
            ["cold reads (misses: a decode ran or was joined)",
             f"{misses:,} ({100 * misses / max(1, reads):.1f}% of reads)"],
            ["decodes, evictions", f"{after['decodes'] - before['decodes']:,}, "
             f"{after['evictions'] - before['evictions']:,}"],
            ["wall time, reads/s", f"{seconds:.1f} s, {reads / max(seconds, 1e-9):,.0f}/s"],
            ["read latency p50 / p99 / max",
             f"{1e3 * percentile(latencies, 0.5):.2f} / {1e3 * percentile(latencies, 0.99):.1f}"
             f" / {1e3 * max(latencies, default=0):.0f} ms"],
            ["daemon RSS before / peak (VmHWM) / after",
             f"{mib(rss_before)} / {mib(peak)} / {mib(rss_after)}"],
            ["daemon open descriptors before / peak / after",
             f"{fds_before} / {sampler.fds} / {fds_after}"],
            ["`decodefs verify` afterwards", f"exit {verify_status}: {verify_line}"],
            ["ERROR lines in the daemon log", f"{len(errors_logged)}"],
        ],
    )  # fmt: skip
    part.check(reads == sizes.load_readers * sizes.load_reads, f"{reads} reads counted")
    part.check(errors == 0, f"{errors} reads failed, e.g. {examples[:3]}")
    part.check(wrong == 0, f"{wrong} arrays were wrong, e.g. {examples[:3]}")
    part.check(misses > 0, "no read was cold: the capped store evicted nothing")
    part.check(fds_after <= fds_before, f"descriptors grew from {fds_before} to {fds_after}")
    part.check(peak <= BOUND_KIB, f"peak RSS {mib(peak)} above {mib(BOUND_KIB)}")
    part.check(verify_status == 0, f"decodefs verify: {verify_line}")
    part.check(not errors_logged, f"daemon logged errors: {errors_logged[:3]}")
    return part
