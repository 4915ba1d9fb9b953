"""A training job on the driver: check, open the MLflow run, launch ranks, log the model."""

from __future__ import annotations

import io
import logging
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shardline.pipelines import storage
from shardline.pipelines.errors import ConfigError, DataError, ShardlineError, StorageError
from shardline.pipelines.lease import LEASE_NAME, Lease
from shardline.pipelines.manifest import ShardManifest, load_manifest, sequences
from shardline.pipelines.progress import ProgressListener, listen_address
from shardline.pipelines.redact import redact

from . import checkpoints, sharded_checkpoints
from .config import TrackingConfig, TrainingConfig
from .launchers import DriverGuard, TrainingFailed
from .loader import check_world_size, epoch_steps, rows_per_rank
from .mlflow_outage import Outbox, replay, tracked_run, when_reachable
from .model_check import check_callables, check_model
from .model_inputs import ModelInputs
from .models import build_model
from .strategies import get_strategy
from .tracking import describe_version, log_curves, log_dataset_input, open_experiment, run_name
from .worker import TrainJob, train_rank


@dataclass
class TrainResult:
    run_id: str
    tracking_uri: str
    model_name: str
    model_version: str
    metrics: dict[str, float]
    weights: dict[str, torch.Tensor]  # the final plain-model state dict
    stopped_early: bool = False  # the epoch hook stopped it before training.epochs
    # Rank 0's tensor collectives by (call, device type), each checked against the rank's
    # device (training.collectives): shows a job kept the device contract.
    collective_calls: dict = field(default_factory=dict)

    @property
    def model_uri(self) -> str:
        if not self.model_version:  # logged, not registered
            return f"runs:/{self.run_id}/model"
        return f"models:/{self.model_name}/{self.model_version}"


def check_settings(cfg: TrainingConfig) -> None:
    """The checks that need no dataset: run before an engine starts (`shardline run`
    prepares the dataset first, so its preflight comes only after Spark is up)."""
    # The mesh (its degrees multiply to world_size; PS leaves workers): needs no model.
    get_strategy(cfg.strategy).data_world(cfg)
    # The model, loss and metrics import and take their arguments (the user's code: the cwd
    # and training.code_paths on sys.path).
    check_callables(cfg)


def preflight(cfg: TrainingConfig, dataset_dir: str) -> ShardManifest:
    """Every check that can fail before a process starts: the strategy's (mesh, batch
    split, model split) need the model, so the dataset's shape."""
    check_settings(cfg)
    manifest = load_manifest(dataset_dir)
    manifest.split("train")
    strategy = get_strategy(cfg.strategy)
    model = build_model(manifest, cfg)
    check_model(cfg, ModelInputs.from_manifest(manifest), model)  # one forward pass, its output's width
    strategy.check(cfg, model)  # the plans the strategy needs, declared by the model
    check_world_size(manifest, "train", strategy.data_world(cfg))
    check_steps(cfg, manifest, strategy.data_world(cfg))
    return manifest


def check_checkpoints(cfg: TrainingConfig, manifest: ShardManifest) -> None:
    """checkpoint_dir fits the job, before an engine starts: a checkpoint to resume from,
    or, for a new job, no other job's checkpoints (which starting over would delete)."""
    if cfg.resume:
        if checkpoints.latest(cfg.checkpoint_dir) is None:
            raise DataError(f"{storage.display(cfg.checkpoint_dir)}: no checkpoint to resume from")
        checkpoints.check_unfinished(cfg.checkpoint_dir, cfg.epochs, cfg.resume_allow_changed,
                                     checkpoints.fingerprint(cfg, manifest.version_id))
    else:
        checkpoints.check_owner(cfg.checkpoint_dir, checkpoints.fingerprint(cfg, manifest.version_id),
                                own_folder=cfg._own_checkpoint_dir)


