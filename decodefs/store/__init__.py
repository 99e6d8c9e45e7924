"""The store on flash and its offline tools: entries kept, checked and evicted
(``Store``), ``decodefs adopt`` and ``decodefs verify``.

Imports only the shared vocabulary (decodefs.common). Other folders import what
this file exports, never its rooms.
"""

from . import pagecache
from .adopt import DEFAULT_SAMPLE, AdoptError, adopt
from .pagecache import PendingDrops
from .store import (
    CorruptEntry,
    Discarded,
    SizeUsage,
    Store,
    StoreError,
    StoreInUse,
    StoreReadError,
    StoreUsage,
    StoreWriteError,
    VerifiedEntry,
)
from .verify import StoreBusy, recorded_digests, verify_store

__all__ = [
    "DEFAULT_SAMPLE",
    "AdoptError",
    "CorruptEntry",
    "Discarded",
    "PendingDrops",
    "SizeUsage",
    "Store",
    "StoreBusy",
    "StoreError",
    "StoreInUse",
    "StoreReadError",
    "StoreUsage",
    "StoreWriteError",
    "VerifiedEntry",
    "adopt",
    "pagecache",
    "recorded_digests",
    "verify_store",
]
