"""Benchmarks: each prints its figure beside a baseline measured in the same run."""

from pathlib import Path

from shardline.engines import DaskEngine
from shardline.foundation.engine_config import DaskConfig
from shardline.foundation.sessions import dask_client
from shardline.pipelines.config import PipelineConfig

# Imported inside the functions that use them: pipelines.prepare (imports pandas).


def significant(x: float, digits: int = 4) -> float:
    """`x` to `digits` significant digits, whatever its scale: a figure keeps its precision
    (round(x, 3) turns a 0.4 ms timing or a 0.0004 ratio into 0 and breaks rate = n / s)."""
    return float(f"{x:.{digits}g}")


def synthetic_pipeline(root: Path, rows: int, partitions: int = 4, world_size: int = 2) -> PipelineConfig:
    """The pipeline section a benchmark prepares its data with: `rows` synthetic rows under `root`."""
    return PipelineConfig.model_validate(
        {
            "dataset_dir": str(root / "dataset"),
            "source": {"format": "synthetic", "path": str(root / "raw"),
                       "synthetic": {"rows": rows, "partitions": partitions}},
            "layout": {"world_size": world_size},
        }
    )


def prepare_with_dask(cfg: PipelineConfig, progress=print):
    """Generate and prepare `cfg` on an embedded Dask cluster, closed after; the manifest."""
    from shardline.pipelines.prepare import prepare

    client = dask_client(DaskConfig())
    try:
        progress(f"generating and preparing {cfg.source.synthetic.rows:,} rows (Dask)")
        return prepare(DaskEngine(client), cfg)
    finally:
        cluster = client.cluster
        client.close()
        cluster.close()