def check_steps(cfg: TrainingConfig, manifest: ShardManifest, data_world: int) -> None:
    """No silent non-training: refuse a job whose ranks would take 0 optimizer steps an
    epoch (the global batch split over the data-parallel ranks is more than the train rows
    a rank gets, after `remainder`), naming the numbers and the fix."""
    local = cfg.batch_size // data_world
    if local < 1:
        raise ConfigError(
            f"training.batch_size {cfg.batch_size} is less than the {data_world} data-parallel "
            f"ranks it is split over: set training.batch_size to at least {data_world}"
        )
    per_rank = rows_per_rank(manifest, "train", data_world)
    if epoch_steps(per_rank, local, cfg.remainder) > 0:
        return
    drop = cfg.remainder == "drop"
    limit = min(per_rank) if drop else max(per_rank)
    whose = "the smallest rank gets" if drop else "the largest rank gets"
    fix = (f"set training.batch_size to at most {limit * data_world}" if limit
           else f"re-prepare with more rows or train on fewer than {data_world} data-parallel ranks")
    raise DataError(
        f"training.batch_size {cfg.batch_size} is {local} rows per step on each of {data_world} "
        f"data-parallel rank(s), but {whose} only {limit} train rows (train rows per rank: "
        f"{per_rank}, training.remainder = '{cfg.remainder}'): every epoch would take 0 optimizer "
        f"steps and the model would not train; {fix}"
    )


def describe(cfg: TrainingConfig, manifest: ShardManifest) -> str:
    """What the strategy will do, for the log at start ("" when it has nothing to say)."""
    strategy = get_strategy(cfg.strategy)
    text = getattr(strategy, "describe", None)
    return text(cfg, build_model(manifest, cfg)) if text else ""


def run_training(
    cfg: TrainingConfig,
    tracking: TrackingConfig,
    dataset_dir: str,
    spark=None,
    dask_client=None,
    *,
    into_run: str | None = None,
    register: bool = True,
    epoch_hook: Callable[[int, dict[str, float]], bool] | None = None,
    dask_workers: list[str] | None = None,
    lease: Lease | None = None,
) -> TrainResult:
    """Train, track and log the model. The keywords are for sweeps (training.sweep):

    into_run: report into this existing MLflow run (a child run) instead of a new one.
    register: False logs the model without registering it (its URI is runs:/<id>/model).
    epoch_hook: see TrainJob.epoch_hook.
    dask_workers: the Dask workers the ranks run on (default: the first world_size).
    lease: the checkpoint directory's lease, already held (hold_checkpoint_dir; the CLI takes
    it before an engine starts); default: taken here and released at the end.
    """
    dataset_dir = storage.resolve(dataset_dir, "pipelines.dataset_dir")
    ckpt, own = cfg.checkpoint_dir, cfg._own_checkpoint_dir
    if "checkpoint_dir" not in cfg.model_fields_set:  # unset: a folder of this job's own
        ckpt, own = checkpoints.job_dir(cfg, tracking.experiment, tracking.registered_model, dataset_dir), True
    cfg = cfg.model_copy(update={"checkpoint_dir": storage.resolve(ckpt, "training.checkpoint_dir")})
    cfg._own_checkpoint_dir = own
    checkpoints.check_allowed(cfg.resume_allow_changed)
    _check_capacity(cfg, spark, dask_client)
    # The version checked here is the one every rank reads (and every restart), whatever
    # a prepare commits meanwhile: retention keeps it (pipelines.retention).
    manifest = preflight(cfg, dataset_dir)
    # One job per checkpoint directory, held until its ranks are done; they watch it.
    held = lease or hold_checkpoint_dir(cfg)
    try:
        guard = DriverGuard.for_this_process(held.url, held.job, held.ttl_s)
        return _run_training(cfg, tracking, dataset_dir, manifest, spark, dask_client, guard,
                             into_run, register, epoch_hook, dask_workers)
    finally:
        if lease is None:
            held.release()


