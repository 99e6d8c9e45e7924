"""The daemon: one serving process of a mount the holder keeps. The FUSE adapter (fs,
the only pyfuse3 importer), the namespace, the engine and its rooms, the mount's
numbers, and the process's life under its holder (server, lifecycle).

Imports the shared vocabulary, the store and the cluster tier. Nothing imports it:
the holder starts it as ``python -P -m decodefs.daemon`` (server.py).
"""

from .server import main

__all__ = ["main"]
