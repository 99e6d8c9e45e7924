#!/usr/bin/env bash
# Install what decodefs needs on a fresh Debian machine; quick when already done.
#   apt: see system-packages.sh (plus systemd-analyze for the tests)
#   .venv/ with decodefs, its test tools and PyTorch (the torch extra: its tests run in CI),
#   the CPU build $DECODEFS_TORCH (default torch==2.13.0, this machine's CPU wheel), named
#   in the same pip command as the extra so pip never picks a CUDA build and its packages
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
TORCH="${DECODEFS_TORCH:-torch==2.13.0}"
# Reinstall only when the project's dependencies or its C sources change (an editable
# install builds the optional extension decodefs/client/_batchread once, in place).
stamp="$VENV/.decodefs-installed"
want="$( (cat "$ROOT/pyproject.toml" "$ROOT/setup.py" "$ROOT"/decodefs/client/_ext/*; echo "$TORCH") \
    | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "setup: installing decodefs and its test tools into $VENV" >&2
    log="$(mktemp)"
    if ! "$VENV/bin/pip" install --quiet --disable-pip-version-check -e "$ROOT[test,cluster-test,torch]" "$TORCH" >"$log" 2>&1; then
        grep -v "^WARNING: Location .* is ignored" "$log" >&2
        echo "setup: pip install failed" >&2
        exit 1
    fi
    rm -f "$log"
    "$VENV/bin/python" -c 'import decodefs, pyfuse3, skimage, boto3, distributed, torch' # fails loudly if the install did
    "$VENV/bin/python" -c 'import decodefs.client as c; print("setup: batch reads:", c.EXTENSION or "pure Python (the C extension did not build)")' >&2
    echo "$want" >"$stamp"
fi
export VENV