def _run_training(cfg, tracking, dataset_dir, manifest, spark, dask_client, guard,
                  into_run, register, epoch_hook, dask_workers) -> TrainResult:
    import mlflow

    resume_from, run_id, changed, head = None, into_run, {}, {}
    check_checkpoints(cfg, manifest)
    if cfg.resume:
        found = checkpoints.readable(cfg.checkpoint_dir, {})  # the newest readable one
        if found is None:
            raise DataError(f"{storage.display(cfg.checkpoint_dir)}: no checkpoint to resume from")
        resume_from = found[0]
        if "dataset_version" not in cfg.resume_allow_changed:
            manifest = _version_of(resume_from, dataset_dir, manifest)
        fp = checkpoints.fingerprint(cfg, manifest.version_id)
        head = checkpoints.load(resume_from, sharded_checkpoints.comparable(fp), cfg.resume_allow_changed)
        # Another mesh than the one that wrote it: refused here unless it reshards.
        data_world = get_strategy(cfg.strategy).data_world(cfg)
        sharded_checkpoints.check_resume(head, cfg, data_world, storage.display(resume_from))
        if head.get("epoch", 0) >= cfg.epochs:  # check_checkpoints says so first, before an engine
            checkpoints.check_unfinished(cfg.checkpoint_dir, cfg.epochs, cfg.resume_allow_changed)
        changed = {k: (head["fingerprint"].get(k), v) for k, v in fp.items()
                   if k in cfg.resume_allow_changed and head.get("fingerprint", {}).get(k) != v}
        print(f"[shardline] resuming from {storage.display(resume_from)} (step {head.get('global_step')}, "
              f"epoch {head.get('epoch')} of {cfg.epochs} done)"
              + "".join(f"; {k} {old} -> {new}" for k, (old, new) in changed.items()),
              file=sys.stderr, flush=True)
        run_id = head["run_id"] or None
    else:
        fp = checkpoints.fingerprint(cfg, manifest.version_id)
        # A new job starts over (stale checkpoints would be resumed by its restarts), but
        # never over another job's checkpoints.
        checkpoints.start_over(cfg.checkpoint_dir, fp, own_folder=cfg._own_checkpoint_dir)
        sharded_checkpoints.prune(cfg.checkpoint_dir)
    uri = tracking.resolved_uri()
    open_experiment(uri, tracking.experiment)
    if run_id:
        run_id = _continue_run(run_id)

    outline = describe(cfg, manifest)
    if outline:
        print(outline, file=sys.stderr, flush=True)
    # Not `with mlflow.start_run()`: its end, with the server down, would bury the job's one line.
    with tracked_run(run_id, None if run_id else run_name(cfg), uri, tracking.outage_wait_s,
                     lambda: checkpoints.latest(cfg.checkpoint_dir)) as run:
        run_id = run.info.run_id
        if outline:
            mlflow.log_text(outline, f"strategy-{cfg.strategy}.txt")
        if cfg.resume and changed:
            _log_changed(changed, head.get("global_step", 0))
        if not cfg.resume:
            mlflow.log_params(_flat(cfg.model_dump()))
            mlflow.log_params(
                {
                    "dataset_dir": dataset_dir,
                    "dataset_version": manifest.version_id,
                    "dataset_sequence": manifest.sequence,
                    **{f"rows_{s}": info.rows for s, info in manifest.splits.items()},
                    # Values prepare filled in (on_invalid_features = impute), per column in the manifest.
                    "imputed_values": sum(manifest.imputed_values.values()),
                }
            )
            log_dataset_input(manifest, dataset_dir)
        job = TrainJob(
            cfg=cfg,
            dataset_dir=dataset_dir,
            dataset_sequence=manifest.sequence,
            tracking_uri=uri,
            run_id=run_id,
            fingerprint=fp,
            resume_from=str(resume_from) if resume_from else None,
            epoch_hook=epoch_hook,
        )
        # Ranks' progress lines reach this console wherever they run (pipelines.progress).
        with ProgressListener(listen_address(cfg.launcher, spark, dask_client)) as listener:
            job.progress_addr = listener.address
            result = _launch_with_restarts(cfg, job, spark, dask_client, dask_workers, guard)
        # What the server was down for, sent now (waiting for it a while, else one line).
        replay(uri, result.get("mlflow_pending", []), tracking.outage_wait_s, checkpoints.latest(cfg.checkpoint_dir))
        if result.get("steps", 1) == 0:
            # Preflight refuses this; a model that never took a step must not be registered.
            raise ShardlineError(
                f"the job took 0 optimizer steps in {cfg.epochs} epoch(s): the model did not train "
                "and is not logged or registered"
            )

        model = build_model(manifest, cfg)
        model.load_state_dict(torch.load(io.BytesIO(result["state_dict"]), weights_only=True))
        # The driver's own calls: a server down as training ends is waited for like one down during it.
        def reachable(call):
            return when_reachable(call, uri, tracking.outage_wait_s, checkpoints.latest(cfg.checkpoint_dir))

        reachable(lambda: log_curves(run_id, [k for k in result["metrics"] if not k.startswith("rank")]))
        version = reachable(lambda: log_model(model, manifest, cfg, tracking.registered_model if register else None))
        if version:
            reachable(lambda: describe_version(tracking.registered_model, version, cfg, manifest, dataset_dir,
                                               result["metrics"]))
    return TrainResult(
        run_id, uri, tracking.registered_model, version, result["metrics"], model.state_dict(),
        stopped_early=result.get("stopped_early", False), collective_calls=result.get("collective_calls", {}),
    )


