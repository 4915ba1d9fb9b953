"""Score one input unit and commit it: the task body on either engine.

A unit's output name depends only on the unit and the model, and its bytes only
on the unit, the model and the job's `scored_at` (fixed on the driver), so a
retried or duplicated task rewrites the same bytes under the same name; the
ledger entry is written after the file is in place, so a unit is either committed
whole or not at all. Both go through `foundation.storage`: any store, no temp file
left behind.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from shardline.foundation import failures, progress, storage
from shardline.foundation.code_travel import UserCode, use_code
from shardline.foundation.errors import ShardlineError
from shardline.pipelines.transform import features_matrix
from shardline.training.inference import decode_tensors, next_token_outputs, predict

from .inputs import Transform, Unit
from .ledger import commit
from .model_io import input_columns, output_fields, read_inputs, tensor_output
from .models import cached_model

# Imported inside the functions that use them: torch (~2 s: only where a model or a rank runs).


@dataclass(frozen=True)
class UnitTask:
    unit: Unit
    output_dir: str
    output_name: str
    model_uri: str  # pinned: models:/name/<version>, never an alias
    tracking_uri: str
    model_name: str
    model_version: str
    transform: Transform
    batch_size: int
    threads: int = 1  # torch intra-op threads while this unit is scored
    scored_at: str = ""  # UTC ISO 8601, one per job (the driver's clock): retries write the same bytes
    progress_addr: str | None = None  # the driver's progress listener and stage (foundation.progress)
    progress_key: str | None = None
    code: UserCode | None = None  # the user's code the model needs (foundation.code_travel), shipped by the driver
    allow_pickled: bool = False  # a pytorch-flavour model, allowed by serving.allow_pickled_models
    key_column: str = "key"  # the output's name for the rows' key (serving.key_column)


def output_schema(classification: bool, next_token: bool = False, key: str = "key",
                  tensor: bool = False) -> pa.Schema:
    """The row's key (column `key`: the input's key column's own name: serving.key_column),
    the prediction (class and probabilities, or the value), the model and the time.
    next_token: `prediction` is the token id predicted after the row's last non-pad
    position, `loss` the row's mean next-token loss over its `tokens` counted targets.
    tensor: a loop's model whose output is not the task's: one list column (serving.model_io)."""
    fields = [pa.field(key, pa.int64())]
    if tensor:
        fields += output_fields()
    elif next_token:
        fields += [
            pa.field("prediction", pa.int64()),
            pa.field("loss", pa.float64()),
            pa.field("tokens", pa.int64()),
        ]
    elif classification:
        fields += [
            pa.field("prediction", pa.int64()),
            pa.field("probabilities", pa.list_(pa.float32())),
        ]
    else:
        fields.append(pa.field("prediction", pa.float64()))
    fields += [
        pa.field("model_name", pa.string()),
        pa.field("model_version", pa.string()),
        pa.field("scored_at", pa.timestamp("us", tz="UTC")),
    ]
    return pa.schema(fields)


def score_unit(task: UnitTask) -> dict:
    """The unit's ledger entry; a data error or a permanent failure (a full disk, no
    permission: foundation.failures) comes back as {"error": ...}, not raised, because
    retrying the task cannot fix either: no engine retries it."""
    try:
        return _score_unit(task)
    except ShardlineError as e:
        return {"error": str(e), "unit": task.unit.path}
    except Exception as e:
        if not failures.is_permanent(e):
            raise  # transient (a lost connection): the engine's retry may pass
        return {"error": f"serving.output_dir: {failures.describe(e)}", "unit": task.unit.path, "permanent": True}


def _score_unit(task: UnitTask) -> dict:
    import torch  # the task's: its model is torch's (the driver that plans never imports it)

    spec = task.transform.spec
    classification = spec.task == "classification"
    next_token = spec.task == "next_token"
    io = task.transform.io  # a loop's model: its own inputs and output (serving.model_io)
    tensor_out = io.get("output") == "tensor"
    schema = output_schema(classification, next_token, task.key_column, tensor_out)
    use_code(task.code)  # before the model is built: this job's version of the user's code
    model = cached_model(task.model_uri, task.tracking_uri, allow_pickled=task.allow_pickled)
    # torch defaults to one thread per core in every worker process: with one task
    # per core that oversubscribes the machine.
    torch.set_num_threads(task.threads)
    scored_at = datetime.fromisoformat(task.scored_at) if task.scored_at else datetime.now(timezone.utc)
    rows = 0
    tensors = task.transform.tensors  # the named inputs' specs; None: the features tensor
    with storage.write(storage.join(task.output_dir, task.output_name)) as f:
        with pq.ParquetWriter(f, schema) as writer:
            for keys, x in _batches(task, spec):
                n = len(keys)
                cols = [keys]
                if tensor_out:
                    cols.append(tensor_output(predict(model, x, False, tensors, io)))
                elif next_token:
                    cols += _next_token_columns(model, x, tensors, spec.label, spec.tensors[spec.label].pad_id)
                elif classification:
                    pred = predict(model, x, classification, tensors, io)
                    k = pred.shape[1]
                    offsets = pa.array(np.arange(0, n * k + 1, k, dtype=np.int32))
                    cols += [
                        pa.array(pred.argmax(1), pa.int64()),
                        pa.ListArray.from_arrays(offsets, pa.array(pred.reshape(-1), pa.float32())),
                    ]
                else:
                    pred = predict(model, x, classification, tensors, io)
                    cols.append(pa.array(pred[:, 0].astype(np.float64)))
                cols += [
                    pa.array([task.model_name] * n, pa.string()),
                    pa.array([task.model_version] * n, pa.string()),
                    pa.array([scored_at] * n, pa.timestamp("us", tz="UTC")),
                ]
                writer.write_batch(pa.RecordBatch.from_arrays(cols, schema=schema))
                rows += n
    entry = {
        "unit": task.unit.path,
        "unit_id": task.unit.unit_id,
        "fingerprint": task.unit.fingerprint,
        "output": task.output_name,
        "key_column": task.key_column,  # entries without it are older: their files name it "key"
        "rows": rows,
        "model_name": task.model_name,
        "model_version": task.model_version,
        "model_uri": task.model_uri,
        "scored_at": scored_at.isoformat(),
    }
    commit(task.output_dir, entry)
    progress.tick(task.progress_addr, task.progress_key, rows, unit=task.unit.unit_id)
    return entry


def _next_token_columns(model, x: dict, tensors: dict, token_column: str, pad_id: int | None) -> list[pa.Array]:
    """prediction, loss, tokens of a language model's rows (training.inference.next_token_outputs)."""
    rows = next_token_outputs(model, x, tensors, token_column, pad_id)
    return [pa.array(rows["next_token"], pa.int64()), pa.array(rows["loss"], pa.float64()),
            pa.array(rows["tokens"], pa.int64())]


