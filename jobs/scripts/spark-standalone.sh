#!/usr/bin/env bash
# A Spark standalone Master and N one-core Workers on this host, from pyspark's own
# jars (no Spark distribution needed), for
#   shardline train CONFIG --set spark.master='spark://HOST:7077'
# Usage: jobs/scripts/spark-standalone.sh [N_WORKERS] [HOST]; Ctrl-C stops them all.
set -euo pipefail
n=${1:-2}; host=${2:-127.0.0.1}
bin=$(readlink -f "$(dirname "$(readlink -f "$0")")/../../.venv/bin")
export PATH="$bin:$PATH" PYSPARK_PYTHON="$bin/python" SPARK_LOCAL_IP="$host"
trap 'kill 0' EXIT INT TERM
spark-class org.apache.spark.deploy.master.Master --host "$host" --port 7077 --webui-port 8080 &
sleep 5
for i in $(seq "$n"); do
  spark-class org.apache.spark.deploy.worker.Worker "spark://$host:7077" --cores 1 --memory 1g \
    --work-dir "${TMPDIR:-/tmp}/shardline-spark-worker-$i" --host "$host" --webui-port 0 &
done
wait
