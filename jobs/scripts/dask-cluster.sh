#!/usr/bin/env bash
# Start a Dask scheduler and N single-threaded workers on this host, for
#   shardline train CONFIG --launcher dask --set dask.address='tcp://HOST:8786'
# Usage: jobs/scripts/dask-cluster.sh [N_WORKERS] [HOST] [PORT]; Ctrl-C stops them all.
set -euo pipefail
n=${1:-2}; host=${2:-127.0.0.1}; port=${3:-8786}
bin=$(dirname "$(readlink -f "$0")")/../../.venv/bin
trap 'kill 0' EXIT INT TERM
"$bin/dask" scheduler --host "$host" --port "$port" --dashboard-address :8787 &
sleep 2
for _ in $(seq "$n"); do
  # One thread per worker: one torch rank per worker, ranks x threads <= cores.
  "$bin/dask" worker "tcp://$host:$port" --nworkers 1 --nthreads 1 --host "$host" &
done
wait
