"""Scoring a loop's model whose inputs or output are its own (training.loop.io).

Inputs: each of the model's inputs is read from the column of its name — a prepared
shard's tensor column decoded as the loader decodes it, the shards' `features`, or a
list of numbers per row (raw Parquet: a generator's noise, a query's embedding) made an
array of the input's dtype and shape. A single input is given positionally.

Output: the task's is scored as any model's (serving.worker); another (an embedding, a
generated image) is one list column `output`, each row's values flattened.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from shardline.foundation.errors import ShardlineError

OUTPUT = "output"


def input_columns(io: dict, tensors: dict | None, kind: str) -> list[str]:
    """The unit's columns the model's own inputs are read from, in input order."""
    return [tensors[n].column if kind == "shard" and tensors and n in tensors else n for n in io["inputs"]]


def read_inputs(batch: pa.RecordBatch, io: dict, tensors: dict | None, spec, kind: str, width: int, path: str):
    """{name: numpy [n, *shape]} of one batch (columns 1.. in input_columns' order); a single
    positional input: its array alone."""
    from shardline.training.loader.columns import decode_column

    n, out = batch.num_rows, {}
    for i, (name, t) in enumerate(io["inputs"].items(), start=1):
        column = batch.column(i)
        if kind == "shard" and tensors and name in tensors:
            out[name] = decode_column(column, tensors[name], spec.images, n, f"{path}: column '{name}'")
            continue
        dtype = np.dtype(t["dtype"])  # never bfloat16: only a dataset's own column is (training.loop.io)
        values = column.flatten() if pa.types.is_list(column.type) or pa.types.is_large_list(column.type) \
            or pa.types.is_fixed_size_list(column.type) else column
        flat = values.to_numpy(zero_copy_only=False)
        shape = [n, *t["shape"]] if name != "features" or kind != "shard" else [n, width]
        if flat.size != int(np.prod(shape)):
            raise ShardlineError(f"{path}: column '{name}' does not hold {t['shape']} values a row "
                                 f"(the model's input {name!r})")
        out[name] = flat.astype(dtype).reshape(shape)
    return next(iter(out.values())) if io.get("positional") else out


def tensor_output(y: np.ndarray) -> pa.Array:
    """A model's outputs [n, ...] as one list<float32> per row."""
    n = len(y)
    flat = np.ascontiguousarray(y, dtype=np.float32).reshape(n, -1)
    offsets = pa.array(np.arange(0, flat.size + 1, flat.shape[1], dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(flat.reshape(-1), pa.float32()))


def output_fields() -> list[pa.Field]:
    return [pa.field(OUTPUT, pa.list_(pa.float32()))]
