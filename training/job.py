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
registered. What the driver writes about the job itself (a resume's lines, a new job's
params) is training.job_records'.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardline.foundation import report, storage
from shardline.foundation.code_travel import UserCode, snapshot
from shardline.foundation.errors import ConfigError, DataError, ShardlineError
from shardline.pipelines.manifest import ShardManifest, load_manifest, sequences
from shardline.foundation.progress import ProgressListener

from .checkpoints import fingerprint, sharded
from .checkpoints.store import CheckpointStore
from .config import TrackingConfig, TrainingConfig
from .launchers import DriverGuard, announced_hosts
from .loader.reader import epoch_steps
from .loader.shards import check_world_size, rows_per_rank
from .mlflow_outage import replay, tracked_run, when_reachable
from .rank_grid import MESH_GRID, rank_grid
from .models.check import check_callables, check_model
from .models.inputs import ModelInputs
from .models.builtin import build_model
from .restarts import launch_with_restarts
from .result import TrainResult
from .trained import log_trained
from .job_records import announce_resume, continue_run, log_changed, log_new_job
from .strategies import strategy_for
from .tracking import check_store, open_experiment, run_name
from .loop.function import LoopFunction, resolve as resolve_loop
from .loop.runner import RankJob
from .user_code import check_driver_imports, job_code_folders, refresh_driver_code

# Imported inside the functions that use them: MLflow (~2.5 s: only where MLflow is called).


@dataclass
class Resume:
    """The checkpoint a resumed job continues from, as the checks found it."""

    url: str  # its small file
    head: dict  # what the small file holds (training.checkpoints.fingerprint)
    changed: dict[str, tuple]  # allowed changes (--allow-changed): field -> (old, new)


