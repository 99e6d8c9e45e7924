#!/usr/bin/env bash
# Install everything a fresh machine lacks, then run the whole suite:
# lint, format, types, and the tests (which mount real FUSE filesystems).
# Extra arguments go to pytest, e.g. scripts/test.sh -k faults -x
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$ROOT"

"$VENV/bin/ruff" check decodefs tests scripts
"$VENV/bin/ruff" format --check decodefs tests scripts
"$VENV/bin/mypy"
"$VENV/bin/pytest" "$@"
