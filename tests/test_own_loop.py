"""A user's own training loop (#52): a function of one context, run on every rank of the
local launcher with shardline's shards, checkpoints, MLflow run and registry.

The loops are a user's package outside shardline (tests/usermodels/userloops, shipped
through training.code_paths): two models with two optimizers stepped in turn, prepared
by the job's strategy (ddp, fsdp), checkpointed with ctx.save, resumed with ctx.restore,
logged on every rank, registered and scored. Costs (idle 2-core machine): the ddp job,
its resume and its scoring ~15 s; the fsdp job ~8 s; the refusals ~1 s; the failing ranks ~8 s.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

import shardline
from shardline.foundation.errors import ConfigError
from shardline.pipelines.manifest import load_manifest
from shardline.training.checkpoints.store import CheckpointStore
from shardline.training.launchers import TrainingFailed
from shardline.training.loader.reader import ShardLoader
from shardline.training.models.inputs import ModelInputs

from .serving_helpers import score

PACKAGE = Path(__file__).parent / "usermodels" / "userloops"
ARGS = {"width": 16, "lr": 0.01, "epochs": 2, "save_every": 7}


def overrides(prepared, tmp_path: Path, name: str, **kw) -> dict:
    return {
        "pipelines.dataset_dir": prepared.dataset_dir,
        "training.launcher": "local", "training.world_size": 2, "training.batch_size": 256,
        "training.loop": "userloops.loops:two_models", "training.loop_args": ARGS,
        "training.code_paths": [str(PACKAGE)], "training.checkpoint_dir": str(tmp_path / name),
        "training.keep_checkpoints": 100, "training.timeout_s": 60,
        "tracking.experiment": "own-loop", "tracking.registered_model": f"own-loop-{name}",
        **kw,
    }


def single_process(prepared, epochs: int, width: int, lr: float, batch: int = 256, world: int = 2) -> dict:
    """The same loop in one process on the global batches: the ranks' local batches joined."""
    import sys

    sys.path.insert(0, str(PACKAGE.parent))
    try:
        from userloops.loops import alternating_step
        from userloops.nets import Classifier
    finally:
        sys.path.remove(str(PACKAGE.parent))
    manifest = load_manifest(prepared.dataset_dir)
    loaders = [ShardLoader(manifest, prepared.dataset_dir, "train", r, world, batch // world, 0) for r in range(world)]
    inputs = ModelInputs.from_manifest(manifest)
    torch.manual_seed(0)
    model = Classifier(inputs.feature_width, width, inputs.output_width)
    opt_e = torch.optim.Adam(model.encoder.parameters(), lr=lr)
    opt_h = torch.optim.SGD(model.head.parameters(), lr=lr, momentum=0.9)
    step = 0
    for epoch in range(epochs):
        for parts in zip(*(loader.epoch(epoch) for loader in loaders)):
            x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            alternating_step(model.encoder, model.head, opt_e, opt_h, x, y, step)
            step += 1
    return model.state_dict()


def close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in got:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5, msg=k)


@pytest.fixture(scope="module")
def ddp_job(prepared, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("own-loop")
    return tmp, shardline.train(None, overrides(prepared, tmp, "ddp"))


def test_two_models_resume_exactly_log_on_every_rank_and_score(prepared, ddp_job, spark, tracking_uri):
    from mlflow.tracking import MlflowClient

    tmp, result = ddp_job
    # ctx.prepare under ddp is single-process training of the same loop on the global batches.
    close(result.weights, single_process(prepared, **{k: ARGS[k] for k in ("epochs", "width", "lr")}))
    # ctx.log from every rank into the job's one run: rank 1's figures prefixed.
    run = MlflowClient(tracking_uri).get_run(result.run_id)
    assert {"loss", "rank1_loss", "epoch_steps"} <= run.data.metrics.keys(), sorted(run.data.metrics)
    assert run.data.params["loop"] == "userloops.loops:two_models"

    # ctx.save wrote the nested state: tensors in DCP, each rank's plain values and RNG beside.
    paths = CheckpointStore(str(tmp / "ddp")).paths()
    mid = Path(next(p for p in paths if torch.load(p, weights_only=True)["step_in_epoch"] not in (0,)))
    head = torch.load(mid, weights_only=True)
    assert head["epoch"] is None and head["loader"]["epoch"] == 0 and len(head["rng"]) == 2
    assert set(head["ranks"][1]) == {"models", "optimizers", "loader", "progress"}
    assert len(head["ranks"][0]["progress"]["losses"]) == 3
    # ctx.restore of it in a resumed job: the same final weights, bit for bit (the models,
    # both optimizers, the loader's position and each rank's RNG all came back).
    (tmp / "resumed").mkdir()
    shutil.copy(mid, tmp / "resumed" / mid.name)
    shutil.copytree(mid.parent / head["sharded"], tmp / "resumed" / head["sharded"])
    resumed = shardline.train(None, overrides(prepared, tmp, "resumed", **{"training.resume": True}))
    assert resumed.weights.keys() == result.weights.keys()
    for k in result.weights:
        assert torch.equal(resumed.weights[k], result.weights[k]), k

    # ctx.register: the user's class rebuilt from its import path and args, scored as any model.
    scored = score("spark", spark, result.model_uri, tracking_uri, prepared.dataset_dir, str(tmp / "scores"))
    manifest = load_manifest(prepared.dataset_dir)
    assert scored.rows == manifest.splits["test"].rows
    from shardline.training.models.registered import load_torch_model

    model = load_torch_model(result.model_uri)
    assert type(model).__name__ == "Classifier"
    test = pq.read_table([Path(prepared.dataset_dir) / s.path for s in manifest.splits["test"].shards]).sort_by("key")
    x = torch.from_numpy(
        test.column("features").combine_chunks().flatten().to_numpy().astype(np.float32).reshape(test.num_rows, -1))
    with torch.no_grad():
        expected = model(x).argmax(1).numpy()
    assert (pq.read_table(tmp / "scores").sort_by("key").column("prediction").to_numpy() == expected).all()


def test_prepare_under_fsdp_matches_single_process_and_an_embedding_is_scored_by_its_own_input(
        prepared, tmp_path, spark, tracking_uri, capfd):
    import mlflow
    import pyarrow as pa

    from shardline.training.models.registered import load_torch_model

    args = {**ARGS, "epochs": 1, "register": "encoder"}
    result = shardline.train(None, overrides(prepared, tmp_path, "fsdp", **{
        "training.strategy": "fsdp", "training.loop_args": args}))
    assert "epoch 1 done: loss " in capfd.readouterr().err  # ctx.say, on the driver's console
    reference = single_process(prepared, epochs=1, width=ARGS["width"], lr=ARGS["lr"])
    close(result.weights, {k.removeprefix("encoder."): v for k, v in reference.items() if k.startswith("encoder.")})
    # Registered with an input of its own (`x`) and an output that is not the task's: raw
    # Parquet of that column is scored into a list column `output`, and so is a request.
    x = np.random.default_rng(0).normal(size=(10, len(reference["encoder.net.0.weight"][0]))).astype(np.float32)
    raw = tmp_path / "raw.parquet"
    pq.write_table(pa.table({"key": np.arange(10), "x": list(x)}), raw)
    scored = score("spark", spark, result.model_uri, tracking_uri, str(raw), str(tmp_path / "scores"))
    table = pq.read_table(tmp_path / "scores").sort_by("key")
    assert scored.rows == 10 and "prediction" not in table.column_names
    with torch.no_grad():
        expected = load_torch_model(result.model_uri)(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(np.stack(table.column("output").to_pylist()), expected, rtol=1e-5)
    served = mlflow.pyfunc.load_model(result.model_uri).predict(pd.DataFrame({"x": list(x[:3])}))
    np.testing.assert_allclose(np.stack(served["output"]), expected[:3], rtol=1e-5)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_any_nested_state_round_trips_through_dcp_and_the_small_file(prepared, tmp_path):
    """ctx.save's and ctx.restore's split of a state, in one process (DCP reads and writes
    every piece itself): modules, optimizers paired with them, a scheduler, a loader, a tensor
    and plain values come back into a fresh state of the same structure."""
    from torch import nn

    from shardline.training.checkpoints.state import pruned, read_tensors, write_tensors
    from shardline.training.loop.state import put_plain

    manifest = load_manifest(prepared.dataset_dir)

    def state(seed: int) -> dict:
        torch.manual_seed(seed)
        a, b = nn.Linear(4, 3), nn.Linear(3, 2)
        opts = [torch.optim.Adam(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)]
        return {"models": {"a": a, "b": b}, "opts": opts, "sched": torch.optim.lr_scheduler.StepLR(opts[0], 2),
                "loader": ShardLoader(manifest, prepared.dataset_dir, "train", 0, 2, 64, 0, workers=0),
                "ema": torch.zeros(3), "progress": {"step": 0, "losses": []}}

    saved = state(0)
    for _ in range(3):
        loss = saved["models"]["b"](saved["models"]["a"](torch.randn(5, 4))).square().mean()
        loss.backward()
        for opt in saved["opts"]:
            opt.step()
        saved["sched"].step()
    batches = saved["loader"].epoch(0)
    for _ in range(3):
        next(batches)
    saved["ema"] += 1.5
    saved["progress"] = {"step": 3, "losses": [0.5, 0.25]}
    parts = write_tensors(saved, str(tmp_path / "ckpt.dcp"))
    tree = {k: pruned(v) for k, v in parts.tree.items()}
    assert tree["models"] == {"<dcp tensors>": 1} and tree["progress"] == {"step": 3, "losses": [0.5, 0.25]}

    fresh = state(1)
    read_tensors(fresh, str(tmp_path / "ckpt.dcp"), saved_tree=tree)
    put_plain(fresh, tree, "")
    for name in ("a", "b"):
        close(fresh["models"][name].state_dict(), saved["models"][name].state_dict())
    for mine, theirs in zip(fresh["opts"], saved["opts"]):
        assert str(mine.state_dict()) == str(theirs.state_dict())
    assert fresh["sched"].state_dict() == saved["sched"].state_dict()
    assert fresh["loader"].state_dict() == saved["loader"].state_dict()  # mid-epoch: 3 batches in
    assert torch.equal(fresh["ema"], saved["ema"]) and fresh["progress"] == saved["progress"]


def test_a_loop_jobs_fingerprint_names_the_loop_and_its_args():
    from shardline.training.checkpoints import fingerprint
    from shardline.training.config import TrainingConfig

    builtin = fingerprint.fingerprint(TrainingConfig(), "v")
    assert "loop" not in builtin  # shardline's own loop: the fingerprint (and folder) as before
    mine = TrainingConfig(loop="userloops.loops:two_models", loop_args=ARGS)
    fp = fingerprint.fingerprint(mine, "v")
    assert fp["loop"] == "userloops.loops:two_models" and fp["loop_args"] == str(ARGS)
    other = fingerprint.fingerprint(mine.model_copy(update={"loop_args": {**ARGS, "lr": 0.1}}), "v")
    assert fingerprint.differences(fp, other) == ["loop_args"]
    folders = {fingerprint.job_dir(c, "e", "m", "/d") for c in (TrainingConfig(), mine,
                                                                 mine.model_copy(update={"loop_args": {}}))}
    assert len(folders) == 3  # each its own checkpoint folder


@pytest.mark.parametrize("loop, message", [
    ("userloops.loops:takes_two", r"training.loop: userloops.loops:takes_two\(ctx, extra\) must take exactly one "
                                  r"positional argument, the loop context"),
    ("userloops.nope:loop", r"training.loop: cannot import module 'userloops.nope'"),
    ("userloops.loops:missing", r"training.loop: module 'userloops.loops' has no attribute 'missing'"),
])
def test_a_loop_that_cannot_run_is_refused_before_anything_starts(prepared, tmp_path, loop, message):
    with pytest.raises(ConfigError, match=message):
        shardline.train(None, overrides(prepared, tmp_path, "refused", **{"training.loop": loop}))
    assert not (tmp_path / "refused").exists()


def test_a_loop_given_as_a_function_that_registers_nothing_finishes_cleanly(prepared, tmp_path, capfd):
    # Defined as a notebook cell defines it (in __main__): it travels by value (cloudpickle).
    # (A function nested in a test module would make the `tests` package the user's code,
    # which the driver re-imports for each job: the later tests' functions would no longer
    # be the ones pytest imported.)
    cell = {"__name__": "__main__"}
    exec(compile("def count_batches(ctx):\n"
                 "    ctx.log({'batches': float(sum(1 for _ in ctx.loader('val', batch_size=512)))})\n",
                 "<notebook cell>", "exec"), cell)
    count_batches = cell["count_batches"]

    result = shardline.train(None, overrides(prepared, tmp_path, "nothing", **{
        "training.world_size": 1, "training.loop": None}), loop=count_batches)
    assert result.model_uri is None and result.model_version == "" and result.weights == {}
    assert result.metrics["batches"] > 0
    assert "no model was registered: the loop called no ctx.register" in capfd.readouterr().err


@pytest.mark.parametrize("loop, strategy, said", [
    ("raises", "ddp", r"rank 0 on \S+: ValueError: boom: this loop fails \(at userloops/loops\.py, line {line}, "
                      r"in raises; rank 1 the same; traceback in .*/ranks/rank-0\.log\)"),
    ("reads_a_missing_split", "ddp", r"rank 0 on \S+: DataError: ctx.loader: the dataset \S+ has no split "
                                     r"'holdout' \(its splits: train, val, test\)"),
    ("prepares_a_planless_model", "tensor", r"rank 0 on \S+: ConfigError: training.mesh.tp 2: ctx.prepare: "
                                            r"Planless declares no tensor-parallel plan"),
])
def test_a_loop_that_fails_on_its_ranks_is_one_line(prepared, tmp_path, loop, strategy, said):
    line = next(i for i, ln in enumerate((PACKAGE / "loops.py").read_text().splitlines(), 1)
                if "boom: this loop fails" in ln)
    with pytest.raises(TrainingFailed) as failed:
        shardline.train(None, overrides(prepared, tmp_path, loop, **{
            "training.loop": f"userloops.loops:{loop}", "training.strategy": strategy, "training.max_restarts": 1}))
    assert re.search(said.format(line=line), str(failed.value)), str(failed.value)
    assert failed.value.permanent  # never relaunched


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["local", "spark", "dask"])
def test_a_rank_killed_mid_epoch_in_a_users_loop_ends_on_the_same_weights(
        prepared, ddp_job, tmp_path, launcher, request, capfd):
    """Full tier only (`make test-all`, marker `slow`): a kill test, on each launcher. The
    loop's ranks are relaunched, ctx.restore brings back the last checkpoint (models,
    optimizers, the loader's position, each rank's RNG): the weights of the uninterrupted run."""
    import threading

    from .test_checkpoints import LOST, _kill_rank_after_first_checkpoint

    handles = {"spark": request.getfixturevalue("spark")} if launcher == "spark" else \
        {"client": request.getfixturevalue("dask_client")} if launcher == "dask" else {}
    done, killed = threading.Event(), []
    watcher = threading.Thread(target=_kill_rank_after_first_checkpoint,
                               args=(tmp_path / launcher, 1, done, killed))
    watcher.start()
    try:
        # A short pause a step (no effect on the numbers): on a loaded machine the whole job
        # once ended before the watcher saw its first checkpoint.
        result = shardline.train(None, overrides(prepared, tmp_path, launcher, **{
            "training.launcher": launcher, "training.max_restarts": 2,
            "training.loop_args": {**ARGS, "pause_s": 0.02}}), **handles)
    finally:
        done.set()
        watcher.join()
    assert killed, "the rank was never killed"
    restarts = [ln for ln in capfd.readouterr().err.splitlines() if "restarting from" in ln]
    assert len(restarts) == 1 and re.match(
        r"\[shardline\] " + LOST[launcher].format(pid=killed[0]) + r"; restarting from ckpt-\d{9}-[0-9a-f]{6}\.pt$",
        restarts[0]), restarts
    for k, v in ddp_job[1].weights.items():
        assert torch.equal(result.weights[k], v), k


@pytest.mark.slow
def test_a_loop_that_never_saves_restarts_from_the_start_and_says_so(prepared, ddp_job, tmp_path, capfd):
    """Full tier only (marker `slow`): a kill test. Killed before it committed any checkpoint,
    the loop runs again from its beginning: the same weights, and the restart line says why."""
    import json
    import os
    import signal
    import threading
    import time

    info = tmp_path / "nosave" / "ranks" / "rank-1.json"
    killed = []

    def kill_once_announced():
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not killed:
            if info.exists():
                pid = json.loads(info.read_text())["pid"]
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.005)

    watcher = threading.Thread(target=kill_once_announced)
    watcher.start()
    try:
        result = shardline.train(None, overrides(prepared, tmp_path, "nosave", **{
            "training.loop_args": {**ARGS, "save_every": 10**6}, "training.max_restarts": 2}))
    finally:
        killed.append(None)
        watcher.join()
    restarts = [ln for ln in capfd.readouterr().err.splitlines() if "restarting from" in ln]
    assert len(restarts) == 1 and restarts[0].endswith(
        "; restarting from the start (the loop has committed no checkpoint: ctx.save)"), restarts
    for k, v in ddp_job[1].weights.items():
        assert torch.equal(result.weights[k], v), k
