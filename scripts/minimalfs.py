"""The floor of the binding: a minimal pyfuse3 file system serving a directory's files.

Used by bench_plain.py (and by hand) as the reference decodefs's own cost per
request is measured against: the same bytes, the same attributes and kernel
caching (day-long entry/attr timeouts, ``keep_cache``, FLUSH answered ENOSYS
once, the readahead decodefs sets), and nothing else: no verification, no
pins, no counters, no page-cache policy. Its files are those of ``SOURCE`` (one
flat directory): held in memory (read at start), or with ``--from-disk`` read
per READ request in a trio worker thread, as the simplest passthrough would.
With ``--import-daemon`` it first imports every module decodefs's daemon
imports (numpy, Pillow, prometheus_client, sqlite3, ...) and serves the same
way: what a process of the daemon's size costs the same request loop, with
none of decodefs's handlers.

    .venv/bin/python scripts/minimalfs.py [--from-disk] [--import-daemon] SOURCE MOUNTPOINT

It prints ``ready`` on stdout once the mount is live, and the number of READ
requests it answered when it ends (after an unmount).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import os
import stat
from pathlib import Path

import pyfuse3
import trio

_TIMEOUT = 86400.0
_READAHEAD_KB = 1024  # as decodefs sets it (daemon.READAHEAD_KB)


class MinimalFS(pyfuse3.Operations):
    def __init__(self, source: Path, from_disk: bool) -> None:
        super().__init__()
        names = sorted(p.name for p in source.iterdir() if p.is_file())
        first = pyfuse3.ROOT_INODE + 1
        self._names = {name.encode(): first + i for i, name in enumerate(names)}
        self._paths = {first + i: str(source / name) for i, name in enumerate(names)}
        self._sizes = {inode: os.stat(path).st_size for inode, path in self._paths.items()}
        self._data = {} if from_disk else {i: Path(p).read_bytes() for i, p in self._paths.items()}
        self._threads = trio.CapacityLimiter(8)
        self.reads = 0

    def _attr(self, inode: int) -> pyfuse3.EntryAttributes:
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = inode
        entry.entry_timeout = entry.attr_timeout = _TIMEOUT
        if inode == pyfuse3.ROOT_INODE:
            entry.st_mode, entry.st_size, entry.st_nlink = stat.S_IFDIR | 0o555, 0, 2
        else:
            entry.st_mode, entry.st_nlink = stat.S_IFREG | 0o444, 1
            entry.st_size = self._sizes[inode]
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
        if inode != pyfuse3.ROOT_INODE and inode not in self._sizes:
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
        data = self._data.get(fh)
        if data is not None:
            return data[off : off + size]
        path = self._paths[fh]

        def read_file() -> bytes:
            fd = os.open(path, os.O_RDONLY)
            try:
                return os.pread(fd, size, off)
            finally:
                os.close(fd)

        return await trio.to_thread.run_sync(read_file, limiter=self._threads)

    async def flush(self, fh: int) -> None:
        raise pyfuse3.FUSEError(errno.ENOSYS)

    async def release(self, fh: int) -> None:
        pass


def _raise_readahead(mountpoint: str) -> None:
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            if fields[4] == mountpoint:
                device = fields[2]
    with contextlib.suppress(OSError):  # not root: the kernel's default
        Path(f"/sys/class/bdi/{device}/read_ahead_kb").write_text(str(_READAHEAD_KB))


async def _serve(mountpoint: str) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pyfuse3.main)
        await trio.to_thread.run_sync(os.stat, mountpoint)  # INIT is done: raise it now
        await trio.to_thread.run_sync(_raise_readahead, mountpoint)
        print("ready", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--from-disk", action="store_true")
    parser.add_argument("--import-daemon", action="store_true")
    parser.add_argument("source", type=Path)
    parser.add_argument("mountpoint")
    args = parser.parse_args()
    if args.import_daemon:
        for module in (
            "decodefs.cli.commands",
            "decodefs.daemon.lifecycle",
        ):  # what `decodefs mount` imports
            importlib.import_module(module)
    mountpoint = os.path.abspath(args.mountpoint)
    operations = MinimalFS(args.source, args.from_disk)
    options = set(pyfuse3.default_options) | {"fsname=minimalfs", "ro"}
    pyfuse3.init(operations, mountpoint, options)
    try:
        trio.run(_serve, mountpoint)
    finally:
        pyfuse3.close(unmount=True)
        print(f"reads {operations.reads}", flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
