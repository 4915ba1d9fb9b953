"""Config owned by `pipelines`: the engines and the prepare stage.

Every field has a default that works on the embedded local engines.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Section(BaseModel):
    """Base for every config section: unknown keys are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class SparkConfig(Section):
    master: str = Field(
        "local[2]",
        description="Spark master URL. Ignored when spark-submit already set one.",
    )
    app_name: str = Field("shardline", description="Spark application name.")
    shuffle_partitions: int = Field(
        4, ge=1, description="spark.sql.shuffle.partitions; small is right for small data."
    )
    conf: dict[str, str] = Field(
        default_factory=dict, description="Extra Spark settings, passed as they are."
    )


class SyntheticSource(Section):
    """A deterministic classification dataset: each row is a pure function of its key."""

    rows: int = Field(200_000, ge=1, description="Rows to generate.")
    numeric_features: int = Field(8, ge=1, description="Gaussian numeric columns x0..xN-1.")
    categories: int = Field(6, ge=2, description="Levels of the categorical column `color`.")
    classes: int = Field(3, ge=2, description="Label classes.")
    noise: float = Field(0.5, ge=0, description="Label noise; 0 makes the labels separable.")
    seed: int = Field(7, description="Seed of the generating weights and noise.")
    partitions: int = Field(4, ge=1, description="Spark partitions (= raw files) to generate.")


class SourceConfig(Section):
    format: Literal["synthetic", "parquet"] = Field(
        "synthetic",
        description="synthetic: generate raw Parquet at `path` first, then prepare it.",
    )
    path: str = Field("shardline-data/raw", description="Raw input directory or file.")
    synthetic: SyntheticSource = Field(default_factory=SyntheticSource)


class FeatureSpec(Section):
    key: str = Field("key", description="Stable integer key; the split is a hash of it.")
    label: str = Field("label", description="Integer class label 0..K-1.")
    numeric: list[str] = Field(
        default_factory=lambda: [f"x{i}" for i in range(8)],
        description="Numeric columns, standardised with train-split statistics.",
    )
    categorical: list[str] = Field(
        default_factory=lambda: ["color"],
        description="Categorical columns, indexed by train-split frequency; 0 is unknown.",
    )

    @model_validator(mode="after")
    def _distinct(self) -> FeatureSpec:
        cols = [self.key, self.label, *self.numeric, *self.categorical]
        dup = sorted({c for c in cols if cols.count(c) > 1})
        if dup:
            raise ValueError(f"column(s) used twice in the feature spec: {', '.join(dup)}")
        if not self.numeric and not self.categorical:
            raise ValueError("the feature spec names no numeric or categorical column")
        return self


class SplitConfig(Section):
    train: float = Field(0.8, ge=0, le=1, description="Fraction of keys in train.")
    val: float = Field(0.1, ge=0, le=1, description="Fraction of keys in val.")
    test: float = Field(0.1, ge=0, le=1, description="Fraction of keys in test.")

    @model_validator(mode="after")
    def _sums_to_one(self) -> SplitConfig:
        total = self.train + self.val + self.test
        if not math.isclose(total, 1.0, abs_tol=1e-9):
            raise ValueError(f"split fractions must sum to 1, got {total:g}")
        if self.train == 0:
            raise ValueError("split.train must be > 0: statistics are fitted on it")
        return self


class LayoutConfig(Section):
    world_size: int = Field(
        2, ge=1, description="Ranks the shards are laid out for: shard count is a multiple of it."
    )
    target_shard_bytes: int = Field(
        32 * 2**20, ge=1024, description="Aimed-for Parquet bytes per shard."
    )
    rows_per_row_group: int = Field(16_384, ge=1, description="Parquet row group size.")


class PipelineConfig(Section):
    dataset_dir: str = Field(
        "shardline-data/dataset", description="Prepared dataset: shards + manifest.json."
    )
    source: SourceConfig = Field(default_factory=SourceConfig)
    features: FeatureSpec = Field(default_factory=FeatureSpec)
    split: SplitConfig = Field(default_factory=SplitConfig)
    layout: LayoutConfig = Field(default_factory=LayoutConfig)
