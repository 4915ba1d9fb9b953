"""A batch as the model sees it: the one place that knows tabular `(x, y)` from named tensors.

The loader yields `(features, label)` for a tabular dataset and a dict
`{column: tensor, ..., "label": tensor}` for a dataset with tensor or image columns
(`feature_spec.typed`). A model's forward takes the tabular `features` tensor
positionally and named tensors as keyword arguments (`model(image=..., tokens=...)`),
so a user's model reads its inputs by the names the config gave them, as Hugging Face
models do. Everything that calls a model or moves a batch goes through here: the
strategies' steps, evaluation, the driver's model check and scoring.
"""

from __future__ import annotations

from typing import Union

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


def forward(model: nn.Module, inputs: Inputs) -> torch.Tensor:
    """The model on one batch: features positionally, named tensors as keywords."""
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def rows(inputs: Inputs) -> int:
    """The batch's row count."""
    return len(next(iter(inputs.values()))) if isinstance(inputs, dict) else len(inputs)
