#!/usr/bin/env bash
# A tier of the suite under load: one CPU hog per core beside it, stopped however this ends.
#
#   tests/load_run.sh [pytest args]           # the whole suite once (make test-all), under load
#   TIER=quick tests/load_run.sh              # the quick tier (make test), under load
#   RUNS=3 tests/load_run.sh                  # three runs in a row; stops at the first failure
#   HOGS=0 TIER=quick tests/load_run.sh -k serving   # no hogs: a quiet run, timed the same way
#   PYTHON=/path/to/venv/bin/python tests/load_run.sh
#
# Prints each run's exit status and wall time; exits with the first non-zero status.
set -u
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
RUNS=${RUNS:-1}
TIER=${TIER:-all}
HOGS=${HOGS:-$(nproc)}

hogs=()
stop_hogs() {
    for pid in "${hogs[@]}"; do kill "$pid" 2>/dev/null; done
    for pid in "${hogs[@]}"; do wait "$pid" 2>/dev/null; done
    hogs=()
}
trap stop_hogs EXIT
trap 'exit 130' INT TERM

for _ in $(seq "$HOGS"); do
    # Busy until stopped, and also once this script is gone (its parent changes), so a
    # hog never outlives the run even if the script itself is SIGKILLed.
    python3 -c 'import os
p = os.getppid()
while os.getppid() == p: pass' &
    hogs+=($!)
done
echo "load_run: $HOGS CPU hog(s) running: ${hogs[*]:-none}; $(nproc) core(s)"

status=0
for run in $(seq "$RUNS"); do
    start=$(date +%s)
    PYTHON=$PYTHON bash tests/tiers.sh "$TIER" "$@"
    status=$?
    echo "load_run: run $run of $RUNS: the $TIER tier's exit $status in $(( $(date +%s) - start )) s with $HOGS hog(s)"
    [ "$status" -eq 0 ] || break
done
exit "$status"
