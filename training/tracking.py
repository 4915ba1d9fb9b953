"""MLflow tracking: the driver opens and closes the run, rank 0 reports into it."""

from __future__ import annotations

import base64
import hashlib
import os
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

from shardline.foundation import progress, storage
from shardline.foundation.errors import ShardlineError, first_line
from shardline.foundation.redact import redact
from shardline.pipelines.tables import describe_sources

from .mlflow_outage import Outbox, bound_http, unreachable

# Imported inside the functions that use them: MLflow (~2.5 s: only where MLflow is called); SQLAlchemy (only
# for a database store); matplotlib (only to draw a figure).


class MetricsReporter:
    """Rank 0's handle on the job's one MLflow run (opened by the driver).

    Calls go through an `Outbox` (training.mlflow_outage): while the server is
    unreachable they are kept and training goes on; what is left at the end goes back
    to the driver (`pending`).
    """

    def __init__(self, tracking_uri: str | None, run_id: str | None, progress_addr: str | None = None):
        self.run_id = run_id
        # Its lines go to the driver's console (foundation.progress): a rank's own stderr is
        # an executor's or a Dask worker's log, where nobody reads them during an outage.
        self.progress_addr = progress_addr
        self.client = None
        self.outbox = None
        self.unlogged = 0  # checkpoints not logged as artifacts while the server was down
        self._said = False  # the current outage's line is out
        if tracking_uri and run_id:
            from mlflow.tracking import MlflowClient

            bound_http()
            self.client = MlflowClient(tracking_uri)
            self.outbox = Outbox(self.client)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.outbox is None:
            return
        now = int(time.time() * 1000)
        self.outbox.send(("batch", self.run_id, [(k, float(v), now, step) for k, v in metrics.items()]))

    def pending(self) -> list[tuple]:
        """What could not be sent yet (one last try first)."""
        if self.outbox is None:
            return []
        if self.unlogged > 1:
            progress.say(self.progress_addr, f"[shardline] MLflow was unreachable: {self.unlogged} checkpoints "
                         "in all not logged as artifacts (each is in training.checkpoint_dir)")
        self.outbox.flush(force=True)
        return self.outbox.pending()

    def checkpoint(self, url: str, step: int, artifact: bool, sharded: str | None = None) -> None:
        """Record a checkpoint: always by reference (a tag), as an artifact when asked
        (with its directory of DCP shards, `sharded`, if it has one).

        The artifact goes through the tracking server (proxied artifacts): rank 0 needs
        no credentials of the artifact store, only read access to its own checkpoint.
        """
        if self.outbox is None:
            return
        self.outbox.send(("tag", self.run_id, "checkpoint_latest", url))
        self.log({"checkpoint_step": step}, step)
        if not artifact:
            return
        try:
            if self.outbox.pending():
                raise ConnectionError("kept calls wait for the server")
            self._artifacts(url, sharded)
            self._said = False
        except Exception as e:
            if not unreachable(e):
                raise
            # The server is down: the checkpoint itself is safe in checkpoint_dir. Said once an
            # outage, not for every checkpoint (30 lines in one run), and counted at the end.
            self.unlogged += 1
            if not self._said:
                progress.say(self.progress_addr, f"[shardline] MLflow unreachable: checkpoint {storage.name(url)} "
                             "not logged as an artifact, nor those after it while MLflow is down (counted at the end)")
                self._said = True

    def _artifacts(self, url: str, sharded: str | None) -> None:
        if sharded is not None:
            self._log_dir(sharded, f"checkpoints/{storage.name(sharded)}")
        if not storage.is_remote(url):
            self.client.log_artifact(self.run_id, storage.local_path(url), "checkpoints")
            return
        with tempfile.TemporaryDirectory() as d:
            local = os.path.join(d, storage.name(url))
            with open(local, "wb") as f:
                f.write(storage.read_bytes(url))
            self.client.log_artifact(self.run_id, local, "checkpoints")

    def _log_dir(self, url: str, artifact_path: str) -> None:
        if not storage.is_remote(url):
            self.client.log_artifacts(self.run_id, storage.local_path(url), artifact_path)
            return
        # Through the tracking server (proxied artifacts), like the checkpoint file.
        with tempfile.TemporaryDirectory() as d:
            for f in storage.find_files(url):
                with open(os.path.join(d, storage.name(f)), "wb") as out:
                    out.write(storage.read_bytes(f))
            self.client.log_artifacts(self.run_id, d, artifact_path)


