"""Starting a detached daemon: `decodefs mount` without --foreground returns once the
mount is live, or with the reason the daemon gave (its log's tail).

Knows the command line of the daemon, not what it runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Final

from ..common.mounts import MountError, clear_stale

__all__ = ["spawn"]

# How long a daemon stopped before it was live may take to unmount and exit.
_STOP_SECONDS: Final = 30.0


def holder_command(
    mountpoint: str,
    config_path: Path,
    initial_log_level: str,
    access: str,
    log_level: str | None = None,
    ready_fd: int | None = None,
) -> list[str]:
    """The mount's holder, run from the installed package (-P: never a `decodefs` folder
    where the user stood, a clone) and needing none of the command's imports."""
    command = [sys.executable, "-P", "-m", "decodefs.holder", os.path.abspath(mountpoint)]
    command += ["--config", str(config_path), "--initial-log-level", initial_log_level]
    if log_level:
        command += ["--log-level", log_level]
    command += ["--access", access]
    if ready_fd is not None:
        command += ["--ready-fd", str(ready_fd)]
    return command


def spawn(
    mountpoint: str,
    log_file: Path,
    holder: Callable[[int], list[str]],
) -> int:
    """Start a detached holder (``holder(ready_fd)``: its command) and return its pid once
    the mount is live; the command has checked the config and the mount point.

    The child reports readiness through a pipe; if it exits first, the tail of
    its log explains why and MountError carries it.
    """
    try:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        log_stream = open(log_file, "ab")  # noqa: SIM115 - closed below, once the child has it
        start = log_stream.tell()  # this daemon's lines begin here; earlier runs' are above
    except OSError as exc:
        raise MountError(f"log file {log_file} cannot be written: {exc.strerror}") from None
    read_end, write_end = os.pipe()
    # The root directory: the holder holds none of the user's directories (which a
    # umount of them would find busy).
    command = holder(write_end)
    with log_stream:
        child = subprocess.Popen(
            command,
            cwd="/",
            stdin=subprocess.DEVNULL,
            stdout=log_stream,
            stderr=log_stream,
            pass_fds=(write_end,),
            start_new_session=True,
        )
    os.close(write_end)
    with os.fdopen(read_end, "rb") as ready:
        try:
            message = ready.read()  # EOF when the child exits or closes the fd
        except KeyboardInterrupt:  # Ctrl-C: the mount is not wanted after all
            _stop(child, mountpoint)
            raise
    if message.startswith(b"ready"):
        return child.pid
    code = child.wait()
    if message.startswith(b"error: "):
        raise MountError(message[len(b"error: ") :].decode(errors="replace"))
    tail = "\n".join(f"    {line}" for line in _tail(log_file, start).splitlines())
    raise MountError(
        f"daemon exited with status {code} before the mount was live; {log_file} ends:\n{tail}"
    )


def _stop(child: subprocess.Popen[bytes], mountpoint: str) -> None:
    """Stop a daemon that is not live yet: SIGTERM unmounts it if it got that far, and
    a mount it leaves behind (stopped between mounting and serving) is cleared."""
    child.terminate()
    try:
        child.wait(timeout=_STOP_SECONDS)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
    clear_stale(mountpoint)


def _tail(path: Path, start: int, lines: int = 20) -> str:
    """The last ``lines`` lines the daemon wrote to its log, from ``start`` on."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return "\n".join(text.splitlines()[-lines:]) or "(the daemon wrote nothing)"