def _log_changed(changed: dict[str, tuple], step: int) -> None:
    """A resume's allowed changes (--allow-changed lr) in the run: MLflow params cannot
    change, so each new value is a param of its own (`lr.from_step_120`) and a tag says
    what changed, from when."""
    import mlflow

    mlflow.log_params({f"{k}.from_step_{step}": new for k, (_, new) in changed.items()})
    for k, (old, new) in changed.items():
        mlflow.set_tag(f"shardline.resume_changed.{k}", f"{old} -> {new} from step {step}")


def _check_capacity(cfg: TrainingConfig, spark, dask_client) -> None:
    """Enough task slots or workers for every rank, before anything starts."""
    if cfg.launcher == "spark" and spark is not None:
        from shardline.pipelines.spark_probe import check_executors

        from .launchers.spark import check_spark_slots

        check_spark_slots(spark, cfg.world_size)
        check_executors(spark)  # once per session: the CLI has usually run it already
    if cfg.launcher == "dask" and dask_client is not None:
        from .launchers.dask import check_dask_workers

        check_dask_workers(dask_client, cfg.world_size)


def _version_of(checkpoint: str, dataset_dir: str, newest: ShardManifest) -> ShardManifest:
    """The dataset version a checkpoint was written on, if retention still keeps it: a
    resumed job goes on reading what it started on (else the fingerprint check refuses)."""
    written_on = checkpoints.load(checkpoint, {}).get("fingerprint", {}).get("dataset_version")
    if written_on in (None, newest.version_id):
        return newest
    for seq in reversed(sequences(dataset_dir)):
        m = load_manifest(dataset_dir, seq)
        if m.version_id == written_on:
            print(f"[shardline] resuming on dataset version {written_on} (manifest {seq}), the one "
                  f"the checkpoint was written on; the newest is {newest.version_id}", file=sys.stderr, flush=True)
            return m
    return newest


def _continue_run(run_id: str) -> str | None:
    """Resume into the checkpoint's own run (and experiment), if this store has it."""
    import mlflow
    from mlflow.exceptions import MlflowException

    try:
        run = mlflow.get_run(run_id)
    except MlflowException:
        return None  # another tracking store: the resumed job gets a new run
    mlflow.set_experiment(experiment_id=run.info.experiment_id)
    return run_id


def hold_checkpoint_dir(cfg: TrainingConfig) -> Lease:
    """The checkpoint directory's lease: a second job on it is refused (exit 75) naming the
    holder; one that cannot be written ends here, in one line, before any rank starts."""
    url = storage.join(storage.resolve(cfg.checkpoint_dir, "training.checkpoint_dir"), LEASE_NAME)
    lease = Lease(url, f"shardline train {uuid.uuid4().hex[:8]}", ttl_s=cfg.lease_ttl_s,
                  what="training.checkpoint_dir")
    try:
        return lease.acquire()
    except OSError as e:
        raise StorageError(
            f"training.checkpoint_dir {storage.display(cfg.checkpoint_dir)}: cannot write there "
            f"({e.strerror or type(e).__name__})"
        ) from None


