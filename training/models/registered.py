"""The registered model takes raw rows: an MLflow pyfunc with the dataset's transform inside.

A model trained on prepared shards expects standardised numerics, vector elements and
category indices. A caller of `mlflow models serve` has raw rows, and re-implementing
the transform outside would let serving skew from training. So the logged model is a
pyfunc (`RawRowsModel`) holding the torch module and the training dataset's feature spec
and fitted statistics (manifest), and its `predict` runs the very functions prepare and
batch scoring run (`pipelines.rows.parse_features`, `pipelines.transform.features`):
raw columns in, `prediction` and one `prob_<class>` column per class out (regression:
the value).

Batch scoring of prepared shards does not need the transform: `load_torch_model` gives
it the torch module alone (from this model or from a plain pytorch-flavor one).

A model of a dataset with tensor or image columns (`feature_spec.typed`) takes its
inputs already decoded: `predict({"photo": uint8 [n, C, H, W], "tokens": int32 [n, L]})`
(a dict of array-likes, or a DataFrame whose columns hold one array per row), each
checked against its declared dtype and shape and given to the module by name
(`predict_typed`). Such a model's signature names its inputs with any type and no input
example is logged (MLflow's column types cannot say "uint8 [3, 8, 8]", and a tensor type
would refuse a base64 image): the model checks dtype and shape itself. Over HTTP (`mlflow models serve`) an image
input also comes as the base64 of its PNG/JPEG file and a sequence as a list of ids of
any length: `training.models.encoded_inputs` decodes them as prepare and the loader would.

Nothing in the model is a pickle: the module is safetensors weights plus the JSON that
rebuilds it (training.models.files), the pyfunc is "models from code" (registered_code.py,
run on loading, instead of a pickled python_model).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pyarrow as pa

from shardline.pipelines.config import FeatureSpec
from shardline.foundation.errors import ShardlineError, first_line
from shardline.foundation.code_travel import shardline_files
from shardline.pipelines.manifest import FittedStatistics, ShardManifest, TensorSpec
from shardline.pipelines.rows import INVALID, parse_features
from shardline.pipelines.transform import features

from ..inference import pickled_refusal
from .encoded_inputs import decode
from .files import code_folders, code_on_path, io_of, read_module, write_module
from .signatures import class_names, example_rows, loop_signature, signature, typed_signature

# Imported inside the functions that use them: torch (~2 s: only where a model or a rank runs); training.batch
# (imports torch); training.loader.columns (imports torch); training.task (imports torch); MLflow (~2.5 s:
# only where MLflow is called); safetensors (with torch).

from ..mlflow_quiet import no_download_bars, registry_said_nothing

WEIGHTS = "weights"  # artifact names inside the logged model
MODULE = "module"
TRANSFORM = "transform"
ENTRY = Path(__file__).with_name("registered_code.py")


class RawRowsModel(mlflow.pyfunc.PythonModel):
    """Raw feature columns in, predictions out (see the module docstring)."""

    def load_context(self, context) -> None:
        t = json.loads(Path(context.artifacts[TRANSFORM]).read_text())
        self.spec = FeatureSpec.model_validate(t["spec"])
        self.stats = FittedStatistics.model_validate(t["stats"])
        # The named input tensors of a typed dataset's model (absent from older models).
        self.tensors = {n: TensorSpec.model_validate(v) for n, v in t.get("tensors", {}).items()}
        # MLflow has put the model's code folder (shardline's and the user's) on sys.path.
        self.model = read_module(context.artifacts[WEIGHTS], context.artifacts[MODULE])

    def predict(self, context, model_input: pd.DataFrame, params=None) -> pd.DataFrame:
        io = getattr(self.model, "shardline_io", None) or {}
        if io.get("inputs") is not None:  # a loop's model of inputs of its own (training.loop.io)
            return _outputs(self.model, own_inputs(io, model_input, self.spec), self.spec, self.stats, model_input)
        if self.spec.typed:
            return predict_typed(self.model, self.spec, self.stats, self.tensors, model_input)
        return predict_raw(self.model, self.spec, self.stats, model_input)


def predict_raw(model, spec: FeatureSpec, stats: FittedStatistics, rows: pd.DataFrame) -> pd.DataFrame:
    """Predictions for raw rows; a row the transform cannot take is refused, naming it."""
    import torch

    table = _table(rows, spec)
    numeric, categorical, vectors, problems = parse_features(table, spec)
    impute = spec.on_invalid_features == "impute"
    for (kind, col), mask in problems.items():
        if kind == INVALID and impute:
            continue
        row = int(np.flatnonzero(mask)[0])
        what = "does not parse as a number" if kind == "bad" else "is null, NaN or inf"
        if col in spec.vectors:
            what = f"is not {spec.vectors[col]} finite numbers"
        _refuse(f"column '{col}' {what} at row {row} (value {rows[col].iloc[row]!r})")
    x = features(numeric, categorical, vectors, table.num_rows, spec, stats, impute)
    return _outputs(model, torch.from_numpy(x), spec, stats, rows)


def predict_typed(model, spec: FeatureSpec, stats: FittedStatistics, tensors: dict[str, TensorSpec],
                  rows) -> pd.DataFrame:
    """Predictions for already-decoded named inputs (see the module docstring)."""
    if "features" in tensors:
        _refuse("a model of tensor or image columns and tabular features together takes its "
                "inputs from batch scoring of a prepared dataset, not from raw rows")
    return _outputs(model, typed_inputs(tensors, rows, spec), spec, stats, rows)


def typed_inputs(tensors: dict[str, TensorSpec], rows, spec: FeatureSpec | None = None) -> dict:
    """{name: torch tensor [n, *shape] of the declared dtype} from a dict of array-likes or
    a DataFrame of one array per row; a missing input, another shape, or values its dtype
    cannot hold are refused by name. With the dataset's `spec`, base64 images and id lists
    are decoded first (`encoded_inputs.decode`)."""
    import torch

    from ..batch import torch_dtype

    out = {}
    for name, t in tensors.items():
        if name not in rows:
            _refuse(f"missing input '{name}' ({t.dtype} {t.shape} per row)")
        value = decode(name, t, rows[name], spec, _refuse)
        if isinstance(value, pd.Series):
            value = [np.asarray(v) for v in value]
        try:
            a = np.asarray(value)
        except ValueError as e:  # ragged rows
            _refuse(f"input '{name}': {first_line(e)}")
        if a.ndim < 1 or list(a.shape[1:]) != list(t.shape):
            _refuse(f"input '{name}' has shape {list(a.shape[1:])} per row; the model takes {t.shape}")
        dtype = torch_dtype(t.dtype)
        if not dtype.is_floating_point:
            if a.dtype.kind not in "iub" or (a.size and (a.min() < torch.iinfo(dtype).min or a.max() > torch.iinfo(dtype).max)):
                _refuse(f"input '{name}' holds values that are not {t.dtype}")
        elif a.dtype.kind not in "iubf":
            _refuse(f"input '{name}' holds {a.dtype} values, not numbers")
        out[name] = torch.as_tensor(a).to(dtype)
    return out


def _outputs(model, inputs, spec: FeatureSpec, stats: FittedStatistics, rows) -> pd.DataFrame:
    """The model on `inputs` (features, or named tensors as keywords): prediction and
    one prob_<class> column per class (regression: the value); the caller's key passed through."""
    import torch

    from ..batch import forward
    from ..loader.columns import label_tokens
    from ..task import next_token_rows

    with torch.inference_mode():
        y = forward(model, inputs)
        if (getattr(model, "shardline_io", None) or {}).get("output") == "tensor":
            # Not the task's output (an embedding, a generated image): one list of values a row.
            out = {"key": np.asarray(rows[spec.key])} if spec.key in rows else {}
            return pd.DataFrame({**out, "output": list(y.float().reshape(len(y), -1).numpy())})
        if spec.task == "classification":
            y = torch.softmax(y, 1)
        if spec.task == "next_token":  # batch scoring's columns (serving.worker): reduced here
            tokens = inputs[spec.label].numpy()
            scores = next_token_rows(y, torch.from_numpy(label_tokens(tokens, spec.tensors[spec.label].pad_id)))
    y = y.float().numpy()
    out = {}
    if spec.key in rows:  # pass the caller's key through, under its own name, to join on
        out[spec.key] = np.asarray(rows[spec.key])
    if spec.task == "next_token":
        out.update(prediction=scores["next_token"].numpy(), loss=scores["loss"].numpy(),
                   tokens=scores["tokens"].numpy())
    elif spec.task == "classification":
        out["prediction"] = y.argmax(1).astype(np.int64)
        out.update({name: y[:, i].astype(np.float64) for i, name in enumerate(class_names(spec, stats))})
    else:
        out["prediction"] = y[:, 0].astype(np.float64)
    return pd.DataFrame(out)


