"""A driver for the code-travel tests, run as a process of its own (a Connect client, or
under spark-submit): in ONE Spark session, for each value, write the user's package with
that value into the working folder, find it as shardline finds a user's package (the
folder the command runs from is on the import path), and run a barrier stage through
shardline's launcher whose ranks import it. Prints one `RESULT <json>` line per stage:
each rank's value, the file it imported and its process id.

    python tests/user_code_client.py --remote sc://... --world-size 2 --values 1,2
    spark-submit --master spark://... tests/user_code_client.py --world-size 1 --values 1,2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `tests`, when run as a script

from shardline.foundation.engine_config import SparkConfig  # noqa: E402
from shardline.foundation.sessions import spark_session  # noqa: E402
from shardline.engines.spark.launch import launch_spark_barrier  # noqa: E402
from shardline.foundation.code_travel import snapshot  # noqa: E402
from shardline.training.user_code import user_code_folders  # noqa: E402
from tests.user_code_helpers import MODULE, value_rank, write_package  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--remote")
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--values", default="1,2")
    args = parser.parse_args()
    spark = spark_session(SparkConfig(remote=args.remote) if args.remote else SparkConfig())
    try:
        for value in [int(v) for v in args.values.split(",")]:
            write_package(Path(os.getcwd()), value)
            folders = user_code_folders([f"{MODULE}:value"], [])
            assert folders == [os.path.join(os.getcwd(), "shipped_pkg")], folders
            ranks = launch_spark_barrier(spark, value_rank(), MODULE, args.world_size, 300, code=snapshot(folders))
            print("RESULT " + json.dumps(ranks), flush=True)
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
