"""The loader's columns: how each manifest tensor is decoded from a row group and handed to torch.

Encodings (`pipelines.manifest.TensorSpec.encoding`): `plain` is the tabular float32
`features` list; `raw` a tensor column's stored bytes, viewed without a copy; `image`
PNG/JPEG bytes decoded with Pillow, in the loader's decoding threads (Pillow releases
the GIL while it decodes).
"""

from __future__ import annotations

import numpy as np
import torch

from shardline.pipelines.config import ImageColumn
from shardline.foundation.errors import DataError
from shardline.pipelines.manifest import ShardManifest, TensorSpec
from shardline.pipelines.tensors import decode_raw, storage_dtype


# A label position no loss counts (torch's cross_entropy default ignore_index, and the
# Hugging Face convention for causal language models' `labels`).
IGNORE_INDEX = -100


def label_pad_id(manifest: ShardManifest) -> int | None:
    """next_token: the token column's pad_id, whose positions the label marks IGNORE_INDEX."""
    spec = manifest.feature_spec
    if spec.task != "next_token":
        return None
    return spec.tensors[spec.label].pad_id


def label_tokens(tokens: np.ndarray, pad_id: int | None) -> np.ndarray:
    """A next_token label: the token ids as int64 (a loss's target type), pads IGNORE_INDEX.
    A copy: the input tensor keeps its pads (the model sees them, masked by its attention)."""
    y = tokens.astype(np.int64)
    if pad_id is not None:
        y[tokens == pad_id] = IGNORE_INDEX
    return y


def held_dtype(t: TensorSpec) -> np.dtype:
    """How a decoded column is held: its stored dtype (bfloat16 as its uint16 bits)."""
    return storage_dtype(t.dtype) if t.encoding == "raw" else np.dtype(t.dtype)


def decode_column(col, t: TensorSpec, images: dict[str, ImageColumn], rows: int, where: str) -> np.ndarray:
    """A row group's column as numpy [rows, *t.shape]."""
    arr = col.combine_chunks() if hasattr(col, "combine_chunks") else col
    if t.encoding == "image":
        from shardline.pipelines.images import decode_images

        return decode_images(arr, images[t.column], f"{where}, column '{t.column}'")
    if t.encoding == "raw":
        return decode_raw(arr, t.dtype, t.shape)
    width = t.shape[0]
    # .flatten(), not .values, on a sliced list array: its .values is the whole parent. A
    # row group's own array is no slice; .values then skips a compute call (~0.1 ms a row group).
    whole = arr.offset == 0 and arr.null_count == 0 and len(arr.values) == rows * width
    flat = arr.values if whole else arr.flatten()
    x = np.asarray(flat.to_numpy(zero_copy_only=False), dtype=np.float32)
    if len(x) != rows * width:
        raise DataError(f"{where} holds {len(x)} feature values; the manifest says {rows} rows of {width} features")
    return x.reshape(rows, width)


def to_torch(cols: tuple[np.ndarray, ...], inputs: list[tuple[str, TensorSpec]], named: bool, pin: bool):
    """A batch's columns (the inputs, then the label) as `(x, y)`, or as a dict by name when `named`."""
    out = []
    for (_, t), c in zip([*inputs, ("label", None)], cols):
        tensor = torch.from_numpy(c)
        if t is not None and t.dtype == "bfloat16":
            tensor = tensor.view(torch.bfloat16)  # held as its 16 bits
        if pin:  # page-locked, so the host-to-GPU copy can be non-blocking
            tensor = tensor.pin_memory()
        out.append(tensor)
    if not named:
        return out[0], out[1]
    return {name: tensor for name, tensor in zip([n for n, _ in inputs] + ["label"], out)}
