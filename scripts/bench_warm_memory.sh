#!/usr/bin/env bash
# decodefs warm's peak RSS through a real mount of N originals each (hardlinks of one small
# JPEG, size 8, -j 4), for docs/benchmarks.md: its memory must not grow with the corpus.
#   scripts/bench_warm_memory.sh 10000 40000
# Needs the clone's .venv (scripts/setup.sh); works in a temporary directory it removes.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
V="$ROOT/.venv/bin"
base="$(mktemp -d "${TMPDIR:-/tmp}/decodefs-warm-memory.XXXXXX")"
trap 'for m in "$base"/m-*; do "$V/decodefs" umount --lazy "$m" >/dev/null 2>&1 || true; done; rm -rf "$base"' EXIT
cd "$base" # never a directory holding another clone's decodefs/
"$V/decodefs" make-sample "$base/one" --count 1 --width 64 --height 48 >/dev/null
jpg="$(find "$base/one" -name '*.jpg' | head -1)"
for n in "$@"; do
    src="$base/src-$n"
    mkdir -p "$src" "$base/m-$n"
    "$V/python" -c '
import os, sys
for i in range(int(sys.argv[2])):
    os.link(sys.argv[1], os.path.join(sys.argv[3], "%032x.jpg" % i))' "$jpg" "$n" "$src"
    printf 'store = "%s"\nsizes = [8]\n[versions.v1]\nsource = "%s"\n' "$base/store-$n" "$src" >"$base/c-$n.toml"
    "$V/decodefs" mount "$base/m-$n" --config "$base/c-$n.toml" --log-file "$base/log-$n" >/dev/null
    /usr/bin/time -f "warm of $n originals: %e s, peak RSS %M KiB" \
        "$V/decodefs" warm "$base/m-$n" v1 8 --jobs 4 >/dev/null
    "$V/decodefs" umount "$base/m-$n"
done
