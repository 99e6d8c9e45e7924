"""The mount outlives its serving process: readers under reloads, restarts and kill -9.

Four kinds of reader loop over one mount at once, each checking every array's
pixels against an independent decode: plain `np.load` processes, a
`MountDataset` DataLoader with 2 workers, a `read_array` loop, and a C reader.
Meanwhile the serving process is switched: reloads (each with a config
change: a second version added or removed, the log level, max_store_bytes),
`kill -9`s of the serving process, and restarts. The first few reloads come
while the first epoch still decodes (one decode per original must hold across
overlapping serving processes). Reported: failed reads, wrong bytes, the
longest stall of any read around each kind of event, decodes per original,
the holder's and the serving process's memory, and the epochs before and
after a switch.

  .venv/bin/python scripts/bench_handover.py [--count 200] [--size 64] [--reloads 20]
      [--kills 20] [--restarts 5] [--epoch-count 4000] [--pace 0]

With --pace N each reader makes N reads per second (a training run's steady pace,
leaving the CPU room); without, each reads as fast as it can and the machine is
saturated (then a read's longest time is mostly the scheduler's: compare the
baseline row, the same window with no switch).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import DECODEFS, VERSION, WORK, BenchMount
from PIL import Image

from decodefs.holder.backoff import HEALTHY
from decodefs.sample import make_sample_corpus, photo_like

# A reader process: loops over the list until the stop file appears; records every read
# slower than SLOW seconds with its start time (to tie stalls to events), and the rest
# as counts. Modes: np (np.load), read_array, torch (MountDataset, 2 workers).
_READER = r"""
import hashlib, json, os, random, sys, time
import numpy as np
mode, listing, stop, out = sys.argv[1:5]
SLOW = 0.02
PACE = float(os.environ.get("PACE") or 0)  # reads per second; 0: as fast as it can
due = time.time()
def paced(reads=1):
    global due
    if PACE:
        due = max(due + reads / PACE, time.time() - 1)
        time.sleep(max(0.0, due - time.time()))
expected = json.load(open(listing))
paths = list(expected)
random.seed(os.getpid())
ok = wrong = 0
failed, slow = {}, []
def check(path, pixels, started):
    global ok, wrong
    if hashlib.sha256(pixels).hexdigest() == expected[path]:
        ok += 1
    else:
        wrong += 1
    took = time.time() - started
    if took > SLOW:
        slow.append((started, took))
def fail(exc, started):
    name = f"{type(exc).__name__}:{getattr(exc, 'errno', '')}"
    failed[name] = failed.get(name, 0) + 1
    slow.append((started, time.time() - started))
if mode == "torch":
    import torch
    from torch.utils.data import DataLoader
    from decodefs.torch import MountDataset
    root, version, size = sys.argv[5:8]
    keys = [os.path.basename(p)[:-4] for p in paths]
    dataset = MountDataset(root, version, int(size), keys)
    loader = DataLoader(dataset, batch_size=8, shuffle=True, num_workers=2, persistent_workers=True)
    while not os.path.exists(stop):
        started = time.time()
        try:
            for images, targets in loader:
                for image, key in zip(images, targets):
                    path = os.path.join(root, version, size, key + ".npy")
                    check(path, np.ascontiguousarray(image.numpy()).tobytes(), started)
                paced(len(targets))
                started = time.time()
        except Exception as exc:
            fail(exc, started)
else:
    if mode == "read_array":
        from decodefs import read_array
    while not os.path.exists(stop):
        random.shuffle(paths)
        for path in paths:
            started = time.time()
            try:
                pixels = (np.load(path) if mode == "np" else read_array(path)).tobytes()
            except Exception as exc:
                fail(exc, started)
            else:
                check(path, pixels, started)
            paced()
