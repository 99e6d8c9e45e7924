"""What a training process imports: reading arrays (from the store when it can),
the keys of a mounted version, and ``decodefs warm`` through the mount.

Imports only the shared vocabulary (decodefs.common), never Pillow, trio or
pyfuse3. Other folders import what this file exports, never its rooms: reader
(read_array), discovery (which mount, which store, trusted or not), hits (direct
hits reported to the daemon), batch (a batch of a directory's arrays, each checked
as it is copied, with its optional compiled twin _batchread), keys (listing a
version's keys), failed (the originals that failed to decode), warm.
"""

from .batch import BatchReader
from .failed import failed_keys, failed_originals
from .keys import class_labels, list_keys, missing_directory
from .reader import flush_reports, read_array, read_array_into, read_stored_rows
from .rows import EXTENSION
from .warm import iter_key_list, read_key_list, warm

__all__ = [
    "EXTENSION",
    "BatchReader",
    "class_labels",
    "failed_keys",
    "failed_originals",
    "flush_reports",
    "iter_key_list",
    "list_keys",
    "missing_directory",
    "read_array",
    "read_array_into",
    "read_key_list",
    "read_stored_rows",
    "warm",
]
