#!/usr/bin/env bash
# A Dask scheduler with its dashboard and N single-threaded workers on this host, for
#   shardline train CONFIG --launcher dask --set dask.address='tcp://HOST:PORT'
# Usage: jobs/scripts/dask-cluster.sh [--workers N] [--host HOST] [--port PORT]
#          [--dashboard-port PORT] [--venv DIR] [--timeout SECONDS]
#   defaults: 2 workers, 127.0.0.1 (nothing reachable from other machines), 8786, 8787,
#   the repo's .venv, 300 s. (`dask-cluster.sh N` still means N workers.)
# Prints one "ready" line once the scheduler's /health answers and all N workers have
# registered; Ctrl-C or SIGTERM stops everything it started.
set -euo pipefail
script=dask-cluster.sh
here=$(dirname "$(readlink -f "$0")")
n=2 host=127.0.0.1 port=8786 dashboard=8787 venv=$here/../../.venv timeout=300
while (($#)); do
  case $1 in
    --workers|--host|--port|--dashboard-port|--venv|--timeout)
      (($# >= 2)) || { echo "$script: $1 needs a value" >&2; exit 2; }
      case $1 in
        --workers) n=$2 ;; --host) host=$2 ;; --port) port=$2 ;;
        --dashboard-port) dashboard=$2 ;; --venv) venv=$2 ;; --timeout) timeout=$2 ;;
      esac
      shift 2 ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    [0-9]*) n=$1; shift ;;
    *) echo "$script: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
source "$here/lib.sh"
for arg in workers:$n port:$port dashboard-port:$dashboard timeout:$timeout; do number "--${arg%%:*}" "${arg#*:}"; done
bin=$(readlink -f "$venv")/bin python=$bin/python
[[ -x $bin/dask ]] || die "--venv $venv: no bin/dask there (a venv with shardline's dependencies)"

# Without bokeh (a pinned dependency) the dashboard answers only "Dask needs bokeh".
"$bin/dask" scheduler --host "$host" --port "$port" --dashboard-address "$host:$dashboard" &
scheduler=$!
ready "dask scheduler" "$scheduler" "http://$host:$dashboard/health" "b == b'ok'"
for _ in $(seq "$n"); do
  # One thread per worker: one torch rank per worker, ranks x threads <= cores.
  "$bin/dask" worker "tcp://$host:$port" --nworkers 1 --nthreads 1 --host "$host" \
    --dashboard-address "$host:0" &
done
ready "dask workers" "$scheduler" "http://$host:$dashboard/json/counts.json" "json.loads(b)['workers'] >= $n"
echo "ready: tcp://$host:$port, $n workers, dashboard http://$host:$dashboard/status"
wait
