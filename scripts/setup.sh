#!/usr/bin/env bash
# Install what decodefs needs on a fresh Debian machine; quick when already done.
# Two sizes, chosen by DECODEFS_SETUP (or, run as a command, its one argument):
#   light  (demo.sh): apt: system-packages.sh (FUSE 3, a compiler for pyfuse3, python3-venv);
#          .venv/ with decodefs and its own dependencies alone (pip install -e .), ~100 MB
#   test   (test.sh, the default): also systemd-analyze, prlimit and redis-server (apt), and
#          the test, cluster-test and torch extras in .venv/ with the CPU build $DECODEFS_TORCH
#          (default torch==2.13.0), named in the same pip command as the extra so that pip
#          keeps the build it finds first: the CPU wheel where one is at hand (this project's
#          machines), ~1.6 GB; from PyPI alone, the CUDA build, ~5.5 GB
# A test install serves the demo too; a light one is completed by the next test.sh.
# Sourced by test.sh, demo.sh and mutation.sh; sets VENV.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DECODEFS_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
SETUP="${DECODEFS_SETUP:-test}"
if [ "${BASH_SOURCE[0]}" = "$0" ] && (($#)); then
    SETUP="$1" # bash scripts/setup.sh light (sourced, "$@" are the caller's arguments)
fi
case "$SETUP" in
    light | test) ;;
    *) echo "setup: DECODEFS_SETUP is light or test, not '$SETUP'" >&2; exit 2 ;;
esac
if [ "$SETUP" = test ]; then
    # The tests also run systemd-analyze (command:package), prlimit, and Redis (JuiceFS's
    # metadata, for the cluster tests).
    DECODEFS_EXTRA_PACKAGES="systemd-analyze:systemd prlimit:util-linux redis-server:redis-server" \
        source "$ROOT/scripts/system-packages.sh"
else
    source "$ROOT/scripts/system-packages.sh"
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV" >&2
    "$PYTHON" -m venv "$VENV"
fi
TORCH="${DECODEFS_TORCH:-torch==2.13.0}"
# Reinstall only when the project's dependencies or its C sources change (an editable
# install builds the optional extension decodefs/client/_batchread once, in place). The
# stamp holds "<size> <digest>".
stamp="$VENV/.decodefs-installed"
sources=("$ROOT/pyproject.toml" "$ROOT/setup.py" "$ROOT"/decodefs/client/_ext/*)
light="light $(cat "${sources[@]}" | sha256sum | cut -d' ' -f1)"
full="test $( (cat "${sources[@]}"; echo "$TORCH") | sha256sum | cut -d' ' -f1)"
have="$(cat "$stamp" 2>/dev/null || true)"
if [ "$SETUP" = light ] && { [ "$have" = "$light" ] || [ "$have" = "$full" ]; }; then
    : # a light install or a test install of these dependencies: nothing to do
elif [ "$SETUP" = test ] && [ "$have" = "$full" ]; then
    :
else
    if [ "$SETUP" = light ]; then
        echo "setup: installing decodefs into $VENV" >&2
        what=("$ROOT")
        check='import decodefs, pyfuse3'
        want="$light"
    else
        echo "setup: installing decodefs, its test tools and PyTorch into $VENV (a few minutes)" >&2
        what=("$ROOT[test,cluster-test,torch]" "$TORCH")
        check='import decodefs, pyfuse3, skimage, boto3, distributed, torch'
        want="$full"
    fi
    # pyfuse3 is the one dependency compiled here (PyPI has no wheel of it): without
    # debug information (33 s -> 14 s on 2 cores), and for the light install beside the
    # download of the others, then taken from the wheel it made.
    wheels="$(mktemp -d)" # private (0700): the logs go in it too
    log="$wheels/install.log"
    build=
    pip=(env "CFLAGS=${CFLAGS--g0}" "$VENV/bin/pip" --quiet --disable-pip-version-check)
    failed() {
        # The build runs in a session of its own: its compiler goes with it.
        [ -z "$build" ] || kill -- -"$build" 2>/dev/null || true
        grep -hv "^WARNING: Location .* is ignored" "$log" "$wheels/build.log" 2>/dev/null >&2 || true
        rm -rf "$wheels"
        echo "setup: ${1:-pip install failed}" >&2
        exit 1
    }
    if [ "$SETUP" = light ]; then
        mapfile -t deps < <("$VENV/bin/python" - "$ROOT/pyproject.toml" <<'PY'
import sys, tomllib
for requirement in tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]:
    print(requirement)
PY
        )
        mapfile -t fuse < <(printf '%s\n' "${deps[@]}" | grep '^pyfuse3' || true)
        mapfile -t others < <(printf '%s\n' "${deps[@]}" | grep -v '^pyfuse3' || true)
        if ((${#fuse[@]} != 1 || ${#others[@]} == 0)); then
            failed "cannot read the dependencies of $ROOT/pyproject.toml"
        fi
        setsid --wait "${pip[@]}" wheel --no-deps -w "$wheels" "${fuse[@]}" >"$wheels/build.log" 2>&1 &
        build=$!
        "${pip[@]}" install "${others[@]}" >"$log" 2>&1 || failed
        wait "$build" || { build= && failed; }
        build=
    fi
    "${pip[@]}" install --find-links "$wheels" -e "${what[@]}" >"$log" 2>&1 || failed
    rm -rf "$wheels"
    "$VENV/bin/python" -c "$check" # fails loudly if the install did
    "$VENV/bin/python" -c 'import decodefs.client as c; print("setup: batch reads:", c.EXTENSION or "pure Python (the C extension did not build)")' >&2
    echo "$want" >"$stamp"
fi
export VENV
