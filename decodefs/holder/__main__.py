"""``python -P -m decodefs.holder``: the process `decodefs mount --foreground` becomes.

`decodefs mount` checks what the user named, then replaces itself with this
(same pid, so systemd's main process and a caller's child stay the holder),
so that the holder's memory holds none of the command's imports.
"""

from __future__ import annotations

import argparse
import resource
import sys
from typing import Final

from ..common.startlog import HeldLog
from .supervisor import Holder, HolderSettings

# The holder's own memory bound: it keeps a descriptor, a few small buffers and a
# list of processes; its serving processes get their own limits back (servers.py).
MEMORY_LIMIT: Final = 256 << 20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m decodefs.holder")
    parser.add_argument("mountpoint")
    parser.add_argument("--config", required=True)
    parser.add_argument("--log-level")  # overrides the config's, in every serving process
    parser.add_argument("--initial-log-level", default="info")  # the holder's own
    parser.add_argument("--access", choices=("originals", "owner", "everyone"), default="owner")
    parser.add_argument("--ready-fd", type=int)
    args = parser.parse_args(argv)
    held = HeldLog(args.log_level or args.initial_log_level, hold=True)
    _limit_memory()
    settings = HolderSettings(
        mountpoint=args.mountpoint,
        config=args.config,
        log_level=args.log_level,
        access=args.access,
        ready_fd=args.ready_fd,
    )
    return Holder(settings, log=held).run()


def _limit_memory() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = MEMORY_LIMIT if hard == resource.RLIM_INFINITY else min(MEMORY_LIMIT, hard)
    if soft == resource.RLIM_INFINITY or soft > limit:
        resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))


if __name__ == "__main__":
    sys.exit(main())
