"""The cluster's second tier (L2) as blocking storage: objects named by key, created
without ever overwriting, read, listed by prefix, and deleted.

Two backends: an S3-compatible bucket (boto3, conditional ``If-None-Match: *``
puts) and a directory on a shared POSIX filesystem (a temp file in the same
directory, then ``link``, which never replaces). Objects are store entries
(entry.py: the .npy bytes and their trailer); names carry the decoder
fingerprint::

    <prefix>/<version>/<fingerprint hex>/<size>/<shard>/<file name>    an array
    <prefix>/.leases/<the same name>@<term>                            a claim (leases.py)

where ``<size>/<shard>/<file name>`` is the tail of ``EntryKey.relpath`` (for a
uuid: ``<size>/<uuid[:2]>/<uuid>.npy``). Every call blocks: the caller runs
it in a worker thread (tier.py). Failures raise ``L2Error`` with a short
``kind`` for counting; an absent object is not a failure. This module knows
nothing of trio, the engine or images, and never verifies what it reads.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol

from ..common.entry import EntryKey
from ..common.trusted import CREATE_FLAGS, DIRECTORY_FLAGS, NAMED_DIRECTORY_FLAGS, READ_FLAGS

if TYPE_CHECKING:
    from ..common.config import L2Config

__all__ = [
    "LEASES",
    "S3L2",
    "L2Backend",
    "L2Error",
    "PosixL2",
    "object_name",
    "open_backend",
]

LEASES: Final = ".leases"  # never a version name (those cannot start with ".")


class L2Error(Exception):
    """An L2 call failed (unreachable, timed out, refused); ``kind`` names it for counting."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


def object_name(key: EntryKey, fingerprint_hex: str) -> str:
    """``<version>/<fingerprint hex>/<size>/<shard>/<file name>``: the relpath with the
    decoder fingerprint after the version, so other decode settings never meet."""
    tail = key.relpath[len(key.version) + 1 :]
    return f"{key.version}/{fingerprint_hex}/{tail}"


class L2Backend(Protocol):
    """Blocking, thread-safe object storage. Names are relative, ``/``-separated."""

    @property
    def description(self) -> str: ...  # for logs and stats: the URL

    def get(self, name: str, limit: int) -> bytes | None:
        """The object (at most ``limit`` + 1 bytes of it, so a wrong length shows),
        or None if there is none."""
        ...

    def size(self, name: str) -> int | None:
        """The object's length, or None if there is none (without reading it)."""
        ...

    def create(self, name: str, data: bytes | memoryview) -> bool:
        """Create the object unless one exists: True if this call created it. Never
        replaces an existing object, even one created at the same instant."""
        ...

    def list(self, prefix: str, limit: int) -> list[str]:
        """Names of objects that begin with ``prefix`` (at most ``limit`` of them; on a
        shared directory, only those in the directory ``prefix`` names)."""
        ...

    def delete(self, name: str) -> None:
        """Remove the object if it exists."""
        ...

    def check(self) -> None:
        """Raise L2Error unless the tier can be used at all: reached, with credentials
        it accepts (S3), a directory that exists and can be written (POSIX)."""
        ...

    def close(self) -> None: ...


def open_backend(config: L2Config) -> L2Backend:
    """The backend for ``config.url`` (no call is made yet)."""
    if config.is_s3:
        return S3L2(config)
    return PosixL2(Path(config.url))


# -- S3 -------------------------------------------------------------------------------


