"""``python -P -m decodefs.daemon --channel N``: a serving process, started by a holder."""

import sys

from .server import main

sys.exit(main())
