#!/usr/bin/env bash
# Install decodefs as a systemd service (run as root on the dev box):
#   - the Debian packages it needs;
#   - decodefs itself in a virtual environment at PREFIX (default /opt/decodefs),
#     unless --decodefs names an existing decodefs command to use;
#   - systemd/decodefs.service and the template decodefs@.service in
#     ROOT/etc/systemd/system, pointing at that command;
#   - a commented example config at ROOT/etc/decodefs/config.toml, unless one is
#     there already (then config.example.toml beside it).
# --root DIR stages everything under DIR and touches no running system (tests).
#
#   scripts/install-service.sh [--prefix /opt/decodefs] [--decodefs PATH] [--root DIR]
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
prefix=/opt/decodefs
decodefs=""
root=""
while (($#)); do
    case "$1" in
        --prefix) prefix="$2"; shift 2 ;;
        --decodefs) decodefs="$2"; shift 2 ;;
        --root) root="${2%/}"; shift 2 ;;
        -h | --help) sed -n '2,13p' "$0"; exit 0 ;;
        *) echo "install-service: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

if [ -z "$decodefs" ]; then
    source "$REPO/scripts/system-packages.sh"
    if [ ! -x "$prefix/bin/python" ]; then
        "${PYTHON:-python3}" -m venv "$prefix"
    fi
    log="$(mktemp)"
    if ! "$prefix/bin/pip" install --quiet --disable-pip-version-check --upgrade "$REPO" >"$log" 2>&1; then
        grep -v "^WARNING: Location .* is ignored" "$log" >&2
        echo "install-service: pip install failed" >&2
        exit 1
    fi
    rm -f "$log"
    decodefs="$prefix/bin/decodefs"
fi
decodefs="$(cd "$(dirname "$decodefs")" && pwd)/$(basename "$decodefs")"
"$decodefs" --version >/dev/null || { echo "install-service: $decodefs does not run" >&2; exit 1; }

units="$root/etc/systemd/system"
configs="$root/etc/decodefs"
mkdir -p "$units" "$configs"
for unit in decodefs.service decodefs@.service; do
    sed "s|@DECODEFS@|$decodefs|g" "$REPO/systemd/$unit" >"$units/$unit"
    chmod 0644 "$units/$unit"
done
config="$configs/config.toml"
[ -e "$config" ] && config="$configs/config.example.toml"
install -m 0644 "$REPO/systemd/config.example.toml" "$config"

echo "install-service: units in $units, config in $config, command $decodefs"
if [ -z "$root" ]; then
    systemctl daemon-reload
    echo "Next: edit $configs/config.toml (mountpoint, store, versions), then"
    echo "      systemctl enable --now decodefs"
fi
