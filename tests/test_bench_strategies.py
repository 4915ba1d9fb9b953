"""`shardline bench strategies` at a tiny size: every row's figures are there and keep
their relations (no timing claims)."""

from __future__ import annotations

import json

import pytest

from benchmarks.strategies import CONFIGS, run


def test_bench_strategies_tiny():
    only = ["pipeline-1f1b", "ps-async", "tensor"]
    result = run(progress=lambda msg: None, steps=2, warmup=1, global_batch=32, only=only)
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
