"""The FUSE connection as the holder keeps it: mount, the kernel's INIT, and answers of its own.

The holder opens /dev/fuse and mounts with it (``mount(2)`` as root, else
``fusermount3``, which passes the descriptor back over a socket, as libfuse
does), then reads the kernel's one INIT request, which every serving process
replays to its own libfuse. While no serving process can run (a crash loop
being backed off) the holder answers each request itself with EIO: the
kernel's wire format is a 40-byte header in, a 16-byte header out. This
module knows the kernel's side of the connection, nothing of what is served.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import select
import shutil
import socket
import stat
import struct
import subprocess
from dataclasses import dataclass
from typing import Final

from ..common.protocol import FS_NAME, FS_TYPE

__all__ = [
    "FuseConnection",
    "InitRequest",
    "KernelError",
    "answer_with_eio",
    "mount_failure_hint",
    "mount_options",
    "mount_problem",
]

_IN_HEADER: Final = struct.Struct("<IIQQIIIHH")  # len, opcode, unique, nodeid, uid, gid, pid
_OUT_HEADER: Final = struct.Struct("<IiQ")  # len, error (a negative errno), unique
_INIT_IN: Final = struct.Struct("<IIII")  # major, minor, max_readahead, flags
_FUSE_INIT: Final = 26
_NO_REPLY: Final = frozenset({2, 36, 42})  # FORGET, INTERRUPT, BATCH_FORGET
# A read must offer room for the largest request (libfuse's own buffer: 256 pages + a page).
READ_BUFFER: Final = 256 * 4096 + 4096
_MS_RDONLY, _MS_NOSUID, _MS_NODEV = 1, 2, 4


class KernelError(Exception):
    """The kernel or fusermount3 refused the mount (the message says why)."""


@dataclass(frozen=True)
class InitRequest:
    """The kernel's INIT, as read off the connection right after the mount."""

    data: bytes

    @property
    def protocol(self) -> str:
        major, minor, _, _ = _INIT_IN.unpack_from(self.data, _IN_HEADER.size)
        return f"{major}.{minor}"


def mount_options(*, allow_other: bool) -> list[str]:
    """The mount's options, as fusermount3 takes them (mount(2) adds fd, rootmode, ids)."""
    options = ["nosuid", "nodev", "ro", "default_permissions", f"fsname={FS_NAME}"]
    if allow_other:
        options.append("allow_other")  # other users' processes may read the mount
    return options


class FuseConnection:
    """One /dev/fuse connection, mounted at ``mountpoint``; the holder's for the mount's life."""

    def __init__(self, fd: int, mountpoint: str, init: InitRequest) -> None:
        self.fd = fd
        self.mountpoint = mountpoint
        self.init = init
        self.init_reply: bytes | None = None  # the first serving process's, as the kernel took it

    @classmethod
    def mount(cls, mountpoint: str, *, allow_other: bool) -> FuseConnection:
        """Mount a new connection at ``mountpoint`` and read the kernel's INIT."""
        options = mount_options(allow_other=allow_other)
        fd = (
            _mount_as_root(mountpoint, options)
            if os.geteuid() == 0
            else _fusermount(mountpoint, options)
        )
        try:
            data = os.read(fd, READ_BUFFER)
            opcode = _IN_HEADER.unpack_from(data)[1] if len(data) >= _IN_HEADER.size else None
            if opcode != _FUSE_INIT:
                raise KernelError(f"the kernel's first request was {opcode!r}, not INIT")
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, mountpoint, InitRequest(data))

    def ended(self) -> bool:
        """Whether the kernel has ended the connection (an unmount, an abort). Looked at
        without waiting: a descriptor left in an epoll set would be woken by every request
        the kernel queues, and each wake-up takes the connection's lock from the serving
        process (~10% of a warm reader's rate on this machine's 2 cores)."""
        poller = select.poll()
        poller.register(self.fd, 0)  # errors and hang-ups are always reported
        return any(mask & (select.POLLERR | select.POLLHUP) for _, mask in poller.poll(0))

    def answer_init(self, reply: bytes) -> None:
        """Give the kernel the first serving process's reply to INIT (once per mount)."""
        os.write(self.fd, reply)
        self.init_reply = reply

    def close(self) -> None:
        os.close(self.fd)


