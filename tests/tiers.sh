#!/usr/bin/env bash
# The suite's two tiers; a test's tier is its marker (pyproject.toml).
#
#   tests/tiers.sh quick [pytest args]   # `make test`: every test not marked slow, cluster or multihost
#   tests/tiers.sh all [pytest args]     # `make test-all`: one pytest, the quick tier's tests first,
#                                        # then the tests only the full tier runs (each test once);
#                                        # then both tiers' durations and the 15 slowest tests
#   PYTHON=/path/to/python tests/tiers.sh quick -x
#
# What the full tier needs beyond the README's Python 3.11 and Java 17 is settled, or said,
# before the first test: Chromium (tests/test_ui.py; installed here as root with apt-get)
# and root (the multi-host bed's network namespaces; skipped with its reason otherwise).
# The exit status is pytest's, or tests/tier_times.py's when a tier collected no test (5, as
# pytest says for nothing collected).
set -u
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
QUICK="not slow and not cluster and not multihost"
mode=${1:-}
shift || true
case "$mode" in
    quick) exec "$PYTHON" -m pytest -m "$QUICK" "$@" ;;
    all) ;;
    *) echo "usage: tests/tiers.sh quick|all [pytest args]" >&2; exit 2 ;;
esac
OUT=.pytest_cache/shardline/tiers
mkdir -p "$OUT"
rm -f "$OUT"/*.xml

if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "test-all: installing Debian's chromium for tests/test_ui.py (apt-get)"
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; } \
            >"$OUT/chromium-install.log" 2>&1 \
            || echo "test-all: apt-get could not install chromium ($OUT/chromium-install.log): tests/test_ui.py's browser test will fail"
    else
        echo "test-all: no chromium on PATH and no root with apt-get to install it: tests/test_ui.py's browser test will fail (install Debian's chromium package, or run as root)"
    fi
fi
if [ "$(id -u)" != 0 ]; then
    echo "test-all: not root: the multi-host bed (tests/test_multihost.py, network namespaces) will be skipped"
fi

# One pytest for both tiers: the session's engines, servers and datasets start once
# (tests/conftest.py puts the quick tier's tests first and writes each test's tier).
start=$(date +%s)
SHARDLINE_TIERS=all "$PYTHON" -m pytest --junitxml="$OUT/all.xml" "$@"
status=$?
echo "test-all: pytest exit $status in $(( $(date +%s) - start )) s"
"$PYTHON" tests/tier_times.py "$OUT/all.xml"
times=$?
[ "$status" -ne 0 ] || status=$times
exit "$status"
