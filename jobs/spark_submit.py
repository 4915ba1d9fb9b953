"""Entry point for spark-submit: the same commands as `shardline`, on the submitted master.

    PYSPARK_PYTHON=$PWD/.venv/bin/python PYSPARK_DRIVER_PYTHON=$PWD/.venv/bin/python \
    SPARK_LOCAL_IP=127.0.0.1 \
    .venv/bin/spark-submit --master spark://host:7077 --conf spark.executor.cores=1 \
        --driver-java-options "-Dlog4j2.configurationFile=file:$PWD/shardline/foundation/log4j2.properties" \
        jobs/spark_submit.py run jobs/configs/quickstart.toml

Under spark-submit the JVM (with its --master and --conf) exists before our code
runs: foundation.spark_setup keeps every setting spark-submit was given and fills
in only session settings left unset; what the JVM reads at start (bind address,
log configuration) is given to spark-submit as above. Our packages are shipped
to the executors by shardline itself (no --py-files needed).
"""

from shardline.jobs.cli import main

if __name__ == "__main__":
    main()
