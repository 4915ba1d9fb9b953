"""Resuming at another world size: a checkpoint of 4 ranks continues on 2, and the reverse.

What "matches" means here. The loader's order depends on how many ranks read data
(rank r of w reads shards r, r+w, ... shuffled per (seed, epoch, rank)), so a run
resumed on another mesh cannot repeat the batches the original mesh would have seen:
there is no uninterrupted run to be bit-equal to. What it must equal is single-process
training continued from the same checkpoint on the batches the new mesh reads: this
test loads the checkpoint (its DCP directory, whatever strategy wrote it) into one plain
model and AdamW in this process, and steps it on each global batch of the new mesh — its data-parallel
ranks' local batches concatenated in rank order (their mean-loss gradients average to
that batch's) — for the remaining epochs. The resumed job's final weights must lie within
relative distance 1e-5 of that (AdamW fp32's tolerance, tests/test_equivalence.py), and a
continuation that lost the optimizer state must not. Checkpoints are taken at an epoch
end: mid-epoch, another data-parallel degree is refused (tested through the CLI).
"""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest
import torch

from shardline.engines import LocalEngine
from shardline.pipelines.manifest import load_manifest
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from shardline.training.checkpoints import sharded
from shardline.training.checkpoints.state import TENSORS, read_tensors
from shardline.training.checkpoints.store import CheckpointStore
from shardline.training.config import TrackingConfig, TrainingConfig
from shardline.training.job import run_training
from shardline.training.loader.reader import ShardLoader
from shardline.training.models.builtin import build_model
from shardline.training.strategies.base import train_step
from shardline.training.strategies.precision import Precision
from shardline.training.loop.recipe import lr_factor, make_optimizer

from .conftest import shardline_here, small_pipeline
from .dist_helpers import relative_distance

TOLERANCE = 1e-5
COMMON = dict(launcher="local", epochs=2, batch_size=128, hidden=[64, 32], timeout_s=120, keep_checkpoints=100)
TRANSFORMER = dict(model="transformer", hidden=[16, 16], heads=4)


@pytest.fixture(scope="module")
def prepared4(spark, tmp_path_factory):
    """4 train shards: enough for 4 data-parallel ranks."""
    from shardline.engines import SparkEngine
    from shardline.pipelines.prepare import prepare

    cfg = small_pipeline(tmp_path_factory.mktemp("prepared4"), rows=6000, world_size=4)
    prepare(SparkEngine(spark), cfg)
    return cfg


@pytest.fixture(scope="module")
def first_runs(prepared4, tmp_path_factory):
    """`first_run(settings)`: the checkpoint_dir of a first job with those settings, stopped
    after its first epoch; each distinct job trained once per module. The 4-rank FSDP job
    both resumes on 2 ranks (its epoch-end checkpoint) and is refused a resume from mid-epoch
    (its step-5 checkpoint): checkpoint_every_steps shapes neither its weights nor its
    fingerprint, so one job serves both tests."""
    done: dict[str, str] = {}

    def first_run(settings: dict) -> str:
        key = repr(sorted(settings.items()))
        if key not in done:
            cfg = TrainingConfig(**{**COMMON, **settings,
                                    "checkpoint_dir": str(tmp_path_factory.mktemp("first") / "ckpt")})
            run_training(cfg, TrackingConfig(experiment="resume-world"), prepared4.dataset_dir, LocalEngine(), register=False,
                         epoch_hook=stop_after_first_epoch)
            done[key] = cfg.checkpoint_dir
        return done[key]

    return first_run


def stop_after_first_epoch(epoch: int, metrics: dict) -> bool:
    """The first job's epoch hook: its epoch-1 checkpoint is written, then it stops (a
    config of 1 epoch would differ in the checkpoint's fingerprint: epochs shape the schedule)."""
    return True


def _epoch_end(checkpoint_dir: str, epoch: int) -> Path:
    for path in CheckpointStore(checkpoint_dir).paths():
        head = torch.load(path, weights_only=True)
        if head["epoch"] == epoch and head["step_in_epoch"] == 0:
            return Path(path)
    raise AssertionError(f"no epoch-end checkpoint of epoch {epoch} in {checkpoint_dir}")


def _copy_checkpoint(saved: Path, into: Path) -> None:
    """`saved` (and its DCP directory) alone in a new checkpoint_dir: with no LATEST
    pointer there, a resume takes it as the newest."""
    into.mkdir()
    shutil.copy(saved, into / saved.name)
    sharded = torch.load(saved, weights_only=True)["sharded"]
    shutil.copytree(saved.parent / sharded, into / sharded)


