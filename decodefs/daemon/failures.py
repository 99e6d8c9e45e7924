"""The list of originals that failed to decode (``.decodefs/failed.json``): key, path, reason.

Not the negative cache (decodes.py's, which answers EIO for a while and
forgets): an original stays listed until a decode of it succeeds (it was
replaced, or the settings changed) or the serving process ends. Its memory is
bounded whatever the corpus: past ``limit_bytes`` of rows a failure is only
counted (``not_listed``), and a reason is cut to ``REASON_MAX`` characters. Used
on the trio thread alone (by decodes.py), so no lock. Knows nothing of FUSE,
the store or Pillow.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final

from ..common.protocol import FailedList, FailedOriginal

__all__ = ["FAILED_LIST_BYTES", "REASON_MAX", "FailedOriginals"]

# The most bytes of rows listed (keys, paths and reasons, with a row's JSON around them):
# a hostile or broken corpus of millions of bad files costs this much memory, no more.
FAILED_LIST_BYTES: Final = 8 << 20
REASON_MAX: Final = 300  # characters of a reason kept (Pillow's can quote the file)
_ROW_OVERHEAD: Final = 160  # a row's JSON keys, numbers and Python objects, roughly


class FailedOriginals:
    def __init__(
        self,
        limit_bytes: int = FAILED_LIST_BYTES,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.limit_bytes = limit_bytes
        self._clock = clock
        self._rows: dict[tuple[str, str], FailedOriginal] = {}
        self.bytes = 0  # of the rows listed, as _cost counts them
        self.not_listed = 0  # failures met while the list was full

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, version: str, key: str, size: int, path: str, reason: str) -> None:
        """``key`` of ``version`` (the original at ``path``) failed to decode at ``size``."""
        if len(reason) > REASON_MAX:
            reason = reason[: REASON_MAX - 3] + "..."
        old = self._rows.get((version, key))
        sizes = (size,) if old is None else tuple(sorted({*old.sizes, size}))
        row = FailedOriginal(version, key, path, reason, sizes, round(self._clock(), 3))
        grows = _cost(row) - (0 if old is None else _cost(old))
        if self.bytes + grows > self.limit_bytes:
            self.not_listed += 1
            return
        self._rows[(version, key)] = row
        self.bytes += grows

    def discard(self, version: str, key: str) -> None:
        """``key`` of ``version`` decoded: it is no longer a failure."""
        old = self._rows.pop((version, key), None)
        if old is not None:
            self.bytes -= _cost(old)

    def listed(self, version: str | None = None) -> FailedList:
        """The rows (of ``version``, or all), by version and key."""
        rows = sorted(
            (r for r in self._rows.values() if version is None or r.version == version),
            key=lambda r: (r.version, r.key),
        )
        return FailedList(tuple(rows), self.not_listed)

    def to_json(self) -> bytes:
        """failed.json's content."""
        return self.listed().to_json()


def _cost(row: FailedOriginal) -> int:
    return len(row.version) + len(row.key) + len(row.path) + len(row.reason) + _ROW_OVERHEAD
