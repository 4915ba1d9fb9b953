"""A batch as the model sees it: the one place that knows tabular `(x, y)` from named tensors.

The loader yields `(features, label)` for a tabular dataset and a dict
`{column: tensor, ..., "label": tensor}` for a dataset with tensor or image columns
(`feature_spec.typed`). A model's forward takes the tabular `features` tensor
positionally and named tensors as keyword arguments (`model(image=..., tokens=...)`),
so a user's model reads its inputs by the names the config gave them, as Hugging Face
models do. Everything that calls a model or moves a batch goes through here: the
strategies' steps, evaluation, the driver's model check, the bandwidth planner and
scoring.

Integer inputs (uint8 images, int32 tokens) reach the model as they are: bf16 autocast
casts only floating-point operands of the ops it covers, so a model's own
`image.float() / 255` or `embedding(tokens)` sees the integers the loader gave.

A pipeline's first stage cannot take keyword arguments (torch's schedules hand every
stage of a rank the same kwargs), so it gets the named tensors positionally, in
`names(inputs)` order, and `as_kwargs` turns them back into the first layer's keywords
(training.strategies.pipeline.StageLayers).
"""

from __future__ import annotations

from typing import Union

import numpy as np
import torch
import torch.nn as nn

# What a model's forward is given: the features tensor, or named tensors.
Inputs = Union[torch.Tensor, dict[str, torch.Tensor]]


def split(batch) -> tuple[Inputs, torch.Tensor | None]:
    """(inputs, target) of a loader batch; a dict batch's "label" is the target."""
    if isinstance(batch, dict):
        inputs = {k: v for k, v in batch.items() if k != "label"}
        return inputs, batch.get("label")
    x, y = batch
    return x, y


def to_device(inputs: Inputs | None, device: torch.device) -> Inputs | None:
    """Every tensor on `device` (non-blocking: the loader pins them for a GPU)."""
    if inputs is None:
        return None
    if isinstance(inputs, dict):
        return {k: v.to(device, non_blocking=True) for k, v in inputs.items()}
    return inputs.to(device, non_blocking=True)


def pin(inputs: Inputs) -> Inputs:
    """Every tensor in page-locked memory (a GPU copy from it can be non-blocking)."""
    if isinstance(inputs, dict):
        return {k: v.pin_memory() for k, v in inputs.items()}
    return inputs.pin_memory()


def forward(model: nn.Module, inputs: Inputs) -> torch.Tensor:
    """The model on one batch: features positionally, named tensors as keywords."""
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def rows(inputs: Inputs) -> int:
    """The batch's row count."""
    return len(next(iter(inputs.values()))) if isinstance(inputs, dict) else len(inputs)


def take(inputs: Inputs, part: slice) -> Inputs:
    """Rows `part` of every tensor (a rank's share of a global batch)."""
    if isinstance(inputs, dict):
        return {k: v[part] for k, v in inputs.items()}
    return inputs[part]


def names(inputs: Inputs) -> list[str] | None:
    """The named tensors' names in the order `as_args` lays them out; None for features."""
    return list(inputs) if isinstance(inputs, dict) else None


def as_args(inputs: Inputs) -> tuple[torch.Tensor, ...]:
    """The inputs as positional arguments (a pipeline's first stage): `names` order."""
    return tuple(inputs.values()) if isinstance(inputs, dict) else (inputs,)


def as_kwargs(input_names: list[str], args: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    """`as_args`'s tuple back into named tensors."""
    return dict(zip(input_names, args, strict=True))


def describe(inputs: Inputs) -> str:
    """'features [2, 5] float32', or 'image [2, 3, 8, 8] uint8, grid [2, 2, 3] uint8': for messages."""
    if not isinstance(inputs, dict):
        inputs = {"features": inputs}
    return ", ".join(f"{k} {list(v.shape)} {str(v.dtype).removeprefix('torch.')}" for k, v in inputs.items())


def torch_dtype(name: str) -> torch.dtype:
    """A manifest/ModelInputs dtype name ("uint8", "bfloat16", ...) as torch's dtype."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"no torch dtype '{name}'")
    return dtype


def from_numpy(arrays: dict[str, np.ndarray], dtypes: dict[str, str]) -> dict[str, torch.Tensor]:
    """Decoded numpy columns (training.loader.columns.decode_column) as named tensors of the
    declared dtypes; bfloat16 arrives as its 16 bits and is viewed, not converted."""
    out = {}
    for name, a in arrays.items():
        t = torch.from_numpy(a if a.flags.writeable else a.copy())
        out[name] = t.view(torch.bfloat16) if dtypes.get(name) == "bfloat16" else t
    return out
