#!/usr/bin/env bash
# Install everything a fresh machine lacks, then run the whole suite:
# lint, format, types, and the tests (which mount real FUSE filesystems).
# How long: the install, once, ~4 min (a .venv of 1.6 GB with PyTorch's CPU build, 5.5 GB
# with PyPI's CUDA one, and Dask, SeaweedFS, JuiceFS, the test tools; Redis from apt); the
# suite ~9 min on 2 cores in 2 processes, less on more
# (docs/development.md has the measured figures). It says both when it starts and ends.
# Extra arguments go to pytest, e.g. scripts/test.sh -k faults -x
# Run it as root (sudo bash scripts/test.sh): about 35 tests, every security test among
# them, mount tmpfs and ext4 file systems, act as another user or make network
# namespaces, and skip without root (the run's last lines count them).
set -euo pipefail
started=$SECONDS
echo "test.sh: installs what is missing (~4 min the first time), then runs the suite" \
    "(~9 min on 2 cores)" >&2
trap 'echo "test.sh: $(((SECONDS - started) / 60)) min $(((SECONDS - started) % 60)) s in all" >&2' EXIT
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$ROOT"

"$VENV/bin/ruff" check decodefs tests scripts
"$VENV/bin/ruff" format --check decodefs tests scripts
"$VENV/bin/mypy"
if [ "$(id -u)" -ne 0 ]; then
    echo "test.sh: not root: the tests that need root will be skipped;" \
        "run them as root: sudo bash scripts/test.sh" >&2
fi
# Two processes: most of a test's time is a daemon starting or a mount answering, and
# the two share the CPUs well (-n 0 runs it in one; -n N in N).
"$VENV/bin/pytest" -n 2 "$@"