class S3L2:
    """An S3-compatible bucket through boto3. Credentials come from boto3's default
    chain (environment, ~/.aws, instance roles); timeouts bound every call and
    botocore makes one attempt (the caller decides what a failure means)."""

    def __init__(self, config: L2Config) -> None:
        import boto3  # only an S3 tier needs it (and importing it costs ~0.3 s)
        from botocore.config import Config as BotoConfig

        self.bucket = config.bucket
        self.prefix = config.prefix
        self.description = config.url + (f" at {config.endpoint}" if config.endpoint else "")
        session = boto3.session.Session()
        self._s3: Any = session.client(
            "s3",
            endpoint_url=config.endpoint,
            region_name=config.region or session.region_name or "us-east-1",
            config=BotoConfig(
                connect_timeout=config.timeout_seconds,
                read_timeout=config.timeout_seconds,
                retries={"total_max_attempts": 1, "mode": "standard"},
                max_pool_connections=max(10, config.workers),
                # Endpoints of S3-compatible stores rarely resolve bucket subdomains.
                s3={"addressing_style": "path"} if config.endpoint else None,
                # The entry's own trailer proves its integrity end to end; extra
                # checksum headers are ones some S3-compatible stores refuse.
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def get(self, name: str, limit: int) -> bytes | None:
        with _s3_errors():
            try:
                response = self._s3.get_object(Bucket=self.bucket, Key=self._key(name))
            except Exception as exc:
                if _s3_code(exc) in ("NoSuchKey", "404"):
                    return None
                raise
            body = response["Body"]
            try:
                data: bytes = body.read(limit + 1)
            finally:
                body.close()
            return data

    def size(self, name: str) -> int | None:
        with _s3_errors():
            try:
                response = self._s3.head_object(Bucket=self.bucket, Key=self._key(name))
            except Exception as exc:
                if _s3_code(exc) in ("NoSuchKey", "404", "NotFound"):
                    return None
                raise
            return int(response["ContentLength"])

    def create(self, name: str, data: bytes | memoryview) -> bool:
        with _s3_errors():
            try:
                self._s3.put_object(
                    Bucket=self.bucket, Key=self._key(name), Body=bytes(data), IfNoneMatch="*"
                )
            except Exception as exc:
                # 412: it exists; 409: another create of it is under way (it will exist).
                if _s3_code(exc) in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                    return False
                raise
            return True

    def list(self, prefix: str, limit: int) -> list[str]:
        with _s3_errors():
            response = self._s3.list_objects_v2(
                Bucket=self.bucket, Prefix=self._key(prefix), MaxKeys=limit
            )
        skip = len(self._key(""))
        return [str(item["Key"])[skip:] for item in response.get("Contents", [])]

    def delete(self, name: str) -> None:
        with _s3_errors():
            self._s3.delete_object(Bucket=self.bucket, Key=self._key(name))

    def check(self) -> None:
        # One request: signed (credentials), answered (the endpoint), about the bucket.
        with _s3_errors():
            self._s3.head_bucket(Bucket=self.bucket)

    def close(self) -> None:
        self._s3.close()


def _s3_code(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    code = response.get("Error", {}).get("Code")
    return str(code) if code is not None else None


@contextlib.contextmanager
def _s3_errors() -> Iterator[None]:
    """botocore's exceptions as L2Error, with a kind to count them by."""
    from botocore import exceptions as boto

    try:
        yield
    except (boto.ConnectTimeoutError, boto.ReadTimeoutError) as exc:
        raise L2Error("timeout", str(exc)) from exc
    except (boto.EndpointConnectionError, boto.ConnectionClosedError) as exc:
        raise L2Error("unreachable", str(exc)) from exc
    except boto.NoCredentialsError as exc:
        raise L2Error("credentials", str(exc)) from exc
    except boto.ClientError as exc:
        raise L2Error(f"s3_{_s3_code(exc) or 'error'}", str(exc)) from exc
    except boto.BotoCoreError as exc:
        raise L2Error(type(exc).__name__, str(exc)) from exc
    except OSError as exc:
        raise L2Error(errno.errorcode.get(exc.errno or 0, "OSError"), str(exc)) from exc


# -- a shared POSIX directory -------------------------------------------------------------

_RENAME_NOREPLACE: Final = 1
_NO_LINKS: Final = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK})


class PosixL2:
    """A directory on a filesystem every node mounts (JuiceFS, CephFS, GlusterFS, NFS).

    Every name is walked one component at a time from the root without
    following a symlink, so nothing planted in the shared directory sends the
    daemon (often root) elsewhere. A create writes a temp file in the target's
    directory and links it to its name: ``link`` fails if the name exists, so
    an object is never replaced and never seen half-written. A filesystem
    without hard links gets ``renameat2(RENAME_NOREPLACE)`` instead.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.description = str(root)

    def get(self, name: str, limit: int) -> bytes | None:
        with _os_errors():
            parent, leaf = self._parent(name, create=False)
            if parent is None:
                return None
            try:
                try:
                    fd = os.open(leaf, READ_FLAGS, dir_fd=parent)
                except FileNotFoundError:
                    return None
                except OSError as exc:
                    if exc.errno == errno.ELOOP:
                        return b""  # a symlink is no object: it fails every check
                    raise
                try:
                    if not stat.S_ISREG(os.fstat(fd).st_mode):
                        return b""
                    pieces, total = [], 0
                    while total <= limit:
                        piece = os.read(fd, min(1 << 20, limit + 1 - total))
                        if not piece:
                            break
                        pieces.append(piece)
                        total += len(piece)
                    return b"".join(pieces)
                finally:
                    os.close(fd)
            finally:
                os.close(parent)

    def size(self, name: str) -> int | None:
        with _os_errors():
            parent, leaf = self._parent(name, create=False)
            if parent is None:
                return None
            try:
                st = os.stat(leaf, dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                return None
            finally:
                os.close(parent)
            return st.st_size if stat.S_ISREG(st.st_mode) else None

    def create(self, name: str, data: bytes | memoryview) -> bool:
        with _os_errors():
            parent, leaf = self._parent(name, create=True)
            assert parent is not None
            tmp = f".{leaf}.{secrets.token_hex(6)}.tmp"
            try:
                fd = os.open(tmp, os.O_WRONLY | CREATE_FLAGS, 0o644, dir_fd=parent)
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view) :]
                    os.fchmod(fd, 0o644)  # whatever the umask: every node reads it
                finally:
                    os.close(fd)
                return _link_no_replace(parent, tmp, leaf)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp, dir_fd=parent)
                os.close(parent)

    def list(self, prefix: str, limit: int) -> list[str]:
        with _os_errors():
            parent, start = self._parent(prefix, create=False)
            if parent is None:
                return []
            directory = prefix[: len(prefix) - len(start)]
            found: list[str] = []
            try:
                with os.scandir(parent) as entries:
                    for entry in entries:
                        if len(found) >= limit:
                            break
                        # Not a temp file of a create under way (it begins with ".").
                        if entry.name.startswith(start) and entry.is_file(follow_symlinks=False):
                            found.append(directory + entry.name)
            finally:
                os.close(parent)
            return sorted(found)

    def delete(self, name: str) -> None:
        with _os_errors():
            parent, leaf = self._parent(name, create=False)
            if parent is None:
                return
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(leaf, dir_fd=parent)
            finally:
                os.close(parent)

    def check(self) -> None:
        with _os_errors():
            os.close(os.open(self.root, NAMED_DIRECTORY_FLAGS))  # a directory, reached
            if not os.access(self.root, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, "cannot be written", str(self.root))

    def close(self) -> None:
        pass

    def _parent(self, name: str, *, create: bool) -> tuple[int | None, str]:
        """A descriptor of the directory holding ``name`` (None if it does not exist and
        ``create`` is False) and the last component."""
        *dirs, leaf = name.split("/")
        fd = os.open(self.root, NAMED_DIRECTORY_FLAGS)
        try:
            for part in dirs:
                try:
                    child = os.open(part, DIRECTORY_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        os.close(fd)
                        return None, leaf
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o755, dir_fd=fd)
                    child = os.open(part, DIRECTORY_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd, leaf


def _link_no_replace(directory: int, source: str, target: str) -> bool:
    """Give ``source`` the name ``target`` unless that exists; True if it did."""
    try:
        os.link(source, target, src_dir_fd=directory, dst_dir_fd=directory, follow_symlinks=False)
        return True
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in _NO_LINKS:
            raise
    return _rename_no_replace(directory, source, target)


def _rename_no_replace(directory: int, source: str, target: str) -> bool:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    result = libc.renameat2(
        directory, os.fsencode(source), directory, os.fsencode(target), _RENAME_NOREPLACE
    )
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code == errno.EEXIST:
        return False
    raise OSError(code, os.strerror(code), target)


@contextlib.contextmanager
def _os_errors() -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        raise L2Error(errno.errorcode.get(exc.errno or 0, "OSError"), str(exc)) from exc
