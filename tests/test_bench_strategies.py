"""`shardline bench strategies` at a tiny size: every row's figures are there (no timing claims)."""

from __future__ import annotations

import json

from benchmarks.strategies import CONFIGS, run


def test_bench_strategies_tiny():
    only = ["pipeline-1f1b", "ps-async", "tensor"]
    result = run(progress=lambda msg: None, steps=2, warmup=1, global_batch=32, only=only)
    json.dumps(result)  # one JSON object
    rows = result["strategies"]
    assert list(rows) == [n for n in CONFIGS if n in ["single", *only]]
    for name, row in rows.items():
        assert row["samples_per_s"] > 0 and row["ratio_vs_single"] > 0, name
        assert len(row["peak_mb_per_rank"]) == row["world_size"] == CONFIGS[name][0]
    assert rows["single"]["ratio_vs_single"] == 1.0
    # 2 stages, 4 micro-batches: the formula is 1/5; the measurement is a fraction.
    assert rows["pipeline-1f1b"]["pipeline_bubble_formula"] == 1 / 5
    assert 0 <= rows["pipeline-1f1b"]["pipeline_bubble"] < 1
    assert rows["ps-async"]["ps_staleness_max"] >= 0