def mount_problem(access: str, device: str = "/dev/fuse") -> str | None:
    """Why this user cannot mount with the config's ``access`` at all (checked before
    anything is started), or None."""
    if access == "originals" and os.geteuid() != 0:
        return (
            'access = "originals" needs root (only root shows each array as its original\'s '
            'owner\'s, and lets other users in): set access = "owner" or "everyone"'
        )
    hint = mount_failure_hint(access != "owner", device)
    return None if hint.startswith("is ") else hint


def mount_failure_hint(allow_other: bool, device: str = "/dev/fuse") -> str:
    """Why a FUSE mount most likely failed for this user, and what to do about it."""
    if not os.path.exists(device):
        return f"{device} is missing: load the fuse module (`modprobe fuse`)"
    if os.geteuid() != 0 and not os.access(device, os.R_OK | os.W_OK):
        mode = stat.filemode(os.stat(device).st_mode)
        return (
            f"{device} ({mode}) cannot be opened by uid {os.geteuid()}: mount as root, or "
            f"let users open it as most systems do (`chmod 0666 {device}`)"
        )
    if allow_other and os.geteuid() != 0:
        return (
            "access = \"everyone\" (FUSE allow_other) needs 'user_allow_other' in "
            "/etc/fuse.conf when not root"
        )
    if os.geteuid() != 0 and shutil.which("fusermount3") is None:
        return "fusermount3 is missing: install fuse3"
    return f"is {device} present and fusermount3 installed?"


def answer_with_eio(fd: int) -> int | None:
    """Read one request and answer it EIO (none for those that take no answer); its
    opcode, or None if the read found nothing (interrupted). Raises OSError ENODEV
    once the connection has ended."""
    try:
        data = os.read(fd, READ_BUFFER)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.EINTR, errno.EAGAIN):
            return None  # the request was interrupted meanwhile; nothing to answer
        raise
    if len(data) < _IN_HEADER.size:
        return None
    _, opcode, unique = _IN_HEADER.unpack_from(data)[:3]
    if opcode not in _NO_REPLY:
        try:
            os.write(fd, _OUT_HEADER.pack(_OUT_HEADER.size, -errno.EIO, unique))
        except OSError as exc:
            if exc.errno != errno.ENOENT:  # the kernel no longer waits for it
                raise
    return int(opcode)


def _mount_as_root(mountpoint: str, options: list[str]) -> int:
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    flags = _MS_NOSUID | _MS_NODEV | _MS_RDONLY
    data = [o for o in options if o not in ("nosuid", "nodev", "ro") and not o.startswith("fsname")]
    data = [
        f"fd={fd}",
        # The root's mode until the kernel first asks (as the daemon shows it): not one
        # without permission bits, which a look-up overtaken by a forget of the root's
        # attributes would decide on (reload.py).
        "rootmode=40555",
        f"user_id={os.getuid()}",
        f"group_id={os.getgid()}",
        *data,
    ]
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    result = libc.mount(
        FS_NAME.encode(),
        os.fsencode(mountpoint),
        FS_TYPE.encode(),
        ctypes.c_ulong(flags),
        ",".join(data).encode(),
    )
    if result != 0:
        code = ctypes.get_errno()
        os.close(fd)
        raise KernelError(f"mount(2) of {mountpoint} failed: {os.strerror(code)}")
    return fd


def _fusermount(mountpoint: str, options: list[str]) -> int:
    """Mount through fusermount3 (setuid), which passes /dev/fuse back over a socket."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        theirs.set_inheritable(True)
        result = subprocess.run(
            ["fusermount3", "-o", ",".join([*options, f"subtype={FS_NAME}"]), "--", mountpoint],
            env={**os.environ, "_FUSE_COMMFD": str(theirs.fileno())},
            pass_fds=(theirs.fileno(),),
            capture_output=True,
            text=True,
            check=False,
        )
        theirs.close()
        if result.returncode != 0:
            detail = result.stderr.strip() or f"fusermount3 exited with {result.returncode}"
            raise KernelError(detail)
        _, fds, _, _ = socket.recv_fds(ours, 1, 1)
        if not fds:
            raise KernelError("fusermount3 mounted but passed back no descriptor")
        os.set_inheritable(fds[0], False)
        return fds[0]
    except FileNotFoundError:
        raise KernelError("fusermount3 is missing: install fuse3") from None
    finally:
        ours.close()
        if theirs.fileno() >= 0:
            theirs.close()
