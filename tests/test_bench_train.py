"""`shardline bench train` at a tiny size: the figures are there and positive (no timing claims)."""

from __future__ import annotations

import json


def test_bench_train_tiny(spark, prepared, tmp_path):
    # `spark`: the session's own SparkSession, which the benchmark's spark_session reuses;
    # `prepared`: the session's small dataset (2 ranks), so nothing is prepared here.
    from benchmarks.train import run

    result = run(workdir=str(tmp_path), progress=lambda msg: None, dataset_dir=prepared.dataset_dir,
                 steps=6, warmup=2, allreduce_iters=5, hidden=[32], rounds=1)
    json.dumps(result)  # one JSON object
    assert result["benchmark"] == "train"
    assert result["world_size"] == 2
    assert 0 < result["train_rows"] < result["rows"]
    assert set(result["step_s"]) == set(result["steps_per_s"]) == {"spark", "torchrun"}
    assert {k: len(v) for k, v in result["step_s_by_round"].items()} == {"spark": 1, "torchrun": 1}
    assert set(result["launch_to_first_step_s"]) == {"spark", "torch_distributor", "torchrun"}
    ar = result["allreduce"]
    figures = [*result["step_s"].values(), *result["steps_per_s"].values(),
               *result["launch_to_first_step_s"].values(), result["model"]["grad_bytes"],
               ar["bytes"], ar["buckets"], ar["ddp_comm_s_per_step"], ar["raw_allreduce_s"],
               ar["ddp_in_flight_s_per_step"], ar["ddp_in_flight_bytes_per_s"],
               ar["ddp_bytes_per_s"], ar["raw_bytes_per_s"], result["steps_timed"],
               result["step_time_ratio"], result["launch_ratio"], result["allreduce_ratio"]]
    assert all(isinstance(v, (int, float)) and v > 0 for v in figures)
    assert ar["bytes"] == result["model"]["grad_bytes"]
    # Waiting for the peer only adds to the time an all-reduce is in flight.
    assert ar["ddp_in_flight_s_per_step"] >= ar["ddp_comm_s_per_step"]
