"""A pass-through FUSE filesystem that answers EIO to reads and/or writes of ``*.npy`` files
while its control file says so: part 4 mounts it under a store. It knows nothing of
decodefs or of the harness.

    python -m scripts.reliability.faultfs BACKING MOUNTPOINT CONTROL

Write "read", "write" or "read,write" to CONTROL to fail those calls; "none" to stop.
CONTROL.counts holds how many of each were failed (JSON).
"""

from __future__ import annotations

import collections
import errno
import functools
import json
import os
import stat
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import pyfuse3
import trio

P = ParamSpec("P")
R = TypeVar("R")


def _errno_of_oserror(
    handler: Callable[Concatenate[FaultFS, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[FaultFS, P], Coroutine[Any, Any, R]]:
    @functools.wraps(handler)
    async def wrapper(self: FaultFS, /, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await handler(self, *args, **kwargs)
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        except KeyError:
            raise pyfuse3.FUSEError(errno.ENOENT) from None

    return wrapper


class FaultFS(pyfuse3.Operations):
    """Passes everything through to ``backing``; answers EIO to reads and/or writes of
    ``*.npy`` files while the control file says so ("read", "write", "read,write")."""

    def __init__(self, backing: str, control: str) -> None:
        super().__init__()
        self._backing = backing
        self._control = control
        self._paths: dict[int, str] = {pyfuse3.ROOT_INODE: backing}
        self._files: dict[int, str] = {}  # fh (the backing descriptor) -> path
        self.injected: collections.Counter[str] = collections.Counter()

    def _fault(self, operation: str, path: str) -> None:
        """Fail this call with EIO if the control file says so now (read at every call on
        an entry, so that a fault starts with the first call after it is written)."""
        if not path.endswith(".npy"):
            return
        try:
            mode = Path(self._control).read_text().strip().split(",")
        except OSError:
            mode = []
        if operation in mode:
            self.injected[operation] += 1
            Path(self._control + ".counts").write_text(json.dumps(self.injected))
            raise pyfuse3.FUSEError(errno.EIO)

    def _attributes(self, path: str) -> pyfuse3.EntryAttributes:
        st = os.lstat(path)
        inode = pyfuse3.ROOT_INODE if path == self._backing else st.st_ino
        self._paths[inode] = path
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = inode
        entry.generation = 0
        entry.entry_timeout = entry.attr_timeout = 0
        entry.st_mode, entry.st_nlink = st.st_mode, st.st_nlink
        entry.st_uid, entry.st_gid, entry.st_rdev = st.st_uid, st.st_gid, st.st_rdev
        entry.st_size, entry.st_blksize, entry.st_blocks = st.st_size, st.st_blksize, st.st_blocks
        entry.st_atime_ns, entry.st_mtime_ns = st.st_atime_ns, st.st_mtime_ns
        entry.st_ctime_ns = st.st_ctime_ns
        return entry

    def _child(self, parent: int, name: bytes) -> str:
        return os.path.join(self._paths[parent], os.fsdecode(name))

    @_errno_of_oserror
    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        return self._attributes(self._child(parent_inode, name))

    @_errno_of_oserror
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._attributes(self._paths[inode])

    @_errno_of_oserror
    async def setattr(
        self,
        inode: int,
        attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields,
        fh: int | None,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        path = self._paths[inode]
        if fields.update_mode:
            os.chmod(path, stat.S_IMODE(attr.st_mode), follow_symlinks=False)
        if fields.update_uid or fields.update_gid:
            uid = attr.st_uid if fields.update_uid else -1
            gid = attr.st_gid if fields.update_gid else -1
            os.chown(path, uid, gid, follow_symlinks=False)
        if fields.update_size:
            os.truncate(path, attr.st_size)
        if fields.update_atime or fields.update_mtime:
            st = os.lstat(path)
            atime = attr.st_atime_ns if fields.update_atime else st.st_atime_ns
            mtime = attr.st_mtime_ns if fields.update_mtime else st.st_mtime_ns
            os.utime(path, ns=(atime, mtime), follow_symlinks=False)
        return self._attributes(path)

    @_errno_of_oserror
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        return os.fsencode(os.readlink(self._paths[inode]))

    @_errno_of_oserror
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        return inode

    @_errno_of_oserror
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        path = self._paths[fh]
        names = sorted(os.listdir(path))
        for i in range(start_id, len(names)):
            try:
                attributes = self._attributes(os.path.join(path, names[i]))
            except FileNotFoundError:
                continue
            if not pyfuse3.readdir_reply(token, os.fsencode(names[i]), attributes, i + 1):
                return

    async def releasedir(self, fh: int) -> None:
        pass

    @_errno_of_oserror
    async def mkdir(
        self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        path = self._child(parent_inode, name)
        os.mkdir(path, stat.S_IMODE(mode) & ~ctx.umask)
        os.chown(path, ctx.uid, ctx.gid, follow_symlinks=False)
        return self._attributes(path)

    @_errno_of_oserror
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        os.rmdir(self._child(parent_inode, name))

    @_errno_of_oserror
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        os.unlink(self._child(parent_inode, name))

    @_errno_of_oserror
    async def rename(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
        ctx: pyfuse3.RequestContext,
    ) -> None:
        if flags:
            raise pyfuse3.FUSEError(errno.EINVAL)
        old = self._child(parent_inode_old, name_old)
        new = self._child(parent_inode_new, name_new)
        os.rename(old, new)
        for table in (self._paths, self._files):
            for key, path in list(table.items()):
                if path == old or path.startswith(old + "/"):
                    table[key] = new + path[len(old) :]

    @_errno_of_oserror
    async def create(
        self,
        parent_inode: int,
        name: bytes,
        mode: int,
        flags: int,
        ctx: pyfuse3.RequestContext,
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        path = self._child(parent_inode, name)
        fd = os.open(path, flags | os.O_CREAT, stat.S_IMODE(mode) & ~ctx.umask)
        os.fchown(fd, ctx.uid, ctx.gid)
        self._files[fd] = path
        return pyfuse3.FileInfo(fh=fd), self._attributes(path)

    @_errno_of_oserror
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        path = self._paths[inode]
        fd = os.open(path, flags & ~os.O_CREAT)
        self._files[fd] = path
        return pyfuse3.FileInfo(fh=fd)

    @_errno_of_oserror
    async def read(self, fh: int, off: int, size: int) -> bytes:
        self._fault("read", self._files[fh])
        return os.pread(fh, size, off)

    @_errno_of_oserror
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        self._fault("write", self._files[fh])
        return os.pwrite(fh, buf, off)

    async def flush(self, fh: int) -> None:
        pass

    @_errno_of_oserror
    async def fsync(self, fh: int, datasync: bool) -> None:
        os.fsync(fh)

    @_errno_of_oserror
    async def release(self, fh: int) -> None:
        self._files.pop(fh, None)
        os.close(fh)

    @_errno_of_oserror
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        vfs = os.statvfs(self._backing)
        data = pyfuse3.StatvfsData()
        for name in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                     "f_ffree", "f_favail", "f_namemax"):  # fmt: skip
            setattr(data, name, getattr(vfs, name))
        return data


def main(backing: str, mountpoint: str, control: str) -> None:
    """Serve FaultFS until unmounted."""
    operations = FaultFS(backing, control)
    pyfuse3.init(operations, mountpoint, set(pyfuse3.default_options) | {"fsname=faultfs"})
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=False)
        Path(control + ".counts").write_text(json.dumps(operations.injected))


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: python -m scripts.reliability.faultfs BACKING MOUNTPOINT CONTROL")
    main(*sys.argv[1:])
