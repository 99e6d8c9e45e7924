"""The holder: the small process that keeps a mount's FUSE connection for the mount's whole life.

It mounts, starts serving processes (the daemon) on the connection, hands it
from one to the next on a reload or restart, starts another when one dies,
and answers EIO itself while a crash loop is backed off. It runs no decode,
store, SQLite, cluster or torch code: it imports the shared vocabulary's
rooms that need no package beyond Python's own (tests/test_layers.py checks).
"""

from .control import ControlError, HolderUnreachable, ask_holder
from .kernel import mount_problem
from .supervisor import Holder, HolderSettings

__all__ = [
    "ControlError",
    "Holder",
    "HolderSettings",
    "HolderUnreachable",
    "ask_holder",
    "mount_problem",
]
