"""Opening files as root on a shared machine without trusting anyone else.

``open_trusted_dir`` walks a path from ``/`` with ``O_NOFOLLOW``, one
component at a time, and accepts only what no other user controls; the
descriptor it returns is then used for everything below that directory, so a
path swapped later changes nothing. Used for the store and the lock
directory. The open flags for what lies below such a descriptor, and the one
test of "this user's alone" (``owned_alone``), are defined here for every
room that opens files. This module knows nothing of what the directory holds.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from typing import Final

__all__ = [
    "CREATE_FLAGS",
    "DIRECTORY_FLAGS",
    "NAMED_DIRECTORY_FLAGS",
    "READ_FLAGS",
    "UntrustedPath",
    "open_trusted_dir",
    "opened_directory",
    "owned_alone",
    "owned_alone_problem",
]

# Below a directory descriptor, nothing is reached through a symlink: a name someone
# planted cannot send the opener elsewhere, and no descriptor leaks into a child process.
DIRECTORY_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
READ_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
# A new file, never one that exists: with O_WRONLY or O_RDWR.
CREATE_FLAGS: Final = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# A directory a user names (a cache to adopt, a store to verify, a shared L2 root):
# its path resolves as the user's shell resolves it, symlinks included; what lies
# below it is opened with the flags above.
NAMED_DIRECTORY_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_MAX_SYMLINKS: Final = 40  # as the kernel's own limit (ELOOP)


class UntrustedPath(Exception):
    """A path passes through, or ends in, something another user controls."""


def open_trusted_dir(path: str, *, create_mode: int | None = None) -> int:
    """A descriptor of the directory ``path``, reached only through directories no
    one but root and this user controls; made (with ``create_mode``) if missing.

    Every directory on the way must belong to root or this user and be writable
    by no one else, unless sticky (``/tmp``), in which case what follows must
    belong to root or this user. A symlink is followed only under the same
    rule for its owner. The directory itself must belong to this user and be
    writable by no one else. Raises UntrustedPath for a path that fails these
    rules, OSError for one that cannot be reached or made.
    """
    euid = os.geteuid()
    trusted = (0, euid)
    parts = collections.deque(_components(os.path.abspath(path)))
    fd = os.open("/", DIRECTORY_FLAGS)
    walked = "/"
    symlinks = 0
    try:
        while parts:
            name = parts.popleft()
            here = os.fstat(fd)
            if here.st_uid not in trusted or (
                here.st_mode & 0o022 and not here.st_mode & stat.S_ISVTX
            ):
                raise UntrustedPath(_untrusted(walked, here, path))
            last = not parts
            try:
                child = os.open(name, DIRECTORY_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if create_mode is None:
                    raise
                with contextlib.suppress(FileExistsError):  # someone raced us: checked below
                    os.mkdir(name, create_mode if last else 0o755, dir_fd=fd)
                parts.appendleft(name)
                continue
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISLNK(st.st_mode):
                    raise NotADirectoryError(
                        errno.ENOTDIR, "not a directory", os.path.join(walked, name)
                    ) from None
                symlinks += 1
                if st.st_uid not in trusted or symlinks > _MAX_SYMLINKS:
                    raise UntrustedPath(
                        f"{os.path.join(walked, name)} is a symlink of uid {st.st_uid}; "
                        f"the path to {path} must not pass another user's symlink"
                    ) from None
                target = os.readlink(name, dir_fd=fd)
                parts.extendleft(reversed(_components(target)))
                if target.startswith("/"):
                    os.close(fd)
                    fd, walked = os.open("/", DIRECTORY_FLAGS), "/"
                continue
            os.close(fd)
            fd, walked = child, os.path.join(walked, name)
            mine = os.fstat(fd)
            if mine.st_uid not in trusted:
                raise UntrustedPath(_untrusted(walked, mine, path))
        problem = owned_alone_problem(path, os.fstat(fd))
        if problem is not None:
            raise UntrustedPath(problem)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _components(path: str) -> list[str]:
    return [part for part in path.split("/") if part and part != "."]


def _untrusted(directory: str, st: os.stat_result, path: str) -> str:
    return (
        f"{directory} belongs to uid {st.st_uid} with mode {stat.filemode(st.st_mode)}; "
        f"the path to {path} must pass only directories of root or uid {os.geteuid()} "
        "that no one else may write to (or sticky ones, like /tmp)"
    )


@contextlib.contextmanager
def opened_directory(path: str | os.PathLike[str]) -> Iterator[int]:
    """A directory the user named, open (``NAMED_DIRECTORY_FLAGS``) while in the block."""
    fd = os.open(path, NAMED_DIRECTORY_FLAGS)
    try:
        yield fd
    finally:
        os.close(fd)


def owned_alone(st: os.stat_result, owner: int) -> bool:
    """Whether the file ``st`` describes belongs to ``owner`` and no one else may write it."""
    return st.st_uid == owner and not st.st_mode & 0o022


def owned_alone_problem(path: str, st: os.stat_result) -> str | None:
    """Why ``path`` (with ``st``) is not this user's alone, or None if it is."""
    if owned_alone(st, os.geteuid()):
        return None
    return (
        f"{path} belongs to uid {st.st_uid} with mode {stat.filemode(st.st_mode)}; "
        f"it and every directory in it must belong to uid {os.geteuid()} (the daemon) "
        "and be writable by no one else (use another directory, or fix its owner and modes)"
    )