# ------------------------------------------------------------ what a user sees in MLflow


@contextmanager
def callers_store_kept():
    """MLflow keeps its tracking URI in a module global and copies it into
    os.environ["MLFLOW_TRACKING_URI"] (for subprocesses). Work that points MLflow at a
    job's own store (training, scoring, an estimator's predict in the caller's process)
    would leave the caller's later MLflow calls, and shardline's own default for
    tracking.tracking_uri, pointing at that store: both are put back as they were."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    utils = sys.modules.get("mlflow.tracking._tracking_service.utils")
    before = getattr(utils, "_tracking_uri", None)
    try:
        yield
    finally:
        utils = sys.modules.get("mlflow.tracking._tracking_service.utils")
        if utils is not None:
            utils._tracking_uri = before
        if env is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = env


def run_name(cfg) -> str:
    """What the run is, as its name: `train mlp ddp×2`, `train transformer tensor dp2×tp2`."""
    dims = [f"{d}{getattr(cfg, d)}" for d in ("dp", "dp_shard", "tp", "pp") if getattr(cfg, d, None)]
    if dims:
        return f"train {cfg.model} {cfg.strategy} {'×'.join(dims)}"
    return f"train {cfg.model} {cfg.strategy}×{cfg.world_size}"


def dataset_digest(manifest) -> str:
    """A digest of the dataset's contents (its shards' sha256s): the same data, the same digest."""
    h = hashlib.sha256()
    for split in sorted(manifest.splits):
        for shard in manifest.splits[split].shards:
            h.update(f"{split}/{shard.sha256}".encode())
    return h.hexdigest()[:16]


def log_dataset_input(manifest, dataset_dir: str) -> None:
    """The prepared dataset as the active run's input (the UI's Dataset column): named
    `<dataset dir>@<manifest number>` (the whole path or URL: the folders of different
    jobs are all called `dataset`), its source the dataset's URL, digested by content."""
    import mlflow
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.exceptions import MlflowException

    with warnings.catch_warnings():  # a local path matches two source kinds; either is right
        warnings.simplefilter("ignore")
        source = resolve_dataset_source(dataset_dir)
    name = redact(f"{storage.display(dataset_dir)}@{manifest.sequence}")
    datasets = [(MetaDataset(source, name=name, digest=dataset_digest(manifest)), "training")]
    # The tables it was prepared from, by name and version (pipelines.tables): `delta:<path>@v3`,
    # `iceberg:<table>@<snapshot id>`, `spark:<table or query>`, each as an input of its own.
    for table, where in describe_sources(getattr(manifest, "sources", [])):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            table_source = resolve_dataset_source(where) if "://" in where or where.startswith("/") else None
        datasets.append((MetaDataset(table_source or source, name=redact(table),
                                     digest=dataset_digest(manifest)), "source"))
    for dataset, context in datasets:
        _log_input(mlflow, dataset, context, MlflowException)


