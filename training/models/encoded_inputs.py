"""Inputs as an HTTP client sends them, decoded as prepare and the loader would.

`mlflow models serve` hands the registered model a DataFrame parsed from JSON, which has
no bytes and no fixed shapes: an image arrives as a base64 string of its PNG or JPEG file,
a token sequence as a list of ids of any length. Before the forward, `decode` turns them
into what the loader gives training: images through the same Pillow decode (to uint8
[C, H, W], resized only where the dataset's `images.<name>.resize` says so), sequences
through prepare's own parser (`pipelines.tensors.parse_tensor`: padded with `pad_id`, cut
where `truncate` is set, ids checked against `vocab_size`). A row either would reject is
refused in one line naming the input and the row. Inputs already decoded (arrays) pass
through untouched, to `registered.typed_inputs`' checks.
"""

from __future__ import annotations

import base64
import binascii

import numpy as np
import pandas as pd
import pyarrow as pa

from shardline.pipelines.config import FeatureSpec
from shardline.pipelines.images import check_image, decode_images
from shardline.pipelines.manifest import TensorSpec
from shardline.pipelines.tensors import from_bfloat16_bits, parse_tensor, storage_dtype

# parse_tensor's problem kinds, as a client reads them.
_TENSOR_PROBLEMS = {
    "bad_shape": "has another length or shape than the model takes",
    "bad_dtype": "holds values that are not {dtype}",
    "out_of_vocab": "holds an id outside the vocabulary (0 to {vocab})",
    "invalid": "holds NaN or infinite values",
}


def decode(name: str, t: TensorSpec, value, spec: FeatureSpec | None, refuse):
    """`value` (one input's rows) decoded if it is encoded (base64 images, id lists), else as given."""
    rows = list(value) if isinstance(value, pd.Series | list | tuple) or _objects(value) else None
    if rows is None or spec is None:
        return value
    if t.encoding == "image" and rows and all(isinstance(r, str | bytes) for r in rows):
        return _images(name, t, rows, spec, refuse)
    column = spec.tensors.get(t.column)
    sequence = column is not None and (column.pad_id is not None or column.truncate or column.pack)
    if sequence and rows and all(isinstance(r, list | tuple | np.ndarray) for r in rows):
        return _sequences(name, column, rows, refuse)
    return value


def _objects(value) -> bool:
    return isinstance(value, np.ndarray) and value.dtype == object


def _images(name: str, t: TensorSpec, rows: list, spec: FeatureSpec, refuse) -> np.ndarray:
    image = spec.images[t.column]
    data = []
    for i, r in enumerate(rows):
        if isinstance(r, str):
            try:
                r = base64.b64decode(r, validate=True)
            except (binascii.Error, ValueError):
                refuse(f"input '{name}' row {i}: not base64 (an image goes as the base64 of its PNG or JPEG file)")
        kind = check_image(r, image)
        if kind == "bad_image":
            refuse(f"input '{name}' row {i}: not a PNG or JPEG image that decodes")
        if kind == "image_size":
            _, h, w = image.shape
            refuse(f"input '{name}' row {i}: the image is not {w} x {h} (width x height), "
                   f"and the dataset's images.{t.column}.resize is off")
        data.append(r)
    return decode_images(pa.array(data, pa.binary()), image, f"input '{name}'")


def _sequences(name: str, column, rows: list, refuse) -> np.ndarray:
    arrow = pa.array([np.asarray(r).tolist() for r in rows])
    data, problems = parse_tensor(arrow, column, [])
    for kind, mask in problems.items():
        if mask.any():
            what = _TENSOR_PROBLEMS.get(kind, kind).format(dtype=column.dtype, vocab=(column.vocab_size or 0) - 1)
            refuse(f"input '{name}' row {int(np.flatnonzero(mask)[0])}: {what} ({column.dtype} {column.shape})")
    out = data.view(storage_dtype(column.dtype)).reshape(len(rows), *column.shape)
    return from_bfloat16_bits(out) if column.dtype == "bfloat16" else out