def _launch_with_restarts(
    cfg: TrainingConfig, job: TrainJob, spark, dask_client, dask_workers=None, guard=None
) -> dict:
    """Launch; when a rank is lost, relaunch from the latest checkpoint, max_restarts times.

    The launcher owns restarts: Spark does not retry a failed barrier result stage,
    and a Dask task on a killed worker is never resolved (both seen with Spark 4.3 and
    Dask 2026.8). A permanent failure (launchers.guard: permissions, a full disk, bad
    data) is never retried.
    """
    from mlflow.tracking import MlflowClient

    from .user_code import job_code_folders

    # Found once, on the driver: every attempt's ranks import the same code.
    user_code = job_code_folders(cfg)
    # Restarts never wait on MLflow: the count is kept while the server is down.
    outbox = Outbox(MlflowClient(job.tracking_uri)) if job.tracking_uri and job.run_id else None
    for attempt in range(cfg.max_restarts + 1):
        try:
            result = _launch(cfg, job, spark, dask_client, attempt > 0, dask_workers, guard, user_code)[0]
            if outbox is not None:
                result["mlflow_pending"] = outbox.pending() + result.get("mlflow_pending", [])
            return result
        except TrainingFailed as e:
            if e.permanent or attempt == cfg.max_restarts:
                raise
            if guard is not None and (why := guard.gone()):
                raise ShardlineError(f"not restarting: {why}") from None  # another job has the directory
            # The newest checkpoint a rank can read (a truncated newest one is skipped, said once).
            found = checkpoints.readable(cfg.checkpoint_dir, job.fingerprint or {}, cfg.resume_allow_changed)
            latest = found[0] if found else None
            job.resume_from = latest
            if outbox is not None:
                outbox.send(("batch", job.run_id, [("restarts", float(attempt + 1), int(time.time() * 1000), 0)]))
            where = storage.name(latest) if latest else "the start"
            print(redact(f"[shardline] {e}; restarting from {where}"), file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


def _launch(
    cfg: TrainingConfig, job: TrainJob, spark, dask_client, relaunch: bool, dask_workers=None, guard=None,
    user_code: list[str] | None = None,
) -> list:
    user_code = user_code or []
    if cfg.launcher == "spark":
        from .launchers.spark import launch_spark_barrier

        if spark is None:
            raise ConfigError("training.launcher = 'spark' needs a Spark session")
        return launch_spark_barrier(spark, train_rank, job, cfg.world_size, cfg.timeout_s, guard,
                                    user_code=user_code)
    if cfg.launcher == "dask":
        from .launchers.dask import launch_dask

        if dask_client is None:
            raise ConfigError("training.launcher = 'dask' needs a Dask client")
        wait = 60 if relaunch else 0
        return launch_dask(
            dask_client, train_rank, job, cfg.world_size, cfg.timeout_s, wait, workers=dask_workers,
            guard=guard, user_code=user_code,
        )
    from .launchers.local import launch_local

    return launch_local(train_rank, job, cfg.world_size, cfg.timeout_s, guard, user_code=user_code)


def log_model(model: torch.nn.Module, manifest: ShardManifest, cfg: TrainingConfig,
              registered_name: str | None) -> str:
    """Log the model as a pyfunc that takes raw rows (training.raw_model: the dataset's
    transform inside, raw-feature signature and input example); register it if named.

    Returns the registered version, or "" when not registered.
    """
    from .raw_model import log_raw_model

    model.eval()
    # MLflow warns that the pyfunc's python_model and the signature's optional key column
    # are its own choices to document; both are deliberate here.
    logging.getLogger("mlflow.pyfunc").setLevel(logging.ERROR)
    logging.getLogger("mlflow.models.model").setLevel(logging.ERROR)
    import safetensors

    info = log_raw_model(
        model, manifest, cfg, registered_name,
        # Without an explicit list MLflow spends ~10 s inferring one.
        pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", f"safetensors=={safetensors.__version__}",
                          "pydantic", "pyarrow", "pandas"],
    )
    return str(info.registered_model_version) if registered_name else ""


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
