"""A training job on the driver: resolved once, checked before anything happens, then run.

`TrainingJob.resolve` turns the training section into one object: the paths every host
opens (dataset, checkpoint folder, MLflow store), the user's code as one snapshot (a zip
named by its content, which every rank and every restart imports, and which the driver
imports too: training.user_code.refresh_driver_code), and the strategy.

`check` runs every check that can refuse the job — the settings, the dataset, the model
(built here once, one forward pass on a batch of the dataset's shape), the strategy's
plans, the checkpoint folder, the MLflow store — and writes, deletes, launches and logs
nothing: a refused job leaves every byte and every MLflow run as it was.

`run` then does the effects, in one ordered place: the checkpoint folder held (one job
per folder), the MLflow run opened (or continued), the folder started over (a new job),
the ranks launched (relaunched from the latest checkpoint when one is lost: training.
restarts), the trained weights loaded into the model the checks built, logged and
registered.
"""

from __future__ import annotations

import io
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardline.pipelines import report, storage
from shardline.pipelines.code_travel import UserCode, snapshot
from shardline.pipelines.errors import ConfigError, DataError, ShardlineError, StorageError
from shardline.pipelines.lease import LEASE_NAME, Lease
from shardline.pipelines.manifest import ShardManifest, load_manifest, sequences
from shardline.pipelines.progress import ProgressListener, listen_address

from . import checkpoints, sharded_checkpoints
from .config import TrackingConfig, TrainingConfig
from .launchers import DriverGuard
from .loader import check_world_size, epoch_steps, rows_per_rank
from .mlflow_outage import replay, tracked_run, when_reachable
from .model_check import check_callables, check_model
from .model_inputs import ModelInputs
from .models import build_model
from .restarts import launch_with_restarts
from .result import TrainResult
from .strategies import get_strategy
from .tracking import check_store, describe_version, log_curves, log_dataset_input, open_experiment, run_name
from .user_code import job_code_folders, refresh_driver_code
from .worker import RankJob


@dataclass
class Resume:
    """The checkpoint a resumed job continues from, as the checks found it."""

    url: str  # its small file
    head: dict  # what the small file holds (training.checkpoints)
    changed: dict[str, tuple]  # allowed changes (--allow-changed): field -> (old, new)


