"""What a logged model (training.models.registered) declares to MLflow: its signature, the
raw rows of its input example, and the output column of each class.

Inputs are declared by name with any type, the key optional: the model checks what it
takes itself and names a value it cannot take (`signature` says why no narrower type);
the outputs are batch scoring's columns for the model's task.
"""

from __future__ import annotations

import pandas as pd

from shardline.pipelines.config import FeatureSpec
from shardline.pipelines.manifest import FittedStatistics

# Imported inside the functions that use them: MLflow (~2.5 s: only where MLflow is called).


def class_names(spec: FeatureSpec, stats: FittedStatistics) -> list[str]:
    """The output column per class: `prob_<name>` for named classes, else `prob_<index>`."""
    if isinstance(spec.classes, list):
        return [f"prob_{c}" for c in spec.classes]
    return [f"prob_{i}" for i in range(stats.num_classes)]


def example_rows(spec: FeatureSpec, stats: FittedStatistics, n: int = 2) -> pd.DataFrame:
    """Raw rows the model takes, built from the training statistics (no raw file is needed):
    the numeric means, the most frequent categories, zero vectors."""
    rows: dict[str, list] = {}
    for c in spec.numeric:
        rows[c] = [float(stats.numeric[c].mean)] * n
    for c in spec.categorical:
        vocab = stats.categorical.get(c) or ["a"]
        rows[c] = [vocab[i % len(vocab)] for i in range(n)]
    for c, length in spec.vectors.items():
        rows[c] = [[0.0] * length for _ in range(n)]
    return pd.DataFrame(rows)


def signature(spec: FeatureSpec, stats: FittedStatistics):
    """The raw feature schema in (the key optional, passed through), predictions out.

    Feature columns are declared by name with any type: the model takes what prepare
    takes (numbers as integers, floats or numeric text; categories of any type), and its
    own transform names a value it cannot take, with its row. A declared double would
    have MLflow refuse integer columns before the model sees them ("Can not safely
    convert int64 to float64"), a declared long refuse floats and nulls.
    """
    from mlflow.models import ModelSignature
    from mlflow.types.schema import AnyType, Array, ColSpec, DataType, Schema

    inputs = [ColSpec(DataType.long, spec.key, required=False)] if not spec.generate_key else []
    inputs += [ColSpec(AnyType(), c) for c in [*spec.numeric, *spec.categorical]]
    inputs += [ColSpec(Array(AnyType()), c) for c in spec.vectors]
    if spec.task == "classification":
        outputs = [ColSpec(DataType.long, "prediction")]
        outputs += [ColSpec(DataType.double, name) for name in class_names(spec, stats)]
    else:
        outputs = [ColSpec(DataType.double, "prediction")]
    return ModelSignature(Schema(inputs), Schema(outputs))


def typed_signature(spec: FeatureSpec, stats: FittedStatistics, names):
    """A typed dataset's model: its named inputs declared by name with any type (arrays, a
    base64 image, an id list: `typed_inputs` checks each against its dtype and shape, naming
    it), the key optional; the outputs as batch scoring's columns for its task."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import AnyType, ColSpec, DataType, Schema

    inputs = [ColSpec(DataType.long, spec.key, required=False)] if not spec.generate_key else []
    inputs += [ColSpec(AnyType(), name) for name in names]
    if spec.task == "next_token":
        outputs = [ColSpec(DataType.long, "prediction"), ColSpec(DataType.double, "loss"),
                   ColSpec(DataType.long, "tokens")]
    elif spec.task == "classification":
        outputs = [ColSpec(DataType.long, "prediction")]
        outputs += [ColSpec(DataType.double, name) for name in class_names(spec, stats)]
    else:
        outputs = [ColSpec(DataType.double, "prediction")]
    return ModelSignature(Schema(inputs), Schema(outputs))


def loop_signature(spec: FeatureSpec, stats: FittedStatistics, io: dict, tensors: dict):
    """A loop model's signature: its own inputs (else the dataset's) by name, any type, the
    key optional; its output the task's columns, or one list column `output`."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import Array, ColSpec, DataType, Schema

    names = list(io["inputs"]) if io.get("inputs") is not None else list(tensors) if spec.typed else None
    base = typed_signature(spec, stats, names) if names is not None else signature(spec, stats)
    if io.get("output") != "tensor":
        return base
    key = [ColSpec(DataType.long, "key", required=False)] if not spec.generate_key else []
    return ModelSignature(base.inputs, Schema([*key, ColSpec(Array(DataType.double), "output")]))