def continued_single_process(head_path: Path, cfg: TrainingConfig, data_world: int, dataset_dir: str,
                             keep_optimizer: bool = True) -> dict:
    """One process continues from the checkpoint on the new mesh's global batches."""
    head = torch.load(head_path, weights_only=True)
    manifest = load_manifest(dataset_dir)
    model = build_model(manifest, cfg)
    optimizer = make_optimizer(model.parameters(), cfg)
    # No process group here: DCP reads every piece itself, whichever strategy and ranks
    # wrote them. keep_optimizer False: the state goes to a throwaway optimizer. The
    # hyperparameters (the schedule's lr) are a rank's plain values, in the small file.
    into = optimizer if keep_optimizer else make_optimizer(model.parameters(), cfg)
    state = {"model": model, "optimizer": into}
    groups = next(r["optimizer"]["param_groups"] for r in head["ranks"] if "optimizer" in r)
    mine = get_optimizer_state_dict(model, into)["param_groups"]
    saved = {"model": TENSORS, "optimizer": {"state": TENSORS, "param_groups": [
        {**g, **{k: v for k, v in theirs.items() if k != "params"}} for g, theirs in zip(mine, groups, strict=True)]}}
    read_tensors(state, str(head_path.parent / head["sharded"]), saved_tree=saved)
    loaders = [
        ShardLoader(manifest, dataset_dir, "train", r, data_world, cfg.batch_size // data_world, cfg.seed,
                    remainder=cfg.remainder, shuffle_buffer_rows=cfg.shuffle_buffer_rows)
        for r in range(data_world)
    ]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg, cfg.epochs * loaders[0].steps_per_epoch()))
    # Every rank runs the same schedule; a ps worker (rank 0) has none.
    scheduler.load_state_dict(next(r["scheduler"] for r in head["ranks"] if r.get("scheduler")))
    autocast = Precision.of(cfg).autocast(torch.device("cpu"))
    for epoch in range(head["epoch"], cfg.epochs):
        for parts in zip(*(loader.epoch(epoch) for loader in loaders)):
            x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            model.train()
            train_step(model, optimizer, autocast, x, y)
            scheduler.step()
    return model.state_dict()


@pytest.mark.slow
@pytest.mark.parametrize(
    "first, then",
    [
        (dict(strategy="fsdp", world_size=4, checkpoint_every_steps=5), dict(strategy="fsdp", world_size=2)),
        (dict(strategy="fsdp", world_size=2), dict(strategy="fsdp", world_size=4, mesh={"dp_replicate": 2, "dp_shard": 2})),
        (dict(strategy="tensor", world_size=2, model="transformer", hidden=[16, 16], heads=4),
         dict(strategy="tensor", world_size=4, mesh={"dp_replicate": 2, "tp": 2}, model="transformer", hidden=[16, 16],
              heads=4)),
        (dict(strategy="ddp", world_size=4), dict(strategy="ddp", world_size=2)),
        (dict(strategy="ddp", world_size=2), dict(strategy="ddp", world_size=4)),
        (dict(strategy="tensor", world_size=4, mesh={"dp_shard": 2, "tp": 2}), dict(strategy="tensor", world_size=2)),
        # The mlp's 4 layers, one stage per rank (the first, its feature input, holds no
        # parameters here: that rank has no optimizer and saved no schedule), then two per rank.
        (dict(strategy="pipeline", world_size=4), dict(strategy="pipeline", world_size=2)),
        (dict(strategy="pipeline", world_size=2), dict(strategy="pipeline", world_size=4, mesh={"dp_replicate": 2, "pp": 2})),
        # 2 servers' shards into 1, and 1 server's into 2.
        (dict(strategy="ps", world_size=4, ps={"servers": 2}), dict(strategy="ps", world_size=2, ps={"servers": 1})),
        (dict(strategy="ps", world_size=2, ps={"servers": 1}), dict(strategy="ps", world_size=4, ps={"servers": 2})),
        # One checkpoint path for every mesh (#55 item 4): {dp_shard 2, tp 2} resumed without
        # tensor parallel, without data parallel, and as pipeline stages split by tp.
        (dict(world_size=4, mesh={"dp_shard": 2, "tp": 2}, **TRANSFORMER), dict(strategy="fsdp", world_size=4,
                                                                             **TRANSFORMER)),
        (dict(world_size=4, mesh={"dp_shard": 2, "tp": 2}, **TRANSFORMER), dict(strategy="tensor", world_size=2,
                                                                             **TRANSFORMER)),
        (dict(world_size=4, mesh={"dp_shard": 2, "tp": 2}, **TRANSFORMER), dict(world_size=4, mesh={"pp": 2, "tp": 2},
                                                                             **TRANSFORMER)),
    ],
    ids=["fsdp4-to-2", "fsdp2-to-hsdp2x2", "tp2-to-dp2xtp2", "ddp4-to-2", "ddp2-to-4", "dp2xtp2-to-tp2",
         "pipeline4-to-2", "pipeline2-to-dp2xpp2", "ps4-to-2", "ps2-to-4", "dp_shard2xtp2-to-dp_shard4",
         "dp_shard2xtp2-to-tp2", "dp_shard2xtp2-to-pp2xtp2"],
)
def test_resume_at_another_world_size_matches_single_process_continuation(prepared4, first_runs, tmp_path, first,
                                                                          then):
    """Full tier only (`make test-all`, marker `slow`): thirteen pairs of jobs of up to 4 ranks (about
    210 CPU-s). The quick tier keeps the refusals of a resume that cannot reshard (below), and each
    strategy's exact resume at the same world size (tests/test_strategy_jobs.py)."""
    from shardline.training.strategies import strategy_for

    tracking = TrackingConfig(experiment="resume-world", registered_model="resume-world")
    saved = _epoch_end(first_runs(first), 1)

    after = TrainingConfig(**{**COMMON, **then, "resume": True, "checkpoint_dir": str(tmp_path / "b")})
    _copy_checkpoint(saved, Path(after.checkpoint_dir))
    resumed = run_training(after, tracking, prepared4.dataset_dir, LocalEngine(), register=False)

    data_world = strategy_for(after).data_world
    reference = continued_single_process(saved, after, data_world, prepared4.dataset_dir)
    distance = relative_distance(resumed.weights, reference)
    assert distance <= TOLERANCE, distance
    lost = continued_single_process(saved, after, data_world, prepared4.dataset_dir, keep_optimizer=False)
    print(f"resumed vs continued {distance:.3g}, without optimizer state {relative_distance(lost, reference):.3g}")
    assert relative_distance(lost, reference) > 10 * TOLERANCE  # the optimizer state mattered
    # The registered model is the plain single-device model.
    assert resumed.weights.keys() == build_model(load_manifest(prepared4.dataset_dir), after).state_dict().keys()


