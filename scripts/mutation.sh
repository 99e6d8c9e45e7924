#!/usr/bin/env bash
# Mutation testing: do the fast tests catch broken logic?
#
# Runs mutmut over the caching logic (engine, store, capacity, entry, memory,
# source, tree) against the in-process tests only (no FUSE mount), in a copy of
# the working tree under .mutation/ (so the tree itself is never rewritten),
# then prints the mutants no test killed. Not part of CI: it takes a while.
#
#   scripts/mutation.sh                          # every module above
#   scripts/mutation.sh 'decodefs/daemon/memory.py'     # only files matching these globs
#   MUTATION_JOBS=2 scripts/mutation.sh          # parallel mutants (default: cores)
#
# Afterwards: cd .mutation && ../.venv/bin/mutmut show <name>   (the diff of one survivor)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$ROOT"

if ! "$VENV/bin/python" -c 'import mutmut' 2>/dev/null; then
    echo "mutation: installing mutmut into $VENV" >&2
    "$VENV/bin/pip" install --quiet --disable-pip-version-check -e "$ROOT[test,mutation]"
fi

if [ "$#" -gt 0 ]; then
    modules=("$@")
else
    modules=(decodefs/daemon/engine.py decodefs/daemon/decodes.py decodefs/daemon/known.py
             decodefs/daemon/entry_reads.py decodefs/store/store.py decodefs/store/root.py
             decodefs/store/fingerprints.py decodefs/store/movein.py decodefs/store/capacity.py
             decodefs/common/entry.py decodefs/common/npy.py decodefs/daemon/memory.py
             decodefs/common/source.py decodefs/daemon/namespace.py)
fi
# The in-process tests: real stores, sources and decodes, no mount.
tests=(tests/test_engine.py tests/test_fs.py tests/test_tree.py tests/test_store.py
       tests/test_source.py tests/test_catalog.py tests/test_mirror.py tests/test_pagecache.py
       tests/test_entry.py tests/test_admission.py)

work="$ROOT/.mutation"
rm -rf "$work"
mkdir -p "$work"
cp -r decodefs tests pyproject.toml "$work/"
find "$work" -name __pycache__ -prune -exec rm -rf {} +
toml_list() { printf '"%s", ' "$@"; }
cat >>"$work/pyproject.toml" <<TOML

[tool.mutmut]
source_paths = ["decodefs/"]
only_mutate = [$(toml_list "${modules[@]}")]
pytest_add_cli_args_test_selection = [$(toml_list "${tests[@]}")]
# A fixed order, no per-test timeout thread (mutmut has its own), quiet; fewer
# hypothesis examples; not the one 13 s stress test of the catalog fill.
pytest_add_cli_args = ["-p", "no:randomly", "-p", "no:timeout", "-p", "no:cacheprovider", "-q", "-x",
    "--hypothesis-profile=mutation",
    "--deselect=tests/test_store.py::test_usage_is_exact_after_a_fill_raced_by_writes_and_removals"]
# Lines no selected test runs are not mutated (they could only survive), and a
# mutant that hangs (a lost wake-up, a loop that never ends) is cut off soon.
mutate_only_covered_lines = true
timeout_multiplier = 3.0
timeout_constant = 5.0
TOML

cd "$work"
export DECODEFS_TEST_WAIT_SECONDS=5  # a condition that holds, holds within a second here
started=$(date +%s)
"$VENV/bin/mutmut" run --max-children "${MUTATION_JOBS:-$(nproc)}" >"$work/run.log" 2>&1 || {
    tail -40 "$work/run.log" >&2
    echo "mutation: mutmut run failed (log: $work/run.log)" >&2
    exit 1
}
"$VENV/bin/mutmut" results >"$work/results.txt" 2>&1 || true
elapsed=$(($(date +%s) - started))
echo "mutation: $(grep -c ': survived' "$work/results.txt" || true) survived," \
    "$(grep -c ': killed' "$work/results.txt" || true) killed listed; ${elapsed} s" \
    "(full list: $work/results.txt)"
grep -v ': killed' "$work/results.txt" || true
