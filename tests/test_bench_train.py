"""`shardline bench train` at a tiny size: every figure is there and keeps its relations
(a ratio is the quotient of the two figures it names); nothing is claimed about speed.

Full tier only (`make test-all`, marker `slow`): the benchmark starts torchrun and TorchDistributor
processes beside its Spark job (about 70 CPU-s).
"""

from __future__ import annotations

import json

import pytest

from .bench_figures import assert_quotient

pytestmark = pytest.mark.slow


def test_bench_train_tiny(spark, prepared, tmp_path):
    # `spark`: the session's own SparkSession, which the benchmark's spark_session reuses;
    # `prepared`: the session's small dataset (2 ranks), so nothing is prepared here.
    from shardline.benchmarks.train import run

    result = run(workdir=str(tmp_path), progress=lambda msg: None, dataset_dir=prepared.dataset_dir,
                 steps=6, warmup=2, allreduce_iters=5, hidden=[32], rounds=1)
    json.dumps(result)  # one JSON object
    assert result["benchmark"] == "train"
    assert result["world_size"] == 2
    assert 0 < result["train_rows"] < result["rows"]
    # Timed: the steps after the first (launch) and the warm-up.
    assert result["steps_timed"] == result["steps"] - 1 - result["warmup_steps"] > 0 and result["rounds"] == 1
    step, launch, ar = result["step_s"], result["launch_to_first_step_s"], result["allreduce"]
    assert set(step) == set(result["steps_per_s"]) == {"spark", "torchrun"}
    assert set(launch) == {"spark", "torch_distributor", "torchrun"}
    for k in step:
        # The fastest round is the one reported, and a rate is the inverse of its step time.
        assert step[k] == min(result["step_s_by_round"][k]) and len(result["step_s_by_round"][k]) == 1
        assert_quotient(result["steps_per_s"][k], 1.0, step[k], f"steps_per_s[{k}]")
    assert_quotient(result["step_time_ratio"], step["torchrun"], step["spark"], "step_time_ratio")
    assert_quotient(result["launch_ratio"], launch["torch_distributor"], launch["spark"], "launch_ratio")
    assert launch["torchrun"] > 0
    # All-reduce: bytes/s are the gradient's bytes over each time, the ratio their quotient.
    assert ar["bytes"] == result["model"]["grad_bytes"] > 0 and ar["buckets"] >= 1
    assert_quotient(ar["ddp_bytes_per_s"], ar["bytes"], ar["ddp_comm_s_per_step"], "ddp_bytes_per_s")
    assert_quotient(ar["raw_bytes_per_s"], ar["bytes"], ar["raw_allreduce_s"], "raw_bytes_per_s")
    assert_quotient(ar["ddp_in_flight_bytes_per_s"], ar["bytes"], ar["ddp_in_flight_s_per_step"],
                    "ddp_in_flight_bytes_per_s")
    assert_quotient(result["allreduce_ratio"], ar["ddp_bytes_per_s"], ar["raw_bytes_per_s"], "allreduce_ratio")
    # Waiting for the peer only adds to the time an all-reduce is in flight.
    assert ar["ddp_in_flight_s_per_step"] >= ar["ddp_comm_s_per_step"]
