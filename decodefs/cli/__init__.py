"""The `decodefs` command. Loads the daemon only to mount: every other command and
every error path runs without pyfuse3 or trio.
"""

from .commands import main

__all__ = ["main"]
