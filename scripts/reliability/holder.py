"""A hostile reader, run as another user: open every path given and hold them all open
until a line (or the end) comes on stdin. Prints one line per open: "opened" or
"error ENAME". It imports nothing of decodefs or of the harness.

    python -m scripts.reliability.holder PATH...
"""

from __future__ import annotations

import errno
import os
import sys


def main(paths: list[str]) -> None:
    fds = []
    for path in paths:
        try:
            fds.append(os.open(path, os.O_RDONLY))
            print("opened", flush=True)
        except OSError as exc:
            print("error", errno.errorcode.get(exc.errno or 0, "unknown"), flush=True)
    sys.stdin.readline()


if __name__ == "__main__":
    main(sys.argv[1:])
