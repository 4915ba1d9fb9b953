"""Config owned by `pipelines`: the prepare stage (the engines' sections are
`shardline.foundation.engine_config`).

Every field has a default that works on the embedded local engines.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, field_validator, model_validator

from shardline.foundation.section import Section
from .source_config import SourceConfig, SyntheticSource  # noqa: F401 (their home before)


# Text that means "no value", compared case-insensitively after trimming whitespace.
# The common spellings of missing values in CSV exports (pandas, R, SQL dumps, Excel).
DEFAULT_NULL_VALUES = ["", "na", "n/a", "null", "none", "nan"]


TENSOR_DTYPES = ("uint8", "int32", "int64", "float16", "bfloat16", "float32")
# Names the loader's batches use for the tabular vector and the label.
RESERVED_COLUMNS = ("features", "label")


class TensorColumn(Section):
    """A fixed-shape tensor column, stored in its own dtype (no widening to float32).

    Raw values: nested lists (Parquet list columns; JSON arrays, also as text in CSV and
    JSON) of exactly `shape`. A 1-D integer sequence may be shorter (`pad_id`) or longer
    (`truncate`) than its declared length: token ids."""

    dtype: Literal["uint8", "int32", "int64", "float16", "bfloat16", "float32"] = Field(
        description="Element type, kept in the shards and in the loader's tensors."
    )
    shape: list[int] = Field(min_length=1, description="Fixed shape of one row's tensor.")
    pad_id: int | None = Field(
        None,
        description="1-D integer sequences only: a sequence shorter than shape[0] is padded "
        "with this id to the declared length. None: it must have exactly that length.",
    )
    truncate: bool = Field(
        False, description="1-D sequences only: cut a longer sequence to the declared length."
    )
    pack: bool = Field(
        False,
        description="1-D sequences only: a row's value is a list of sequences (documents), "
        "packed end to end into one row of the declared length (with pad_id / truncate).",
    )
    vocab_size: int | None = Field(
        None, ge=1, description="Integer dtypes: an id at or above it (or below 0) is bad input."
    )

    @model_validator(mode="after")
    def _valid(self) -> TensorColumn:
        if any(d < 1 for d in self.shape):
            raise ValueError(f"shape {self.shape}: every dimension must be >= 1")
        sequence = self.pad_id is not None or self.truncate or self.pack
        if sequence and (len(self.shape) != 1 or self.dtype not in ("uint8", "int32", "int64")):
            raise ValueError("pad_id, truncate and pack are for 1-D integer (token id) tensors")
        if self.vocab_size is not None and self.dtype not in ("uint8", "int32", "int64"):
            raise ValueError("vocab_size is for integer tensors")
        bits = {"uint8": (0, 255), "int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
        if self.pad_id is not None and not bits[self.dtype][0] <= self.pad_id <= bits[self.dtype][1]:
            raise ValueError(f"pad_id {self.pad_id} does not fit dtype {self.dtype}")
        if self.pad_id is not None and self.vocab_size is not None and not 0 <= self.pad_id < self.vocab_size:
            raise ValueError(f"pad_id {self.pad_id} is outside the vocabulary 0..{self.vocab_size - 1}")
        return self


class ImageColumn(Section):
    """Encoded images (PNG or JPEG bytes, or paths to image files), kept encoded in the
    shards; the loader's threads decode them to uint8 [C, H, W]."""

    shape: list[int] = Field(
        min_length=3, max_length=3, description="[C, H, W]: C = 1 (gray), 3 (RGB) or 4 (RGBA)."
    )
    resize: bool = Field(
        False,
        description="Resize images of another size to H x W when the loader decodes them. "
        "False: an image of another size is bad input.",
    )

    @model_validator(mode="after")
    def _valid(self) -> ImageColumn:
        c, h, w = self.shape
        if c not in (1, 3, 4):
            raise ValueError(f"image shape {self.shape}: channels must be 1, 3 or 4")
        if h < 1 or w < 1:
            raise ValueError(f"image shape {self.shape}: height and width must be >= 1")
        return self


