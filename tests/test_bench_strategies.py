"""`shardline bench strategies` at a tiny size: every row's figures are there and keep
their relations (no timing claims).

Full tier only (`make test-all`, marker `slow`): the benchmark launches every strategy's ranks, up
to 4 on 2 cores, for its rounds.
"""

from __future__ import annotations

import json

import pytest

from shardline.benchmarks.strategies import CONFIGS, MEMORY_CONFIGS, run

pytestmark = pytest.mark.slow


def test_bench_strategies_tiny():
    only = ["pipeline-1f1b", "ps-async", "tensor", "hsdp2x2"]
    result = run(progress=lambda msg: None, steps=2, warmup=1, global_batch=32, only=only, memory_hidden=[32, 32],
                 timeout_s=120)
    json.dumps(result)  # one JSON object
    rows = result["strategies"]
    assert list(rows) == [n for n in CONFIGS if n in ["single", *only]]
    single = rows["single"]["samples_per_s"]
    for name, row in rows.items():
        assert row["samples_per_s"] > 0, name
        # The ratio is the quotient of this row's samples/s and the single process's.
        assert row["ratio_vs_single"] == pytest.approx(row["samples_per_s"] / single, rel=1e-12), name
        assert len(row["peak_mb_per_rank"]) == row["world_size"] == CONFIGS[name][0]
    # 2 stages, 4 micro-batches: the formula (p-1)/(m+p-1); the measurement is a fraction.
    assert rows["pipeline-1f1b"]["pipeline_bubble_formula"] == pytest.approx((2 - 1) / (4 + 2 - 1))
    assert 0 <= rows["pipeline-1f1b"]["pipeline_bubble"] < 1
    assert rows["ps-async"]["ps_staleness_max"] >= 0
    # DDP, FSDP and HSDP's memory per rank on the memory model, against DDP's.
    memory = result["memory"]
    assert list(memory["strategies"]) == list(MEMORY_CONFIGS) and memory["baseline"] == "ddp"
    grew = max(memory["strategies"]["ddp"]["peak_mb_per_rank"]) > 0  # a tiny model may not
    assert memory["strategies"]["ddp"]["peak_vs_ddp"] == (1.0 if grew else None)
    for name, row in memory["strategies"].items():
        assert len(row["peak_mb_per_rank"]) == row["world_size"] == MEMORY_CONFIGS[name][0]
        assert row["samples_per_s"] > 0 and (row["peak_vs_ddp"] >= 0 if grew else True), name
        # The total is the growth plus the idle rank's RSS it grew from (rounded apart).
        for growth, total, base in zip(row["peak_mb_per_rank"], row["peak_total_mb_per_rank"],
                                       row["base_mb_per_rank"]):
            assert total == pytest.approx(base + growth, abs=0.2) and base > 0, name
        ddp_total = max(memory["strategies"]["ddp"]["peak_total_mb_per_rank"])
        assert row["peak_total_vs_ddp"] == pytest.approx(max(row["peak_total_mb_per_rank"]) / ddp_total), name
