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
import socket
import struct
import sys
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, Concatenate, Final, ParamSpec, TypeVar

import pyfuse3
import trio

from ..common.metrics import LogThrottle, Metrics
from ..common.names import ARRAY_SUFFIX_BYTES
from ..common.protocol import FS_NAME, NAME_MAX, RECHECK_FLAG, WARM_FLAG, OpenRequest
from .admission import WAITING_PER_USER, UserBusy
from .engine import Engine, Handle, OriginalNotFound, OriginalUndecodable
from .namespace import Attributes, Kind, Node, Tree

__all__ = ["DecodeFS", "FuseSession", "InitReplayFailed"]

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
# A file handle is the array's inode number, so that any serving process of the
# mount can answer a READ or RELEASE of an OPEN another answered; a status
# file's has this bit (no inode number has it), a serial and the file's number.
_STATUS_FH: Final = 1 << 63
_STATUS_NUMBER: Final = 0xFFFF
# Testing aids for the handover's fallbacks: while the file either names exists, the
# reply to the replayed INIT differs from the mount's (another libfuse), or the kernel
# seems to lack FUSE_NOTIFY_RESEND (a kernel before 6.9).
_FAILPOINT_INIT_ENV: Final = "DECODEFS_FAILPOINT_INIT_REPLY"
_FAILPOINT_RESEND_ENV: Final = "DECODEFS_FAILPOINT_NO_RESEND"

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
        # fh (the array's inode) -> a handle of one open; the others open at once on
        # the same array wait in _more; a status file's snapshot by its fh.
        self._opened: dict[int, Handle] = {}
        self._more: dict[int, list[Handle]] = {}
        self._status: dict[int, bytes] = {}
        self._next_status = itertools.count(1)
        self.initialized: Callable[[], None] | None = None  # told of the kernel's INIT
        # Told of a size directory looked up for the first time in the mount (its
        # pages may be cached from then on); awaited before the lookup is answered.
        self.size_seen: Callable[[str, int], Coroutine[Any, Any, None]] | None = None
        self._originals = tree.originals
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
        # known (they are alike but for the inode, and with access = "originals" the
        # owner, group and mode); pyfuse3 copies them out at once.
        try:
            attrs = self._array_attrs.get(parent_inode)
            if attrs is not None:
                ino = self._tree.entry_below(parent_inode, name)
                if ino is not None:
                    attrs.st_ino = ino
                    if self._originals:
                        readers = self._tree.entry_readers(ino)
                        if readers is not None:
                            attrs.st_uid, attrs.st_gid, attrs.st_mode = readers
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
        elif node.kind == Kind.SIZE and self.size_seen is not None:
            await self.size_seen(self._tree.version_name(node), node.size)
        return self._entry(node)

    @_errno_boundary
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._entry(self._node(inode))

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        pass  # inode numbers are computed (numbers.py); there is nothing to release

    def init(self) -> None:
        if self.initialized is not None:
            self.initialized()

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
            strip, delta, numbers = arrays.strip, arrays.offset_delta, arrays.numbers
            readers = arrays.readers.at if arrays.readers is not None else None
            encoding = _FS_ENCODING  # as os.fsencode, without its per-call overhead
            for i in arrays.rows:
                attributes.st_ino = base | numbers[i]
                if readers is not None:
                    attributes.st_uid, attributes.st_gid, attributes.st_mode = readers(i)
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
                        if inode in self._opened:
                            self._more.setdefault(inode, []).append(handle)
                        else:
                            self._opened[inode] = handle
                        info = self._hit_info
                        info.fh = inode
                        return info
        except Exception as exc:
            raise self._errno_of(exc, "open", (inode, flags)) from None
        return await self._open(inode, flags, ctx)

    @_errno_boundary
    async def _open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if flags & _WRITE_FLAGS:
            raise pyfuse3.FUSEError(errno.EROFS)
        node = self._node(inode)
        if node.kind == Kind.ENTRY:
            version = self._tree.version_name(node)
            if self._failpoint and self._tree.key(node) == self._failpoint:
                raise RuntimeError(f"failpoint {_FAILPOINT_ENV} hit")
            request = OpenRequest.from_flags(flags)
            handle = await self._engine.open(
                version,
                node.size,
                self._tree.position(node),
                warm=request.warm,
                recheck=request.recheck,
                uid=ctx.uid,
            )
            if inode in self._opened:
                self._more.setdefault(inode, []).append(handle)
            else:
                self._opened[inode] = handle
            return pyfuse3.FileInfo(fh=inode, keep_cache=True)
        status = self._tree.status_file_name(node)
        if status is None:
            raise pyfuse3.FUSEError(errno.EISDIR if self._tree.is_dir(node) else errno.ENOENT)
        fh = _STATUS_FH | next(self._next_status) << 16 | node.number
        self._status[fh] = self._status_files[status]()
        return pyfuse3.FileInfo(fh=fh, direct_io=True)

    @_errno_boundary
    async def read(self, fh: int, off: int, size: int) -> bytes | bytearray | memoryview:  # type: ignore[override]
        # pyfuse3 replies from any contiguous buffer, so a memoryview slice is zero-copy.
        handle = self._opened.get(fh)
        if handle is None:
            if fh & _STATUS_FH:
                return self._status_snapshot(fh)[off : off + size]
            handle = await self._adopt(fh)
        return await self._engine.read(handle, off, size)

    async def _adopt(self, fh: int) -> Handle:
        """A handle for a READ of a file that an earlier serving process of the mount
        opened: made as an open would make it, and let go at the next RELEASE."""
        node = self._node(fh)
        if node.kind != Kind.ENTRY:
            raise pyfuse3.FUSEError(errno.EBADF)
        handle = self._opened.get(fh)  # another READ adopted it meanwhile
        if handle is None:
            version = self._tree.version_name(node)
            handle = await self._engine.open(version, node.size, self._tree.position(node))
            if fh in self._opened:
                self._more.setdefault(fh, []).append(handle)
            else:
                self._opened[fh] = handle
        return handle

    def _status_snapshot(self, fh: int) -> bytes:
        """A status file's bytes for a handle opened by an earlier serving process."""
        snapshot = self._status.get(fh)
        if snapshot is None:
            name = self._tree.status_file_name(Node(Kind.SPECIAL, number=fh & _STATUS_NUMBER))
            if name is None:
                raise pyfuse3.FUSEError(errno.EBADF)
            snapshot = self._status[fh] = self._status_files[name]()
        return snapshot

    async def flush(self, fh: int) -> None:
        # Nothing is ever written, so there is nothing to flush. ENOSYS makes the
        # kernel stop sending FLUSH on every close() for the rest of the mount,
        # which saves each reader a synchronous round trip per file.
        log.debug("FLUSH answered ENOSYS; the kernel stops sending it")
        raise pyfuse3.FUSEError(errno.ENOSYS)

    async def release(self, fh: int) -> None:
        try:
            more = self._more.get(fh)
            if more:
                handle: Handle | None = more.pop()
                if not more:
                    del self._more[fh]
            else:
                handle = self._opened.pop(fh, None)
            if handle is not None:
                self._engine.release(handle)
            elif fh & _STATUS_FH:
                self._status.pop(fh, None)
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
        entry.st_uid = attrs.uid
        entry.st_gid = attrs.gid
        entry.st_rdev = 0
        entry.st_size = attrs.size
        entry.st_blksize = _BLOCK_SIZE
        entry.st_blocks = (attrs.size + 511) // 512
        entry.st_atime_ns = entry.st_mtime_ns = entry.st_ctime_ns = attrs.mtime_ns
        return entry