class TrainingJob:
    """One training job on the driver (see the module docstring)."""

    def __init__(self, cfg: TrainingConfig, tracking: TrackingConfig, dataset_dir: str, *,
                 own_checkpoint_dir: bool, code: UserCode | None):
        self.cfg, self.tracking, self.dataset_dir = cfg, tracking, dataset_dir
        self.own_checkpoint_dir = own_checkpoint_dir
        self.code = code
        self.strategy = get_strategy(cfg.strategy)
        # Found by check(): what run() acts on.
        self.manifest: ShardManifest | None = None
        self.model: torch.nn.Module | None = None
        self.fingerprint: dict[str, str] = {}
        self.resume: Resume | None = None
        self.replaced: list[str] = []  # a new job in its own folder: what of its earlier run it replaces
        self.outline = ""

    @classmethod
    def resolve(cls, cfg: TrainingConfig, tracking: TrackingConfig, dataset_dir: str, *,
                own_checkpoint_dir: bool | None = None) -> TrainingJob:
        """Paths as every host opens them, the strategy, and the user's code, once.

        An unset checkpoint_dir is this job's own folder (training.checkpoints.job_dir):
        own_checkpoint_dir says so when the caller derived it already (shardline.config)."""
        dataset_dir = storage.resolve(dataset_dir, "pipelines.dataset_dir")
        own = bool(own_checkpoint_dir) or cfg._own_checkpoint_dir
        ckpt = cfg.checkpoint_dir
        if "checkpoint_dir" not in cfg.model_fields_set:
            ckpt, own = checkpoints.job_dir(cfg, tracking.experiment, tracking.registered_model, dataset_dir), True
        cfg = cfg.model_copy(update={"checkpoint_dir": storage.resolve(ckpt, "training.checkpoint_dir")})
        tracking = tracking.model_copy(update={"tracking_uri": tracking.resolved_uri()})
        checkpoints.check_allowed(cfg.resume_allow_changed)
        # The user's code as it is now: the driver's checks and every rank use these bytes.
        code = snapshot(job_code_folders(cfg))
        refresh_driver_code(code)
        return cls(cfg, tracking, dataset_dir, own_checkpoint_dir=own, code=code)

    @property
    def tracking_uri(self) -> str:
        return self.tracking.tracking_uri

    # -- checks: read only ---------------------------------------------------------------

    def check(self) -> TrainingJob:
        """Every check that can refuse the job before an engine starts, in the order a user
        would fix them: settings, dataset and model, checkpoints, the MLflow store."""
        self.check_model_and_data()
        self._check_checkpoints()
        check_store(self.tracking_uri)  # a dead server, a missing database driver: now, in one line
        return self

    def check_settings(self) -> None:
        """The checks that need no dataset (`shardline run` makes the dataset first)."""
        # The mesh (its degrees multiply to world_size; PS leaves workers): needs no model.
        self.strategy.data_world(self.cfg)
        # The model, loss and metrics import and take their arguments.
        check_callables(self.cfg)

    def check_model_and_data(self) -> ShardManifest:
        """The dataset, and the model built once for it: one forward pass, the strategy's
        plans, enough shards and rows for every rank to take a step."""
        cfg = self.cfg
        self.check_settings()
        # The version checked here is the one every rank reads (and every restart), whatever a
        # prepare commits meanwhile: retention keeps it (pipelines.retention).
        manifest = load_manifest(self.dataset_dir)
        manifest.split("train")
        self.model = build_model(manifest, cfg)
        check_model(cfg, ModelInputs.from_manifest(manifest), self.model)
        self.strategy.check(cfg, self.model)  # the plans the strategy needs, declared by the model
        data_world = self.strategy.data_world(cfg)
        check_world_size(manifest, "train", data_world)
        check_steps(cfg, manifest, data_world)
        describe = getattr(self.strategy, "describe", None)
        self.outline = describe(cfg, self.model) if describe else ""
        self.manifest = manifest
        return manifest

    def check_folder(self) -> None:
        """What can be told of the checkpoint folder before the dataset exists (`shardline
        run` prepares it first): a checkpoint to resume from; for a new job, no other job's
        checkpoints (their dataset version is no part of that comparison)."""
        cfg = self.cfg
        if cfg.resume:
            if checkpoints.latest(cfg.checkpoint_dir) is None:
                raise DataError(f"{storage.display(cfg.checkpoint_dir)}: no checkpoint to resume from")
            return
        checkpoints.check_owner(cfg.checkpoint_dir, checkpoints.fingerprint(cfg, ""),
                                own_folder=self.own_checkpoint_dir)

    def _check_checkpoints(self) -> None:
        """The checkpoint folder fits the job: a checkpoint to resume from, of this job, at a
        mesh it reshards to, not already the job's end; or, for a new job, no other job's
        checkpoints (starting over would delete them)."""
        cfg, where = self.cfg, storage.display(self.cfg.checkpoint_dir)
        allowed = cfg.resume_allow_changed
        if not cfg.resume:
            self.fingerprint = checkpoints.fingerprint(cfg, self.manifest.version_id)
            self.replaced = checkpoints.check_owner(cfg.checkpoint_dir, self.fingerprint,
                                                    own_folder=self.own_checkpoint_dir)
            return
        if checkpoints.latest(cfg.checkpoint_dir) is None:
            raise DataError(f"{where}: no checkpoint to resume from")
        checkpoints.check_unfinished(cfg.checkpoint_dir, cfg.epochs, allowed,
                                     checkpoints.fingerprint(cfg, self.manifest.version_id))
        found = checkpoints.readable(cfg.checkpoint_dir, {})  # the newest readable one
        if found is None:
            raise DataError(f"{where}: no checkpoint to resume from")
        url = found[0]
        if "dataset_version" not in allowed:
            self.manifest = _version_of(url, self.dataset_dir, self.manifest)
        fp = checkpoints.fingerprint(cfg, self.manifest.version_id)
        head = checkpoints.load(url, sharded_checkpoints.comparable(fp), allowed)
        # Another mesh than the one that wrote it: refused here unless it reshards.
        sharded_checkpoints.check_resume(head, cfg, self.strategy.data_world(cfg), storage.display(url))
        if head.get("epoch", 0) >= cfg.epochs:
            checkpoints.check_unfinished(cfg.checkpoint_dir, cfg.epochs, allowed)
        saved = head.get("fingerprint", {})
        changed = {k: (saved.get(k), v) for k, v in fp.items() if k in allowed and saved.get(k) != v}
        self.fingerprint, self.resume = fp, Resume(url, head, changed)

    def check_capacity(self, spark=None, dask_client=None) -> None:
        """Enough task slots or workers for every rank: the one check that needs the engine."""
        cfg = self.cfg
        if cfg.launcher == "spark" and spark is not None:
            from shardline.pipelines.spark_probe import check_executors

            from .launchers.spark import check_spark_slots

            check_spark_slots(spark, cfg.world_size)
            check_executors(spark)  # once per session: the API has usually run it already
        if cfg.launcher == "dask" and dask_client is not None:
            from .launchers.dask import check_dask_workers

            check_dask_workers(dask_client, cfg.world_size)

    def hold(self) -> Lease:
        """The checkpoint folder's lease: a second job on it is refused (exit 75) naming the
        holder; one that cannot be written ends here, in one line, before any rank starts.
        Folders made only to hold it go when it is released (a refused job leaves nothing)."""
        return hold_checkpoint_dir(self.cfg)

    # -- effects, in order ---------------------------------------------------------------

    def run(self, spark=None, dask_client=None, *, lease: Lease | None = None, into_run: str | None = None,
            register: bool = True, epoch_hook: Callable[[int, dict[str, float]], bool] | None = None,
            dask_workers: list[str] | None = None) -> TrainResult:
        """Train, track, log and register (after `check`, and `check_capacity` on the engine
        given). The keywords are for sweeps
        (training.sweep): into_run reports into an existing (child) run; register=False
        logs the model without registering it; epoch_hook: see RankJob.epoch_hook;
        dask_workers: the workers the ranks run on. lease: the folder's lease, already held
        (the API takes it first); default: taken here and released at the end."""
        if self.manifest is None:
            raise AssertionError("TrainingJob.run before check")
        held = lease or self.hold()
        try:
            guard = DriverGuard.for_this_process(held.url, held.job, held.ttl_s)
            return self._run(spark, dask_client, guard, into_run, register, epoch_hook, dask_workers)
        finally:
            if lease is None:
                held.release()

    def _run(self, spark, dask_client, guard, into_run, register, epoch_hook, dask_workers) -> TrainResult:
        import mlflow

        cfg, tracking, manifest, uri = self.cfg, self.tracking, self.manifest, self.tracking_uri
        run_id = into_run
        if self.resume:
            head = self.resume.head
            report.line(f"[shardline] resuming from {storage.display(self.resume.url)} (step "
                        f"{head.get('global_step')}, epoch {head.get('epoch')} of {cfg.epochs} done)"
                        + "".join(f"; {k} {old} -> {new}" for k, (old, new) in self.resume.changed.items()))
            run_id = head["run_id"] or None
        open_experiment(uri, tracking.experiment)
        if run_id:
            run_id = _continue_run(run_id)
        if self.outline:
            report.line(self.outline)

        def latest() -> str | None:
            return checkpoints.latest(cfg.checkpoint_dir)

        # Not `with mlflow.start_run()`: its end, with the server down, would bury the job's one line.
        with tracked_run(run_id, None if run_id else run_name(cfg), uri, tracking.outage_wait_s, latest) as run:
            run_id = run.info.run_id
            if self.outline:
                mlflow.log_text(self.outline, f"strategy-{cfg.strategy}.txt")
            if self.resume is None:
                self._start_over()
                mlflow.log_params(_flat(cfg.model_dump()))
                mlflow.log_params({
                    "dataset_dir": self.dataset_dir, "dataset_version": manifest.version_id,
                    "dataset_sequence": manifest.sequence,
                    **{f"rows_{s}": info.rows for s, info in manifest.splits.items()},
                })
                log_dataset_input(manifest, self.dataset_dir)
            elif self.resume.changed:
                _log_changed(self.resume.changed, self.resume.head.get("global_step", 0))
            job = RankJob(
                cfg=cfg, dataset_dir=self.dataset_dir, dataset_sequence=manifest.sequence, tracking_uri=uri,
                run_id=run_id, fingerprint=self.fingerprint, code=self.code,
                resume_from=self.resume.url if self.resume else None, epoch_hook=epoch_hook,
            )
            # Ranks' progress lines reach this process's reporter wherever they run (pipelines.progress).
            with ProgressListener(listen_address(cfg.launcher, spark, dask_client)) as listener:
                job.progress_addr = listener.address
                result = launch_with_restarts(job, spark, dask_client, dask_workers, guard)
            # What the server was down for, sent now (waiting for it a while, else one line).
            replay(uri, result.get("mlflow_pending", []), tracking.outage_wait_s, latest())
            if result.get("steps", 1) == 0:
                # check_steps refuses this; a model that never took a step must not be registered.
                raise ShardlineError(
                    f"the job took 0 optimizer steps in {cfg.epochs} epoch(s): the model did not train "
                    "and is not logged or registered"
                )
            # The model the checks built (from this job's code), now with the trained weights.
            model = self.model
            model.load_state_dict(torch.load(io.BytesIO(result["state_dict"]), weights_only=True))

            # The driver's own calls: a server down as training ends is waited for like one down during it.
            def reachable(call):
                return when_reachable(call, uri, tracking.outage_wait_s, latest())

            from .raw_model import log_trained_model

            reachable(lambda: log_curves(run_id, [k for k in result["metrics"] if not k.startswith("rank")]))
            name = tracking.registered_model if register else None
            version = reachable(lambda: log_trained_model(model, manifest, cfg, name, self.code))
            if version:
                reachable(lambda: describe_version(tracking.registered_model, version, cfg, manifest,
                                                   self.dataset_dir, result["metrics"]))
        model_uri = f"models:/{tracking.registered_model}/{version}" if version else f"runs:/{run_id}/model"
        return TrainResult(
            run_id, model_uri, tracking.registered_model, version, uri, result["metrics"], cfg.checkpoint_dir,
            cfg.launcher, result.get("stopped_early", False), model.state_dict(), result.get("collective_calls", {}),
        )

    def _start_over(self) -> None:
        """A new job's folder: its own earlier checkpoints go (its restarts would resume them)."""
        directory = self.cfg.checkpoint_dir
        if self.replaced:
            report.line(f"[shardline] starting over in this job's own checkpoint folder {storage.display(directory)}: "
                        f"the checkpoints of its earlier run ({', '.join(self.replaced)}) are replaced "
                        "(--resume --allow-changed would have continued them)")
        checkpoints.clear(directory)
        sharded_checkpoints.prune(directory)


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
    """Resolve, check and run a training job (TrainingJob) in one call: what a sweep's
    trial, the fault runner and the benchmarks use."""
    job = TrainingJob.resolve(cfg, tracking, dataset_dir)
    job.check_capacity(spark, dask_client)  # the engine's slots first: the rest is moot without them
    job.check()
    return job.run(spark, dask_client, lease=lease, into_run=into_run, register=register,
                   epoch_hook=epoch_hook, dask_workers=dask_workers)