class TrainingJob:
    """One training job on the driver (see the module docstring)."""

    def __init__(self, cfg: TrainingConfig, tracking: TrackingConfig, dataset_dir: str, *,
                 store: CheckpointStore, code: UserCode, loop: LoopFunction | None = None):
        self.cfg, self.tracking, self.dataset_dir = cfg, tracking, dataset_dir
        self.store = store  # the checkpoint folder's owner (training.checkpoints.store)
        self.code = code
        # The user's loop (training.loop or the API's loop=), resolved and checked once;
        # None: shardline's own loop trains training.model.
        self.loop = loop
        # The job's strategy, looked up once: its settings and mesh (a mesh that cannot be laid
        # out is refused here); the checks use it and it travels to every rank in the RankJob.
        self.strategy = strategy_for(cfg)
        # Found by check(): what run() acts on.
        self.manifest: ShardManifest | None = None
        self.model: torch.nn.Module | None = None
        self.fingerprint: dict[str, str] = {}
        self.resume: Resume | None = None
        self.outline = ""

    @classmethod
    def resolve(cls, cfg: TrainingConfig, tracking: TrackingConfig, dataset_dir: str, *,
                store: CheckpointStore | None = None, loop: LoopFunction | Callable | None = None) -> TrainingJob:
        """Paths as every host opens them, the checkpoint folder's store, the strategy, and
        the user's code, once. store: the caller's (shardline.config.checkpoint_store, which
        knows whether the config left checkpoint_dir unset); else made here
        (CheckpointStore.for_job: an unset checkpoint_dir is this job's own folder).
        loop: the API's `loop=` (a function, or its LoopFunction), else training.loop's."""
        if loop is not None:
            loop = loop if isinstance(loop, LoopFunction) else LoopFunction.of(loop)
            cfg = cfg.model_copy(update={"loop": loop.path})  # named in the fingerprint and the run's params
        dataset_dir = storage.resolve(dataset_dir, "pipelines.dataset_dir")
        if store is None:
            store = CheckpointStore.for_job(cfg, tracking.experiment, tracking.registered_model, dataset_dir)
        cfg = cfg.model_copy(update={"checkpoint_dir": store.url})
        tracking = tracking.model_copy(update={"tracking_uri": tracking.resolved_uri()})
        fingerprint.check_allowed(cfg.resume_allow_changed, "--allow-changed / training.resume_allow_changed")
        # The user's code as it is now: the driver's checks, the fingerprint and every rank
        # use these bytes.
        code = snapshot(job_code_folders(cfg))
        refresh_driver_code(code)
        # After the refresh: a loop edited since the last job is checked as it is now.
        return cls(cfg, tracking, dataset_dir, store=store, code=code, loop=loop or resolve_loop(cfg))

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
        """The checks that need no dataset (`shardline run` makes the dataset first). The mesh
        (its degrees multiply to world_size; PS leaves workers) was checked as the strategy
        was resolved."""
        # The model, loop, loss and metrics import and take their arguments, from the job's code.
        check_callables(self.cfg, loop_resolved=True)
        check_driver_imports(self.code)

    def check_model_and_data(self) -> ShardManifest:
        """The dataset, and the model built once for it: one forward pass, the strategy's
        plans, enough shards and rows for every rank to take a step."""
        cfg = self.cfg
        self.check_settings()
        # The version checked here is the one every rank reads (and every restart), whatever a
        # prepare commits meanwhile: retention keeps it (pipelines.retention).
        manifest = load_manifest(self.dataset_dir)
        manifest.split("train")
        if self.loop is None:  # a user's loop builds its own models (ctx.prepare checks them on the ranks)
            self.model = build_model(manifest, cfg)
            inputs = ModelInputs.from_manifest(manifest)
            check_model(cfg, inputs, self.model)
            self.strategy.check(cfg, self.model, inputs)  # the plans the strategy needs, declared by the model
            self.outline = self.strategy.describe(cfg, self.model)
        data_world = self.strategy.data_world
        check_world_size(manifest, "train", data_world)
        check_steps(cfg, manifest, data_world)
        self.manifest = manifest
        return manifest

    def check_folder(self) -> None:
        """What can be told of the checkpoint folder before the dataset exists (`shardline
        run` prepares it first): a checkpoint to resume from, over the same code; for a new
        job, no other job's checkpoints (their dataset version is no part of that comparison)."""
        cfg = self.cfg
        fp = fingerprint.fingerprint(cfg, "", self.code)
        if cfg.resume:
            self.store.check_resume(fp, self.code, cfg.epochs, cfg.resume_allow_changed)
        else:
            self.store.check_new(fp)

    def _check_checkpoints(self) -> None:
        """The checkpoint folder fits the job: a checkpoint to resume from, of this job, over
        the same code (unless allowed), at a mesh it reshards to, not already the job's end;
        or, for a new job, no other job's checkpoints (starting over would delete them)."""
        cfg, store, code = self.cfg, self.store, self.code
        allowed = cfg.resume_allow_changed
        if not cfg.resume:
            self.fingerprint = fingerprint.fingerprint(cfg, self.manifest.version_id, code)
            store.check_new(self.fingerprint)
            return
        store.check_resume(fingerprint.fingerprint(cfg, self.manifest.version_id, code), code, cfg.epochs, allowed)
        found = store.readable()  # the newest readable one
        if found is None:
            raise fingerprint.ResumeRefused(f"{store.where}: no checkpoint to resume from")
        url = found[0]
        if "dataset_version" not in allowed:
            self.manifest = _version_of(store, url, self.dataset_dir, self.manifest)
        fp = fingerprint.fingerprint(cfg, self.manifest.version_id, code)
        head = store.read(url, fingerprint.comparable(fp), allowed)
        # Another mesh than the one that wrote it: refused here unless it reshards.
        sharded.check_resume(head, cfg, self.strategy.data_world, storage.display(url))
        if (head.get("epoch") or 0) >= cfg.epochs:  # None: a loop that counts no epochs
            store.check_unfinished(cfg.epochs, allowed)
        saved = head.get("fingerprint", {})
        changed = {k: (saved.get(k), fp[k]) for k in fingerprint.differences(saved, fp) if k in allowed}
        self.fingerprint, self.resume = fp, Resume(url, head, changed)

    def check_capacity(self, engine) -> None:
        """Enough task slots or workers for every rank: the one check that needs the engine
        (`engine`: training.launcher's, shardline.engines.base.Engine)."""
        check_engine(self.cfg, engine)
        engine.check_capacity(self.cfg.world_size)

    def hold(self) -> None:
        """The checkpoint folder's lease (CheckpointStore.hold): a second job on it is refused
        (exit 75) naming the holder; one that cannot be written ends here, in one line, before
        any rank starts. Folders made only to hold it go when it is released (a refused job
        leaves nothing). `self.store.release()` lets it go."""
        self.store.hold(self.cfg.lease_ttl_s)

    # -- effects, in order ---------------------------------------------------------------

    def run(self, engine, *, into_run: str | None = None, register: bool = True,
            epoch_hook: Callable[[int, dict[str, float]], bool] | None = None,
            workers: list[str] | None = None) -> TrainResult:
        """Train, track, log and register (after `check`, and `check_capacity` on `engine`).
        engine: training.launcher's (shardline.engines.base.Engine): the job asks it for its
        listen_address and to launch_ranks, nothing else. The keywords are for sweeps
        (training.sweeps.trials): into_run reports into an existing (child) run; register=False
        logs the model without registering it; epoch_hook: see RankJob.epoch_hook;
        workers: where the ranks run (a trial's group of the engine's Slots.workers). The
        folder's hold: the caller's if it holds it already (the API takes it first), else
        taken here and released at the end."""
        if self.manifest is None:
            raise AssertionError("TrainingJob.run before check")
        check_engine(self.cfg, engine)
        held_here = self.store.lease is None
        held = self.store.hold(self.cfg.lease_ttl_s)
        try:
            guard = DriverGuard.for_this_process(held.url, self.store.stop_file, held.job, held.ttl_s)
            return self._run(engine, guard, into_run, register, epoch_hook, workers)
        finally:
            if held_here:
                self.store.release()

    def _run(self, engine, guard, into_run, register, epoch_hook, workers) -> TrainResult:
        import mlflow

        cfg, tracking, manifest, uri, store = self.cfg, self.tracking, self.manifest, self.tracking_uri, self.store
        run_id, code_changes = into_run, []
        if self.resume:
            run_id, code_changes = announce_resume(self.resume, self.code, cfg.epochs)
        open_experiment(uri, tracking.experiment)
        if run_id:
            run_id = continue_run(run_id)
        if self.outline:
            report.line(self.outline)

        latest = store.latest
        # Not `with mlflow.start_run()`: its end, with the server down, would bury the job's one line.
        with tracked_run(run_id, None if run_id else run_name(cfg), uri, tracking.outage_wait_s, latest) as run:
            run_id = run.info.run_id
            if self.outline:
                mlflow.log_text(self.outline, f"strategy-{cfg.strategy}.txt")
            # The ranks on the mesh (training.rank_grid), hosts as the engine knows them before
            # launch; logged again with the hosts the ranks reported once they ran.
            before = engine.hosts_before_launch(cfg.world_size)
            mlflow.log_text(rank_grid(cfg, manifest, before, self.model), MESH_GRID)
            if self.resume is None:
                # A new job starts over (stale checkpoints would be resumed by its restarts),
                # never over another job's checkpoints (check() refused those).
                store.start_over(self.fingerprint)
                # The mesh as resolved (mesh.tp 2 however it was asked for), under the settings' names.
                mesh = self.strategy.mesh.as_settings() if self.strategy.mesh else {}
                log_new_job(cfg, mesh, manifest, self.dataset_dir, self.code)
            elif self.resume.changed:
                log_changed(self.resume.changed, self.resume.head.get("global_step", 0), code_changes)
            result = self._train(engine, run_id, epoch_hook, workers, guard)
            model, version = log_trained(self, result, run_id, register)
        if model is None:  # a user's loop that called no ctx.register
            model_uri = None
            report.line("[shardline] no model was registered: the loop called no ctx.register")
        else:
            model_uri = f"models:/{tracking.registered_model}/{version}" if version else f"runs:/{run_id}/model"
        return TrainResult(
            run_id, model_uri, tracking.registered_model, version or "", uri, result["metrics"], cfg.checkpoint_dir,
            cfg.launcher, result.get("stopped_early", False), model.state_dict() if model is not None else {},
            result.get("collective_calls", {}),
        )

    def _train(self, engine, run_id: str, epoch_hook, workers, guard) -> dict:
        """The ranks launched (and relaunched when one is lost) into the open run `run_id`; what
        the server missed meanwhile sent; the grid logged with the hosts the ranks ran on."""
        import mlflow

        cfg, manifest, uri, latest = self.cfg, self.manifest, self.tracking_uri, self.store.latest
        job = RankJob(
            cfg=cfg, dataset_dir=self.dataset_dir, dataset_sequence=manifest.sequence, tracking_uri=uri,
            strategy=self.strategy, run_id=run_id, fingerprint=self.fingerprint, code=self.code,
            resume_from=self.resume.url if self.resume else None, epoch_hook=epoch_hook, loop=self.loop,
        )
        # Ranks' progress lines reach this process's reporter wherever they run (foundation.progress).
        with ProgressListener(engine.listen_address()) as listener:
            job.progress_addr = listener.address
            result = launch_with_restarts(job, self.store, engine, workers, guard)
        # What the server was down for, sent now (waiting for it a while, else one line).
        replay(uri, result.get("mlflow_pending", []), self.tracking.outage_wait_s, latest())
        if result.get("steps") == 0:
            # check_steps refuses this; a model that never took a step must not be registered.
            raise ShardlineError(
                f"the job took 0 optimizer steps in {cfg.epochs} epoch(s): the model did not train "
                "and is not logged or registered"
            )
        hosts = announced_hosts(job.ranks_dir, cfg.world_size)
        if hosts:  # the grid again, with the hosts the ranks ran on
            when_reachable(lambda: mlflow.log_text(rank_grid(cfg, manifest, hosts, self.model), MESH_GRID),
                           uri, self.tracking.outage_wait_s, latest())
        return result


