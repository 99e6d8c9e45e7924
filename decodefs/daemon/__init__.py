"""The daemon: the FUSE adapter (fs, the only pyfuse3 importer), the namespace, the
engine and its rooms, and the mount's life (serve, spawn, signals, systemd).

Imports the shared vocabulary, the store and the cluster tier; the command loads
it only to mount. Other folders import what this file exports, never its rooms.
"""

from .lifecycle import empty_version_warning, serve, spawn, store_warning

__all__ = ["empty_version_warning", "serve", "spawn", "store_warning"]
