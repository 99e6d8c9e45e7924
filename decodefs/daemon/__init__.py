"""The daemon: the FUSE adapter (fs, the only pyfuse3 importer), the namespace, the
engine and its rooms, and the mount's life (serve, spawn, signals, systemd).

Imports the shared vocabulary, the store and the cluster tier; the command loads
it only to mount. Other folders import what this file exports, never its rooms.
"""

from .lifecycle import serve, spawn

__all__ = ["serve", "spawn"]
