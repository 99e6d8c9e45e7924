"""The program `decodefs`: parses the command line, runs its command, and prints a user's
error as one line instead of a traceback. Knows no command's arguments or work.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from .errors import EXIT_BROKEN_PIPE, EXIT_ERROR, EXIT_INTERRUPTED, is_user_error, print_error
from .parser import build_parser

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run `decodefs` with ``argv`` (default: sys.argv[1:]); return its exit status."""
    args = build_parser().parse_args(argv)
    try:
        result: int = args.run(args)
        # Output to a pipe is buffered: a reader gone away shows here, where it is
        # handled, not as noise and exit 120 when the interpreter flushes at its exit.
        sys.stdout.flush()
        return result
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # Whoever read our output went away (`decodefs mount ... | head -1`): what was
        # done stays done, and nothing more is said on the closed pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except Exception as exc:
        if not is_user_error(exc):
            raise
        print_error(exc)
        return EXIT_ERROR
