"""The per-worker model cache: a model is loaded once per Python worker process."""

from __future__ import annotations

_CACHE: dict[tuple[str, str], object] = {}


def cached_model(model_uri: str, tracking_uri: str):
    key = (model_uri, tracking_uri)
    if key not in _CACHE:
        import mlflow
        import torch

        mlflow.set_tracking_uri(tracking_uri)
        model = mlflow.pytorch.load_model(model_uri, map_location="cpu")
        if torch.cuda.is_available():
            model = model.cuda()
        _CACHE[key] = model.eval()
    return _CACHE[key]


def resolve_version(model_uri: str, tracking_uri: str) -> tuple[str, str]:
    """(registered name, version) of a models:/ URI; (uri, '') for other URIs."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from pipelines.errors import ShardlineError

    client = MlflowClient(tracking_uri)
    if not model_uri.startswith("models:/"):
        return model_uri, ""
    ref = model_uri[len("models:/") :]
    try:
        if "@" in ref:
            name, alias = ref.split("@", 1)
            return name, str(client.get_model_version_by_alias(name, alias).version)
        name, _, version = ref.partition("/")
        if version in ("", "latest"):
            versions = client.search_model_versions(f"name='{name}'")
            if not versions:
                raise MlflowException(f"no versions of {name}")
            return name, str(max(versions, key=lambda v: int(v.version)).version)
        return name, str(client.get_model_version(name, version).version)
    except MlflowException:
        raise ShardlineError(f"model {model_uri} not found in MLflow at {tracking_uri}") from None
