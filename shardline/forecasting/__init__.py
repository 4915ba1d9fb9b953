"""The cost of a run before it starts (`shardline plan --hosts H --cores C`): prepare, an
epoch and scoring, in wall time, driver memory and per-worker memory, on H hosts x C cores.

measure: per-core rates on a sample of the user's own data (seconds); model: the pure
forecast from those rates and each engine's costs (costs); the result is printed, stored
beside the dataset (pipelines.manifest.FORECAST_NAME) and logged to MLflow by the next
training run (training.tracking.log_forecast).
"""

from __future__ import annotations

import json

from shardline.foundation import storage
from shardline.foundation.errors import ShardlineError
from shardline.pipelines.manifest import FORECAST_NAME, check_dataset_dir

from .measure import Measured, measure
from .model import Cluster, Forecast, forecast
from .sample import SAMPLE_ROWS

__all__ = ["Cluster", "Forecast", "Measured", "SAMPLE_ROWS", "forecast", "measure", "store"]


def store(f: Forecast, m: Measured, dataset_dir: str) -> str | None:
    """The forecast (and what it was made from) as dataset_dir/FORECAST_NAME, for the next
    training run's MLflow run; None when dataset_dir holds something not shardline's."""
    try:
        check_dataset_dir(dataset_dir)
    except ShardlineError:
        return None
    url = storage.join(dataset_dir, FORECAST_NAME)
    storage.write_bytes(url, json.dumps(to_json(f, m)).encode())
    return url


def to_json(f: Forecast, m: Measured) -> dict:
    return {**f.model_dump(mode="json"), "total_s": f.total_s, "measured": m.model_dump(mode="json")}
