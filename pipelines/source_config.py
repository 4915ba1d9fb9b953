"""`[pipelines.source]`: where prepare reads its rows. Files (parquet, csv, json, images),
generated rows (synthetic), or a table: a Delta Lake or Apache Iceberg table read as its
live Parquet files at one pinned version, or a Spark catalog table or SQL query."""

from __future__ import annotations

import datetime as dt
from typing import Literal

from pydantic import Field, field_validator, model_validator

from shardline.foundation.section import Section

# Read through their own metadata (pipelines.tables): the version is resolved once on the
# driver and every task reads exactly that version's files.
TABLE_FORMATS = ("delta", "iceberg")
# Read through the Spark session (pipelines.frames): Spark only.
SPARK_FORMATS = ("table",)


class SyntheticSource(Section):
    """A deterministic classification dataset: each row is a pure function of its key.

    Its columns are `key`, `x0`..`x{numeric_features-1}`, `color` and `label`; a
    feature spec that leaves them out takes them from here.
    """

    rows: int = Field(200_000, ge=1, description="Rows to generate.")
    numeric_features: int = Field(8, ge=1, description="Gaussian numeric columns x0..xN-1.")
    categories: int = Field(6, ge=2, description="Levels of the categorical column `color`.")
    classes: int = Field(3, ge=2, description="Label classes.")
    noise: float = Field(0.5, ge=0, description="Label noise; 0 makes the labels separable.")
    seed: int = Field(7, description="Seed of the generating weights and noise.")
    partitions: int = Field(4, ge=1, description="Raw files to generate (one task each).")


