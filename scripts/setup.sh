#!/usr/bin/env bash
# Install what decodefs needs on a fresh Debian machine; quick when already done.
#   apt: see system-packages.sh (plus systemd-analyze for the tests)
#   .venv/ with decodefs, its test tools and PyTorch (the torch extra: its tests run in CI)
# Sourced by test.sh and demo.sh; sets VENV.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DECODEFS_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
# The tests also run systemd-analyze (command:package), prlimit, and Redis (JuiceFS's
# metadata, for the cluster tests).
DECODEFS_EXTRA_PACKAGES="systemd-analyze:systemd prlimit:util-linux redis-server:redis-server" \
    source "$ROOT/scripts/system-packages.sh"

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV" >&2
    "$PYTHON" -m venv "$VENV"
fi
# Reinstall only when the project's dependencies change.
stamp="$VENV/.decodefs-installed"
want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "setup: installing decodefs and its test tools into $VENV" >&2
    log="$(mktemp)"
    if ! "$VENV/bin/pip" install --quiet --disable-pip-version-check -e "$ROOT[test,cluster-test,torch]" >"$log" 2>&1; then
        grep -v "^WARNING: Location .* is ignored" "$log" >&2
        echo "setup: pip install failed" >&2
        exit 1
    fi
    rm -f "$log"
    "$VENV/bin/python" -c 'import decodefs, pyfuse3, skimage, boto3, distributed, torch' # fails loudly if the install did
    echo "$want" >"$stamp"
fi
export VENV
