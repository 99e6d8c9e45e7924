"""The `decodefs` command. Loads the daemon only to mount: every other command and
every error path runs without pyfuse3 or trio.

Its rooms: program (main: parse, run, print a user error), parser (the grammar),
commands (one body per command), checks (what the user named), errors (the error
model and exit statuses), status (a mount's status files in words).
"""

from .program import main

__all__ = ["main"]
