"""The store's index of entries in SQLite: their sizes and last access, for usage and LRU.

Not an integrity record (every entry file proves its own) and never the only
copy of anything: if it is lost, a scan of the store rebuilds it. The store
keeps it a superset of the files on disk: a row is committed (and synced)
before its file is renamed into place and deleted after its file is unlinked,
so a crash or a power cut at any instant leaves at worst a row without a
file, which eviction tidies.

Thread-safe: one connection, serialized by a lock; callers run off the event loop.
This module knows nothing of images, FUSE or the entry file format.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Final

__all__ = ["Catalog", "CatalogRow"]

log = logging.getLogger(__name__)

SCHEMA_VERSION: Final = 1
_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS entries (
    version TEXT NOT NULL,
    size INTEGER NOT NULL,
    uuid BLOB NOT NULL,          -- os.fsencode(uuid): file names need not be UTF-8
    bytes INTEGER NOT NULL,
    last_access REAL NOT NULL,   -- seconds since the epoch
    PRIMARY KEY (version, size, uuid)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS entries_by_access ON entries (last_access);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
"""


@dataclass(frozen=True)
class CatalogRow:
    version: str
    size: int
    key: str
    bytes: int
    last_access: float


class Catalog:
    def __init__(self, connection: sqlite3.Connection, path: str) -> None:
        self._db = connection
        self._lock = threading.Lock()
        self.path = path

    @classmethod
    def open(cls, path: str) -> tuple[Catalog, bool]:
        """Open or create the catalog at ``path``; True if it has to be filled by a scan.

        A damaged catalog is moved aside and started afresh. ``":memory:"``
        gives a private one (a read-only store).
        """
        if path != ":memory:":
            try:
                return cls._open_file(path)
            except sqlite3.DatabaseError as exc:
                aside = f"{path}.damaged"
                log.warning("catalog %s is damaged (%s); moved to %s, rebuilding", path, exc, aside)
                for suffix in ("", "-wal", "-shm"):
                    if os.path.exists(path + suffix):
                        os.replace(path + suffix, aside + suffix)
                return cls._open_file(path)
        memory = sqlite3.connect(":memory:", check_same_thread=False, isolation_level=None)
        catalog = cls(memory, path)
        catalog._db.executescript(_SCHEMA)
        return catalog, True

    @classmethod
    def _open_file(cls, path: str) -> tuple[Catalog, bool]:
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=30)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            # FULL: a row is on disk before its file is renamed into place, so the
            # catalog stays a superset of the files even across a power cut.
            db.execute("PRAGMA synchronous=FULL")
            db.executescript(_SCHEMA)
            (verdict,) = db.execute("PRAGMA quick_check").fetchone()
            if verdict != "ok":
                raise sqlite3.DatabaseError(f"quick_check: {verdict}")
            db.execute("SELECT count(*), total(bytes) FROM entries").fetchone()
            row = db.execute("SELECT value FROM meta WHERE key = 'filled'").fetchone()
        except sqlite3.DatabaseError:
            db.close()
            raise
        catalog = cls(db, path)
        return catalog, row is None

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- reads --------------------------------------------------------------

    def totals(self) -> tuple[int, int]:
        """(entries, bytes)."""
        with self._lock:
            count, total = self._db.execute("SELECT count(*), total(bytes) FROM entries").fetchone()
        return int(count), int(total)

    def totals_by_size(self) -> dict[tuple[str, int], tuple[int, int]]:
        """(version, size) -> (entries, bytes), for every pair with an entry."""
        with self._lock:
            rows = self._db.execute(
                "SELECT version, size, count(*), total(bytes) FROM entries GROUP BY version, size"
            ).fetchall()
        return {(str(v), int(s)): (int(n), int(b)) for v, s, n, b in rows}

    def contains(self, version: str, size: int, uuid: str) -> bool:
        with self._lock:
            row = self._db.execute(
                "SELECT 1 FROM entries WHERE version = ? AND size = ? AND uuid = ?",
                (version, size, os.fsencode(uuid)),
            ).fetchone()
        return row is not None

    def keys(self, version: str, size: int) -> set[str]:
        """Every uuid with an entry at (version, size)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT uuid FROM entries WHERE version = ? AND size = ?", (version, size)
            ).fetchall()
        return {os.fsdecode(bytes(uuid)) for (uuid,) in rows}

    def oldest(self, limit: int, skip: int = 0) -> list[CatalogRow]:
        """The least recently used rows, oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT version, size, uuid, bytes, last_access FROM entries "
                "ORDER BY last_access LIMIT ? OFFSET ?",
                (limit, skip),
            ).fetchall()
        return [CatalogRow(v, s, os.fsdecode(bytes(u)), b, t) for v, s, u, b, t in rows]

    # -- writes -------------------------------------------------------------

    def put(self, version: str, size: int, uuid: str, nbytes: int, now: float) -> bool:
        """Record an entry; True if it was not there before."""
        key = (version, size, os.fsencode(uuid))
        with self._lock, _transaction(self._db):
            existed = self._db.execute(
                "SELECT 1 FROM entries WHERE version = ? AND size = ? AND uuid = ?", key
            ).fetchone()
            self._db.execute(
                "INSERT OR REPLACE INTO entries (version, size, uuid, bytes, last_access) "
                "VALUES (?, ?, ?, ?, ?)",
                (*key, nbytes, now),
            )
        return existed is None

    def remove(self, version: str, size: int, uuid: str) -> int | None:
        """Drop a row; its byte count, or None if there was none."""
        with self._lock:
            row = self._db.execute(
                "DELETE FROM entries WHERE version = ? AND size = ? AND uuid = ? RETURNING bytes",
                (version, size, os.fsencode(uuid)),
            ).fetchone()
        return None if row is None else int(row[0])

    def remove_version(self, version: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM entries WHERE version = ?", (version,))

    def touch(self, accesses: Iterable[tuple[str, int, str, float]]) -> None:
        """Record last-access times, in one transaction."""
        rows = [(t, v, s, os.fsencode(u)) for v, s, u, t in accesses]
        if not rows:
            return
        with self._lock, _transaction(self._db):
            self._db.executemany(
                "UPDATE entries SET last_access = max(last_access, ?) "
                "WHERE version = ? AND size = ? AND uuid = ?",
                rows,
            )

    def fill(self, rows: Iterable[tuple[str, int, str, int, float]]) -> None:
        """Add rows found by a scan of the store; rows already known stay as they are."""
        with self._lock, _transaction(self._db):
            self._db.executemany(
                "INSERT OR IGNORE INTO entries (version, size, uuid, bytes, last_access) "
                "VALUES (?, ?, ?, ?, ?)",
                ((v, s, os.fsencode(u), b, t) for v, s, u, b, t in rows),
            )

    def mark_filled(self) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO meta (key, value) VALUES ('filled', ?)",
                (str(SCHEMA_VERSION),),
            )


@contextlib.contextmanager
def _transaction(db: sqlite3.Connection) -> Iterator[None]:
    """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on an exception (autocommit connection)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")
