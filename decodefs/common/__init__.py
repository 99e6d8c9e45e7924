"""The shared vocabulary: what every process of decodefs agrees on, defined once.

Names and status files (protocol), the stats schema, the inode layout, the entry
format, the ``.npy`` layout, decode and the decoder fingerprint, config, the
source index, who may read an original (readers), trusted opens, the mount
table and the status files, file names and keys, metrics, the runtime
directory and the holder's channel to its serving processes. Imports nothing of
decodefs outside this folder, and nothing heavy here: each room is imported by
name (``from decodefs.common.config import Config``), so a client that needs
the ``.npy`` layout (npy) does not load Pillow (decode).
"""

__all__ = [
    "advice",
    "channel",
    "config",
    "decode",
    "entry",
    "fingerprint",
    "inodes",
    "metrics",
    "mounts",
    "names",
    "npy",
    "protocol",
    "readers",
    "runtime",
    "source",
    "startlog",
    "stats_schema",
    "status",
    "trusted",
    "version",
]
