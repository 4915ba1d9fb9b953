"""Fault cases run against your own engine, cluster and storage.

    python -m shardline.jobs.faults CONFIG [--set SECTION.FIELD=VALUE ...] [--case NAME ...]
    python -m shardline.jobs.faults --list

CONFIG is a training config as for `shardline train` (launcher, cluster, dataset,
checkpoint_dir, tracking). The runner first works out from the config and the dataset's
manifest what each case needs (how many checkpoints the reference will write and keep;
root and a local disk for full-disk): a case the config cannot give is refused in one line
before anything runs when named with --case (exit 2), else said SKIP. Then it trains a
reference run, then each case, under `<checkpoint_dir>/_faults-<id>/` (deleted at the
end), and prints one line per case: `PASS`, `FAIL` or `SKIP` with what it checked; the
exit status is 1 if any case failed. Nothing is registered in MLflow; the runs are in the
configured experiment.

Cases (each ends on the reference's weights or on the documented refusal):
- kill-rank: SIGKILL rank 1 after the first checkpoint; the launcher relaunches from
  the checkpoint and the job ends bit-equal to the reference. The runner can signal only
  ranks on its own host (local ranks, a local Spark master or Dask LocalCluster); on a
  remote cluster the case is skipped, saying so.
- truncated-checkpoint: the reference's newest checkpoint cut short in a copy of its
  directory; a resume falls back to the previous readable one and ends bit-equal.
- changed-lr: a resume with another `lr` is refused, naming the field.
- ctrl-c: SIGINT to the runner's own process (the driver) after the first checkpoint: the
  job ends with KeyboardInterrupt, at most one checkpoint (one being written) is committed
  after the signal and nothing is written once it ended; `--resume` then ends bit-equal.
- full-disk, stale-lease: see jobs.faults_storage (a full checkpoint disk ends in one
  line without a relaunch; a killed job's lease is reported gone and taken over).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
import uuid
from functools import partial

from shardline.foundation import storage
from shardline.foundation.errors import ConfigError, ShardlineError, first_line

from . import faults_storage
from shardline.config import CHECKPOINTS, DATASET, check_storage, load_config, resolve_paths
from shardline.engines import Engines
from shardline.pipelines.manifest import load_manifest
from shardline.training.checkpoints.store import CheckpointStore

# Imported inside the functions that use them: training.job (imports torch); torch (~2 s: only where a model
# or a rank runs); training.loader.reader and training.loader.shards (import torch); training.strategies (imports
# torch).


def _train(cfg, ckpt: str, engine, **changes):
    from shardline.training.job import run_training

    t = cfg.training.model_copy(update={"checkpoint_dir": ckpt, **changes})
    return run_training(t, cfg.tracking, cfg.pipelines.dataset_dir, engine, register=False)


def _equal(a: dict, b: dict) -> bool:
    import torch  # here, not at the top: `--list` and a refused flag answer without importing it

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def kill_rank(cfg, ref, root: str, engine) -> tuple[str, str]:
    ckpt = storage.join(root, "kill-rank")
    done, seen = threading.Event(), {}

    def killer() -> None:
        info = CheckpointStore(ckpt).rank_file(1)
        while not done.is_set():
            if CheckpointStore(ckpt).paths() and storage.exists(info):
                rank = json.loads(storage.read_bytes(info))
                seen["host"] = rank["host"]
                if rank["host"] == socket.gethostname():
                    os.kill(rank["pid"], signal.SIGKILL)
                    seen["killed"] = rank["pid"]
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=killer, daemon=True)
    watcher.start()
    try:
        result = _train(cfg, ckpt, engine)
    finally:
        done.set()
        watcher.join()
    if "killed" not in seen:
        host = seen.get("host")
        if host:
            return "SKIP", f"rank 1 runs on {host}, not this host: the runner signals only its own host's ranks"
        return "FAIL", "no checkpoint appeared before training ended: nothing to kill (train longer)"
    if _equal(result.weights, ref.weights):
        return "PASS", f"rank 1 (pid {seen['killed']}) SIGKILLed after the first checkpoint; relaunched, bit-equal"
    return "FAIL", "relaunched after the kill, but the final weights differ from the reference"


def _copy_prefix(cfg, ref_dir: str, into: str, keep: int) -> list[str]:
    """The reference's first `keep` checkpoints (and their DCP shards) into `into`."""
    from shardline.training.checkpoints.store import CheckpointStore

    paths = CheckpointStore(ref_dir).paths()[:keep]
    for p in paths:
        storage.write_bytes(storage.join(into, storage.name(p)), storage.read_bytes(p))
        sharded = CheckpointStore.holding(p).read(p).get("sharded")
        if sharded:
            for f in storage.find_files(storage.join(ref_dir, sharded)):
                rel = f[len(ref_dir) + 1:]
                storage.write_bytes(storage.join(into, rel), storage.read_bytes(f))
    CheckpointStore(into).point_at(storage.join(into, storage.name(paths[-1])))
    return [storage.join(into, storage.name(p)) for p in paths]


