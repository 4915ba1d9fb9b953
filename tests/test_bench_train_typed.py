"""`shardline bench train --images` and `--tokens` at a tiny size: every figure is there and keeps
its relations (a rate is its count over its own seconds, a ratio the quotient of the two
figures it names, `met` agrees with its ratio and target); nothing is claimed about speed."""

from __future__ import annotations

import json

import pytest

from .bench_figures import assert_met, assert_quotient
from .conftest import shardline_here


def _legs_keep_their_relations(result: dict, legs: set[str], count: float, rate: str, per_cpu: str) -> None:
    secs, rates, cpu = result["seconds"], result[rate], result["cpu_seconds"]
    assert set(secs) == set(rates) == set(cpu) == set(result[per_cpu]) == legs
    for k in legs:
        assert_quotient(rates[k], count, secs[k], f"{rate}[{k}]")
        assert_quotient(result[per_cpu][k], count, cpu[k], f"{per_cpu}[{k}]")
    assert len(result["load_average"]) == 2 and result["cores"] >= 1


@pytest.mark.slow
def test_bench_train_images_tiny(spark, tmp_path):
    from shardline.benchmarks.train_images import BAD_ROW_GROUP, run

    result = run(workdir=str(tmp_path), progress=lambda msg: None, steps=2, warmup=1, global_batch=16,
                 num_workers=(0, 1), rounds=1, spark=spark)
    json.dumps(result)  # one JSON object
    assert result["benchmark"] == "train-images" and result["world_size"] == 2
    legs = {"shardline_local", "shardline_spark", "shardline_bad_layout", "torchvision"}
    _legs_keep_their_relations(result, legs, 16 * 2, "images_per_s", "images_per_cpu_s")
    ips, cpu = result["images_per_s"], result["images_per_cpu_s"]
    # The best num_workers is the one reported, and every one tried is listed.
    assert result["rounds"] == 1
    for k, runs in result["images_per_s_by_round"].items():  # the fastest round counts
        assert ips[k] == max(runs) and len(runs) == 1, k
    by = result["torchvision_by_workers"]
    assert set(by) == {"0", "1"} and ips["torchvision"] == max(by.values())
    assert {k: max(v) for k, v in result["torchvision_by_workers_by_round"].items()} == by
    assert by[str(result["torchvision_num_workers"])] == ips["torchvision"]
    ratio = result["ratio"]
    assert_quotient(ratio["vs_torchvision"], ips["shardline_local"], ips["torchvision"], "vs_torchvision")
    assert_quotient(ratio["spark_vs_torchvision"], ips["shardline_spark"], ips["torchvision"], "spark")
    assert_quotient(ratio["bad_layout_vs_planned"], ips["shardline_bad_layout"], ips["shardline_local"], "bad")
    assert_quotient(ratio["per_cpu_vs_torchvision"], cpu["shardline_local"], cpu["torchvision"], "per cpu")
    t, met = result["targets"], result["met"]
    assert_met(met["vs_torchvision"], ratio["vs_torchvision"], t["vs_torchvision"], "vs_torchvision")
    wait = result["data_wait"]
    assert set(wait) == {"planned", "planned_spark", "bad_layout", "torchvision"}
    assert all(0 <= w <= 1 for w in wait.values())
    assert met["data_wait"] == (wait["planned"] <= t["data_wait"])
    # The planned layout is the plan's; the bad one has one row group per shard.
    planned, bad = result["layouts"]["planned"], result["layouts"]["bad"]
    assert planned["rows_per_row_group"] == result["plan"]["rows_per_row_group"] < BAD_ROW_GROUP
    assert bad["rows_per_row_group"] == BAD_ROW_GROUP and bad["row_groups"] == bad["train_shards"]
    assert planned["train_rows"] == bad["train_rows"] == result["images"]
    f = result["first_epoch"]
    assert f["shardline_s"] == pytest.approx(f["prepare_s"] + f["train_s"], rel=2e-3)
    assert_quotient(f["torchvision_vs_shardline"], f["torchvision_s"], f["shardline_s"], "first epoch")
    assert list(tmp_path.iterdir()) == []  # its scratch folder is gone


@pytest.mark.slow
def test_bench_train_tokens_tiny(spark, tmp_path):
    from shardline.benchmarks.train_tokens import LENGTH, run

    result = run(workdir=str(tmp_path), progress=lambda msg: None, steps=2, warmup=1, global_batch=8,
                 rounds=2, spark=spark)
    json.dumps(result)
    assert result["benchmark"] == "train-tokens" and result["sequence_length"] == LENGTH
    _legs_keep_their_relations(result, {"shardline", "memmap"}, 8 * LENGTH * 2, "tokens_per_s", "tokens_per_cpu_s")
    tps, cpu, ratio = result["tokens_per_s"], result["tokens_per_cpu_s"], result["ratio"]
    assert result["rounds"] == 2
    for k, runs in result["tokens_per_s_by_round"].items():  # the fastest of the two rounds counts
        assert tps[k] == max(runs) and len(runs) == 2, k
    assert_quotient(ratio["vs_memmap"], tps["shardline"], tps["memmap"], "vs_memmap")
    assert_quotient(ratio["per_cpu_vs_memmap"], cpu["shardline"], cpu["memmap"], "per cpu")
    assert_met(result["met"]["vs_memmap"], ratio["vs_memmap"], result["targets"]["vs_memmap"], "vs_memmap")
    assert set(result["data_wait"]) == {"shardline", "memmap"}
    assert result["met"]["data_wait"] == (result["data_wait"]["shardline"] <= result["targets"]["data_wait"])
    assert result["layout"]["train_rows"] == result["rows"]
    assert list(tmp_path.iterdir()) == []


def test_bench_train_takes_one_of_images_and_tokens(tmp_path):
    proc = shardline_here("bench", "train", "--images", "--tokens", cwd=tmp_path)
    assert proc.returncode == 2 and "--images, --tokens and --loop are three benchmarks: give one" in proc.stderr
    assert list(tmp_path.iterdir()) == []
