"""pyfuse3: the session (FuseMount) and the Operations (DecodeFS) that answer it.

Thin by design: names and inodes live in namespace.py, caching policy in
engine.py. This is the only module that imports pyfuse3 or raises FUSEError,
and every handler runs behind ``_errno_boundary``: an unexpected exception
becomes EIO for that one request instead of ending pyfuse3's main loop.
"""

from __future__ import annotations

import errno
import functools
import itertools
import logging
import os
import sys
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, Concatenate, Final, ParamSpec, TypeVar

import pyfuse3

from ..common.metrics import LogThrottle, Metrics
from ..common.names import ARRAY_SUFFIX_BYTES
from ..common.protocol import FS_NAME, NAME_MAX, RECHECK_FLAG, WARM_FLAG, OpenRequest
from .admission import WAITING_PER_USER, UserBusy
from .engine import Engine, Handle, OriginalNotFound, OriginalUndecodable
from .namespace import Attributes, Kind, Node, Tree

__all__ = ["DecodeFS", "FuseMount", "MountFailed"]

log = logging.getLogger(__name__)

# pyfuse3 starts a worker task per concurrent request up to this many; a reader
# waiting on a decode holds one, so keep it well above any plausible reader count.
MAX_REQUEST_TASKS: Final = 512
assert MAX_REQUEST_TASKS >= 2 * WAITING_PER_USER  # one user's waits leave tasks for the rest
# Content never changes for a name within a mount, so let the kernel cache
# names and attributes for a day; status files are live and never cached.
CACHE_TIMEOUT: Final = 86400.0
_BLOCK_SIZE: Final = 128 * 1024
_WRITE_FLAGS: Final = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT
# Opens with any of these bits set are not plain reads: they go the whole way.
_SLOW_OPEN_FLAGS: Final = _WRITE_FLAGS | WARM_FLAG | RECHECK_FLAG
_FS_ENCODING: Final = sys.getfilesystemencoding()
# Testing aid: a uuid named here makes `open` raise an unexpected exception,
# so the suite can show the errno boundary holds on a real mount.
_FAILPOINT_ENV: Final = "DECODEFS_FAILPOINT_OPEN"

P = ParamSpec("P")
R = TypeVar("R")


