"""Entry point for spark-submit: the same commands as `shardline`, on the submitted master.

    PYSPARK_PYTHON=.venv/bin/python PYSPARK_DRIVER_PYTHON=.venv/bin/python \
    .venv/bin/spark-submit --master spark://host:7077 --conf spark.executor.cores=1 \
        jobs/spark_submit.py run jobs/configs/quickstart.toml

Under spark-submit the session (and its --master) exists before our code runs;
pipelines.engines.spark_session reuses it instead of overriding the master, and
ships pipelines/training/serving to the executors itself (no --py-files needed).
"""

from jobs.cli import main

if __name__ == "__main__":
    main()