def _config(tmp: Path, dataset_dir: str, checkpoint_dir: str | Path, training: str) -> Path:
    path = tmp / "job.toml"
    path.write_text(textwrap.dedent(f"""
        [pipelines]
        dataset_dir = "{dataset_dir}"
        [training]
        launcher = "local"
        hidden = [64, 32]
        batch_size = 128
        epochs = 2
        timeout_s = 120
        keep_checkpoints = 100
        checkpoint_dir = "{checkpoint_dir}"
    """) + textwrap.dedent(training))
    return path


@pytest.mark.parametrize(
    "first, resumed_with, message",
    [
        ({"strategy": "fsdp", "world_size": 4, "checkpoint_every_steps": 5},
         ["training.strategy=fsdp", "training.world_size=2"],
         "written mid-epoch (epoch 1, step 5) by 4 data-parallel ranks, resumed with 2 "
         "(training.world_size 4 -> 2, training.mesh.dp_shard 4 -> 2): the loader's order within an epoch depends on how many ranks"),
        # An earlier shardline's checkpoint: the weights in the small file, no DCP directory.
        ({"strategy": "fsdp", "world_size": 4, "checkpoint_every_steps": 5},
         ["training.strategy=fsdp", "training.world_size=4"],
         "written by an earlier shardline (the weights in the checkpoint file itself, not in a .dcp "
         "directory beside it), which this version does not resume: train from the start"),
        # A DCP checkpoint of an earlier layout (the optimizers' hyperparameters pickled in DCP).
        ({"strategy": "fsdp", "world_size": 4, "checkpoint_every_steps": 5},
         ["training.strategy=fsdp", "training.world_size=4"],
         "written by an earlier shardline (checkpoint layout 1; this one reads 2): train from the start"),
    ],
    ids=["mid-epoch-other-data-world", "earlier-format", "earlier-layout"],
)
def test_cli_refuses_a_resume_that_cannot_reshard(prepared4, first_runs, tmp_path, first, resumed_with, message):
    # The mid-epoch checkpoint at step 5 alone in a directory: the latest, as a resume takes it.
    mid = next(Path(p) for p in CheckpointStore(first_runs(first)).paths()
               if torch.load(p, weights_only=True)["global_step"] == 5)
    _copy_checkpoint(mid, tmp_path / "mid")
    if "in the checkpoint file itself" in message:  # as ddp, pipeline and ps wrote them before DCP
        head = torch.load(mid, weights_only=True)
        head["model"] = sharded.read_weights(str(tmp_path / "mid" / mid.name))
        shutil.rmtree(tmp_path / "mid" / head.pop("sharded"))
        torch.save(head, tmp_path / "mid" / mid.name)
    if "checkpoint layout 1" in message:
        head = torch.load(mid, weights_only=True)
        del head["layout"]
        torch.save(head, tmp_path / "mid" / mid.name)
    work = tmp_path / "work"
    work.mkdir()
    config = _config(work, prepared4.dataset_dir, tmp_path / "mid", "")
    sets = [a for s in [*resumed_with, "training.resume=true"] for a in ("--set", s)]
    proc = shardline_here("train", str(config), *sets, cwd=work)
    assert proc.returncode == 2, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (work / "mlflow.db").exists()  # refused before the run was opened
