#!/usr/bin/env bash
# Shows that the rapid-trigger test guards race R7 end to end: re-introduces the bug in
# flock-core (the restart gate fires whenever the debounce ends, ignoring liveness,
# via scripts/mutant-rustc) and requires
# bins/flock-supervisor/tests/envoy_hot_restart.rs::rapid_triggers_never_fork_an_initializing_epoch
# to FAIL against real Envoy. Exit 0 = the mutant was caught.
# Needs FLOCK_ENVOY_BIN (source scripts/prereqs/10-envoy.sh) or .venv-peers.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
log=target/mutants/r7-supervisor.log
mkdir -p target/mutants
find flock-core/src -name '*.rs' -exec touch {} +
run() {
    RUSTC_WRAPPER="$ROOT/scripts/mutant-rustc" FLOCK_MUTANT=r7 \
        cargo test -p flock-supervisor --target-dir target/mutants/supervisor \
        --test envoy_hot_restart rapid_triggers_never_fork_an_initializing_epoch "$@"
}
run --no-run >"$log" 2>&1 || { cat "$log"; echo "r7 mutant did not build"; exit 1; }
status=0
run >>"$log" 2>&1 || status=$?
find flock-core/src -name '*.rs' -exec touch {} +
if [ "$status" = 0 ]; then
    echo "MUTANT SURVIVED: r7 (gate ignores liveness): the rapid-trigger test passed (log: $log)"
    exit 1
fi
echo "caught r7 in the supervisor: $(grep -E 'panicked|assertion' "$log" | head -2 | tr '\n' ' ')"
