"""The version of decodefs this process runs: the installed package's, and the commit
it was checked out at when it runs from a clone (an editable install).

The commit is read from the clone's ``.git`` files, never by running git: a root
daemon must not run a repository's configured commands. Imports nothing else.
"""

from __future__ import annotations

import functools
import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

__all__ = ["package_version"]

_COMMIT = re.compile(rb"[0-9a-f]{40}|[0-9a-f]{64}")  # sha-1 or sha-256
_SHORT = 12


@functools.cache
def package_version() -> str:
    """``0.1.0``, or ``0.1.0+g<commit>`` when this code runs from a clone: what `decodefs
    --version` and the daemon's stats (``version``) say. Read once per process, so a
    serving process names the code it loaded, not what was installed since."""
    try:
        base = version("decodefs")
    except PackageNotFoundError:  # pragma: no cover - not installed at all
        base = "0+unknown"
    commit = clone_commit(Path(__file__).resolve().parents[2])
    return f"{base}+g{commit[:_SHORT]}" if commit else base


def clone_commit(root: Path) -> str | None:
    """The commit checked out in the git clone (or worktree) at ``root``; None if
    ``root`` is no clone or its files cannot be read."""
    try:
        git = root / ".git"
        if git.is_file():  # a worktree: "gitdir: <path>"
            git = (root / git.read_text().removeprefix("gitdir:").strip()).resolve()
        head = (git / "HEAD").read_bytes().strip()
        if not head.startswith(b"ref: "):
            return _commit(head)  # a detached HEAD
        ref = head.removeprefix(b"ref: ").decode()
        common = git
        if (git / "commondir").is_file():  # a worktree's refs live in the main clone
            common = (git / (git / "commondir").read_text().strip()).resolve()
        for where in (git, common):
            if (where / ref).is_file():
                return _commit((where / ref).read_bytes().strip())
        for line in (common / "packed-refs").read_bytes().splitlines():
            commit, _, name = line.partition(b" ")
            if name.decode(errors="replace") == ref:
                return _commit(commit)
    except (OSError, ValueError):
        return None
    return None


def _commit(text: bytes) -> str | None:
    return text.decode() if _COMMIT.fullmatch(text) else None
