"""Config owned by `serving`: batch scoring."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from shardline.foundation.section import Section


class ServingConfig(Section):
    model_uri: str | None = Field(
        None,
        description="MLflow model URI (models:/name/3, models:/name@alias, runs:/id/model); "
        "`shardline run` scores the model it just registered.",
    )
    split: str = Field("test", description="Split of the prepared dataset to score.")
    output_dir: str = Field(
        "shardline-data/scores",
        description="Scored output: a folder of Parquet files per model version, or with output_format = "
        "'delta' the root of a Delta table (created by the first run).",
    )
    output_format: Literal["parquet", "delta"] = Field(
        "parquet",
        description="parquet: OUTPUT/model=NAME/version=V/scores-*.parquet. delta: each run appends its rows "
        "to the Delta table at output_dir in one transaction, exactly once per input file and model version "
        "(Delta's idempotent transaction id: app id `shardline-score NAME VERSION` and a version).",
    )
    batch_size: int = Field(4096, ge=1, description="Rows per model call.")
    threads_per_task: int = Field(
        1,
        ge=1,
        description="torch threads per scoring task. Spark runs one task per core "
        "(spark.task.cpus = 1) and a Dask worker one per thread, so 1 keeps the cores "
        "from being oversubscribed; raise it with spark.task.cpus.",
    )
    engine: Literal["spark", "dask"] = Field("spark", description="Engine that runs the scoring tasks.")
    allow_pickled_models: bool = Field(
        False,
        description="Score a model with MLflow's `pytorch` flavour (logged by other code with "
        "mlflow.pytorch.log_model): loading one unpickles it, which runs any code its writer put in "
        "it on every scoring worker. Off: such a model is refused in one line. shardline's own "
        "models (safetensors weights and a factory's import path) never need it.",
    )
    incremental: bool = Field(
        False,
        description="Score only input files the output's ledger does not hold yet, adding to "
        "an output that holds other inputs' scores (for scheduled runs).",
    )
    backfill: Literal["all", "new"] = Field(
        "new",
        description="In an incremental (scheduled) run, when a model version scores an output "
        "that earlier versions of the model scored (the alias moved): 'new' scores only input "
        "files no version has scored yet; "
        "'all' also every file earlier versions scored and this one has not. Each version "
        "writes its own OUTPUT/model=NAME/version=V/; earlier versions' scores are kept. A run that "
        "is not incremental scores every input file its version has not scored.",
    )
