# Shared by the cluster scripts: argument checks, a health-check wait, and stopping what
# the script started (its own children only, never the caller's process group).

die() { echo "$script: $*" >&2; exit 2; }

# number NAME VALUE: a positive integer, or one line naming the argument.
number() { [[ $2 =~ ^[0-9]+$ && $2 -gt 0 ]] || die "$1 must be a positive integer (got '$2')"; }

# ready WHAT PID URL CONDITION: poll URL until the Python CONDITION on its body `b` (bytes)
# holds. Fails at once if PID (the daemon being waited on) exited, or after $timeout s.
ready() {
  local what=$1 pid=$2 url=$3 cond=$4 deadline=$((SECONDS + timeout))
  until "$python" -c "import json, sys, urllib.request as u
b = u.urlopen(sys.argv[1], timeout=5).read()
sys.exit(0 if ($cond) else 1)" "$url" 2>/dev/null; do
    kill -0 "$pid" 2>/dev/null || { echo "$script: $what exited (its log is above)" >&2; exit 1; }
    ((SECONDS < deadline)) || { echo "$script: $what not ready within $timeout s ($url)" >&2; exit 1; }
    sleep 0.5  # the poll interval of the health check, not a guess at start-up time
  done
}

stop() {
  trap - EXIT INT TERM
  local pids
  pids=$(jobs -p)
  [[ -z $pids ]] || kill $pids 2>/dev/null || true
  wait || true
}
trap 'stop; exit 130' INT
trap 'stop; exit 143' TERM
trap stop EXIT