def run_training(
    cfg: TrainingConfig,
    tracking: TrackingConfig,
    dataset_dir: str,
    engine,
    *,
    into_run: str | None = None,
    register: bool = True,
    epoch_hook: Callable[[int, dict[str, float]], bool] | None = None,
    workers: list[str] | None = None,
    store: CheckpointStore | None = None,
) -> TrainResult:
    """Resolve, check and run a training job (TrainingJob) in one call on `engine` (training.
    launcher's, shardline.engines.base.Engine): what a sweep's trial, the fault runner and the
    benchmarks use. store: the job's checkpoint store (CheckpointStore.for_job), held already
    or not; default: made from cfg."""
    job = TrainingJob.resolve(cfg, tracking, dataset_dir, store=store)
    job.check_capacity(engine)  # the engine's slots first: the rest is moot without them
    job.check()
    return job.run(engine, into_run=into_run, register=register, epoch_hook=epoch_hook, workers=workers)


def check_engine(cfg: TrainingConfig, engine) -> None:
    """The engine given is the one training.launcher names (the API chose it by that name)."""
    if engine.name != cfg.launcher:
        raise ConfigError(f"training.launcher = '{cfg.launcher}', but the engine given is {engine.name}'s")


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


def _version_of(store: CheckpointStore, checkpoint: str, dataset_dir: str, newest: ShardManifest) -> ShardManifest:
    """The dataset version a checkpoint was written on, if retention still keeps it: a
    resumed job goes on reading what it started on (else the fingerprint check refuses)."""
    written_on = store.read(checkpoint).get("fingerprint", {}).get("dataset_version")
    if written_on in (None, newest.version_id):
        return newest
    for seq in reversed(sequences(dataset_dir)):
        m = load_manifest(dataset_dir, seq)
        if m.version_id == written_on:
            report.line(f"[shardline] resuming on dataset version {written_on} (manifest {seq}), the one "
                        f"the checkpoint was written on; the newest is {newest.version_id}")
            return m
    return newest
