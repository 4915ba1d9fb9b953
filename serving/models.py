"""The per-worker model cache: a model is loaded once per Python worker process."""

from __future__ import annotations

import gc
import sys

from shardline.foundation.errors import ShardlineError
from shardline.foundation.redact import redact
from shardline.training.inference import load_model, model_info, pickled_refusal, registry_client

# Imported inside the functions that use them: torch (~2 s: only where a model or a rank runs); MLflow (~2.5
# s: only where MLflow is called).

_CACHE: dict[tuple[str, str, str], object] = {}


def spark_task_gpus(resources: dict | None) -> list[str]:
    """The GPU addresses in a Spark task's resources (TaskContext.resources()): what
    spark.task.resource.gpu.amount gave it; [] without GPU scheduling or outside Spark."""
    gpu = (resources or {}).get("gpu")
    return list(gpu.addresses) if gpu is not None else []


def choose_scoring_device(task_gpus: list[str], device_count: int, current: int):
    """The Spark task's first GPU, else the current CUDA device (a dask-cuda worker's own
    GPU is its device 0), else the CPU."""
    import torch  # a scoring task's: the driver that plans never imports it

    if device_count == 0:
        return torch.device("cpu")
    if task_gpus:
        given = task_gpus[0]
        if not given.isdigit() or int(given) >= device_count:
            raise ShardlineError(
                f"Spark gave this scoring task GPU {given!r}, which is not one of the {device_count} "
                "CUDA device(s) its process sees: the GPU discovery script "
                "(spark.executor.resource.gpu.discoveryScript) must list their indices"
            )
        return torch.device("cuda", int(given))
    return torch.device("cuda", current)


def scoring_device():
    """Where this task scores: see choose_scoring_device."""
    import torch  # as in choose_scoring_device

    resources = None
    if "pyspark" in sys.modules:  # a Spark task imported it; a Dask worker need not
        from pyspark import TaskContext  # (the guard above)

        ctx = TaskContext.get()
        resources = ctx.resources() if ctx is not None else None
    if not torch.cuda.is_available():
        return torch.device("cpu")
    gpus = spark_task_gpus(resources)
    # Asked only without a Spark GPU: a Spark task's process needs nothing from CUDA's current one.
    current = 0 if gpus else torch.cuda.current_device()
    return choose_scoring_device(gpus, torch.cuda.device_count(), current)


def cached_model(model_uri: str, tracking_uri: str, device=None, allow_pickled: bool = False):
    """The model on `device` (scoring_device() when None), loaded once per process and device:
    Spark reuses a Python worker for tasks that may have been given different GPUs. A GPU
    becomes the calling thread's current device, so nothing of the task lands on GPU 0.
    allow_pickled: a pytorch-flavour model may be unpickled (serving.allow_pickled_models)."""
    import torch  # as in choose_scoring_device

    device = device if device is not None else scoring_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    key = (model_uri, tracking_uri, str(device))
    if key not in _CACHE:
        # The torch module alone: batch scoring applies the transform itself, and a
        # prepared split needs none. (In the caller's own process too: an estimator's
        # predict of a pandas frame; its MLflow is left pointing where it was.)
        model = load_model(model_uri, tracking_uri, allow_pickled)
        _CACHE[key] = model.to(device).eval()
        # What loading brought in (torch, MLflow, the model: ~430k objects) lives as long as
        # the process: frozen out of the collector, so neither later collections nor the
        # process's exit walk it again. The exit's collections took over 4 s in a Dask
        # worker, which its nanny then killed ("still alive after 4.0 seconds"): 4 s at the
        # end of every `shardline score` on the embedded cluster. Garbage first: frozen
        # garbage would never be freed.
        gc.collect()
        gc.freeze()
    return _CACHE[key]


def resolve_version(model_uri: str, tracking_uri: str) -> tuple[str, str]:
    """(registered name, version) of a models:/ URI; (uri, '') for other URIs."""
    from mlflow.exceptions import MlflowException  # MLflow: ~2.5 s to import; the driver of a score only

    # A dead server: one line now, not minutes of retries and then "not found".
    client = registry_client(tracking_uri)
    if not model_uri.startswith("models:/"):
        return model_uri, ""
    ref = model_uri[len("models:/") :]
    name, alias = ref.split("@", 1) if "@" in ref else (ref.partition("/")[0], None)
    where = f"in MLflow at {redact(tracking_uri)}"
    try:
        registered = client.get_registered_model(name)
    except MlflowException:
        raise ShardlineError(f"model {model_uri}: no registered model '{name}' {where}") from None
    try:
        if alias is not None:
            return name, str(client.get_model_version_by_alias(name, alias).version)
        version = ref.partition("/")[2]
        if version in ("", "latest"):
            versions = client.search_model_versions(f"name='{name}'")
            if not versions:
                raise ShardlineError(f"model {model_uri}: registered model '{name}' has no versions {where}")
            return name, str(max(versions, key=lambda v: int(v.version)).version)
        return name, str(client.get_model_version(name, version).version)
    except MlflowException:
        if alias is not None:
            aliases = ", ".join(f"@{a} → version {v}" for a, v in sorted((registered.aliases or {}).items()))
            raise ShardlineError(
                f"model {model_uri}: alias '{alias}' of '{name}' points to no version {where} "
                f"({'its aliases: ' + aliases if aliases else 'it has no aliases'}); "
                f"set it with MlflowClient.set_registered_model_alias"
            ) from None
        raise ShardlineError(f"model {model_uri}: '{name}' has no version {version} {where}") from None


class ResolvedModel:
    """A model URI pinned to one version, so workers cannot load another (an alias may move)."""

    def __init__(self, uri: str, pinned_uri: str, name: str, version: str, run_id: str | None,
                 pickled: bool = False, io: dict | None = None):
        self.uri, self.pinned_uri, self.name, self.version, self.run_id = (
            uri, pinned_uri, name, version, run_id
        )
        self.pickled = pickled  # a pytorch-flavour model, allowed by serving.allow_pickled_models
        # A loop's model (training.loop.io): its own inputs and whether its output is the task's.
        self.io = io or {}


def resolve_model(model_uri: str, tracking_uri: str, allow_pickled: bool = False) -> ResolvedModel:
    """Check the model exists (its MLmodel file only, no weights) and pin its version; a
    pytorch-flavour model is refused unless `allow_pickled` (see training.inference.pickled_refusal)."""
    from mlflow.exceptions import MlflowException  # as in resolve_version

    name, version = resolve_version(model_uri, tracking_uri)
    pinned = f"models:/{name}/{version}" if model_uri.startswith("models:/") else model_uri
    try:
        info = model_info(pinned, tracking_uri)
    except (MlflowException, OSError):
        raise ShardlineError(f"model {model_uri} not found in MLflow at {redact(tracking_uri)}") from None
    if not version and info.run_id:
        # runs:/ and path URIs have no registry version; the run id identifies them.
        version = f"run-{info.run_id}"
    pickled = "pytorch" in info.flavors
    if pickled and not allow_pickled:
        raise ShardlineError(pickled_refusal(model_uri))
    io = (getattr(info, "metadata", None) or {}).get("shardline_io")
    return ResolvedModel(model_uri, pinned, name, version, info.run_id, pickled, io)