def log_forecast(dataset_dir: str) -> None:
    """The dataset's forecast (`shardline plan --hosts`, pipelines.manifest.FORECAST_NAME), if
    it has one, into the active run: forecast.json, and its seconds as forecast_* params, to
    read beside the run's own figures."""
    import json

    import mlflow

    from shardline.pipelines.manifest import FORECAST_NAME

    url = storage.join(dataset_dir, FORECAST_NAME)
    if not storage.is_file(url):
        return
    forecast = json.loads(storage.read_bytes(url))
    mlflow.log_dict(forecast, "forecast.json")
    cluster = forecast.get("cluster", {})
    mlflow.log_params({
        "forecast_cluster": f"{cluster.get('hosts')} x {cluster.get('cores')} cores"
                            + (f" x {cluster['gpus']} GPUs" if cluster.get("gpus") else ""),
        **{f"forecast_{k}_s": round(forecast[k]["seconds"], 1) for k in ("prepare", "epoch", "score") if k in forecast},
    })


def _log_input(mlflow, dataset, context: str, error) -> None:
    # A sweep's concurrent trials log the same dataset at once, and the store inserts it
    # after looking for it: the loser of that race fails on the table's unique key (seen on
    # SQLite in a Dask sweep). By the time it tries again the row exists and is only linked.
    for attempt in range(4):
        try:
            mlflow.log_input(dataset, context=context)
            return
        except error:
            if attempt == 3:
                raise
            time.sleep(0.2 * (attempt + 1))


