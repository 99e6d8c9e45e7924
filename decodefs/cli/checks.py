"""Checks of what the user named (config, mount point, log file, key list, store), each
problem a UsageError that says what to do. Parses no argument and does no command's work.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Final, TypeVar

from ..client import iter_key_list, read_key_list
from ..common.config import DEFAULT_CONFIG_PATH, Config, load_config
from ..common.mounts import PROBE_TIMEOUT, decodefs_mount_above, find_mount, mounts, probe
from ..common.protocol import CONFIG_FILE, FS_TYPE, STORE_MARKER
from .errors import UsageError
from .status import read_status

__all__ = [
    "check_l2_client",
    "check_log_file",
    "count_keys",
    "daemon_gone",
    "decodefs_mounts",
    "default_log_file",
    "live_mount",
    "mount_failure",
    "mounted_at",
    "mounted_version",
    "named_config",
    "named_mountpoint",
    "read_keys",
    "require_store",
    "version_size_dir",
]


def named_config(args: argparse.Namespace) -> Config:
    """The config the user named with --config, else $DECODEFS_CONFIG's, else the default.

    A config the user did not name that does not exist is a UsageError saying
    how to name one (sets ``args.config`` to the path used).
    """
    given: Path | None = args.config
    from_env = os.environ.get("DECODEFS_CONFIG")
    args.config = given or Path(from_env or DEFAULT_CONFIG_PATH)
    if given is None and not os.path.lexists(args.config):
        origin = "$DECODEFS_CONFIG names it" if from_env else "the default"
        raise UsageError(
            f"no config file at {args.config} ({origin}); name yours with --config FILE "
            "or $DECODEFS_CONFIG (a minimal one: docs/configuration.md)"
        )
    return load_config(args.config)


def check_l2_client(config: Config) -> None:
    """An S3 l2 needs boto3, which decodefs installs only with its ``s3`` extra."""
    if config.l2 is None or not config.l2.is_s3:
        return
    try:
        import boto3  # noqa: F401  (the daemon imports it anyway, for this l2)
    except ImportError:
        raise UsageError(
            f"{config.path}: l2 = {config.l2.url!r} needs boto3, which is not installed: "
            "pip install 'decodefs[s3]' (in decodefs's clone: .venv/bin/pip install -e '.[s3]')"
        ) from None


def named_mountpoint(given: Path | None, configured: Path | None) -> str:
    """The mount point given, else the config's, as an absolute path; a UsageError if neither."""
    if given is None and configured is None:
        raise UsageError(
            "no mount point: give one, or set `mountpoint` in the config"
            f"{mounted_at(decodefs_mounts())}"
        )
    return os.path.abspath(given if given is not None else configured)  # type: ignore[arg-type]


def decodefs_mounts() -> list[str]:
    """Where decodefs is mounted now (for a user who gave no mount point)."""
    return [m.mountpoint for m in mounts() if m.fstype == FS_TYPE]


def mounted_at(points: list[str]) -> str:
    """A hint for a message: where decodefs is mounted (nothing if nowhere)."""
    return f" (decodefs is mounted at {', '.join(points)})" if points else ""


def default_log_file(mountpoint: str) -> Path:
    """Where a background daemon of ``mountpoint`` logs unless --log-file says."""
    state = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", mountpoint.strip("/")) or "root"
    return state / "decodefs" / f"{name}.log"


def check_log_file(path: Path, what: str) -> None:
    """The daemon will be able to create or append to its log; checked without writing."""
    if path.is_dir():
        raise UsageError(f"{what} {path} cannot be written: Is a directory")
    existing = path if path.exists() else path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent  # the directories below it are created
    if existing != path and not existing.is_dir():
        raise UsageError(f"{what} {path} cannot be written: Not a directory ({existing})")
    needs = os.W_OK if existing == path else os.W_OK | os.X_OK
    if not os.access(existing, needs, effective_ids=os.access in os.supports_effective_ids):
        reason = "Read-only file system" if _read_only(existing) else "Permission denied"
        where = "" if existing == path else f" ({existing})"
        raise UsageError(f"{what} {path} cannot be written: {reason}{where}")


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def read_keys(path: Path) -> list[str]:
    """The keys of a --keys file, one a line; a UsageError naming what is wrong with it."""
    return _key_file(path, read_key_list)


