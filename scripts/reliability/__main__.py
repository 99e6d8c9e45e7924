"""Reliability figures on real mounts, one markdown table per part.

  1 load      reader processes x random reads (np.load, open().read(), read_array) of
              small arrays, the store capped so that about 30% of reads are cold
  2 memory    processes each holding arrays open at max_size, stored and cold; one
              9000x9000 PNG: the daemon's RSS against its memory budgets; then the same
              opens of arrays the store does not take, and a flood of opens past the daemon's
              request tasks that must get EAGAIN (--no-hostile-fallback: not those)
  3 kill      kill -9 of the daemon during `decodefs warm` and during a stream of misses,
              then `decodefs mount` on the same mount point: the store afterwards
  4 store     the store full, read-only at runtime (ext4 error), removed at runtime, and
              answering EIO (a fault-injecting FUSE filesystem under it)
  5 sources   the source directory unmounted and renamed at runtime
  6 fuzz      mutated JPEG and PNG originals through the mount vs the in-process decode
  7 security  another user, allow_other off and on; planted symlinks, a pre-created store

  .venv/bin/python -m scripts.reliability [--quick] [--parts 1,3] [--json FILE] [--output FILE]

Run it as root from the repository's root (it mounts tmpfs and ext4 file systems and runs
commands as uid 65534). It mounts daemons through the `decodefs` CLI, as a user would, in a
run directory under /tmp/decodefs-reliability; every mount, loop device and temporary
directory it makes is removed at the end of each part, pass or fail, also on Ctrl-C or
SIGTERM. Exit status 1 if an invariant failed (each part lists them under "Problems").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import numpy as np
import PIL
import pyfuse3

from .fuzz import part_fuzz
from .harness import QUICK, Harness, Part, Sizes
from .kill import part_kill
from .load import part_load
from .memory import part_memory
from .security import part_security
from .sources import part_sources
from .store import part_store

PARTS: Final[dict[str, Callable[[Harness, Sizes], Part]]] = {
    "1": part_load,
    "2": part_memory,
    "3": part_kill,
    "4": part_store,
    "5": part_sources,
    "6": part_fuzz,
    "7": part_security,
}


def machine() -> str:
    return (
        f"{os.cpu_count()} cores, kernel {platform.release()}, Python "
        f"{platform.python_version()}, Pillow {PIL.__version__}, numpy {np.__version__}, "
        f"pyfuse3 {pyfuse3.__version__}"
    )


def parse(argv: list[str]) -> tuple[argparse.Namespace, Sizes]:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.reliability",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="the short version (the test suite's)")
    parser.add_argument("--parts", default=",".join(PARTS), help="e.g. 1,3 (default: all)")
    parser.add_argument("--json", type=Path, help="write every part's figures here")
    parser.add_argument("--output", type=Path, help="write the markdown here too")
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    for f in dataclasses.fields(Sizes):
        flag = f"--{f.name.replace('_', '-')}"
        if isinstance(f.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            parser.add_argument(flag, type=type(f.default), default=None)
    args = parser.parse_args(argv)
    base = QUICK if args.quick else Sizes()
    chosen = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(Sizes)
        if getattr(args, f.name) is not None
    }
    if os.geteuid() != 0:
        parser.error("run it as root (it mounts file systems and runs commands as uid 65534)")
    unknown = [p for p in args.parts.split(",") if p.strip() and p.strip() not in PARTS]
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    return args, dataclasses.replace(base, **chosen)


def main() -> int:
    args, sizes = parse(sys.argv[1:])
    chosen = [p.strip() for p in args.parts.split(",") if p.strip()]

    def stop(signum: int, _: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through every cleanup

    signal.signal(signal.SIGTERM, stop)
    command = " ".join(["python -m scripts.reliability", *sys.argv[1:]])
    header = [
        "# decodefs reliability figures",
        "",
        f"`{command}` on {time.strftime('%Y-%m-%d')}; {machine()}.",
        f"Sizes: {dataclasses.asdict(sizes)}",
        "",
    ]
    print("\n".join(header), flush=True)
    report: dict[str, Any] = {
        "command": command,
        "machine": machine(),
        "sizes": dataclasses.asdict(sizes),
        "parts": {},
        "run_directories": [],
    }
    markdown = list(header)
    failed = False
    for key in chosen:
        started, load = time.monotonic(), os.getloadavg()[0]
        harness = Harness(keep=args.keep)
        report["run_directories"].append(str(harness.root))
        try:
            part = PARTS[key](harness, sizes)
        except Exception:
            part = Part(key, f"{key}. (crashed)", problems=[traceback.format_exc()])
        finally:
            cleanup = harness.close()
        part.problems += cleanup
        part.seconds = time.monotonic() - started
        part.load = f"{load:.1f} -> {os.getloadavg()[0]:.1f}"
        failed = failed or bool(part.problems)
        text = part.markdown()
        print(text + "\n", flush=True)
        markdown.append(text + "\n")
        report["parts"][part.key] = {
            "title": part.title,
            "figures": part.figures,
            "problems": part.problems,
            "seconds": part.seconds,
            "markdown": text,
        }
        if args.json:
            args.json.write_text(json.dumps(report, indent=2, default=str))
        if args.output:
            args.output.write_text("\n".join(markdown))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
