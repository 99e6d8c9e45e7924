"""A flood of opens, run as another user: one thread per path given, all opening at once,
each holding what it opened until a line (or the end) comes on stdin. Prints one line per
thread as its open returns: "opened" or "error ENAME". It imports nothing of decodefs or
of the harness.

    python -m scripts.reliability.flooder PATH...
"""

from __future__ import annotations

import errno
import os
import sys
import threading

_print = threading.Lock()


def open_one(path: str) -> None:
    try:
        os.open(path, os.O_RDONLY)  # held until the process exits
        line = "opened"
    except OSError as exc:
        line = f"error {errno.errorcode.get(exc.errno or 0, 'unknown')}"
    with _print:
        print(line, flush=True)


def main(paths: list[str]) -> None:
    for path in paths:
        threading.Thread(target=open_one, args=(path,), daemon=True).start()
    sys.stdin.readline()


if __name__ == "__main__":
    main(sys.argv[1:])
