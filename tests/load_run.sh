#!/usr/bin/env bash
# The suite under load: one CPU hog per core beside pytest, stopped however this ends.
#
#   tests/load_run.sh [pytest args]           # the whole suite once, under load
#   RUNS=3 tests/load_run.sh                  # three runs in a row; stops at the first failure
#   HOGS=0 tests/load_run.sh -k serving       # no hogs: a quiet run, timed the same way
#   PYTHON=/path/to/venv/bin/python tests/load_run.sh
#
# Prints each run's exit status and wall time; exits with the first non-zero status.
set -u
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
RUNS=${RUNS:-1}
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
    "$PYTHON" -m pytest -p no:cacheprovider "$@"
    status=$?
    echo "load_run: run $run of $RUNS: pytest exit $status in $(( $(date +%s) - start )) s with $HOGS hog(s)"
    [ "$status" -eq 0 ] || break
done
exit "$status"
