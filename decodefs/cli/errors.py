"""The command's error model: which exceptions are the user's to fix, how they print,
and the exit statuses. Knows no command and no argument; imports nothing of the daemon.

A user error (bad config, bad file, busy or dead mount point) is found before
anything is mounted or written, and printed as one line per problem starting
``decodefs: error:`` (exit 1; bad arguments exit 2 through argparse), never as
a traceback. Details that follow such a line are indented.
"""

from __future__ import annotations

import sys

from ..common.config import ConfigError
from ..common.mounts import MountError, store_holder_hint
from ..common.source import SourceError
from ..store import AdoptError, StoreBusy, StoreError

__all__ = [
    "EXIT_BROKEN_PIPE",
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "UsageError",
    "error_text",
    "exit_status",
    "is_user_error",
    "print_error",
]

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports a writer the pipe killed


class UsageError(Exception):
    """A command-line mistake the user can fix (printed as one line)."""


_USER_ERRORS = (AdoptError, ConfigError, MountError, SourceError, StoreError, UsageError, StoreBusy)


def is_user_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a mistake the user can fix (printed), not a bug (a traceback).

    Runs on every exception of every command: it loads nothing (its classes are
    imported with this module, none of them from the daemon).
    """
    return isinstance(exc, _USER_ERRORS)


def print_error(exc: BaseException) -> None:
    """``decodefs: error: <line>`` for every line of a user error (a ConfigError has
    one per problem); indented lines are details of the line above and printed as they are."""
    for line in error_text(exc).splitlines() or [type(exc).__name__]:
        print(line if line[:1].isspace() else f"decodefs: error: {line}", file=sys.stderr)


def error_text(exc: BaseException) -> str:
    """A user error's text; for a store another process holds, which one and how to stop it."""
    text = str(exc)
    pid = getattr(exc, "holder_pid", None)
    if isinstance(pid, int) and pid > 0:
        text += store_holder_hint(pid)
    return text


def exit_status(interrupted: bool, failed: bool) -> int:
    """A long command's exit status: 130 if interrupted (saying how to resume), else 1
    if some of its work failed, else 0."""
    if interrupted:
        print("decodefs: interrupted; run the same command again to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_ERROR if failed else 0