def _table(rows: pd.DataFrame, spec: FeatureSpec) -> pa.Table:
    if not isinstance(rows, pd.DataFrame):
        rows = pd.DataFrame(rows)
    cols = [*spec.numeric, *spec.categorical, *spec.vectors]
    missing = [c for c in cols if c not in rows.columns]
    if missing:
        _refuse(f"missing feature column(s) {', '.join(repr(c) for c in missing)}")
    data = {}
    for c in cols:
        try:
            if c in spec.vectors:
                data[c] = pa.array([None if v is None else list(v) for v in rows[c]], pa.list_(pa.float64()))
            elif c in spec.categorical:
                data[c] = pa.array([None if v is None or v != v else str(v) for v in rows[c]], pa.string())
            else:
                data[c] = pa.array(rows[c], from_pandas=True)
        except (pa.ArrowException, TypeError, ValueError) as e:
            _refuse(f"column '{c}': {first_line(e)}")
    return pa.table(data)


def _refuse(message: str):
    """A bad request: `mlflow models serve` answers it with HTTP 400 and this message."""
    from mlflow.exceptions import INVALID_PARAMETER_VALUE, MlflowException

    raise MlflowException(message, error_code=INVALID_PARAMETER_VALUE)


def own_inputs(io: dict, rows, spec: FeatureSpec) -> dict | object:
    """A loop model's own inputs from the request: each an array of its dtype and shape per
    row (typed_inputs' checks); a single positional one is given as a tensor."""
    tensors = {n: TensorSpec(column=n, dtype=t["dtype"], shape=t["shape"], encoding="raw")
               for n, t in io["inputs"].items()}
    inputs = typed_inputs(tensors, rows)
    return next(iter(inputs.values())) if io.get("positional") else inputs


