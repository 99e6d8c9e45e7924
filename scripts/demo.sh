#!/usr/bin/env bash
# The main job on a generated sample corpus: install what is missing, make
# photo-like JPEGs, mount, read every array twice (epoch 1 decodes, epoch 2 is
# a cache read), show the stats, unmount.
#   DECODEFS_DEMO_DIR   where corpus, store and mount live (default $TMPDIR/decodefs-demo,
#                       /tmp/decodefs-demo, removed once the demo succeeds; one you name is kept)
#   DEMO_COUNT          number of sample JPEGs (default 32)
set -euo pipefail
DECODEFS_SETUP=light source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"

work="${DECODEFS_DEMO_DIR:-${TMPDIR:-/tmp}/decodefs-demo}"
count="${DEMO_COUNT:-32}"
decodefs="$VENV/bin/decodefs"
mnt="$work/mnt"
mkdir -p "$mnt"

"$decodefs" make-sample "$work/originals" --count "$count" --width 3000 --height 2000
cat >"$work/config.toml" <<TOML
store = "$work/store"

[versions.v1]
source = "$work/originals"
sizes = [224]
TOML
rm -rf "$work/store" # start cold, so epoch 1 really decodes

trap '"$decodefs" umount --lazy "$mnt" >/dev/null 2>&1 || true' EXIT
"$decodefs" mount "$mnt" --config "$work/config.toml" --log-file "$work/daemon.log"
echo
"$VENV/bin/python" "$ROOT/scripts/epochs.py" "$mnt/v1/224" --originals "$work/originals"
echo
"$decodefs" stats "$mnt"
echo
"$decodefs" umount "$mnt"
trap - EXIT
if [ -z "${DECODEFS_DEMO_DIR:-}" ]; then
    rm -rf "$work" # the demo leaves nothing behind (on a failure, its log stays there)
    echo "decodefs: unmounted $mnt, and removed $work"
else
    echo "decodefs: unmounted $mnt (daemon log: $work/daemon.log)"
fi
