"""Which decodefs a process runs: the package's version, and the commit of a clone.

Real git repositories (made by the git command) in tmp_path, read by the file
reading of common/version.py: a branch, a detached HEAD, packed refs, a
worktree, and a directory that is no clone.
"""

from __future__ import annotations

import subprocess
from importlib.metadata import version
from pathlib import Path

from decodefs.common.version import clone_commit, package_version
from tests.helpers import decodefs


def git(repo: Path, *args: str) -> str:
    result = subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout.strip()


def clone(tmp_path: Path) -> Path:
    repo = tmp_path / "clone"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    (repo / "a").write_text("a")
    git(repo, "add", "a")
    git(repo, "commit", "-q", "-m", "first")
    return repo


def test_a_clone_names_the_commit_checked_out_on_a_branch_or_detached(tmp_path: Path) -> None:
    repo = clone(tmp_path)
    first = git(repo, "rev-parse", "HEAD")
    assert clone_commit(repo) == first
    (repo / "a").write_text("b")
    git(repo, "commit", "-q", "-am", "second")
    second = git(repo, "rev-parse", "HEAD")
    assert clone_commit(repo) == second != first
    git(repo, "checkout", "-q", first)  # detached
    assert clone_commit(repo) == first
    git(repo, "checkout", "-q", "main")
    git(repo, "pack-refs", "--all")  # the branch now lives in packed-refs alone
    assert not (repo / ".git" / "refs" / "heads" / "main").exists()
    assert clone_commit(repo) == second


def test_a_worktree_names_its_own_commit(tmp_path: Path) -> None:
    repo = clone(tmp_path)
    first = git(repo, "rev-parse", "HEAD")
    (repo / "a").write_text("b")
    git(repo, "commit", "-q", "-am", "second")
    git(repo, "worktree", "add", "-q", "-b", "other", str(tmp_path / "wt"), first)
    assert clone_commit(tmp_path / "wt") == first
    assert clone_commit(repo) == git(repo, "rev-parse", "HEAD")


def test_no_clone_no_commit(tmp_path: Path) -> None:
    assert clone_commit(tmp_path) is None
    (tmp_path / ".git").mkdir()  # not a repository's files
    assert clone_commit(tmp_path) is None
    (tmp_path / ".git" / "HEAD").write_text("not a commit\n")
    assert clone_commit(tmp_path) is None


def test_the_version_says_the_commit_of_the_clone_it_runs_from() -> None:
    base = version("decodefs")
    root = Path(__file__).resolve().parents[1]
    commit = clone_commit(root)
    expected = f"{base}+g{commit[:12]}" if commit else base
    assert package_version() == expected
    result = decodefs("--version")
    assert result.stdout.strip() == f"decodefs {expected}"
