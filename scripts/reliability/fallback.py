"""Part 2's last phase: another user's opens of arrays the store does not take, held open,
then a flood of more opens than the daemon has request tasks, which must get EAGAIN while
root's reads keep being served. It knows nothing of the other parts."""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from decodefs import npy_file_size
from decodefs.daemon.admission import WAITING_PER_USER
from decodefs.daemon.fs import MAX_REQUEST_TASKS
from tests.helpers import NOBODY, wait_until

from .checks import errno_name
from .harness import (
    DEFAULT_MEMORY_CACHE,
    MIB,
    REPO,
    VERSION,
    Harness,
    Part,
    Sizes,
    gone,
    task_states,
)

FLOOD_THREADS: Final = MAX_REQUEST_TASKS + 100  # more than the daemon's request tasks
# Root's reads of a stored array and of stats.json while the flood is on.
SERVED_READS: Final = 10
_AS_NOBODY: Final = ("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups")


class Program:
    """One of this package's programs run as uid 65534, its answers counted as they come."""

    def __init__(self, module: str, paths: Sequence[Path]) -> None:
        self.process = subprocess.Popen(
            [*_AS_NOBODY, sys.executable, "-m", f"scripts.reliability.{module}", *map(str, paths)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.answers: collections.Counter[str] = collections.Counter()
        threading.Thread(target=self._count, daemon=True).start()

    def _count(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            words = line.split()
            self.answers["opened" if words == ["opened"] else words[-1]] += 1

    @property
    def answered(self) -> int:
        return sum(self.answers.values())


@dataclass
class Flood:
    """What a flood of opens by another user met, and how root's reads fared meanwhile."""

    threads: int
    answers: collections.Counter[str]  # each thread's open so far: "opened", or its errno
    daemon_eagain: int  # errors.EAGAIN the daemon counted during the flood
    served: list[str] = field(default_factory=list)  # root's reads: "returned in X s", ...


def flood_problems(flood: Flood) -> list[str]:
    """The invariants of a flood: past the per-user limit another user's opens get EAGAIN
    (and only that, or open), the daemon counts each, and root's reads are all served."""
    problems = []
    eagain = flood.answers["EAGAIN"]
    if eagain == 0:
        problems.append(
            f"no open of the flood's {flood.threads} got EAGAIN (answers so far: "
            f"{dict(flood.answers)}): the per-user limit was never reached"
        )
    others = {k: v for k, v in flood.answers.items() if k not in ("opened", "EAGAIN")}
    if others:
        problems.append(f"the flood's opens failed otherwise than with EAGAIN: {others}")
    if flood.daemon_eagain < eagain:
        problems.append(f"the daemon counted {flood.daemon_eagain} EAGAIN; the flood saw {eagain}")
    if not flood.served:
        problems.append("root read nothing during the flood")
    unserved = [s for s in flood.served if not s.startswith("returned")]
    if unserved:
        problems.append(f"{len(unserved)} of root's {len(flood.served)} reads during the "
                        f"flood were not served: {unserved[:3]}")  # fmt: skip
    return problems


def timed_read(path: Path, timeout: float, want: bytes | None = None) -> str:
    """Read ``path`` on a thread: how long it took, or that it had not returned in time
    (or returned other bytes than ``want``)."""
    outcome: list[str] = []

    def read() -> None:
        started = time.monotonic()
        try:
            data = path.read_bytes()
        except OSError as exc:
            outcome.append(errno_name(exc))
            return
        if want is not None and data != want:
            outcome.append(f"wrong bytes ({len(data)})")
        else:
            outcome.append(f"returned in {time.monotonic() - started:.2f} s")

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(timeout)  # a read that hangs is the finding: the thread is left behind
    return outcome[0] if outcome else f"no answer in {timeout:.0f} s"


def slowest(results: Sequence[str]) -> str:
    """The slowest "returned in X s" of ``results``, or the first that did not return."""
    failed = [r for r in results if not r.startswith("returned")]
    if failed or not results:
        return failed[0] if failed else "none"
    return max(results, key=lambda r: float(r.split()[2]))


def flood_paths(d_path: Path, cold: Sequence[Path], size: int, count: int) -> list[Path]:
    """``count`` distinct arrays no one has read: the cold originals at sizes just under
    ``size``, so that every open of the flood needs a decode of its own."""
    return [
        d_path / VERSION / str(size - 1 - i // len(cold)) / f"{cold[i % len(cold)].stem}.npy"
        for i in range(count)
    ]


def memory_fallback(
    h: Harness, part: Part, sizes: Sizes, source: Path, cold: Sequence[Path]
) -> None:
    """The hostile opens again, of arrays the store does not take: another user's reads of
    a size no version lists (allow_other on), served from memory and held while open."""
    size = sizes.hostile_size
    d = h.daemon("memory-fallback", {VERSION: source}, sizes=[224], max_size=size, allow_other=True)
    d.mount()
    fit = DEFAULT_MEMORY_CACHE // (2 * npy_file_size(size))
    hit = cold[-2]
    hit_bytes = d.path(hit.stem, 224).read_bytes()  # stored: a hit from now on
    started = time.monotonic()
    holders = [
        Program("holder", [d.path(cold[(i + j) % len(cold)].stem, size)
                           for j in range(sizes.hostile_open)])
        for i in range(sizes.hostile_processes)
    ]  # fmt: skip
    programs = list(holders)  # and the flood, below: killed at the end, also on a failure

    def kill_programs() -> None:
        for program in programs:
            program.process.kill()

    h.on_close("the holders and the flood", kill_programs)
    total = sizes.hostile_processes * sizes.hostile_open
    answered = 0

    def progress() -> int:
        """How many opens have been answered, once more than ``answered``; 0 until then."""
        now = sum(p.answered for p in holders)
        return now if now > answered else 0

    with contextlib.suppress(AssertionError):  # 30 s without an answer: the hang checked below
        while answered < total:
            answered = wait_until(progress, 30, "one more of the holders' opens answered")
    held = sum(p.answers["opened"] for p in holders)
    stats = d.stats()
    # Someone else's cold read of a listed size, meanwhile.
    bystander_result = timed_read(d.path(cold[-1].stem, 224), 15)

    # More opens at once than the daemon has request tasks, by one process of uid 65534.
    eagain_before = d.stats()["errors"].get("EAGAIN", 0)
    flooder = Program("flooder", flood_paths(d.mountpoint, cold, size, FLOOD_THREADS))
    programs.append(flooder)
    part.wait(lambda: flooder.answers["EAGAIN"], 120, "the flood's first EAGAIN")
    # At most WAITING_PER_USER of its opens may wait; every other is answered at once.
    part.wait(
        lambda: flooder.answered >= FLOOD_THREADS - WAITING_PER_USER,
        60,
        f"an answer to every open of the flood past the {WAITING_PER_USER} that may wait",
    )
    served = []
    for _ in range(SERVED_READS):
        served.append(timed_read(d.path(hit.stem, 224), 10, hit_bytes))
        served.append(timed_read(d.mountpoint / ".decodefs/stats.json", 10))
    answers = collections.Counter(flooder.answers)  # before the daemon's count: see flood_problems
    eagain = 0
    with contextlib.suppress(OSError):
        eagain = d.stats()["errors"].get("EAGAIN", 0) - eagain_before
    flood = Flood(FLOOD_THREADS, answers, eagain, served)
    for problem in flood_problems(flood):
        part.check(False, problem)

    kill_programs()
    pids = [p.process.pid for p in programs]
    killed = time.monotonic()
    with contextlib.suppress(AssertionError):  # who is still there is the finding, below
        wait_until(lambda: all(gone(pid) for pid in pids), 180, "every holder gone after kill -9")
    stuck = [pid for pid in pids if not gone(pid)]
    gone_in = time.monotonic() - killed
    states = collections.Counter(state for pid in stuck for state in task_states(pid))
    assert d.pid is not None
    pid = d.pid
    os.kill(pid, signal.SIGTERM)
    stopped = True
    try:
        wait_until(lambda: gone(pid), 25, "the daemon to exit on SIGTERM")
    except AssertionError:
        stopped = False
        d.kill9()  # the only way out: every blocked request then fails
    for program in programs:
        program.process.wait(timeout=30)
    d.pid = None
    waited = time.monotonic() - started
    part.say(
        "The same opens of arrays the store does not take: uid 65534 reads a size no version "
        f'lists ({size}; allow_other on, unlisted_sizes = "owner"), which the daemon serves '
        "from its memory cache (which the budget may reclaim: an open file holds none of it). "
        f"{sizes.hostile_processes} processes "
        f"open {sizes.hostile_open} arrays each from a pool of {len(cold)}; a decode takes "
        f"2 x {npy_file_size(size) / MIB:.0f} MiB of the 512 MiB memory budget, so {fit} run at "
        f"once, and the memory cache keeps twice as many. Then one process of uid 65534 opens "
        f"{FLOOD_THREADS} arrays no one has read, each from its own thread, all at once (more "
        f"than the daemon's {MAX_REQUEST_TASKS} request tasks); once it has met its first "
        f"EAGAIN and every open past the {WAITING_PER_USER} that may wait has its answer, root "
        f"reads a stored array and stats.json {SERVED_READS} times each. Then every holder "
        "and the flood are killed (-9), and the daemon is stopped with SIGTERM."
    )
    part.table(
        ["arrays the store does not take", "value"],
        [
            ["opens done (waiting up to 30 s without progress)", f"{held:,} of {total:,}"],
            ["stats: memory_bytes / memory_waits",
             f"{stats['memory_bytes'] / MIB:,.0f} MiB / {stats['memory_waits']:,}"],
            ["root's read of another array at a listed size (224), meanwhile",
             bystander_result],
            [f"then {FLOOD_THREADS} threads of uid 65534 open arrays no one has read: what "
             "their opens got (when root's reads were done)",
             ", ".join(f"{k} {v}" for k, v in sorted(answers.items())) + ", no answer yet "
             f"{FLOOD_THREADS - sum(answers.values())} (the limit: {WAITING_PER_USER} may wait)"],
            ["... EAGAIN counted by the daemon meanwhile", f"{eagain:,}"],
            [f"root's reads of a stored array (224) and of `.decodefs/stats.json`, "
             f"{SERVED_READS} each: served / slowest",
             f"{sum(s.startswith('returned') for s in served)} of {len(served)} / "
             f"{slowest(served)}"],
            ["holders after kill -9 (every thread)", f"{len(stuck)} of {len(programs)} still there"
             + (f" (state {', '.join(sorted(states))})" if stuck else f", all gone in "
                f"{gone_in:.1f} s")],
            ["the daemon after SIGTERM", "exited" if stopped else "still running after 25 s; "
             "killed with SIGKILL, which freed every blocked reader"],
        ],
    )  # fmt: skip
    part.check(
        held == total,
        f"arrays the store does not take: {total - held} of {total} opens not done (answers "
        f"{sum((p.answers for p in holders), collections.Counter())}; hold-and-wait on the "
        "memory budget? docs/reliability.md, defect 1)",
    )
    part.check(bystander_result.startswith("returned"), f"a bystander's read: {bystander_result}")
    part.check(not stuck, f"{len(stuck)} holders still there 180 s after kill -9")
    part.check(stopped, "the daemon did not exit on SIGTERM")
    errors_logged = d.errors_logged()
    part.check(not errors_logged, f"daemon logged errors: {errors_logged[:3]}")
    hits = [s for i, s in enumerate(served) if i % 2 == 0]
    part.figures["fallback"] = {
        "opened": held, "total": total, "fit": fit, "bystander": bystander_result,
        "stuck_after_kill": len(stuck), "stopped_on_sigterm": stopped, "seconds": waited,
        "flood_answers": dict(answers), "flood_eagain": answers["EAGAIN"],
        "daemon_eagain": eagain, "served": served,
        "hit_while_flooded": slowest(hits), "stats_while_flooded": slowest(served[1::2]),
    }  # fmt: skip
