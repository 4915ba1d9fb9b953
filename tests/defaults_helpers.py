"""A small dataset of a user's own (300 rows, fewer than the default global batch),
prepared once per module with Dask: the data #16's safe-default tests start from."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardline.pipelines.config import PipelineConfig

ROWS = 300
FEATURES = {"key": "key", "label": "label", "numeric": ["a", "b", "c"], "categorical": []}


@pytest.fixture(scope="module")
def small_dataset(dask_client, tmp_path_factory) -> PipelineConfig:
    from shardline.engines import DaskEngine
    from shardline.pipelines.prepare import prepare

    tmp = tmp_path_factory.mktemp("small")
    rng = np.random.default_rng(5)
    x = rng.normal(size=(ROWS, 3))
    (tmp / "raw").mkdir()
    pq.write_table(pa.table({
        "key": np.arange(ROWS, dtype=np.int64), "a": x[:, 0], "b": x[:, 1], "c": x[:, 2],
        "label": (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.5).astype(np.int64),
    }), tmp / "raw" / "part-0.parquet")
    cfg = PipelineConfig.model_validate({
        "engine": "dask", "dataset_dir": str(tmp / "dataset"),
        "source": {"format": "parquet", "path": str(tmp / "raw")},
        "features": FEATURES, "layout": {"world_size": 2},
    })
    prepare(DaskEngine(dask_client), cfg)
    return cfg


def tree(root: Path) -> dict[str, tuple]:
    """Every file under `root` by its bytes (size, mtime, sha256) and every folder: what
    "nothing written or lost" compares (a folder made and left empty counts too)."""
    import hashlib

    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            if p.is_file() else "folder" for p in sorted(root.rglob("*"))}
