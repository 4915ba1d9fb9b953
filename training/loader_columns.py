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
from shardline.pipelines.errors import DataError
from shardline.pipelines.manifest import TensorSpec
from shardline.pipelines.tensors import decode_raw, storage_dtype


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
    # .flatten(), not .values: on a sliced list array .values is the whole parent.
    x = np.asarray(arr.flatten().to_numpy(zero_copy_only=False), dtype=np.float32)
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
