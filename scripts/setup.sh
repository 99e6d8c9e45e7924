#!/usr/bin/env bash
# Install what decodefs needs on a fresh Debian machine; quick when already done.
#   apt: fuse3 (fusermount3), libfuse3-dev + pkg-config (to build pyfuse3)
#   .venv/ with decodefs and its test tools
# Sourced by test.sh and demo.sh; sets VENV.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DECODEFS_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"

missing=()
command -v fusermount3 >/dev/null 2>&1 || missing+=(fuse3)
command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
pkg-config --exists fuse3 2>/dev/null || missing+=(libfuse3-dev)
command -v gcc >/dev/null 2>&1 || missing+=(gcc)
"$PYTHON" -c 'import ensurepip' >/dev/null 2>&1 || missing+=(python3-venv)
"$PYTHON" -c 'import os, sysconfig; assert os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))' \
    >/dev/null 2>&1 || missing+=(python3-dev)
if ((${#missing[@]})); then
    echo "setup: installing ${missing[*]} (apt)" >&2
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV" >&2
    "$PYTHON" -m venv "$VENV"
fi
# Reinstall only when the project's dependencies change.
stamp="$VENV/.decodefs-installed"
want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "setup: installing decodefs and its test tools into $VENV" >&2
    "$VENV/bin/pip" install --quiet --disable-pip-version-check -e "$ROOT[test]" 2>&1 \
        | grep -v "^WARNING: Location .* is ignored" >&2 || true
    "$VENV/bin/python" -c 'import decodefs, pyfuse3, skimage' # fails loudly if the install did
    echo "$want" >"$stamp"
fi
export VENV
