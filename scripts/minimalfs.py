"""The floor of the binding: a minimal pyfuse3 file system serving a directory's files.

Used by bench_scale.py (and by hand) as the reference decodefs's own cost per
request is measured against: the same bytes, the same attributes and kernel
caching (day-long entry/attr timeouts, ``keep_cache``, FLUSH answered ENOSYS
once), and nothing else: no verification, no pins, no counters. Every file of
``SOURCE`` (one flat directory) is read into memory at start.

    .venv/bin/python scripts/minimalfs.py SOURCE MOUNTPOINT   # serves until unmounted

It prints ``ready`` on stdout once the mount is live, and the number of READ
requests it answered when it ends.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
from pathlib import Path

import pyfuse3
import trio

_TIMEOUT = 86400.0


class MinimalFS(pyfuse3.Operations):
    def __init__(self, source: Path) -> None:
        super().__init__()
        names = sorted(p.name for p in source.iterdir() if p.is_file())
        self._names = {name.encode(): pyfuse3.ROOT_INODE + 1 + i for i, name in enumerate(names)}
        self._data = {
            pyfuse3.ROOT_INODE + 1 + i: (source / name).read_bytes() for i, name in enumerate(names)
        }
        self.reads = 0

    def _attr(self, inode: int) -> pyfuse3.EntryAttributes:
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = inode
        entry.entry_timeout = entry.attr_timeout = _TIMEOUT
        if inode == pyfuse3.ROOT_INODE:
            entry.st_mode, entry.st_size, entry.st_nlink = stat.S_IFDIR | 0o555, 0, 2
        else:
            entry.st_mode, entry.st_nlink = stat.S_IFREG | 0o444, 1
            entry.st_size = len(self._data[inode])
        entry.st_blksize = 128 * 1024
        entry.st_blocks = (entry.st_size + 511) // 512
        return entry

    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        inode = self._names.get(name) if parent_inode == pyfuse3.ROOT_INODE else None
        if inode is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(inode)

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if inode != pyfuse3.ROOT_INODE and inode not in self._data:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(inode)

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        return inode

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        items = list(self._names.items())
        for i in range(start_id, len(items)):
            name, inode = items[i]
            if not pyfuse3.readdir_reply(token, name, self._attr(inode), i + 1):
                return

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        self.reads += 1
        return memoryview(self._data[fh])[off : off + size]  # type: ignore[return-value]

    async def flush(self, fh: int) -> None:
        raise pyfuse3.FUSEError(errno.ENOSYS)

    async def release(self, fh: int) -> None:
        pass


def main() -> None:
    source, mountpoint = Path(sys.argv[1]), sys.argv[2]
    operations = MinimalFS(source)
    options = set(pyfuse3.default_options) | {"fsname=minimalfs", "ro"}
    pyfuse3.init(operations, mountpoint, options)
    print("ready", flush=True)
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=True)
        print(f"reads {operations.reads}", flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