class FeatureSpec(Section):
    """Which columns are what. Nothing defaults to a column name: a setting left out is
    inferred from the input's schema (and printed), or is an error when it cannot be."""

    key: str | None = Field(
        None,
        description="Stable integer key column; the split is a hash of it. Required, "
        "unless generate_key (then the generated column's name, default `key`) or a "
        "synthetic source (its `key`).",
    )
    generate_key: bool = Field(
        False,
        description="The input has no key: make `key` a 63-bit hash of the row's parsed "
        "values (label and features). Stable across re-runs, engines and appends; two "
        "identical rows get one key (a repeated key: see source.on_bad_rows).",
    )
    label: str | None = Field(
        None,
        description="Label column. Required, except for a synthetic source (its `label`) and "
        "task = 'next_token' (there: the token tensor column; left out, the only integer "
        "tensor column with a vocab_size).",
    )
    numeric: list[str] | None = Field(
        None,
        description="Numeric columns, standardised with train-split statistics. Left out: "
        "every numeric column no other setting names (CSV: columns whose values all parse "
        "as numbers in the first 1,000 rows).",
    )
    categorical: list[str] | None = Field(
        None,
        description="Categorical columns, indexed by train-split frequency; 0 is unknown. "
        "Left out: every text column no other setting names.",
    )
    categorical_encoding: Literal["index", "hash"] = Field(
        "index",
        description="index: vocabulary fitted on train, unseen values -> 0; "
        "hash: a stable hash into `hash_buckets` (no vocabulary; for huge cardinality).",
    )
    hash_buckets: int = Field(1024, ge=1, description="Buckets of the hash encoding.")
    vectors: dict[str, int] = Field(
        default_factory=dict,
        description="Fixed-length float vector columns and their lengths (list<float>); "
        "passed through unscaled. Never inferred.",
    )
    tensors: dict[str, TensorColumn] = Field(
        default_factory=dict,
        description="Fixed-shape tensor columns: name = {dtype, shape} (token ids: int32 with "
        "pad_id / truncate / vocab_size). Never inferred.",
    )
    images: dict[str, ImageColumn] = Field(
        default_factory=dict,
        description="Encoded image columns (PNG/JPEG bytes, or paths to image files, relative "
        "to the raw file's folder): name = {shape = [C, H, W]}. Never inferred.",
    )
    task: Literal["classification", "regression", "next_token"] = Field(
        "classification",
        description="classification: integer labels 0..K-1 (or the names in `classes`); "
        "regression: a float label; next_token: a language model's task, no label column: "
        "the target is the token sequence itself (`label` names its tensor column, which "
        "declares a vocab_size), predicted one position ahead.",
    )
    classes: int | list[str] | None = Field(
        None,
        description="Classification only. A count K: labels are integers 0..K-1; a list of "
        "names: labels are those names, indexed in list order. A label outside them is a bad "
        "row. Left out: K = largest label + 1, inferred on the first prepare and printed; "
        "appends keep the dataset's classes.",
    )
    null_values: list[str] = Field(
        default_factory=lambda: list(DEFAULT_NULL_VALUES),
        description="Text read as null in every column and format (CSV, JSON, Parquet text "
        "columns), compared case-insensitively after trimming whitespace; serving reads "
        "raw input with the dataset's list.",
    )
    on_invalid_features: Literal["fail", "impute"] = Field(
        "fail",
        description="NaN, inf or null in a numeric/vector feature: fail naming file, key "
        "and column, or impute the train mean (0 after standardisation).",
    )

    @field_validator("key", "label", "numeric", "categorical", "vectors", "tensors", "images", mode="after")
    @classmethod
    def _named(cls, v):
        # An empty name matches no column: refused here, as a config error, before any engine
        # reads a file and fails on a column '' it cannot find.
        names = [v] if isinstance(v, str) else list(v or [])
        if any(not n.strip() for n in names):
            raise ValueError("a column name cannot be empty")
        return v

    @model_validator(mode="after")
    def _distinct(self) -> FeatureSpec:
        # next_token: the label is the token column itself, named once more on purpose.
        label = self.label if self.task != "next_token" else None
        cols = [c for c in (self.key, label) if c]
        cols += [*(self.numeric or []), *(self.categorical or []), *self.vectors, *self.tensors, *self.images]
        dup = sorted({c for c in cols if cols.count(c) > 1})
        if dup:
            raise ValueError(f"column(s) used twice in the feature spec: {', '.join(dup)}")
        reserved = [c for c in (*self.tensors, *self.images) if c in RESERVED_COLUMNS]
        if reserved:
            raise ValueError(
                f"tensor column '{reserved[0]}': 'features' and 'label' name the loader's "
                "tabular vector and label; rename the column"
            )
        if self.numeric == [] and self.categorical == [] and not (self.vectors or self.typed):
            raise ValueError("the feature spec names no feature column")
        bad = [c for c, n in self.vectors.items() if n < 1]
        if bad:
            raise ValueError(f"vector column '{bad[0]}' needs a length >= 1")
        if self.task == "next_token":
            self._next_token()
        if self.classes is not None:
            if self.task != "classification":
                raise ValueError("classes is for task = 'classification' only")
            if isinstance(self.classes, int) and self.classes < 2:
                raise ValueError(f"classes needs at least 2 classes, got {self.classes}")
            if isinstance(self.classes, list):
                if len(self.classes) < 2:
                    raise ValueError("classes needs at least 2 names")
                if len(set(self.classes)) != len(self.classes):
                    raise ValueError("classes names a class twice")
        return self

    def _next_token(self) -> None:
        """The token column a next_token task predicts: a 1-D integer tensor with a vocab_size."""
        if self.label is None:
            return  # resolved against the tensors (checks.py), which says when there is none
        if self.label not in self.tensors:
            raise ValueError(
                f"task = 'next_token': label '{self.label}' must name a column of "
                f"pipelines.features.tensors (the token ids), not a column of its own"
            )
        t = self.tensors[self.label]
        if t.dtype not in ("uint8", "int32", "int64") or len(t.shape) != 1 or t.vocab_size is None:
            raise ValueError(
                f"task = 'next_token': tensor '{self.label}' must be a 1-D integer tensor with a "
                f"vocab_size (token ids), e.g. {{dtype = \"int32\", shape = [512], vocab_size = 32000}}"
            )

    def token_column(self) -> str | None:
        """next_token: the token tensor its label names, or the only one it can name."""
        if self.task != "next_token":
            return None
        if self.label is not None:
            return self.label
        found = [c for c, t in self.tensors.items()
                 if t.dtype in ("uint8", "int32", "int64") and len(t.shape) == 1 and t.vocab_size is not None]
        return found[0] if len(found) == 1 else None

    @property
    def resolved(self) -> bool:
        """Every column named: what a manifest holds and the row code needs."""
        return self.key is not None and self.label is not None and self.numeric is not None \
            and self.categorical is not None

    @property
    def typed(self) -> bool:
        """Tensor or image columns: the loader yields named tensors, not (x, y)."""
        return bool(self.tensors or self.images)

    @property
    def class_names(self) -> list[str] | None:
        return self.classes if isinstance(self.classes, list) else None


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


class RetentionConfig(Section):
    versions: int = Field(
        2, ge=1, description="Dataset versions kept after a prepare commits, the new one included."
    )
    hours: float = Field(
        24.0, ge=0, description="Also keep every version replaced less than this long ago: a "
        "training or scoring job started on it reads it to the end.",
    )


class PipelineConfig(Section):
    engine: Literal["spark", "dask"] = Field("spark", description="Engine of the prepare stage.")
    dataset_dir: str = Field(
        "shardline-data/dataset",
        description="Prepared dataset: shards + manifests. A local path or a URL every host "
        "can reach (s3://bucket/prefix, gs://, abfs://, hdfs://).",
    )
    source: SourceConfig = Field(default_factory=SourceConfig)
    features: FeatureSpec = Field(default_factory=FeatureSpec)
    split: SplitConfig = Field(default_factory=SplitConfig)
    layout: LayoutConfig = Field(default_factory=LayoutConfig)
    retention: RetentionConfig = Field(default_factory=RetentionConfig)
