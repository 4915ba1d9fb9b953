"""One leg of `shardline bench scale`: one engine on N cores, one raw dataset: prepare, the
ddp steps, scoring the test split, each stage sampled (benchmarks.proc_tree) and timed,
through shardline's API on the leg's own engine (started once, reused by every stage)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from .bench_engines import ENGINES
from .proc_tree import TreeSampler
from .scale_data import folder_bytes

FEATURES = {"key": "key", "label": "label", "numeric": [f"x{i}" for i in range(8)], "categorical": ["color"]}
HIDDEN = [128, 64]  # the quickstart's model
GLOBAL_BATCH = 512
WARMUP = 20


def leg_config(raw: Path, work: Path, engine: str, cores: int, tracking_uri: str, name: str) -> dict:
    """The leg's config: the quickstart's features and model, `cores` of everything."""
    return {
        "spark": {"master": f"local[{cores}]", "shuffle_partitions": max(2, cores)},
        "dask": {"n_workers": cores, "threads_per_worker": 1},
        "pipelines": {"engine": engine, "dataset_dir": str(work / "dataset"), "features": FEATURES,
                      "source": {"format": "csv", "path": str(raw)}, "layout": {"world_size": cores}},
        "training": {"launcher": engine, "world_size": cores, "strategy": "ddp", "model": "mlp", "hidden": HIDDEN,
                     "batch_size": GLOBAL_BATCH, "threads_per_rank": 1, "checkpoint_dir": str(work / "checkpoints")},
        "tracking": {"tracking_uri": tracking_uri, "experiment": "shardline-bench-scale", "registered_model": name},
        "serving": {"engine": engine, "split": "test", "output_dir": str(work / "scores")},
    }


class TimedEngine:
    """The leg's prepare engine (shardline.engines), its two jobs timed: pass 1 (`run`) and
    pass 2 with the shuffle and the shard writes (`shuffle_write`)."""

    def __init__(self, engine: str, handle):
        from shardline.config import load_config
        from shardline.engines import Engines

        self._engine = Engines(load_config({}), **ENGINES[engine].given(handle)).get(engine, "pipelines.engine")
        self.seconds = {"pass1": 0.0, "pass2_shuffle_write": 0.0}

    def __getattr__(self, name):  # name, version, spark, client: the engine's
        return getattr(self._engine, name)

    def run(self, fn, items):
        start = time.perf_counter()
        try:
            return self._engine.run(fn, items)
        finally:
            self.seconds["pass1"] += time.perf_counter() - start

    def shuffle_write(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self._engine.shuffle_write(*args, **kwargs)
        finally:
            self.seconds["pass2_shuffle_write"] += time.perf_counter() - start


def prepare_timed(cfg_dict: dict, engine: str, handle, timed: TimedEngine):
    """What shardline.api.prepare does (paths resolved, every check, the lease), on `timed`;
    the manifest. The driver's checks are timed too."""
    from shardline.config import DATASET, SOURCE, check_storage, load_config, resolve_paths
    from shardline.stages import check_prepare, dataset_lease, run_prepare

    start = time.perf_counter()
    cfg = resolve_paths(load_config(cfg_dict), [engine], (SOURCE, DATASET), **ENGINES[engine].given(handle))
    check_storage(cfg, reads=(SOURCE,), writes=(DATASET,))
    checked = check_prepare(cfg)
    timed.seconds["driver_checks"] = time.perf_counter() - start
    with dataset_lease(cfg) as lease:
        return run_prepare(cfg, timed, lease=lease, checked=checked)


def _stage(fn, spawned_as: str) -> tuple[Any, dict]:
    sampler = TreeSampler(spawned_as=spawned_as).start()
    start = time.perf_counter()
    try:
        out = fn()
    finally:
        figures = sampler.stop()
    figures["seconds"] = time.perf_counter() - start
    return out, figures


def run_leg(raw: Path, work: Path, engine: str, cores: int, handle, tracking_uri: str, steps: int,
            loader_workers: int, progress=print) -> dict:
    """prepare, `steps` ddp steps and scoring, on `handle` (the engine open_engine gave)."""
    from shardline import api

    from .scale_train import register, scale_rank

    name = f"bench-scale-{engine}-{cores}"
    cfg = leg_config(raw, work, engine, cores, tracking_uri, name)
    side = ENGINES[engine]
    given, worker = side.given(handle), side.spawned_as
    stages: dict[str, dict] = {}

    progress(f"{engine} on {cores} core(s): prepare {raw.name}")
    timed = TimedEngine(engine, handle)
    m, stages["prepare"] = _stage(lambda: prepare_timed(cfg, engine, handle, timed), worker)
    stages["prepare"].update(rows=sum(s.rows for s in m.splits.values()), output_bytes=folder_bytes(work / "dataset"),
                             shards={s: len(i.shards) for s, i in m.splits.items()}, phases=timed.seconds)
    dataset_dir = str((work / "dataset").resolve())

    progress(f"{engine} on {cores} core(s): {steps:,} ddp steps on {cores} rank(s)")
    payload = {"dataset_dir": dataset_dir, "training": cfg["training"], "threads": 1,
               "workers": loader_workers, "warmup": min(WARMUP, steps // 2), "steps": steps}
    results, stages["train"] = _stage(lambda: side.launch(handle, scale_rank, payload, cores), worker)
    ranked = results[0]
    stages["train"].update(
        steps=steps, timed_steps=ranked["steps"], step_s=ranked["elapsed_s"] / ranked["steps"],
        data_wait=ranked["data_wait"], data_wait_by_rank=ranked["data_wait_by_rank"],
        rank_start_mb=ranked["rank_start_mb"], rank_peak_mb=ranked["rank_peak_mb"],
        rank_added_mb=[b - a for a, b in zip(ranked["rank_start_mb"], ranked["rank_peak_mb"])],
        samples=steps * GLOBAL_BATCH, epoch_steps=m.split("train").rows // GLOBAL_BATCH,
    )
    model_uri = register(ranked, dataset_dir, cfg["training"], tracking_uri, name)

    progress(f"{engine} on {cores} core(s): score the test split ({m.split('test').rows:,} rows)")
    scored, stages["score"] = _stage(lambda: api.score(cfg, model_uri=model_uri, **given), worker)
    stages["score"].update(rows=scored.rows, output_bytes=folder_bytes(work / "scores"))
    for s in stages.values():
        n = s.get("rows") or s.get("samples") or 0
        s["rows_per_s"] = n / s["seconds"] if s["seconds"] else 0.0
    shutil.rmtree(work, ignore_errors=True)  # the raw data stays; a leg's outputs are big
    return {"engine": engine, "cores": cores, "raw": str(raw), "stages": stages,
            "splits": {s: i.rows for s, i in m.splits.items()}}
