"""The plan for decoded data (#49): row groups of a few batches for images, the shuffle
buffer's warm start (an epoch's first batch waits for a few batches' rows, not a full
buffer), and a loader rate that is refused when an epoch is too short to time it."""

from __future__ import annotations

import numpy as np
import pytest

from shardline.foundation.errors import DataError
from shardline.training.loader.batches import ShuffleBuffer
from shardline.training.plan import DECODED_ROW_GROUP_BATCHES, MIN_LOADER_BATCHES, MIN_ROW_GROUP, choose_layout

from .conftest import shardline_here


def _choose(**kw):
    args = dict(world_size=2, local_batch=64, train_rows=200_000, max_workers_per_rank=4)
    return choose_layout(1_000.0, 2_000.0, **{**args, **kw})


def test_decoded_rows_get_row_groups_of_a_few_batches_without_the_tabular_floor():
    tabular, images = _choose(), _choose(decoded=True)
    assert tabular.rows_per_row_group >= MIN_ROW_GROUP
    assert images.rows_per_row_group == DECODED_ROW_GROUP_BATCHES * 64 < MIN_ROW_GROUP
    # Still at most a rank's rows per worker: every worker gets a row group to decode.
    small = _choose(decoded=True, train_rows=2 * 100, max_workers_per_rank=1)
    assert small.rows_per_row_group == 100


def _stream(capacity: int, warm: int | None, groups: list[int]) -> list[int]:
    """Rows emitted after each row group is added, then at the end (the counts only)."""
    buf = ShuffleBuffer(capacity, capacity + max(groups), [((), np.dtype(np.int64))], warm=warm)
    rng, out, first = np.random.default_rng(0), [], 0
    for n in groups:
        buf.add_ids(first, n)
        first += n
        take = buf.draw(rng)
        out.append(0 if take is None else len(buf.emit_ids(take)))
    out.append(len(buf.emit_ids(buf.draw(rng, final=True))))
    return out


def test_the_buffer_starts_emitting_warm_and_grows_to_capacity():
    # Without warm it fills to capacity first (the old order): nothing until 1,000 rows.
    assert _stream(1_000, None, [100] * 12) == [0] * 10 + [100, 100, 1_000]
    # Warm 200: emits once it holds 200 rows, keeping max(200, read / 8) rows, up to capacity.
    got = _stream(1_000, 200, [100] * 100)
    assert got[:3] == [0, 0, 100]
    held = np.cumsum([100] * 100) - np.cumsum(got[:-1])
    assert list(held) == [min(1_000, max(200, min(100 * (k + 1), 100 * (k + 1) // ShuffleBuffer.GROWTH)))
                          if 100 * (k + 1) > 200 else 100 * (k + 1) for k in range(100)]
    assert held.max() == 1_000 and got[-1] == 1_000
    assert sum(got) == 100 * 100  # every row once


def test_plan_refuses_a_loader_rate_it_cannot_measure(dask_client, tmp_path):
    """`shardline plan` on 96 images (the image example's size): one line saying the loader's
    rate cannot be measured, exit 1, nothing stored in the manifest."""
    from shardline.benchmarks.loader_images import make_images
    from shardline.pipelines.config import PipelineConfig
    from shardline.engines import DaskEngine
    from shardline.pipelines.manifest import load_manifest
    from shardline.pipelines.prepare import prepare

    make_images(tmp_path / "images", 96, (3, 16, 16), jpeg=False)
    dataset = tmp_path / "dataset"
    prepare(DaskEngine(dask_client), PipelineConfig.model_validate({
        "dataset_dir": str(dataset), "source": {"format": "images", "path": str(tmp_path / "images")},
        "features": {"images": {"image": {"shape": [3, 16, 16]}}},
        "layout": {"world_size": 2, "rows_per_row_group": 64},
    }))
    config = tmp_path / "job.toml"
    config.write_text(f"[pipelines]\ndataset_dir = '{dataset}'\n[pipelines.source]\nformat = 'images'\n"
                      f"path = '{tmp_path / 'images'}'\n[pipelines.features.images.image]\nshape = [3, 16, 16]\n"
                      "[training]\nmodel = 'shardline.benchmarks.bench_cnn:build'\nworld_size = 2\nbatch_size = 32\n")
    proc = shardline_here("plan", str(config), cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "the loader's rate cannot be measured: rank 0 of 2 reads" in lines[0]
    assert f"at least {MIN_LOADER_BATCHES} are needed" in lines[0]
    assert "samples/s" not in proc.stdout  # no rate printed
    assert load_manifest(str(dataset)).plan is None


def test_a_loader_rate_is_refused_before_the_model_is_measured(prepared):
    """The refusal comes from the loader's check, before any measuring: a batch that leaves
    rank 0 fewer than MIN_LOADER_BATCHES batches an epoch."""
    from shardline.pipelines.manifest import load_manifest
    from shardline.training.config import TrainingConfig
    from shardline.training.plan import measure_loader

    manifest = load_manifest(prepared.dataset_dir)
    rows = manifest.split("train").shards[0].rows
    local = rows // (MIN_LOADER_BATCHES - 1)
    cfg = TrainingConfig(batch_size=2 * local, world_size=2)
    with pytest.raises(DataError, match=r"the loader's rate cannot be measured: rank 0 of 2 reads \d+ train rows"):
        measure_loader(manifest, prepared.dataset_dir, cfg, budget_s=0.1)
