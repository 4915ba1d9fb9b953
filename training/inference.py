"""The trained model as scoring meets it: what serving (batch scoring, the estimators'
predictions) shares with training, in the one module both import.

- `registry_client`: an MLflow client whose calls are bounded (mlflow_outage.bound_http) on a
  store checked reachable first: a dead server is one line, not minutes of retries.
- `model_info`, `pickled_refusal`: a logged model's MLmodel file, read without its weights,
  and why a pickled (pytorch-flavour) one is not loaded unless allowed.
- `load_model`: its torch module (models.registered: safetensors weights and the user's code),
  the caller's MLflow store left as it was.
- `predict`, `next_token_outputs`: the model's forward (batch.forward) on one batch of numpy
  inputs on its device, as the model's own pyfunc runs it; a language model's rows reduced
  as training counts its loss (task.next_token_rows).
- `decode_tensors`: a shard's tensor and image columns decoded as the loader decodes them.

torch, and the modules built on it, are imported by the functions that run a model only: the
driver of `shardline score` resolves the model and plans without them (a guarded import, each
with its reason). MLflow likewise, by the functions that call it.
"""

from __future__ import annotations

import os
import posixpath
import tempfile

import numpy as np
import pyarrow as pa

from shardline.foundation.environ import restored
from shardline.foundation.errors import ShardlineError
from shardline.foundation.redact import redact

from .mlflow_outage import bound_http
from .tracking import callers_store_kept, check_reachable

# Imported inside the functions that use them: MLflow (~2.5 s: only where MLflow is called);
# training.models.registered (a cycle: it imports this module); torch (~2 s: only where a model or a rank
# runs); training.batch (imports torch); training.loader.columns (imports torch); training.task (imports
# torch).


def registry_client(tracking_uri: str):
    """An MlflowClient of `tracking_uri` with short HTTP retries, its server checked first, to
    find a model in: a SQLite store that does not exist holds none, and is refused (opening it
    would create it: a refused job leaves no file)."""
    from mlflow.tracking import MlflowClient  # MLflow: ~2.5 s to import; only where it is called

    path = tracking_uri[len("sqlite:///"):] if tracking_uri.startswith("sqlite:///") else ""
    if path not in ("", ":memory:") and not os.path.exists(path):
        raise ShardlineError(redact(f"tracking.tracking_uri: no MLflow store at {tracking_uri} (the file does not "
                                    "exist), so no model is registered there: point it at the model's store"))
    bound_http()
    check_reachable(tracking_uri)
    return MlflowClient(tracking_uri)


def model_info(model_uri: str, tracking_uri: str):
    """mlflow.models.get_model_info of `model_uri` in `tracking_uri`, its MLmodel file read in a
    folder removed after: MLflow's own call leaves a copy in the temp folder for every runs:/ or
    remote model. Without MLflow's progress bar: one small file, on the user's console."""
    import mlflow  # as in registry_client
    from mlflow.models import Model

    bar = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
    with callers_store_kept(), restored([bar]), tempfile.TemporaryDirectory(prefix="shardline-model-") as tmp:
        os.environ[bar] = "false"
        mlflow.set_tracking_uri(tracking_uri)
        local = mlflow.artifacts.download_artifacts(posixpath.join(model_uri, "MLmodel"), dst_path=tmp)
        return Model.load(local).get_model_info()


def pickled_refusal(model_uri: str) -> str:
    """Why a pytorch-flavour model is not loaded. MLflow's pytorch loader unpickles the model:
    whoever could write it to the registry runs code on every scorer. shardline's own models
    are safetensors weights and a factory's import path (models.registered.log_raw_model)."""
    return (f"model {model_uri} has MLflow's pytorch flavour (logged with mlflow.pytorch.log_model): "
            "loading it unpickles it, which runs whatever code its writer put in it; score it only if you "
            "trust everyone who can write to this registry, with serving.allow_pickled_models = true")


def load_model(model_uri: str, tracking_uri: str, allow_pickled: bool = False):
    """The torch module of `model_uri` (on the CPU), read from `tracking_uri`; the caller's
    MLflow tracking URI is left as it was (an estimator's predict runs in the caller's process)."""
    import mlflow  # as in registry_client

    from .models.registered import load_torch_model  # MLflow and torch: a scoring task's imports

    with callers_store_kept():
        mlflow.set_tracking_uri(tracking_uri)
        return load_torch_model(model_uri, allow_pickled=allow_pickled)


def predict(model, x, classification: bool, tensors: dict | None = None, io: dict | None = None) -> np.ndarray:
    """The model's outputs (softmax for classification) on float32 features [n, width], or on
    named numpy inputs ({name: [n, *shape]}, `tensors` their specs, or a loop model's own:
    `io`, serving.model_io) given as keywords."""
    import torch  # a model runs here: torch is loaded with it

    from .batch import forward, from_numpy, to_device  # torch's

    device = next(model.parameters()).device
    own = (io or {}).get("inputs")
    if isinstance(x, dict):
        dtypes = {n: t["dtype"] for n, t in own.items()} if own else {n: t.dtype for n, t in (tensors or {}).items()}
        inputs = from_numpy(x, dtypes)
    elif own:  # a loop's model of one input: the features matrix in its own dtype
        inputs = from_numpy({"x": x}, {"x": next(iter(own.values()))["dtype"]})["x"]
    else:
        inputs = torch.from_numpy(x)
    with torch.inference_mode():
        y = forward(model, to_device(inputs, device))
        if classification:
            y = torch.softmax(y, 1)
    return y.float().cpu().numpy()


def next_token_outputs(model, x: dict, tensors: dict, token_column: str, pad_id: int | None) -> dict[str, np.ndarray]:
    """A language model's rows: the token predicted after each row's last counted position
    (`next_token`), its mean next-token loss (`loss`) over its counted targets (`tokens`): the
    targets are the row's own tokens, pads ignored, as training counts them. Reduced on the
    model's device: the logits [n, length, vocab] never come to the host."""
    import torch  # as in predict

    from .batch import forward, from_numpy, to_device  # torch's
    from .loader.columns import label_tokens
    from .task import next_token_rows

    device = next(model.parameters()).device
    inputs = to_device(from_numpy(x, {n: t.dtype for n, t in tensors.items()}), device)
    label = torch.from_numpy(label_tokens(x[token_column], pad_id)).to(device)
    with torch.inference_mode():
        return {k: v.cpu().numpy() for k, v in next_token_rows(forward(model, inputs), label).items()}


def decode_tensors(batch: pa.RecordBatch, tensors: dict, images, path: str) -> dict[str, np.ndarray]:
    """A batch's input tensors {name: numpy [n, *shape]}, decoded as the loader decodes them
    (images with Pillow, raw tensors viewed in their dtype, bfloat16 as its 16 bits)."""
    from .loader.columns import decode_column  # torch's dtypes: a scoring task's import

    n = batch.num_rows
    return {name: decode_column(batch.column(t.column), t, images, n, f"{path}: column '{t.column}'")
            for name, t in tensors.items()}