def _batches(task: UnitTask, spec):
    """(int64 keys, inputs) per batch, bounded in memory: inputs are float32 [n, width]
    features, or for a dataset with tensor or image columns {name: numpy [n, *shape]},
    each column decoded as the loader decodes it (training.loader.columns)."""
    unit = task.unit
    tensors = task.transform.tensors if unit.kind == "shard" else None
    io = task.transform.io
    if io.get("inputs") is not None:  # a loop's model of its own inputs (serving.model_io)
        columns = [spec.key, *input_columns(io, tensors, unit.kind)]
    elif tensors is not None:
        columns = [spec.key, *(t.column for t in tensors.values())]
    elif unit.kind == "shard":
        columns = [spec.key, "features"]
    else:
        columns = [spec.key, *spec.numeric, *spec.categorical, *spec.vectors]
    stats = task.transform.stats if unit.kind == "raw" else None
    impute = spec.on_invalid_features == "impute"
    for batch in pq.ParquetFile(storage.open_input(unit.path)).iter_batches(task.batch_size, columns=columns):
        key = batch.column(0)
        if key.null_count:
            raise ShardlineError(f"{unit.path}: column '{spec.key}' has null keys")
        if io.get("inputs") is not None:
            x = read_inputs(batch, io, tensors, spec, unit.kind, task.transform.width, unit.path)
        elif tensors is not None:
            x = decode_tensors(batch, tensors, spec.images, unit.path)
        elif unit.kind == "shard":
            # On a sliced list array `.values` is the whole parent: flatten().
            flat = batch.column(1).flatten().to_numpy(zero_copy_only=False)
            x = flat.astype(np.float32).reshape(len(key), task.transform.width)
        else:
            table = pa.Table.from_batches([batch])
            _check_raw(table, spec, unit.path, impute)
            x = features_matrix(table, spec, stats, impute)
        yield key.cast(pa.int64()), x


def _check_raw(table: pa.Table, spec, path: str, impute: bool) -> None:
    for c, length in spec.vectors.items():
        lengths = pc.list_value_length(table.column(c)).to_numpy(zero_copy_only=False)
        bad = np.flatnonzero(lengths != length)
        if len(bad):
            raise ShardlineError(
                f"{path}: column '{c}' needs {length} values per row "
                f"(key {table.column(spec.key)[int(bad[0])]} has {lengths[bad[0]]})"
            )
    if impute:
        return
    for c in spec.numeric:
        x = table.column(c).to_numpy(zero_copy_only=False).astype(np.float64)
        bad = np.flatnonzero(~np.isfinite(x))
        if len(bad):
            raise ShardlineError(
                f"{path}: column '{c}' is null, NaN or inf at key "
                f"{table.column(spec.key)[int(bad[0])]} (on_invalid_features = fail)"
            )
