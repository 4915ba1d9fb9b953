"""What a model factory is told about the data: `ModelInputs`, read from the dataset's manifest.

A model is any callable `factory(inputs: ModelInputs, **training.model_args) -> nn.Module`
(training.models.factory). Its forward takes what the loader yields (training.batch):

- a tabular dataset: the `features` tensor, positionally, [batch, feature_width] float32
  — the standardised numerics, then the vector columns' elements, then one category
  index per categorical column (0: unknown);
- a dataset with tensor or image columns (`pipelines.features.tensors` / `images`):
  every tensor of `inputs.inputs` as a keyword argument by its name, in its own dtype
  and shape with the batch first — `forward(self, image, tokens)` gets uint8
  [batch, C, H, W] and int32 [batch, length]; `features` too when the dataset also
  has tabular columns.

It returns [batch, output_width]: one logit per class for classification, one value
for regression.

`ModelInputs` is a plain pydantic model: it pickles to ranks and round-trips through
JSON (`model_dump_json` / `model_validate_json`), so a registered model can store it and
rebuild the module from the factory's import path without the manifest.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from shardline.pipelines.manifest import ShardManifest

# Imported inside the functions that use them: torch (~2 s: only where a model or a rank runs); training.batch
# (imports torch).


class TensorInput(BaseModel):
    """One tensor of a row, as the loader yields it (the batch dimension comes first)."""

    model_config = ConfigDict(frozen=True)

    dtype: str = Field(description="torch dtype name: float32, int64, ...")
    shape: list[int] = Field(description="Shape of one row's tensor (no batch dimension).")


class ModelInputs(BaseModel):
    """The prepared inputs a model is built for. Feature order is the `features` tensor's."""

    model_config = ConfigDict(frozen=True)

    task: Literal["classification", "regression", "next_token"]
    num_classes: int = Field(
        description="Classes K (classification); 1 for regression; the vocabulary size V for "
        "next_token (the model returns V logits at every position: [batch, length, V])."
    )
    class_names: list[str] = Field(
        description="Name of each class, in logit order ('0'..'K-1' when classes are counts); [] for regression."
    )
    numeric: list[str] = Field(description="Numeric columns, standardised: features[:, :len(numeric)].")
    vectors: dict[str, int] = Field(description="Vector columns and their lengths, after the numerics.")
    categorical: list[str] = Field(description="Categorical columns: the last len(categorical) features.")
    cardinalities: list[int] = Field(
        description="Per categorical column (same order), its distinct indices 1..c; 0 is the "
        "unknown bucket, so an embedding table needs c + 1 rows."
    )
    inputs: dict[str, TensorInput] = Field(
        description="Each tensor the model's forward gets, by name: {'features': float32 [feature_width]} "
        "for a tabular dataset (given positionally); each tensor or image column (and features, if any) "
        "for a dataset with typed columns (given as keyword arguments)."
    )
    label: TensorInput = Field(
        description="The target: int64 [] class index, float32 [] value, or (next_token) int64 "
        "[length], the input tokens again with pads as -100."
    )

    @property
    def n_numeric(self) -> int:
        """The leading float features (numerics and vector elements); category indices follow."""
        return len(self.numeric) + sum(self.vectors.values())

    @property
    def feature_width(self) -> int:
        return self.n_numeric + len(self.categorical)

    @property
    def output_width(self) -> int:
        """What the model's output must be wide: K logits, 1 value for regression, V logits
        at each position for next_token ([batch, length, V])."""
        return 1 if self.task == "regression" else self.num_classes

    @classmethod
    def from_manifest(cls, manifest: ShardManifest) -> ModelInputs:
        spec, stats = manifest.feature_spec, manifest.statistics
        task = "regression" if manifest.tensors["label"].dtype == "float32" else "classification"
        if spec.task == "next_token":
            task = "next_token"
        if task != "classification":
            names: list[str] = []
        elif isinstance(spec.classes, list):
            names = list(spec.classes)
        else:
            names = [str(i) for i in range(stats.num_classes)]
        return cls(
            task=task,
            num_classes=1 if task == "regression" else stats.num_classes,
            class_names=names,
            numeric=list(spec.numeric or []),
            vectors=dict(spec.vectors),
            categorical=list(spec.categorical or []),
            cardinalities=[stats.cardinality[c] for c in spec.categorical or []],
            inputs={
                name: TensorInput(dtype=t.dtype, shape=list(t.shape))
                for name, t in manifest.tensors.items() if name != "label"
            },
            label=_label(manifest),
        )

    @property
    def named(self) -> bool:
        """True when the forward takes named tensors (keyword arguments), not the features
        tensor: the dataset has tensor or image columns (`feature_spec.typed`)."""
        return set(self.inputs) != {"features"}

    def sample_batch(self, rows: int = 2):
        """(inputs, target) of `rows` rows of this shape, as the loader yields them: the
        features tensor, or named tensors of their declared dtypes and shapes (uint8
        images, int32 tokens) when `named`. Zeros: category 0 (the unknown bucket) and
        token 0 are valid for every column. For the driver's checks of a model, loss, metrics."""
        import torch

        from ..batch import torch_dtype

        y = torch.zeros(rows, *self.label.shape, dtype=torch_dtype(self.label.dtype))
        if not self.named:
            return torch.zeros(rows, self.feature_width, dtype=torch.float32), y
        x = {name: torch.zeros(rows, *t.shape, dtype=torch_dtype(t.dtype)) for name, t in self.inputs.items()}
        return x, y


def _label(manifest: ShardManifest) -> TensorInput:
    """The target as the loader yields it: next_token's is its token ids as int64 [length]
    (pads -100, training.loader.columns), whatever dtype the column stores."""
    t = manifest.tensors["label"]
    return TensorInput(dtype="int64" if t.encoding == "raw" else t.dtype, shape=list(t.shape))