def log_trained_model(model, manifest: ShardManifest, cfg, registered_name: str | None, code=None,
                      loop_model: dict | None = None) -> str:
    """Log a job's trained model (training.job) as a RawRowsModel with the job's own code
    snapshot (`code`: the bytes its ranks ran, whatever the folders hold by now); register
    it if named. The registered version, or "" when not registered."""
    import safetensors
    import torch

    model.eval()
    # MLflow warns that the pyfunc's python_model and the signature's optional key column
    # are its own choices to document; both are deliberate here.
    logging.getLogger("mlflow.pyfunc").setLevel(logging.ERROR)
    logging.getLogger("mlflow.models.model").setLevel(logging.ERROR)
    info = log_raw_model(
        model, manifest, cfg, registered_name, code=code, loop_model=loop_model,
        # Without an explicit list MLflow spends ~10 s inferring one.
        pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", f"safetensors=={safetensors.__version__}",
                          "pydantic", "pyarrow", "pandas"],
    )
    return str(info.registered_model_version) if registered_name else ""


def log_raw_model(model, manifest: ShardManifest, cfg, registered_name: str | None, code=None,
                  loop_model: dict | None = None, **kwargs):
    """Log `model` (built by `build_model(manifest, cfg)`) as a RawRowsModel of
    `manifest`'s transform, with the user's code (`code`, a foundation.code_travel.UserCode
    snapshot; else the folders as they are now); MLflow's ModelInfo."""
    spec, stats = manifest.feature_spec, manifest.statistics
    no_download_bars()  # MLflow loads the model back to check its input example
    # Before anything is written: a missing code_paths entry is one line.
    user_code = None if code is not None and code.zip_path else code_folders(cfg)
    with tempfile.TemporaryDirectory() as d:
        if user_code is None:
            user_code = _unpacked(code, os.path.join(d, "usercode"))
        code_dir = os.path.join(d, "code")
        for arcname, f in shardline_files():  # shardline/__init__.py and code_travel.ENGINE_PACKAGES
            os.makedirs(os.path.dirname(os.path.join(code_dir, arcname)), exist_ok=True)
            shutil.copyfile(f, os.path.join(code_dir, arcname))
        weights, module = write_module(model, manifest, cfg, d, loop_model)
        transform = os.path.join(d, "transform.json")
        tensors = {n: t.model_dump(mode="json") for n, t in manifest.tensors.items() if n != "label"}
        Path(transform).write_text(json.dumps({
            "spec": spec.model_dump(mode="json"), "stats": stats.model_dump(mode="json"),
            **({"tensors": tensors} if spec.typed else {}),
        }))
        io = io_of(loop_model)
        own = bool(io)
        # MLflow loads the model back to check its input example, which puts the model's code
        # folder (its copy of shardline's engine packages) first on sys.path and leaves it
        # there: a process this one starts later (multiprocessing, a rank server) would import
        # shardline from that copy. The path is put back as it was.
        path = list(sys.path)
        try:
            with registry_said_nothing():  # "Successfully registered model 'm'." and its like
                return mlflow.pyfunc.log_model(
                    name="model",
                    python_model=str(ENTRY),
                    artifacts={WEIGHTS: weights, MODULE: module, TRANSFORM: transform},
                    # Named tensors: by name, any type (no MLflow type says "uint8 [3, 8, 8]": module docstring).
                    signature=(loop_signature(spec, stats, io, tensors) if own
                               else typed_signature(spec, stats, tensors) if spec.typed else signature(spec, stats)),
                    input_example=None if spec.typed or own else example_rows(spec, stats),
                    # What batch scoring needs to know before it loads the model (serving.models.ResolvedModel).
                    metadata={"shardline_io": io} if io else None,
                    # Each folder lands in the model's code/ by its own name: code/shardline, and the
                    # user's packages beside it, importable as they were in training.
                    code_paths=[os.path.join(code_dir, "shardline"), *user_code],
                    registered_model_name=registered_name,
                    **kwargs,
                )
        finally:
            sys.path[:] = path


