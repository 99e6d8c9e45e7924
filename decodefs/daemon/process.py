"""The daemon process's own tuning: open-file limit, large allocations given back to
the system while a decode's image memory is used again, and the mount's readahead.

Each is best effort: a failure is logged, never raised. Knows nothing of serving.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import resource
import stat
from typing import Final

from PIL import _imaging  # Pillow's C core (Image.core)

from ..common.mounts import mounts
from ..common.protocol import FS_TYPE

__all__ = [
    "IMAGE_BLOCKS_KEPT",
    "IMAGE_BLOCK_BYTES",
    "READAHEAD_KB",
    "log_destination",
    "raise_open_file_limit",
    "raise_readahead",
    "return_large_allocations",
    "reuse_image_memory",
]

log = logging.getLogger(__name__)


# The mount's readahead: an array of up to 591x591 (1 MiB) arrives in one READ request.
READAHEAD_KB: Final = 1024


_M_MMAP_THRESHOLD: Final = -3  # glibc's mallopt parameter (malloc.h)

# Pillow's image memory: blocks of at most 1 MiB, up to 32 freed ones kept for the
# next decode (so at most 32 MiB held between decodes).
IMAGE_BLOCK_BYTES: Final = 1 << 20
IMAGE_BLOCKS_KEPT: Final = 32


def raise_open_file_limit() -> None:
    """Many readers at once must not run the daemon out of descriptors (soft limit 1024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:  # an unlimited hard limit cannot be the soft one
        log.debug("open-file limit stays %d: %s", soft, exc)
    else:
        log.debug("open-file limit raised from %d to %d", soft, hard)


def return_large_allocations() -> None:
    """Give the memory of a large decode back to the system when it is freed.

    glibc serves allocations above a threshold with their own mmap and unmaps
    them on free, but raises that threshold (up to 32 MiB) each time such a
    block is freed, after which Pillow's 16 MiB image blocks come from the
    heap and stay with the process: one 9000x9000 decode left the daemon at
    ~660 MiB. A fixed threshold of 1 MiB (mallopt disables the adjustment)
    returns them at once, measured back to ~40 MiB, for one mmap per large
    block, which is nothing next to a decode.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if libc.mallopt(_M_MMAP_THRESHOLD, 1 << 20) != 1:
            log.debug("mallopt(M_MMAP_THRESHOLD) refused; large decodes may stay resident")
    except (OSError, AttributeError) as exc:  # not glibc
        log.debug("cannot set malloc's mmap threshold: %s", exc)
    reuse_image_memory()


def reuse_image_memory() -> None:
    """Keep a few freed image blocks for the next decode instead of unmapping them.

    With the 1 MiB threshold above, each of a decode's images (a 640x480 RGB
    image is 1.2 MiB: Pillow keeps 4 bytes a pixel) was its own mmap, faulted
    in page by page and unmapped on free: ~600 page faults a decode, measured
    as 40% more CPU per 640x480 decode than without the threshold. Pillow's
    own block cache, with blocks no bigger than IMAGE_BLOCK_BYTES, serves them
    from the kept blocks instead; a large image is many blocks, of which
    IMAGE_BLOCKS_KEPT stay, so its memory still goes back.
    """
    try:
        _imaging.set_block_size(IMAGE_BLOCK_BYTES)
        _imaging.set_blocks_max(IMAGE_BLOCKS_KEPT)
    except (AttributeError, ValueError) as exc:  # a Pillow without its block allocator
        log.debug("Pillow keeps no freed image blocks: %s", exc)


def raise_readahead(mountpoint: str) -> None:
    """Let the kernel read an array ahead in one READ request (READAHEAD_KB), not in
    pieces of its default 128 KiB: each request is a round trip through the daemon.

    The mount's readahead is its backing device's (/sys/class/bdi/MAJOR:MINOR), which
    FUSE caps at INIT to what libfuse answers (the kernel's default); only root may
    raise it, once the mount is live. Found through the mount table.
    """
    ours = [m for m in mounts() if m.mountpoint == mountpoint and m.fstype == FS_TYPE]
    if not ours:
        return
    major, minor = ours[-1].device
    path = f"/sys/class/bdi/{major}:{minor}/read_ahead_kb"
    try:
        with open(path, "r+", encoding="ascii") as f:
            if int(f.read()) < READAHEAD_KB:
                f.seek(0)
                f.write(str(READAHEAD_KB))
    except (OSError, ValueError) as exc:
        log.debug("cannot raise the readahead of %s (%s): %s", mountpoint, path, exc)


def log_destination() -> str:
    """Where this process's log lines go, as a user can find them: the file its stderr
    is, the journal (systemd), or its standard error (a terminal, a pipe)."""
    try:
        st = os.fstat(2)
    except OSError:
        return "nowhere"
    if stat.S_ISREG(st.st_mode):
        try:
            return os.readlink("/proc/self/fd/2")
        except OSError:
            return "the daemon's log file"
    if os.environ.get("JOURNAL_STREAM", "") == f"{st.st_dev}:{st.st_ino}":
        return "the journal (journalctl)"
    return "the daemon's standard error"
