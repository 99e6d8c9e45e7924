"""Part 5, sources: the source directory unmounted and renamed under a running daemon;
stored arrays must still be served and misses fail quietly. It knows no other part."""

from __future__ import annotations

import shutil

from decodefs.sample import make_sample_corpus

from .checks import Reference, Tally, read_all
from .harness import VERSION, Harness, Part, Sizes, run

# WARNING lines a vanished source may cause, however many reads fail (LogThrottle).
_MAX_LINES = 3


def part_sources(h: Harness, sizes: Sizes) -> Part:
    part = Part("sources", "5. Sources vanishing at runtime")
    n = sizes.source_originals
    corpus = make_sample_corpus(h.directory("sources-corpus"), 2 * n, 256, 192, seed=51)
    ref = Reference()
    rows: list[list[object]] = []
    for scenario in ("unmounted", "renamed"):
        if scenario == "unmounted":
            source = h.tmpfs("sources-fs", "64m")
        else:
            source = h.directory("sources-dir")
        for path in corpus:
            shutil.copy(path, source / path.name)
        originals = [source / p.name for p in corpus]
        d = h.daemon(f"sources-{scenario}", {VERSION: source}, sizes=[64])
        d.mount()
        stored, cold = originals[:n], originals[n:]
        before = Tally()
        read_all(before, d, ref, stored, 64)
        moved = source.with_name(source.name + ".moved")
        if scenario == "unmounted":
            run("umount", "-l", source)  # what is left is the empty directory below it
        else:
            source.rename(moved)
        lines_before = len(d.log_lines(r"WARNING"))
        hits = Tally()
        for _ in range(3):
            read_all(hits, d, ref, stored, 64)
        misses = Tally()
        for _ in range(3):  # every cold array asked three times
            for original in cold:
                misses.check("open().read()", d.path(original.stem, 64), 64, None)
        stats = d.stats()
        alive = d.alive()
        warnings_logged = d.log_lines(r"WARNING")[lines_before:]
        # Put it back: misses are decoded again.
        if scenario == "unmounted":
            run("mount", "-t", "tmpfs", "-o", "size=64m,mode=0755", "decodefs-rel", source)
            for path in corpus:
                shutil.copy(path, source / path.name)
        else:
            moved.rename(source)
        back = Tally()
        read_all(back, d, ref, cold, 64)
        errors_logged = d.errors_logged()
        rows.append(
            [
                f"source {scenario}",
                f"{hits.outcomes['ok']:,} of {hits.reads:,}",
                misses.summary(),
                f"{len(warnings_logged)} for {misses.reads:,} failed reads",
                ", ".join(f"{k} {v}" for k, v in sorted(stats["errors"].items())) or "-",
                "yes" if alive else "NO",
                f"{back.outcomes['ok']} of {back.reads}",
                len(errors_logged),
            ]
        )
        part.figures[scenario] = {
            "hits_ok": hits.outcomes["ok"], "hits": hits.reads, "misses": dict(misses.outcomes),
            "log_lines": len(warnings_logged), "alive": alive, "back_ok": back.outcomes["ok"],
            "sample_lines": warnings_logged[:3],
        }  # fmt: skip
        part.check(before.bad == 0, f"{scenario}: first reads: {before.examples}")
        part.check(hits.bad == 0, f"{scenario}: stored arrays not served: {hits.examples}")
        part.check(
            set(misses.outcomes) == {"ENOENT"},
            f"{scenario}: misses {misses.summary()} (the README says ENOENT)",
        )
        part.check(
            stats["errors"].get("ENOENT", 0) >= misses.reads,
            f"{scenario}: stats count {stats['errors']} for {misses.reads} failed reads",
        )
        part.check(alive, f"{scenario}: the daemon died")
        part.check(
            len(warnings_logged) <= _MAX_LINES,
            f"{scenario}: {len(warnings_logged)} log lines (a flood)",
        )
        part.check(back.bad == 0, f"{scenario}: misses not decoded once the source is back")
        part.check(not errors_logged, f"daemon logged errors: {errors_logged[:3]}")
        d.stop()
    part.say(
        f"{n} arrays are read (stored) first; then the source directory is unmounted (a tmpfs, "
        "`umount -l`: the empty directory below shows) or renamed; the stored arrays are read "
        f"three times and {n} arrays never read before three times each; then the source is "
        "put back and those are read again. Reads of stored arrays take turns with np.load, "
        "open().read() and read_array."
    )
    part.table(
        ["while the source is gone", "stored arrays served right", "cold reads", "WARNING lines "
         "logged", "errors counted (stats)", "daemon alive", "cold arrays right once back",
         "ERROR lines logged"],
        rows,
    )  # fmt: skip
    return part