json.dump({"mode": mode, "ok": ok, "wrong": wrong, "failed": failed, "slow": slow}, open(out, "w"))
"""

# The C reader: open, read, close each file, FNV-1a over the pixels (past the 128-byte
# header), compared with the expected value; the same report, as JSON.
_C_READER = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <unistd.h>
static double now(void) {
    struct timeval t;
    gettimeofday(&t, 0);
    return t.tv_sec + t.tv_usec / 1e6;
}
int main(int argc, char **argv) {
    FILE *list = fopen(argv[1], "r");
    static char paths[4096][512]; static unsigned long long sums[4096]; int n = 0;
    while (n < 4096 && fscanf(list, "%511s %llu", paths[n], &sums[n]) == 2) n++;
    fclose(list);
    static unsigned char buf[1 << 24];
    long ok = 0, wrong = 0, failed = 0; int slows = 0;
    double pace = getenv("PACE") ? atof(getenv("PACE")) : 0, due = now();
    static double slow_at[100000], slow_took[100000];
    int last_errno = 0;
    while (access(argv[2], F_OK) != 0) {
        for (int i = 0; i < n; i++) {
            double started = now();
            int fd = open(paths[i], O_RDONLY);
            ssize_t got = 0, total = 0;
            if (fd >= 0) {
                while ((got = read(fd, buf + total, sizeof buf - total)) > 0) total += got;
                if (got < 0) last_errno = errno;
                close(fd);
            } else last_errno = errno;
            if (fd < 0 || got < 0) failed++;
            else {
                uint64_t h = 1469598103934665603ULL;
                for (ssize_t j = 128; j < total; j++) { h ^= buf[j]; h *= 1099511628211ULL; }
                if (h == sums[i]) ok++; else wrong++;
            }
            double took = now() - started;
            if (took > 0.02 && slows < 100000) {
                slow_at[slows] = started;
                slow_took[slows++] = took;
            }
            if (pace > 0) {
                due += 1 / pace;
                if (due < now() - 1) due = now() - 1;
                double wait = due - now();
                if (wait > 0) usleep((useconds_t)(wait * 1e6));
            }
        }
    }
    FILE *out = fopen(argv[3], "w");
    fprintf(out, "{\"mode\": \"c\", \"ok\": %ld, \"wrong\": %ld, \"failed\": {", ok, wrong);
    if (failed) fprintf(out, "\"errno:%d\": %ld", last_errno, failed);
    fprintf(out, "}, \"slow\": [");
    for (int i = 0; i < slows; i++)
        fprintf(out, "%s[%f, %f]", i ? ", " : "", slow_at[i], slow_took[i]);
    fprintf(out, "]}\n");
    fclose(out);
    return 0;
}
"""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--reloads", type=int, default=20)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--restarts", type=int, default=5)
    parser.add_argument("--np-readers", type=int, default=2)
    parser.add_argument(
        "--pace",
        type=float,
        default=0.0,
        help="reads per second per reader (0: each as fast as it can, the machine saturated)",
    )
    parser.add_argument("--epoch-count", type=int, default=4000, help="arrays for the epochs")
    args = parser.parse_args()
    print(f"bench_handover: {platform.node()}, {os.cpu_count()} cores, load "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)  # fmt: skip
    corpus = WORK / f"handover-{args.count}"
    make_sample_corpus(corpus, args.count, 1600, 1200, seed=11)
    bench = BenchMount(corpus, [args.size], settings={"log_level": "info"})
    bench.mount()
    try:
        figures = under_switches(bench, corpus, args)
    finally:
        bench.unmount()
    epochs = epochs_around_a_switch(args.epoch_count) if args.epoch_count else {}
    report(args, figures, epochs)
    print(f"load after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def under_switches(bench: BenchMount, corpus: Path, args: argparse.Namespace) -> dict[str, Any]:
    run = bench.directory
    expected = {}
    fnv = {}
    for original in sorted(corpus.rglob("*.jpg")):
        with Image.open(original) as image:
            pixels = np.asarray(image.convert("RGB").resize((args.size, args.size), Image.BILINEAR))  # type: ignore[attr-defined]
        path = str(bench.mountpoint / VERSION / str(args.size) / f"{original.stem}.npy")
        expected[path] = hashlib.sha256(pixels.tobytes()).hexdigest()
        fnv[path] = _fnv(pixels.tobytes())
    listing = run / "expected.json"
    listing.write_text(json.dumps(expected))
    (run / "expected.txt").write_text("".join(f"{p} {v}\n" for p, v in fnv.items()))
    c_reader = _compile_c_reader(run)
    stop = run / "stop"
    outs: list[Path] = []
    readers = []

    paced = {**os.environ, "PACE": str(args.pace)}

    def start(mode: str, *extra: str) -> None:
        out = run / f"reader-{len(outs)}.json"
        outs.append(out)
        command = [sys.executable, "-c", _READER, mode, str(listing), str(stop), str(out)]
        readers.append(subprocess.Popen([*command, *extra], env=paced))

    for _ in range(args.np_readers):
        start("np")
    start("read_array")
    start("torch", str(bench.mountpoint), VERSION, str(args.size))
    c_out = run / f"reader-{len(outs)}.json"
    outs.append(c_out)
    readers.append(
        subprocess.Popen(
            [str(c_reader), str(run / "expected.txt"), str(stop), str(c_out)], env=paced
        )
    )

    events: list[tuple[str, float, float]] = []  # (kind, start, end)
    pauses: dict[str, list[float]] = {}  # kind -> the holder's measure of each switch's pause
    memory = {"before": _memory(bench)}
    config = bench.config.read_text()
    second = run / "second"  # the extra version's originals: this run's own
    make_sample_corpus(second, 8, 800, 600, seed=12)

    def switch(kind: str, action: Callable[[], None], serve_for: float = 6.0) -> None:
        before = _stats(bench)
        if before.get("mount_decodes", 0) < len(expected):
            kind += " (first epoch decoding)"  # reads wait on decodes too
        started = time.time()
        action()
        _wait(
            lambda: _stats(bench).get("pid") not in (None, before["pid"]),
            f"a new serving process ({kind})",
        )
        events.append((kind, started, time.time()))
        pauses.setdefault(kind, []).append(_stats(bench)["switch_pause_seconds"])
        time.sleep(serve_for)  # a bench's pacing between events, not a test's wait

    for i in range(args.reloads):
        changed = config
        if i % 3 == 0:
            changed += f'[versions.extra]\nsource = "{second}"\nsizes = [{args.size}]\n'
        elif i % 3 == 1:
            changed = changed.replace('log_level = "info"', 'log_level = "debug"')
        else:
            changed = f"max_store_bytes = {10**9 + i}\n" + changed
        bench.config.write_text(changed)
        switch("reload", lambda: _decodefs("reload", bench.mountpoint))
    bench.config.write_text(config)
    first_epoch_decodes = _stats(bench)["mount_decodes"]
    for _ in range(args.kills):
        # Each killed after serving a while (HEALTHY): deaths in a row soon after their
        # start are a crash loop, which the holder backs off (answering EIO meanwhile).
        kill = lambda: os.kill(_stats(bench)["pid"], signal.SIGKILL)  # noqa: E731
        switch("kill -9", kill, serve_for=HEALTHY + 0.5)
    for _ in range(args.restarts):
        switch("restart", lambda: _decodefs("restart", bench.mountpoint))
    memory["after"] = _memory(bench)
    stats = _stats(bench)
    applied = reload_applies(bench, config, second, args.size)  # (its decodes not counted)
    stopped = time.time()
    stop.write_text("")
    for process in readers:
        process.wait(timeout=300)
    results = [json.loads(out.read_text()) for out in outs]
    return {
        "results": results,
        "events": events,
        "stopped": stopped,
        "pauses": pauses,
        "memory": memory,
        "stats": stats,
        "first_epoch_decodes": first_epoch_decodes,
        "applied": applied,
        "originals": len(expected),
    }


def reload_applies(bench: BenchMount, config: str, second: Path, size: int) -> dict[str, bool]:
    """What a reload applies, each checked against an independent decode: a version
    added is listed and read, an original added is served, an original rewritten in
    place (same name, new pixels) is served new."""
    extra = bench.mountpoint / "extra" / str(size)

    def served_right(original: Path) -> bool:
        with Image.open(original) as image:
            pixels = np.asarray(image.convert("RGB").resize((size, size), Image.BILINEAR))  # type: ignore[attr-defined]
        return np.array_equal(np.load(extra / f"{original.stem}.npy"), pixels)

    bench.config.write_text(config + f'[versions.extra]\nsource = "{second}"\nsizes = [{size}]\n')
    _decodefs("reload", bench.mountpoint)
    originals = sorted(second.rglob("*.jpg"))
    listed = sorted(os.listdir(extra)) == sorted(f"{o.stem}.npy" for o in originals)
    checks = {"a version added is listed and read": listed and served_right(originals[0])}
    added = second / "added" / "0b5e6c1c-0000-4000-8000-000000000001.jpg"
    added.parent.mkdir()
    photo_like(np.random.default_rng(1), 800, 600).save(added, quality=90)
    _decodefs("reload", bench.mountpoint)
    checks["an original added is served"] = served_right(added)
    before = np.load(extra / f"{added.stem}.npy")
    photo_like(np.random.default_rng(2), 800, 600).save(added, quality=90)  # in place
    _decodefs("reload", bench.mountpoint)
    rewritten = np.load(extra / f"{added.stem}.npy")
    checks["an original rewritten in place is served new"] = served_right(added) and not (
        np.array_equal(before, rewritten)
    )
    bench.config.write_text(config)
    _decodefs("reload", bench.mountpoint)
    return checks


def epochs_around_a_switch(count: int) -> dict[str, float]:
    """np.load rates over a store of ``count`` arrays at 224, page cache dropped before
    each epoch: the epoch before a restart, after it, and after a remount (today's
    restart: nothing verified), each once the mount has settled."""
    if os.geteuid() != 0:
        return {}
    corpus = WORK / f"epochs-{count}"
    make_sample_corpus(corpus, count, 640, 480, seed=13)
    bench = BenchMount(corpus, [224])
    bench.mount()
    directory = bench.mountpoint / VERSION / "224"
    paths = sorted(str(directory / name) for name in os.listdir(directory))
    rates: dict[str, float] = {}
    try:
        for name in ("first (decodes)", "second"):
            rates[name] = _epoch(paths)
        _decodefs("restart", bench.mountpoint)
        bench.settle()
        rates["after a restart"] = _epoch(paths)
        bench.unmount()
        bench.mount()
        bench.settle()
        rates["after a remount (nothing verified)"] = _epoch(paths)
    finally:
        bench.unmount()
    return rates


def _epoch(paths: list[str]) -> float:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3")
    started = time.perf_counter()
    for path in paths:
        np.load(path)
    return len(paths) / (time.perf_counter() - started)


def report(args: argparse.Namespace, figures: dict[str, Any], epochs: dict[str, float]) -> None:
    results, events = figures["results"], figures["events"]
    print()
    pace = f"{args.pace:.0f} reads/s per reader" if args.pace else "as fast as they can"
    print(f"readers: {pace}")
    print(f"{figures['originals']} arrays at {args.size}; events: {args.reloads} reloads (each "
          f"with a config change), {args.kills} kill -9, {args.restarts} restarts")  # fmt: skip
    print()
    print("| reader | reads | failed | wrong bytes |")
    print("| --- | --- | --- | --- |")
    for result in results:
        failed = sum(result["failed"].values())
        detail = f" ({result['failed']})" if failed else ""
        print(f"| {result['mode']} | {result['ok'] + result['wrong']:,} | {failed}{detail} | "
              f"{result['wrong']} |")  # fmt: skip
    print()

    arrays = [(at, took) for r in results if r["mode"] != "torch" for at, took in r["slow"]]
    batches = [(at, took) for r in results if r["mode"] == "torch" for at, took in r["slow"]]

    def longest(slow: list[tuple[float, float]], start: float, end: float) -> float:
        return max((took for at, took in slow if at <= end and at + took >= start), default=0.0)

    # An event's window: from the command until AFTER s after the new process serves
    # (its standby prepares meanwhile). The same window right after it, before the next
    # event, is the baseline: how long a read takes on this machine under this load
    # with no switch at all.
    after = 2.0
    windows: dict[str, list[tuple[float, float]]] = {}
    for i, (name, start, end) in enumerate(events):
        windows.setdefault(name, []).append(
            (longest(arrays, start, end + after), longest(batches, start, end + after))
        )
        quiet, length = end + after, end + after - start
        following = events[i + 1][1] if i + 1 < len(events) else figures["stopped"]
        if quiet + length < following and "first epoch" not in name:
            windows.setdefault("none (baseline)", []).append(
                (longest(arrays, quiet, quiet + length), longest(batches, quiet, quiet + length))
            )
    print("| event | count | longest array read around it (np, read_array, C; max / median) "
          "| longest DataLoader batch of 8 (max / median) | the switch's pause, holder's "
          "measure (max / median) |")  # fmt: skip
    print("| --- | --- | --- | --- | --- |")

    def spread(values: list[float]) -> str:
        ordered = sorted(values)
        if not ordered:
            return "-"
        return f"{ordered[-1] * 1000:.0f} / {ordered[len(ordered) // 2] * 1000:.0f} ms"

    for kind, stalls in windows.items():
        pause = spread(figures["pauses"].get(kind, []))
        print(f"| {kind} | {len(stalls)} | {spread([a for a, _ in stalls])} | "
              f"{spread([b for _, b in stalls])} | {pause} |")  # fmt: skip
    stats = figures["stats"]
    print()
    print(f"decodes per original: {figures['first_epoch_decodes'] / figures['originals']:.2f} "
          f"(first epoch, under {args.reloads} reloads); "
          f"{stats['mount_decodes'] / figures['originals']:.2f} by the end")  # fmt: skip
    for check, held in figures["applied"].items():
        print(f"{check}: {'yes' if held else 'NO'}")
    print(f"handovers {stats['handovers']}, crashes {stats['crashes']}, refused "
          f"{stats['handovers_refused']}")  # fmt: skip
    for when, (holder, server) in figures["memory"].items():
        print(f"memory {when}: holder {holder / 2**20:.1f} MiB, serving process "
              f"{server / 2**20:.1f} MiB")  # fmt: skip
    if epochs:
        print()
        print("| epoch (np.load, page cache dropped) | arrays/s | vs the second |")
        print("| --- | --- | --- |")
        for name, rate in epochs.items():
            print(f"| {name} | {rate:,.0f} | {rate / epochs['second']:.2f} |")


def _memory(bench: BenchMount) -> tuple[int, int]:
    stats = _stats(bench)
    server = Path(f"/proc/{stats['pid']}/statm").read_text().split()[1]
    return int(stats["holder_rss_bytes"]), int(server) * os.sysconf("SC_PAGE_SIZE")


def _stats(bench: BenchMount) -> dict[str, Any]:
    try:
        value: dict[str, Any] = json.loads(
            (bench.mountpoint / ".decodefs" / "stats.json").read_bytes()
        )
    except (OSError, ValueError):
        return {}
    return value


def _wait(predicate: Callable[[], object], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"bench_handover: waited {timeout} s for {what}")
        time.sleep(0.01)


def _decodefs(*args: object) -> None:
    subprocess.run([*DECODEFS, *map(str, args)], check=True, capture_output=True)


def _compile_c_reader(run: Path) -> Path:
    source = run / "reader.c"
    source.write_text(_C_READER)
    binary = run / "reader"
    subprocess.run(["cc", "-O2", "-o", str(binary), str(source)], check=True)
    return binary


def _fnv(data: bytes) -> int:
    value = 1469598103934665603
    for byte in data:
        value = ((value ^ byte) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return value


if __name__ == "__main__":
    main()