def _failpoint(env: str) -> bool:
    path = os.environ.get(env)
    return path is not None and os.path.exists(path)


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


class InitReplayFailed(Exception):
    """libfuse did not answer the replayed INIT (the message says what it did)."""


# fuse_out_header of a notification: its length, the notify code in the error
# field, no request; FUSE_NOTIFY_RESEND (kernel 6.9) puts back every request read
# but not answered, so a serving process that died loses none.
_NOTIFY: Final = struct.Struct("<IiQ")
_NOTIFY_RESEND: Final = 7


class FuseSession:
    """pyfuse3's session in one serving process of a mount that the holder keeps.

    One per process (pyfuse3 is global). The kernel sends INIT once per mount,
    and libfuse answers nothing before it has seen INIT, so the session starts
    on one end of a socket pair, is given the kernel's INIT there (its reply goes
    back to the holder, which compares it with the first serving process's),
    and only then is the real /dev/fuse descriptor put in place of the socket
    (``dup2``): libfuse keeps using the descriptor number it was given.
    """

    def __init__(self, operations: DecodeFS) -> None:
        self._operations = operations
        self._fd: int | None = None  # the descriptor number libfuse reads
        self.started = False  # pyfuse3 has a session (to close)

    def replay_init(self, init: bytes, allow_other: bool) -> bytes:
        """Start the session on the kernel's ``init``; libfuse's reply to it."""
        pyfuse3_log = logging.getLogger("pyfuse3")
        if not any(isinstance(f, _DroppedRequestFilter) for f in pyfuse3_log.filters):
            pyfuse3_log.addFilter(_DroppedRequestFilter())
        ours, theirs = socket.socketpair(
            socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC
        )
        with ours, theirs:
            self._fd = os.dup(theirs.fileno())  # the number libfuse keeps (CLOEXEC: dup's)
            ours.sendall(init)
            options = set(pyfuse3.default_options) | {
                f"fsname={FS_NAME}",
                f"subtype={FS_NAME}",
                "ro",
            }
            if allow_other:
                options.add("allow_other")
            try:
                pyfuse3.init(self._operations, f"/dev/fd/{self._fd}", options)
            except RuntimeError as exc:
                raise InitReplayFailed(f"libfuse would not start a session: {exc}") from exc
            self.started = True
            trio.run(self._until_initialized)
            ours.settimeout(10.0)
            try:
                reply = ours.recv(65536)
            except TimeoutError:
                raise InitReplayFailed("libfuse did not answer INIT") from None
            if _failpoint(_FAILPOINT_INIT_ENV):
                reply = reply[:-1] + bytes([reply[-1] ^ 1])
            return reply

    async def _until_initialized(self) -> None:
        initialized = trio.Event()
        self._operations.initialized = initialized.set
        try:
            with trio.fail_after(10):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(pyfuse3.main)
                    await initialized.wait()
                    nursery.cancel_scope.cancel()
        except trio.TooSlowError:
            raise InitReplayFailed("libfuse did not take the replayed INIT") from None
        finally:
            self._operations.initialized = None

    def adopt(self, fuse_fd: int) -> None:
        """Put the mount's /dev/fuse descriptor where libfuse reads (and close ``fuse_fd``)."""
        assert self._fd is not None
        os.dup2(fuse_fd, self._fd, inheritable=False)
        os.close(fuse_fd)

    def resend(self) -> str | None:
        """Have the kernel send again every request read but not answered (by a serving
        process that died); why it cannot (a kernel before 6.9), or None."""
        assert self._fd is not None
        try:
            if _failpoint(_FAILPOINT_RESEND_ENV):
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
            os.write(self._fd, _NOTIFY.pack(_NOTIFY.size, _NOTIFY_RESEND, 0))
        except OSError as exc:
            return f"FUSE_NOTIFY_RESEND: {exc.strerror} (kernel 6.9 or later has it)"
        return None

    async def serve(self) -> bool:
        """Answer requests until told to stop reading (``stop_reading``), or until the
        kernel ends the session (an unmount; after a lazy unmount, once the last
        open file is closed).

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

    def stop_reading(self) -> None:
        """Read no more requests; ``serve`` returns once those read are answered (call
        from the trio thread)."""
        pyfuse3.terminate()

    def close(self) -> None:
        """Free the session; the connection stays the holder's (this closes our copy)."""
        pyfuse3.close(unmount=False)

    @staticmethod
    def invalidate_inode(inode: int, *, attributes_only: bool = False) -> bool:
        """Have the kernel drop what it caches of ``inode`` (blocking: call from a worker
        thread); False if the kernel does not know it."""
        try:
            pyfuse3.invalidate_inode(inode, attributes_only)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return False
            raise
        return True

    @staticmethod
    def invalidate_entry(parent: int, name: bytes) -> bool:
        """Have the kernel forget the name ``name`` in ``parent`` (blocking: a worker
        thread); False if it does not know it."""
        try:
            pyfuse3.invalidate_entry(parent, name)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return False
            raise
        return True