def _errno_boundary(
    handler: Callable[Concatenate[DecodeFS, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[DecodeFS, P], Coroutine[Any, Any, R]]:
    @functools.wraps(handler)
    async def wrapper(self: DecodeFS, /, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await handler(self, *args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except Exception as exc:
            raise self._errno_of(exc, handler.__name__.lstrip("_"), args) from None

    return wrapper


class DecodeFS(pyfuse3.Operations):
    def __init__(
        self, tree: Tree, engine: Engine, status_files: Mapping[str, Callable[[], bytes]]
    ) -> None:
        super().__init__()
        self._tree = tree
        self._engine = engine
        self._metrics: Metrics = engine.metrics
        self._status_files = status_files
        self._handles: dict[int, Handle | bytes] = {}
        self._next_fh = itertools.count(1)
        self._uid = os.getuid()
        self._gid = os.getgid()
        self._failpoint = os.environ.get(_FAILPOINT_ENV)
        self._throttle = LogThrottle(log)
        # pyfuse3 copies an open's FileInfo before any other request runs, so the hot
        # path fills this one instead of making one per open.
        self._hit_info = pyfuse3.FileInfo(keep_cache=True)
        # Size directory inode -> the attributes of its arrays, for lookup's hot path.
        self._array_attrs: dict[int, pyfuse3.EntryAttributes] = {}

    # -- names and attributes -----------------------------------------------

    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        # The hot path: <uuid>.npy in a size directory whose arrays' attributes are
        # known (they are alike but for the inode); pyfuse3 copies them out at once.
        try:
            attrs = self._array_attrs.get(parent_inode)
            if attrs is not None:
                ino = self._tree.entry_below(parent_inode, name)
                if ino is not None:
                    attrs.st_ino = ino
                    return attrs
        except Exception as exc:
            raise self._errno_of(exc, "lookup", (parent_inode, name)) from None
        return await self._lookup(parent_inode, name, ctx)

    @_errno_boundary
    async def _lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        parent = self._node(parent_inode)
        if len(name) > NAME_MAX:
            raise pyfuse3.FUSEError(errno.ENAMETOOLONG)
        if name == b".":
            node: Node | None = parent
        elif name == b"..":
            node = self._tree.parent(parent)
        else:
            node = self._tree.lookup(parent, name)
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if node.kind == Kind.ENTRY and parent.kind == Kind.SIZE:
            # Its siblings' attributes, for the hot path: one object, which each hit
            # gives its inode (pyfuse3 copies it out before another request runs).
            self._array_attrs.setdefault(parent.ino, self._entry(node))
        return self._entry(node)

    @_errno_boundary
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._entry(self._node(inode))

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        pass  # inode numbers are computed (inodes.py); there is nothing to release

    @_errno_boundary
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        usage = self._engine.store.usage()
        data = pyfuse3.StatvfsData()
        data.f_bsize = data.f_frsize = 4096
        data.f_blocks = usage.bytes // 4096
        data.f_bfree = data.f_bavail = 0
        data.f_files = usage.entries
        data.f_ffree = data.f_favail = 0
        data.f_namemax = NAME_MAX
        return data

    # -- directories --------------------------------------------------------

    @_errno_boundary
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        if not self._tree.is_dir(self._node(inode)):
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    @_errno_boundary
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        node = Node.from_ino(fh)
        for next_id, name, child in self._tree.children(node, start_id):
            if not pyfuse3.readdir_reply(token, name, self._entry(child), next_id):
                return
        arrays = self._tree.array_rows(node, start_id)
        if arrays is not None:
            # Every array of a directory has the same attributes but its inode;
            # readdir_reply copies them, so one object serves the whole listing.
            attributes = self._entry(arrays.sample)
            reply, keys, base = pyfuse3.readdir_reply, arrays.keys, arrays.base_ino
            strip, delta = arrays.strip, arrays.offset_delta
            encoding = _FS_ENCODING  # as os.fsencode, without its per-call overhead
            for i in arrays.rows:
                attributes.st_ino = base | i
                name = keys[i][strip:].encode(encoding, "surrogateescape") + ARRAY_SUFFIX_BYTES
                if not reply(token, name, attributes, i + delta):
                    return

    async def releasedir(self, fh: int) -> None:
        pass

    # -- files --------------------------------------------------------------

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        # The hot path, the one most requests take: a plain open of an array verified
        # earlier in this daemon's life. Nothing is awaited and no object is made but
        # the handle; anything else goes the whole way (_open).
        try:
            if not flags & _SLOW_OPEN_FLAGS and self._failpoint is None:
                entry = self._tree.entry(inode)
                if entry is not None:
                    handle = self._engine.open_verified(entry[0], entry[1], entry[2], ctx.uid)
                    if handle is not None:
                        fh = next(self._next_fh)
                        self._handles[fh] = handle
                        info = self._hit_info
                        info.fh = fh
                        return info
        except Exception as exc:
            raise self._errno_of(exc, "open", (inode, flags)) from None
        return await self._open(inode, flags, ctx)

    @_errno_boundary
    async def _open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if flags & _WRITE_FLAGS:
            raise pyfuse3.FUSEError(errno.EROFS)
        node = self._node(inode)
        fh = next(self._next_fh)
        if node.kind == Kind.ENTRY:
            version = self._tree.version_name(node)
            if self._failpoint and self._tree.key(node) == self._failpoint:
                raise RuntimeError(f"failpoint {_FAILPOINT_ENV} hit")
            request = OpenRequest.from_flags(flags)
            handle = await self._engine.open(
                version,
                node.size,
                node.number,
                warm=request.warm,
                recheck=request.recheck,
                uid=ctx.uid,
            )
            self._handles[fh] = handle
            return pyfuse3.FileInfo(fh=fh, keep_cache=True)
        status = self._tree.status_file_name(node)
        if status is None:
            raise pyfuse3.FUSEError(errno.EISDIR if self._tree.is_dir(node) else errno.ENOENT)
        self._handles[fh] = self._status_files[status]()
        return pyfuse3.FileInfo(fh=fh, direct_io=True)

    @_errno_boundary
    async def read(self, fh: int, off: int, size: int) -> bytes | bytearray | memoryview:  # type: ignore[override]
        # pyfuse3 replies from any contiguous buffer, so a memoryview slice is zero-copy.
        handle = self._handles[fh]
        if isinstance(handle, bytes):
            return handle[off : off + size]
        return await self._engine.read(handle, off, size)

    async def flush(self, fh: int) -> None:
        # Nothing is ever written, so there is nothing to flush. ENOSYS makes the
        # kernel stop sending FLUSH on every close() for the rest of the mount,
        # which saves each reader a synchronous round trip per file.
        log.debug("FLUSH answered ENOSYS; the kernel stops sending it")
        raise pyfuse3.FUSEError(errno.ENOSYS)

    async def release(self, fh: int) -> None:
        try:
            handle = self._handles.pop(fh, None)
            if isinstance(handle, Handle):
                self._engine.release(handle)
        except Exception as exc:
            raise self._errno_of(exc, "release", (fh,)) from None

    # -- the mount is read-only (the kernel already refuses most of these: "ro") --

    async def setattr(
        self,
        inode: int,
        attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields,
        fh: int | None,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        raise pyfuse3.FUSEError(errno.EROFS)

    async def mknod(
        self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        raise pyfuse3.FUSEError(errno.EROFS)

    async def mkdir(
        self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        raise pyfuse3.FUSEError(errno.EROFS)

    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        raise pyfuse3.FUSEError(errno.EROFS)

    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        raise pyfuse3.FUSEError(errno.EROFS)

    async def symlink(
        self, parent_inode: int, name: bytes, target: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        raise pyfuse3.FUSEError(errno.EROFS)

    async def rename(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
        ctx: pyfuse3.RequestContext,
    ) -> None:
        raise pyfuse3.FUSEError(errno.EROFS)

    async def link(
        self, inode: int, new_parent_inode: int, new_name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        raise pyfuse3.FUSEError(errno.EROFS)

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        raise pyfuse3.FUSEError(errno.EROFS)

    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: pyfuse3.RequestContext
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        raise pyfuse3.FUSEError(errno.EROFS)

    async def setxattr(
        self, inode: int, name: bytes, value: bytes, ctx: pyfuse3.RequestContext
    ) -> None:
        raise pyfuse3.FUSEError(errno.EROFS)

    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        raise pyfuse3.FUSEError(errno.EROFS)

    # -- helpers ------------------------------------------------------------

    def _errno_of(
        self, exc: Exception, handler: str, args: tuple[object, ...]
    ) -> pyfuse3.FUSEError:
        """The errno to answer for ``exc``, raised by ``handler``: the errno boundary."""
        if isinstance(exc, pyfuse3.FUSEError):
            return exc
        if isinstance(exc, OriginalNotFound):
            return pyfuse3.FUSEError(errno.ENOENT)
        if isinstance(exc, OriginalUndecodable):
            return pyfuse3.FUSEError(errno.EIO)
        if isinstance(exc, UserBusy):
            return pyfuse3.FUSEError(errno.EAGAIN)
        self._metrics.errors["unexpected"] += 1
        # Folded like any repeated error: a bug that every request hits must
        # not write a traceback per request.
        self._throttle.log(
            logging.ERROR,
            f"unexpected-{handler}-{type(exc).__name__}",
            "unexpected error in %s%r; answering EIO",
            handler,
            args,
            exc_info=True,  # called while handling exc
        )
        return pyfuse3.FUSEError(errno.EIO)

    def _node(self, inode: int) -> Node:
        """The node an inode number names; ENOENT for one that names nothing."""
        try:
            node = Node.from_ino(inode)
        except IndexError:  # no such kind
            raise pyfuse3.FUSEError(errno.ENOENT) from None
        if not self._tree.exists(node):
            raise pyfuse3.FUSEError(errno.ENOENT)
        return node

    def _entry(self, node: Node) -> pyfuse3.EntryAttributes:
        status = self._tree.status_file_name(node)
        if status is not None:
            attrs = self._tree.attributes(node, len(self._status_files[status]()))
            timeout = 0.0
        else:
            attrs = self._tree.attributes(node)
            timeout = CACHE_TIMEOUT
        return self._fill(node, attrs, timeout)

    def _fill(self, node: Node, attrs: Attributes, timeout: float) -> pyfuse3.EntryAttributes:
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = node.ino
        entry.generation = 0
        entry.entry_timeout = timeout
        entry.attr_timeout = timeout
        entry.st_mode = attrs.mode
        entry.st_nlink = attrs.nlink
        entry.st_uid = self._uid
        entry.st_gid = self._gid
        entry.st_rdev = 0
        entry.st_size = attrs.size
        entry.st_blksize = _BLOCK_SIZE
        entry.st_blocks = (attrs.size + 511) // 512
        entry.st_atime_ns = entry.st_mtime_ns = entry.st_ctime_ns = attrs.mtime_ns
        return entry


class _DroppedRequestFilter(logging.Filter):
    """Demote pyfuse3's ERROR for a reply the kernel no longer wanted.

    A reply fails with ENOENT when the kernel has dropped the request:
    interrupted, or ended by an unmount while RELEASEs were queued. Nothing is
    lost, so it is a debug line, not an error for the operator.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "fuse_reply_* failed with No such file or directory" in message:
            log.debug("%s (the kernel had dropped the request)", message)
            return False
        return True


class MountFailed(Exception):
    """The kernel refused the mount (libfuse has printed its reason on stderr)."""


class FuseMount:
    """pyfuse3's session for one mount point. One per process (pyfuse3 is global)."""

    def __init__(self, operations: DecodeFS, mountpoint: str, allow_other: bool = False) -> None:
        self._operations = operations
        self._mountpoint = mountpoint
        self._allow_other = allow_other

    def mount(self) -> None:
        pyfuse3_log = logging.getLogger("pyfuse3")
        if not any(isinstance(f, _DroppedRequestFilter) for f in pyfuse3_log.filters):
            pyfuse3_log.addFilter(_DroppedRequestFilter())
        # default_permissions: the kernel enforces the 0444/0555 modes for every user.
        options = set(pyfuse3.default_options) | {f"fsname={FS_NAME}", f"subtype={FS_NAME}", "ro"}
        if self._allow_other:
            options.add("allow_other")  # other users' processes may read the mount
        try:
            pyfuse3.init(self._operations, self._mountpoint, options)
        except RuntimeError as exc:
            raise MountFailed(str(exc)) from exc

    async def serve(self) -> bool:
        """Answer requests until the kernel ends the session: an unmount, and
        after a lazy unmount, once the last open file is closed.

        Returns True if the kernel ended it with ECONNABORTED rather than
        ENODEV: libfuse passes that on as an error, yet it happens on a plain
        unmount that races queued RELEASE requests, as well as when someone
        aborts the connection through fusectl. The caller tells them apart.
        """
        aborted = False
        try:
            await pyfuse3.main(max_tasks=MAX_REQUEST_TASKS)
        except* ConnectionAbortedError:
            aborted = True
        return aborted

    def stop(self) -> None:
        """Make ``serve`` return (call from the trio thread)."""
        pyfuse3.terminate()

    def close(self) -> None:
        """Unmount if still mounted, and free the session."""
        pyfuse3.close(unmount=True)
