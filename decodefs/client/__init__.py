"""What a training process imports: reading arrays (from the store when it can),
the keys of a mounted version, a mount's status files, and ``decodefs warm`` through the mount.

Imports only the shared vocabulary (decodefs.common), never Pillow, trio or
pyfuse3. Other folders import what this file exports, never its rooms: reader
(read_array), discovery (which mount, which store, trusted or not), hits (direct
hits reported to the daemon), names (file name <-> key), status (the status
files), keys (listing a version's keys), warm.
"""

from .keys import class_labels, list_keys, missing_directory
from .names import ARRAY_SUFFIX, array_name, is_array_name, is_key, key_of
from .reader import flush_reports, read_array, read_array_into, read_stored_rows
from .status import StatusElsewhere, read_status, read_status_bytes
from .warm import read_key_list, read_uuid_list, warm

__all__ = [
    "ARRAY_SUFFIX",
    "StatusElsewhere",
    "array_name",
    "class_labels",
    "flush_reports",
    "is_array_name",
    "is_key",
    "key_of",
    "list_keys",
    "missing_directory",
    "read_array",
    "read_array_into",
    "read_key_list",
    "read_status",
    "read_status_bytes",
    "read_stored_rows",
    "read_uuid_list",
    "warm",
]