def count_keys(path: Path) -> int:
    """How many keys a --keys file holds, every line checked, none kept (``read_keys``'s
    UsageErrors): the file is read again, a line at a time, as the warm goes."""
    return _key_file(path, lambda p: sum(1 for _ in iter_key_list(p)))


T = TypeVar("T")


def _key_file(path: Path, read: Callable[[Path], T]) -> T:
    try:
        return read(path)
    except IsADirectoryError:
        raise UsageError(f"--keys {path}: is a directory, not a file of keys") from None
    except OSError as exc:
        raise UsageError(f"--keys {path}: cannot read it: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"--keys {path}: byte {exc.start} is not UTF-8 text") from None
    except ValueError as exc:
        raise UsageError(f"--keys {path}: {exc}") from None


def live_mount(path: Path, command: str) -> Path:
    """``path`` if a live decodefs daemon serves it; else a UsageError that says what it is
    (``command``, e.g. "stats {}", is how to run it on the mount point: for a path inside one)."""
    real = os.path.realpath(path)  # the mount table holds real paths
    info = find_mount(real)
    if info is None:
        above = decodefs_mount_above(real)
        if above is not None:
            raise UsageError(
                f"{path} is inside the decodefs mount at {above}; give the mount point "
                f"itself: `decodefs {command.replace('{}', str(above), 1)}`"
            )
        raise UsageError(f"{path} is not a decodefs mount (nothing is mounted there)")
    if info.fstype != FS_TYPE:
        raise UsageError(f"{path} is not a decodefs mount (it is {info.fstype})")
    try:
        state = probe(real)
    except OSError as exc:
        raise mount_failure(path, exc) from None
    if state == "stale":
        raise daemon_gone(path, "transport endpoint is not connected")
    if state == "hung":
        raise UsageError(
            f"the decodefs daemon of {path} does not answer (waited {PROBE_TIMEOUT:.0f} s); "
            "`kill -USR1` its pid to log where it is stuck"
        )
    return path


_GONE: Final = frozenset({errno.ENOTCONN, errno.ECONNABORTED})


def daemon_gone(mountpoint: Path, reason: str, progress: str = "") -> UsageError:
    """The error for a mount whose daemon died (``progress``: how far a command got)."""
    return UsageError(
        f"the decodefs daemon of {mountpoint} is gone ({reason.lower()})"
        f"{' ' + progress if progress else ''}; "
        "run `decodefs mount` again (it clears the dead mount)"
    )


def mount_failure(mountpoint: Path, exc: OSError) -> UsageError:
    """The error for a read of the mount that failed: its daemon gone, or why."""
    if exc.errno in _GONE:
        return daemon_gone(mountpoint, exc.strerror or str(exc))
    return UsageError(f"cannot read {exc.filename or mountpoint}: {exc.strerror or exc}")


def mounted_version(mountpoint: Path, version: str) -> None:
    """A UsageError unless the live mount at ``mountpoint`` serves ``version``."""
    try:
        versions = sorted(n for n in os.listdir(mountpoint) if not n.startswith("."))
    except OSError as exc:
        raise mount_failure(mountpoint, exc) from None
    if version not in versions:
        raise UsageError(
            f"{mountpoint} has no version {version!r} (it has: {', '.join(versions) or 'none'})"
        )


def version_size_dir(mountpoint: Path, version: str, size: int) -> Path:
    """``<mountpoint>/<version>/<size>``, or a UsageError naming what the mount lacks."""
    mounted_version(mountpoint, version)
    directory = mountpoint / version / str(size)
    try:
        os.stat(directory)
    except FileNotFoundError:
        bounds = read_status(mountpoint, CONFIG_FILE)
        low, high = bounds.get("min_size"), bounds.get("max_size")
        served = f" (it serves sizes {low} to {high})" if low and high else ""
        raise UsageError(f"{mountpoint} serves no size {size} of {version}{served}") from None
    except OSError as exc:
        raise mount_failure(mountpoint, exc) from None
    return directory


def require_store(root: Path, what: str = "") -> None:
    """A UsageError unless ``root`` is a store a daemon has used (it has the format marker)."""
    name = f"{what} ({root})" if what else str(root)
    if not root.exists():
        raise UsageError(f"{name} does not exist (no daemon has used it yet)")
    if not root.is_dir():
        raise UsageError(f"{name} is not a directory")
    if not (root / STORE_MARKER).is_file():
        raise UsageError(f"{name} is not a decodefs store (it has no {STORE_MARKER} file)")
