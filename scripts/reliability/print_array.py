"""Write the bytes of ``read_array(PATH)`` to stdout: part 7 runs it as another user.
It knows nothing of the harness.

    python -m scripts.reliability.print_array PATH
"""

from __future__ import annotations

import sys

from decodefs import read_array

if __name__ == "__main__":
    sys.stdout.buffer.write(read_array(sys.argv[1]).tobytes())