def _unpacked(code, folder: str) -> list[str]:
    """The snapshot's packages (folders, or single .py files) unpacked into `folder`."""
    with zipfile.ZipFile(code.zip_path) as z:
        z.extractall(folder)
    return [p if os.path.isdir(p := os.path.join(folder, name)) else f"{p}.py" for name in code.packages]


def load_torch_model(model_uri: str, allow_pickled: bool = False):
    """The torch module of a logged model: a RawRowsModel's weights, or, with
    `allow_pickled`, a pytorch-flavor model (one logged by other code, which MLflow
    unpickles: serving.allow_pickled_models). On the CPU; the caller moves it.

    The model is downloaded into a temporary folder removed before returning: a scorer that
    loads models for days must not fill its disk with copies. The module is built by then,
    and the user's modules it imported stay imported.
    """
    from mlflow.models import Model

    from .files import read_module

    no_download_bars()  # a task's log, not a terminal
    with tempfile.TemporaryDirectory(prefix="shardline-model-") as tmp:
        local = mlflow.artifacts.download_artifacts(model_uri, dst_path=tmp)
        flavors = Model.load(local).flavors
        if "pytorch" in flavors:
            if not allow_pickled:  # the driver refused it already; a worker never loads it unasked
                raise ShardlineError(pickled_refusal(model_uri))
            # A model logged by other code with mlflow.pytorch: MLflow's own loader.
            return mlflow.pytorch.load_model(local, map_location="cpu")
        pyfunc = flavors["python_function"]
        artifacts = pyfunc.get("artifacts", {})
        if MODULE not in artifacts:
            raise ShardlineError(
                f"model {model_uri} holds no safetensors weights (one logged by an older shardline "
                "as a pickled module, which is never loaded): train it again or log it with this version"
            )
        with code_on_path(os.path.join(local, pyfunc["code"]) if pyfunc.get("code") else None):
            return read_module(os.path.join(local, artifacts[WEIGHTS]["path"]),
                               os.path.join(local, artifacts[MODULE]["path"]))
