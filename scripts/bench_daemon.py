"""The daemon's own cost per request, measured from /proc while plain readers run.

On --count small photo-like JPEGs, stored once at --size, then in --rounds
rounds, each with a fresh daemon on the full store (so every first open
verifies its entry):
  first epoch   plain np.load of every array once after the mount: arrays/s and the
                daemon's CPU (all its threads, utime+stime from /proc) per array
  hits          plain np.load of every array --loops times more (the kernel holds the
                bytes, so each costs OPEN, IOCTL and RELEASE): daemon CPU per hit, hits/s
Figures are the medians and the ranges over the rounds.

    .venv/bin/python scripts/bench_daemon.py [--count 200] [--size 224] [--rounds 6]

(At commit 3e514a5 it also compared page-cache seeding on and off.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, TypeVar

import numpy as np
from benchlib import WORK, BenchMount

from decodefs.sample import make_sample_corpus

TICK = os.sysconf("SC_CLK_TCK")
T = TypeVar("T")


class Round(NamedTuple):
    first_rate: float  # arrays/s
    first_cpu_us: float  # daemon CPU per array
    hit_rate: float
    hit_cpu_us: float


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--loops", type=int, default=20, help="hit epochs per round")
    args = parser.parse_args()
    originals = WORK / "originals-640x480"
    make_sample_corpus(originals, args.count, 640, 480, seed=2)
    bench = BenchMount(originals, [args.size])
    try:
        mounted_run(bench, args.size, lambda files, pid: [np.load(f) for f in files])  # fill
        rounds = [
            mounted_run(bench, args.size, lambda f, p: measure(f, p, args.loops))
            for _ in range(args.rounds)
        ]
        print(render(rounds, args))
    finally:
        bench.remove()


def mounted_run(bench: BenchMount, size: int, work: Callable[[list[str], int], T]) -> T:
    """Mount a fresh daemon, run ``work(its arrays of size, its pid)``, unmount."""
    bench.mount()
    try:
        files = sorted(str(p) for p in bench.arrays(size).iterdir())
        return work(files, int(bench.stats()["pid"]))
    finally:
        bench.unmount()


def measure(files: list[str], pid: int, loops: int) -> Round:
    cpu, started = cpu_seconds(pid), time.perf_counter()
    for path in files:
        np.load(path)
    first_seconds, first_cpu = time.perf_counter() - started, cpu_seconds(pid) - cpu
    time.sleep(0.5)  # deferred work (recency updates) settles; its CPU belongs to the first epoch
    cpu, started = cpu_seconds(pid), time.perf_counter()
    for _ in range(loops):
        for path in files:
            np.load(path)
    hits = loops * len(files)
    hit_seconds, hit_cpu = time.perf_counter() - started, cpu_seconds(pid) - cpu
    return Round(
        len(files) / first_seconds,
        first_cpu / len(files) * 1e6,
        hits / hit_seconds,
        hit_cpu / hits * 1e6,
    )


def cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of ``pid`` (threads that ended included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def render(rounds: list[Round], args: argparse.Namespace) -> str:
    lines = [
        f"{args.count} arrays of {args.size}, {args.rounds} rounds",
        "",
        "| figure | median | range |",
        "| --- | ---: | ---: |",
    ]
    for label, field, unit in (
        ("first epoch after a mount (plain np.load)", "first_rate", "arrays/s"),
        ("first epoch, daemon CPU per array", "first_cpu_us", "us"),
        ("plain np.load hits", "hit_rate", "hits/s"),
        ("plain np.load hits, daemon CPU per hit", "hit_cpu_us", "us"),
    ):
        values = [float(getattr(r, field)) for r in rounds]
        lines.append(
            f"| {label} | {statistics.median(values):,.0f} {unit} "
            f"| {min(values):,.0f}-{max(values):,.0f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
