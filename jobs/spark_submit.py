"""Entry point for spark-submit: the same commands as `shardline`, on the submitted master.

    spark-submit --master spark://host:7077 --conf spark.executor.cores=1 \
        --py-files shardline-packages.zip jobs/spark_submit.py run jobs/configs/quickstart.toml

Under spark-submit the session (and its --master) exists before our code runs;
pipelines.engines.spark_session reuses it instead of overriding the master.
"""

from jobs.cli import main

if __name__ == "__main__":
    main()
