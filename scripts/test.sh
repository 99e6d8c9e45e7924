#!/usr/bin/env bash
# Install everything a fresh machine lacks, then run the whole suite:
# lint, format, types, and the tests (which mount real FUSE filesystems).
# Extra arguments go to pytest, e.g. scripts/test.sh -k faults -x
# Run it as root (sudo bash scripts/test.sh): about 35 tests, every security test among
# them, mount tmpfs and ext4 file systems, act as another user or make network
# namespaces, and skip without root (the run's last lines count them).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$ROOT"

"$VENV/bin/ruff" check decodefs tests scripts
"$VENV/bin/ruff" format --check decodefs tests scripts
"$VENV/bin/mypy"
if [ "$(id -u)" -ne 0 ]; then
    echo "test.sh: not root: the tests that need root will be skipped;" \
        "run them as root: sudo bash scripts/test.sh" >&2
fi
"$VENV/bin/pytest" "$@"