def preflight(cfg: TrainingConfig, dataset_dir: str) -> ShardManifest:
    """The dataset and model checks of a job, no checkpoints or MLflow: the bandwidth plan's
    and a sweep's checks of its trials. Returns the manifest checked."""
    return TrainingJob.resolve(cfg, TrackingConfig(), dataset_dir).check_model_and_data()


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


def hold_checkpoint_dir(cfg: TrainingConfig) -> Lease:
    """The checkpoint directory's lease (see TrainingJob.hold)."""
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


def _log_changed(changed: dict[str, tuple], step: int) -> None:
    """A resume's allowed changes (--allow-changed lr) in the run: MLflow params cannot
    change, so each new value is a param of its own (`lr.from_step_120`) and a tag says
    what changed, from when."""
    import mlflow

    mlflow.log_params({f"{k}.from_step_{step}": new for k, (_, new) in changed.items()})
    for k, (old, new) in changed.items():
        mlflow.set_tag(f"shardline.resume_changed.{k}", f"{old} -> {new} from step {step}")


def _version_of(checkpoint: str, dataset_dir: str, newest: ShardManifest) -> ShardManifest:
    """The dataset version a checkpoint was written on, if retention still keeps it: a
    resumed job goes on reading what it started on (else the fingerprint check refuses)."""
    written_on = checkpoints.load(checkpoint, {}).get("fingerprint", {}).get("dataset_version")
    if written_on in (None, newest.version_id):
        return newest
    for seq in reversed(sequences(dataset_dir)):
        m = load_manifest(dataset_dir, seq)
        if m.version_id == written_on:
            report.line(f"[shardline] resuming on dataset version {written_on} (manifest {seq}), the one "
                        f"the checkpoint was written on; the newest is {newest.version_id}")
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


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