def truncated_checkpoint(cfg, ref, root: str, engine) -> tuple[str, str]:
    kept = CheckpointStore(ref.checkpoint_dir).paths()
    if len(kept) < 3:  # needs() said it would: the reference wrote fewer than planned
        return "FAIL", f"the reference kept {len(kept)} checkpoint(s), not the 3 planned"
    ckpt = storage.join(root, "truncated")
    copied = _copy_prefix(cfg, ref.checkpoint_dir, ckpt, keep=len(kept) // 2 + 1)
    storage.write_bytes(copied[-1], storage.read_bytes(copied[-1])[:1000])  # a write cut short
    result = _train(cfg, ckpt, engine, resume=True)
    if _equal(result.weights, ref.weights):
        return "PASS", f"newest of {len(copied)} checkpoints truncated; resumed from the previous one, bit-equal"
    return "FAIL", "resumed past the truncated checkpoint, but the final weights differ from the reference"


def changed_lr(cfg, ref, root: str, engine) -> tuple[str, str]:
    ckpt = storage.join(root, "changed-lr")
    _copy_prefix(cfg, ref.checkpoint_dir, ckpt, keep=max(1, len(CheckpointStore(ref.checkpoint_dir).paths()) // 2))
    try:
        _train(cfg, ckpt, engine, resume=True, lr=cfg.training.lr * 10)
    except ShardlineError as e:
        line = first_line(e, 100_000)
        said = line[line.find("different run"):] if "different run" in line else line  # past the path
        if "lr=" in line and "--allow-changed lr" in line:
            return "PASS", f"refused: {said[:200]}"
        return "FAIL", f"refused, but not naming lr: {said[:200]}"
    return "FAIL", "a resume with another lr was accepted"


def _names(ckpt: str) -> set[str]:
    return {storage.name(p) for p in CheckpointStore(ckpt).paths()}


def ctrl_c(cfg, ref, root: str, engine) -> tuple[str, str]:
    ckpt = storage.join(root, "ctrl-c")
    done, seen = threading.Event(), {}

    def interrupter() -> None:
        while not done.is_set():
            names = _names(ckpt) if storage.exists(ckpt) else set()
            if names:
                seen["before"] = names
                os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C to the driver: this process
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=interrupter, daemon=True)
    watcher.start()
    try:
        _train(cfg, ckpt, engine)
    except KeyboardInterrupt:
        if "before" not in seen:
            raise  # the user's own Ctrl-C, not the case's
    else:
        return "FAIL", "training ended before the interrupt landed: nothing to interrupt (train longer)"
    finally:
        done.set()
        watcher.join()
    after = _names(ckpt)
    committed = sorted(after - seen["before"])
    if len(committed) > 1:
        return "FAIL", f"{len(committed)} checkpoints committed after the interrupt ({', '.join(committed)}); " \
                       "at most the one being written may complete"
    time.sleep(3)  # a rank still running would write its next checkpoint within this
    if _names(ckpt) != after:
        return "FAIL", "something still writes the checkpoint folder after the interrupted job ended"
    result = _train(cfg, ckpt, engine, resume=True)
    if not _equal(result.weights, ref.weights):
        return "FAIL", "resumed after the interrupt, but the final weights differ from the reference"
    return "PASS", (f"interrupted after the first checkpoint; {len(committed)} committed after the signal, "
                    "nothing written once it ended; --resume ended bit-equal")


CASES = {
    "kill-rank": kill_rank, "truncated-checkpoint": truncated_checkpoint, "changed-lr": changed_lr,
    "ctrl-c": ctrl_c,
    "full-disk": partial(faults_storage.full_disk, train=_train),
    "stale-lease": partial(faults_storage.stale_lease, train=_train),
}


def checkpoints_planned(cfg) -> tuple[int, int, str]:
    """(written, kept, how) for the reference run, from the config and the dataset's
    manifest alone: an epoch-end checkpoint per epoch, one every checkpoint_every_steps
    optimizer steps, the newest keep_checkpoints kept; `how` says where the figures came from."""
    from shardline.training.loader.reader import epoch_steps
    from shardline.training.loader.shards import rows_per_rank
    from shardline.training.strategies import strategy_for

    t = cfg.training
    data_world = strategy_for(t).data_world
    steps = epoch_steps(rows_per_rank(load_manifest(cfg.pipelines.dataset_dir), "train", data_world),
                        max(1, t.batch_size // data_world), t.remainder)
    every = t.checkpoint_every_steps
    written = t.epochs + (t.epochs * steps // every if every else 0)
    how = (f"training.epochs {t.epochs} x {steps} steps, training.checkpoint_every_steps {every}"
           + (" (epoch ends only)" if not every else "") + f", training.keep_checkpoints {t.keep_checkpoints}")
    return written, min(written, t.keep_checkpoints), how


def needs(name: str, cfg, planned: tuple[int, int, str], root: str) -> str | None:
    """Why case `name` cannot run with this config (None: it can), in words naming the fix."""
    written, kept, how = planned
    more = "raise training.epochs or set a smaller training.checkpoint_every_steps"
    if name in ("kill-rank", "ctrl-c") and written < 2:
        return f"needs a checkpoint before training ends, but the reference writes {written} ({how}): {more}"
    if name == "truncated-checkpoint" and kept < 3:
        return (f"needs 3 checkpoints kept, but the reference keeps {kept} ({how}): {more}"
                + (", or raise training.keep_checkpoints" if written >= 3 else ""))
    if name == "full-disk":
        return faults_storage.full_disk_needs(root)
    return None


class _Reference:
    def __init__(self, result, checkpoint_dir: str):
        self.weights, self.checkpoint_dir = result.weights, checkpoint_dir


def parser() -> argparse.ArgumentParser:
    """The runner's flags (also rendered into docs/reference/cli.md by docs/gen_ref.py)."""
    ap = argparse.ArgumentParser(prog="python -m shardline.jobs.faults", description=__doc__.split("\n\n")[0])
    ap.add_argument("config", nargs="?", help="a shardline config (TOML)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                    help="override any config field (repeatable)")
    ap.add_argument("--case", dest="cases", action="append", choices=list(CASES), help="(repeatable; default all)")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.list:
        for name, fn in CASES.items():
            print(name)
        return 0

    try:
        cfg = load_config(args.config, args.overrides)
        cfg = resolve_paths(cfg, [cfg.training.launcher], (DATASET, CHECKPOINTS), tracking=True)
        check_storage(cfg, reads=(DATASET,), writes=(CHECKPOINTS,))
        root = storage.join(cfg.training.checkpoint_dir, f"_faults-{uuid.uuid4().hex[:8]}")
        # What each case needs, before any engine starts or the reference trains.
        planned = checkpoints_planned(cfg)
        chosen = args.cases or list(CASES)
        cannot = {name: why for name in chosen if (why := needs(name, cfg, planned, root))}
        named = [n for n in args.cases or [] if n in cannot]
        if named:
            raise ConfigError(f"--case {named[0]}: {cannot[named[0]]}")
        failed = False
        t = cfg.training
        with Engines(cfg, ranks=(t.launcher, t.world_size)) as engines:
            engine = engines.get(t.launcher, "training.launcher")
            try:
                ref = None
                for name in chosen:
                    if name in cannot:
                        print(f"{name}: SKIP: {cannot[name]}", flush=True)
                        continue
                    if ref is None:  # trained once, for the first case that can run
                        ref_dir = storage.join(root, "reference")
                        ref = _Reference(_train(cfg, ref_dir, engine), ref_dir)
                    verdict, detail = CASES[name](cfg, ref, root, engine)
                    failed |= verdict == "FAIL"
                    print(f"{name}: {verdict}: {detail}", flush=True)
            finally:
                storage.delete_tree(root)
    except ShardlineError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
