#!/usr/bin/env bash
# The Debian packages decodefs needs, installed if missing (sourced by setup.sh
# and install-service.sh):
#   fuse3 (fusermount3), libfuse3-dev + pkg-config + gcc + python3-dev (to build
#   pyfuse3), python3-venv.
set -euo pipefail

PYTHON="${PYTHON:-python3}"
missing=()
command -v fusermount3 >/dev/null 2>&1 || missing+=(fuse3)
command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
pkg-config --exists fuse3 2>/dev/null || missing+=(libfuse3-dev)
command -v gcc >/dev/null 2>&1 || missing+=(gcc)
"$PYTHON" -c 'import ensurepip' >/dev/null 2>&1 || missing+=(python3-venv)
"$PYTHON" -c 'import os, sysconfig; assert os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))' \
    >/dev/null 2>&1 || missing+=(python3-dev)
for extra in ${DECODEFS_EXTRA_PACKAGES:-}; do
    command -v "${extra%%:*}" >/dev/null 2>&1 || missing+=("${extra##*:}")
done
if ((${#missing[@]})); then
    echo "setup: installing ${missing[*]} (apt)" >&2
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