class SourceConfig(Section):
    format: Literal["parquet", "csv", "json", "synthetic", "images", "delta", "iceberg", "table"] = Field(
        "parquet",
        description="parquet, csv, json (JSON lines), synthetic: generate raw Parquet at "
        "`path` first (only into a directory that is absent or that shardline generated), "
        "then prepare it; images: a folder of class folders, `path/<class>/*.png|jpg`, "
        "read as the columns `key` (a hash of the file's path under `path`), `path`, "
        "`label` (the class folder's name) and `image` (the file's bytes); delta: the Delta "
        "Lake table at `path` (`version` or `timestamp` pins one); iceberg: the Iceberg table "
        "`table` in `catalog` (`snapshot_id` pins one); table (Spark only): the Spark catalog "
        "table `table`, or the result of the Spark SQL `query`.",
    )
    path: str = Field(
        "shardline-data/raw",
        description="Raw input: a file, a directory of files, or a glob; a local path or a "
        "URL (file://, s3://, gs://, abfs://, hdfs://). format = 'delta': the table's root.",
    )
    on_bad_rows: Literal["fail", "drop"] = Field(
        "fail",
        description="A row that cannot be used (a value that does not parse as its column's "
        "type, a null key or label, a label outside the classes, a key seen before): fail "
        "naming file, key and column, or drop the row and report the count (of repeated "
        "keys the first in file and row order is kept).",
    )
    csv_delimiter: str = Field(",", min_length=1, max_length=1, description="CSV delimiter.")
    synthetic: SyntheticSource = Field(default_factory=SyntheticSource)
    version: int | None = Field(
        None, ge=0, description="format = 'delta': the table version to read. None: the latest "
        "(or the one `timestamp` names), resolved once when prepare starts.",
    )
    timestamp: str | None = Field(
        None,
        description="format = 'delta': read the version that was current at this time (ISO 8601, "
        "e.g. '2026-11-27T10:00:00Z', quoted or as a TOML datetime; without a zone: UTC).",
    )
    table: str | None = Field(
        None,
        description="format = 'iceberg': the table as 'namespace.name' in `catalog`; format = "
        "'table': a Spark catalog table ('db.name' or 'name').",
    )
    catalog: dict[str, str] = Field(
        default_factory=dict,
        description="format = 'iceberg': the pyiceberg catalog's properties, e.g. {type = 'sql', "
        "uri = 'sqlite:////data/catalog.db', warehouse = 's3://bucket/warehouse'}; `name` is the "
        "catalog's name (default 'default'). Every task "
        "reads the data files the driver planned, so only the driver opens the catalog.",
    )
    snapshot_id: int | None = Field(
        None, description="format = 'iceberg': the snapshot to read. None: the table's current snapshot.",
    )
    query: str | None = Field(
        None, description="format = 'table': a Spark SQL query whose result is the input (instead of `table`).",
    )

    @field_validator("timestamp", mode="before")
    @classmethod
    def _time_as_text(cls, value):
        """A TOML datetime or date (`timestamp = 2026-11-28T23:42:48Z`, unquoted, in the file
        or a --set) and a Python one (the API) are times too: kept as their ISO 8601 text."""
        if isinstance(value, (dt.datetime, dt.date)):
            return value.isoformat()
        return value

    @model_validator(mode="after")
    def _table_settings(self) -> SourceConfig:
        f = self.format
        only = {"version": "delta", "timestamp": "delta", "snapshot_id": "iceberg", "query": "table"}
        for name, fmt in only.items():
            if getattr(self, name) is not None and f != fmt:
                raise ValueError(f"{name} is a setting of format = '{fmt}' (format is '{f}')")
        if self.catalog and f != "iceberg":
            raise ValueError(f"catalog is a setting of format = 'iceberg' (format is '{f}')")
        if self.table is not None and f not in ("iceberg", "table"):
            raise ValueError(f"table is a setting of format = 'iceberg' or 'table' (format is '{f}')")
        if self.version is not None and self.timestamp is not None:
            raise ValueError("version and timestamp both pin the Delta table's version: set one")
        if self.timestamp is not None:
            self.pinned_time()
        if f == "iceberg":
            if not self.table or "." not in self.table.strip("."):
                raise ValueError("format = 'iceberg' needs table = 'namespace.name'")
            if not self.catalog:
                raise ValueError("format = 'iceberg' needs catalog = {...}, the pyiceberg catalog's "
                                 "properties (e.g. type = 'sql', uri = ..., warehouse = ...)")
        if f == "table" and (self.table is None) == (self.query is None):
            raise ValueError("format = 'table' needs either table (a Spark catalog table) or query (Spark SQL)")
        for name in ("table", "query"):
            if getattr(self, name) is not None and not getattr(self, name).strip():
                raise ValueError(f"{name} is empty")
        return self

    @property
    def reads_path(self) -> bool:
        """Whether `path` is read (an Iceberg table or a Spark table or query has none)."""
        return self.format not in ("iceberg", "table")

    def describe(self) -> str:
        """The input as the console names it."""
        if self.format == "synthetic":
            return f"{self.synthetic.rows:,} synthetic rows"
        if self.format == "delta":
            pin = f" version {self.version}" if self.version is not None else \
                f" at {self.timestamp}" if self.timestamp is not None else ""
            return f"Delta table {self.path}{pin}"
        if self.format == "iceberg":
            pin = f" snapshot {self.snapshot_id}" if self.snapshot_id is not None else ""
            return f"Iceberg table {self.table}{pin}"
        if self.format == "table":
            return f"Spark table {self.table}" if self.table is not None else "a Spark SQL query"
        return self.path

    def pinned_time(self) -> dt.datetime | None:
        """`timestamp` as an aware datetime (UTC when it names no zone)."""
        if self.timestamp is None:
            return None
        try:
            t = dt.datetime.fromisoformat(self.timestamp.strip())
        except ValueError:
            raise ValueError(f"timestamp {self.timestamp!r} is not an ISO 8601 time "
                             "(e.g. '2026-11-27T10:00:00Z')") from None
        return t if t.tzinfo is not None else t.replace(tzinfo=dt.timezone.utc)