def describe_version(name: str, version: str, cfg, manifest, dataset_dir: str, metrics: dict) -> None:
    """The registered version's description and tags: what it is and what it was trained on."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    shown = {k: metrics[k] for k in ("val_accuracy", "val_loss", "val_rmse", "val_r2") if k in metrics}
    client.update_model_version(name, version, description=(
        f"{cfg.model} trained with {cfg.strategy} on {cfg.world_size} rank(s), {cfg.epochs} epoch(s), "
        f"on dataset {storage.display(dataset_dir)} version {manifest.version_id} (manifest "
        f"{manifest.sequence}); " + ", ".join(f"{k} {v:.4g}" for k, v in shown.items())
    ))
    tags = {
        "dataset_dir": redact(storage.display(dataset_dir)), "dataset_version": manifest.version_id,
        "dataset_sequence": str(manifest.sequence), "dataset_digest": dataset_digest(manifest),
        "model": cfg.model, "strategy": cfg.strategy, "world_size": str(cfg.world_size),
        **{k: f"{v:.6g}" for k, v in shown.items()},
    }
    for k, v in tags.items():
        client.set_model_version_tag(name, version, k, v)


def open_experiment(tracking_uri: str, experiment: str) -> str:
    """Point MLflow at `tracking_uri` and make sure it answers, before any work starts."""
    import mlflow

    bound_http()
    check_reachable(tracking_uri)
    # MLflow prints "🏃 View run … at: URL" / "🧪 View experiment at: URL" on stdout when a run on
    # a server ends: the URL holds the URI's password if it has one, and shardline's summary
    # names the run and the UI already. A user who wants them sets the variable to false.
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    mlflow.set_tracking_uri(tracking_uri)
    try:
        create_beside_store(tracking_uri, experiment)
        return mlflow.set_experiment(experiment).experiment_id
    except Exception as e:
        raise not_usable(tracking_uri, e) from None


def create_beside_store(tracking_uri: str, experiment: str) -> None:
    """A new experiment of a SQLite store keeps its artifacts in `mlruns/` beside the store's
    file. MLflow would put them in `./mlruns` of whatever folder the job ran from: a store
    elsewhere (`sqlite:////data/mlflow.db`) left an `mlruns/` in every working folder. An
    experiment that exists keeps its location."""
    if not tracking_uri.startswith("sqlite:///"):
        return

    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    if client.get_experiment_by_name(experiment) is not None:
        return
    db = Path(tracking_uri[len("sqlite:///"):].partition("?")[0]).resolve()
    location = (db.parent / "mlruns" / quote(experiment, safe="")).as_uri()
    try:
        client.create_experiment(experiment, artifact_location=location)
    except MlflowException:
        if client.get_experiment_by_name(experiment) is None:  # not another job's, made meanwhile
            raise


def not_usable(tracking_uri: str, e: BaseException) -> ShardlineError:
    """The one line for a store MLflow cannot use: the first line of its error."""
    return ShardlineError(f"tracking.tracking_uri: MLflow at {tracking_uri} is not usable ({first_line(e, 200)})")


# MLflow's database stores (SQLAlchemy URLs) other than SQLite, whose driver is a separate package.
_DATABASES = ("postgresql", "mysql", "mssql")


def check_store(tracking_uri: str) -> None:
    """The MLflow store can be used, checked without writing to it (a job refused later
    must leave no run, not even a new experiment): a server answers; a database store's
    driver is installed."""
    check_reachable(tracking_uri)
    check_driver(tracking_uri)


def check_driver(tracking_uri: str) -> None:
    """A database store's driver is installed: without it MLflow fails with a 77-line
    ModuleNotFoundError (score), only once the job's effects have begun, and `shardline ui`'s
    server only after its ready line. SQLAlchemy names the module without connecting."""
    scheme = tracking_uri.split(":", 1)[0].split("+", 1)[0].lower()
    if scheme not in _DATABASES:
        return
    from sqlalchemy.engine import make_url

    try:
        make_url(tracking_uri).get_dialect().import_dbapi()
    except ImportError as e:
        missing = getattr(e, "name", None) or str(e)
        raise ShardlineError(redact(
            f"tracking.tracking_uri: MLflow's {scheme} store needs a database driver that is not "
            f"installed (no module named {missing!r}): install it beside shardline, or use an MLflow "
            "server (tracking.tracking_uri = 'http://host:5000')"
        )) from None
    except Exception as e:  # a malformed URL
        raise ShardlineError(redact(f"tracking.tracking_uri: {tracking_uri} is not a database URL ({e})")) from None


def check_reachable(tracking_uri: str, timeout_s: float = 5.0) -> None:
    """One line, in seconds, when an MLflow server URL does not answer (other stores pass)."""
    if not tracking_uri.startswith(("http://", "https://")):
        return
    # MLflow's client retries a dead server with backoff for minutes; one short
    # probe tells the user at once.

    try:
        urllib.request.urlopen(health_request(tracking_uri), timeout=timeout_s).close()
    except urllib.error.HTTPError:
        pass  # it answered: a server without /health, or behind auth; MLflow decides
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ShardlineError(redact(
            f"tracking.tracking_uri: MLflow at {tracking_uri} is not reachable ({reason})"
        )) from None


def health_request(server_uri: str):
    """A GET of the server's /health. A user and password in the URL (http://u:pw@host/, as
    MLflow's own client takes them) become a Basic authorization header: urllib would read
    `u:pw@host` as the host's name and fail on resolving it."""
    parts = urllib.parse.urlsplit(server_uri.rstrip("/"))
    netloc = parts.hostname or ""
    netloc = f"[{netloc}]" if ":" in netloc else netloc
    netloc += f":{parts.port}" if parts.port else ""
    url = urllib.parse.urlunsplit((parts.scheme, netloc, f"{parts.path}/health", "", ""))
    headers = {}
    if parts.username is not None:
        user = urllib.parse.unquote(parts.username)
        password = urllib.parse.unquote(parts.password or "")
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        headers["Authorization"] = f"Basic {token}"
    return urllib.request.Request(url, headers=headers)


def log_curves(run_id: str, keys: list[str]) -> None:
    """A loss/accuracy/throughput-per-epoch figure, as an artifact of the run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    groups = [[k for k in keys if k.endswith(suffix)] for suffix in ("loss", "accuracy")]
    groups.append(["samples_per_s"])
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 3.5))
    for ax, group in zip(axes, groups):
        for key in group:
            hist = sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)
            if hist:
                ax.plot([m.step + 1 for m in hist], [m.value for m in hist], marker="o", label=key)
        ax.set_xlabel("epoch")
        if ax.get_legend_handles_labels()[0]:  # an empty panel (a regression run's accuracy, a loop's): no legend
            ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    client.log_figure(run_id, fig, "curves.png")
    plt.close(fig)
