#!/usr/bin/env bash
# A Spark standalone Master and N Workers on this host, from pyspark's own jars (no Spark
# distribution needed), for
#   shardline train CONFIG --set spark.master='spark://HOST:PORT'
# Usage: jobs/scripts/spark-standalone.sh [--workers N] [--host HOST] [--port PORT]
#          [--webui-port PORT] [--worker-cores C] [--worker-memory M] [--work-dir DIR]
#          [--venv DIR] [--python PATH] [--timeout SECONDS]
#   defaults: 2 workers of 1 core and 1g, 127.0.0.1 (nothing reachable from other
#   machines: RPC and web UIs bind HOST via SPARK_LOCAL_IP), 7077, 8080,
#   $TMPDIR/shardline-spark-worker-I, the repo's .venv (its pyspark jars run the
#   daemons), the venv's python as the workers' PYSPARK_PYTHON, 300 s.
#   (`spark-standalone.sh N [HOST]` still means N workers on HOST.)
# Prints one "ready" line once the Master's web UI reports all N workers alive;
# Ctrl-C or SIGTERM stops everything it started.
set -euo pipefail
script=spark-standalone.sh
here=$(dirname "$(readlink -f "$0")")
n=2 host=127.0.0.1 port=7077 webui=8080 cores=1 memory=1g venv=$here/../../.venv timeout=300
work=${TMPDIR:-/tmp}/shardline-spark-worker positional=0 worker_python=
while (($#)); do
  case $1 in
    --workers|--host|--port|--webui-port|--worker-cores|--worker-memory|--work-dir|--venv|--python|--timeout)
      (($# >= 2)) || { echo "$script: $1 needs a value" >&2; exit 2; }
      case $1 in
        --workers) n=$2 ;; --host) host=$2 ;; --port) port=$2 ;; --webui-port) webui=$2 ;;
        --worker-cores) cores=$2 ;; --worker-memory) memory=$2 ;; --work-dir) work=$2 ;;
        --venv) venv=$2 ;; --python) worker_python=$2 ;; --timeout) timeout=$2 ;;
      esac
      shift 2 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    -*) echo "$script: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    *) ((positional++ == 0)) && n=$1 || host=$1; shift ;;
  esac
done
source "$here/lib.sh"
for arg in workers:$n port:$port webui-port:$webui worker-cores:$cores timeout:$timeout; do
  number "--${arg%%:*}" "${arg#*:}"
done
bin=$(readlink -f "$venv")/bin python=$bin/python
[[ -x $bin/spark-class ]] || die "--venv $venv: no bin/spark-class there (a venv with pyspark)"
# The JVMs read these at start: executors run this Python unless the driver names
# another (a packed env: docs/deploy.md); every socket, web UIs included, binds HOST.
# SPARK_HOME from the venv's pyspark: spark-class would otherwise look for it through
# PYSPARK_PYTHON, which need not have pyspark.
SPARK_HOME=$("$python" -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))')
export PATH="$bin:$PATH" PYSPARK_PYTHON="${worker_python:-$python}" SPARK_LOCAL_IP="$host" SPARK_HOME

spark-class org.apache.spark.deploy.master.Master --host "$host" --port "$port" --webui-port "$webui" &
master=$!
ready "spark master" "$master" "http://$host:$webui/json/" "json.loads(b)['status'] == 'ALIVE'"
for i in $(seq "$n"); do
  spark-class org.apache.spark.deploy.worker.Worker "spark://$host:$port" --cores "$cores" \
    --memory "$memory" --work-dir "$work-$i" --host "$host" --webui-port 0 &
done
ready "spark workers" "$master" "http://$host:$webui/json/" "json.loads(b)['aliveworkers'] >= $n"
echo "ready: spark://$host:$port, $n workers, web UI http://$host:$webui"
wait
