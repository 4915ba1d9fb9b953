"""The bandwidth planner: the pure layout rule, real measurements, the CLI, prepare by a plan."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from shardline.foundation.errors import DataError
from shardline.pipelines.manifest import BandwidthPlan, load_manifest, store_plan
from shardline.training.config import TrainingConfig
from shardline.training.plan import MIN_SHARD_ROWS, choose_layout, plan_dataset, plan_from_measurements

from .conftest import shardline_here, small_pipeline

ROWS = 20_000
# Row groups far below any the planner chooses: `prepare --plan` visibly lays shards out anew.
TINY_ROW_GROUPS = 64


def _choose(train, per_worker, **kw):
    args = dict(world_size=2, local_batch=256, train_rows=200_000, max_workers_per_rank=16)
    return choose_layout(train, per_worker, **{**args, **kw})


# -- the pure rule -------------------------------------------------------------


def test_fewest_workers_that_load_1_2x_training():
    p = _choose(1000.0, 500.0)
    assert p.loader_workers_per_rank == p.required_loader_workers == 3  # ceil(1.2 * 1000 / 500)
    assert p.loading_samples_per_s == 1500.0 and p.target_met and p.predicted_data_wait == 0.0
    assert p.shards_per_rank == 3  # one file per worker; 100k rows per rank allow 10
    assert p.rows_per_row_group == 16_384  # 16 local batches = 4,096, raised to the 16,384 floor
    assert p.world_size == 2 and p.local_batch == 256 and p.headroom == 1.2


def test_a_faster_model_gets_more_loader_workers():
    workers = [_choose(train, 500.0).loader_workers_per_rank for train in (100.0, 1000.0, 5000.0)]
    assert workers == [1, 3, 12]


def test_the_core_cap_is_reported_with_its_predicted_wait():
    p = _choose(5000.0, 500.0, max_workers_per_rank=4)
    assert p.loader_workers_per_rank == 4 and p.required_loader_workers == 12
    assert p.max_loader_workers_per_rank == 4 and not p.target_met
    assert p.loading_samples_per_s == 2000.0
    assert p.predicted_data_wait == pytest.approx(1 - 2000 / 5000)  # overlapped: 1 - loading/training
    # Between training and 1.2x training the target is missed, yet nothing waits.
    close = _choose(900.0, 500.0, max_workers_per_rank=2)
    assert not close.target_met and close.predicted_data_wait == 0.0


def test_row_groups_and_shards_respect_batch_and_rows():
    assert _choose(100.0, 500.0, local_batch=2048).rows_per_row_group == 32_768
    assert _choose(100.0, 500.0, local_batch=8192).rows_per_row_group == 65_536
    # Small data: every worker still gets a row group, and one shard per rank keeps rows balanced.
    small = _choose(1000.0, 500.0, train_rows=6000)
    assert small.rows_per_row_group == 1000 and small.shards_per_rank == 1
    # The dataset's own size rule is a floor; hash balance caps shards at MIN_SHARD_ROWS each.
    assert _choose(100.0, 500.0, train_rows=2_000_000, min_shards_per_rank=5).shards_per_rank == 5
    capped = _choose(5000.0, 500.0, train_rows=2 * 3 * MIN_SHARD_ROWS)
    assert capped.loader_workers_per_rank == 12 and capped.shards_per_rank == 3


def test_no_throughput_is_an_error():
    with pytest.raises(DataError, match="0 samples/s"):
        _choose(0.0, 500.0)


def test_training_takes_the_plans_workers_unless_set():
    plan = BandwidthPlan(loader_workers_per_rank=3)
    assert TrainingConfig().loader_workers_for(plan) == 3
    assert TrainingConfig(loader_workers=0).loader_workers_for(plan) == 0
    assert TrainingConfig().loader_workers_for(None) == 1
    assert TrainingConfig().loader_workers_for(BandwidthPlan()) == 1


# -- real measurements, the CLI and prepare ------------------------------------------------


@pytest.fixture(scope="module")
def slow_loading(dask_client, tmp_path_factory):
    """A dataset with tiny row groups, prepared once; tests copy it before changing it."""
    from shardline.engines import DaskEngine
    from shardline.pipelines.prepare import prepare

    root = tmp_path_factory.mktemp("plan")
    prepare(DaskEngine(dask_client), small_pipeline(root, rows=ROWS, rows_per_row_group=TINY_ROW_GROUPS))
    return root


def _copy(root: Path, tmp: Path):
    shutil.copytree(root, tmp, dirs_exist_ok=True)
    return small_pipeline(tmp, rows=ROWS, rows_per_row_group=TINY_ROW_GROUPS)


def test_a_faster_model_is_given_more_loader_workers(prepared):
    """plan_dataset's rule on chosen figures (never on this machine's speed): the same
    loader, a model 100x faster, needs 100x the loading and is given the workers for it."""
    manifest = load_manifest(prepared.dataset_dir)
    cfg = TrainingConfig(batch_size=256, world_size=2)
    slow = plan_from_measurements(manifest, cfg, 500.0, 1_000.0, cores=128)
    fast = plan_from_measurements(manifest, cfg, 50_000.0, 1_000.0, cores=128)
    assert (slow.required_loader_workers, slow.loader_workers_per_rank) == (1, 1)
    assert (fast.required_loader_workers, fast.loader_workers_per_rank) == (60, 60)  # ceil(1.2 x 50)
    assert fast.target_met and fast.predicted_data_wait == 0.0
    assert (fast.world_size, fast.local_batch) == (2, 128)
    # The measured figures are kept as measured, beside what the rule made of them.
    assert (fast.train_samples_per_s, fast.loader_samples_per_s_per_worker) == (50_000.0, 1_000.0)
    # On 2 cores, 2 ranks get a core each: one worker, and the plan says what it misses.
    capped = plan_from_measurements(manifest, cfg, 50_000.0, 1_000.0, cores=2)
    assert (capped.loader_workers_per_rank, capped.required_loader_workers) == (1, 60)
    assert not capped.target_met and capped.predicted_data_wait == pytest.approx(1 - 1_000 / 50_000)
    # One shard per rank: the prepared 6,000 rows allow no more (MIN_SHARD_ROWS).
    assert fast.shards_per_rank == capped.shards_per_rank == 1


def _files(directory: str) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in Path(directory).rglob("*") if p.is_file()}


def test_measuring_gives_the_rules_plan_and_writes_nothing(prepared):
    before = _files(prepared.dataset_dir)
    cfg = TrainingConfig(hidden=[8], batch_size=256, world_size=2)
    manifest, p = plan_dataset(cfg, prepared.dataset_dir, budget_s=0.2)
    assert p.train_samples_per_s > 0 and p.loader_samples_per_s_per_worker > 0
    assert p.device == "cpu" or p.device.startswith("cuda")
    assert p.model == "mlp [8] ddp fp32, 1 thread(s)/rank"
    # What it chose is the rule's answer for what it measured.
    again = plan_from_measurements(manifest, cfg, p.train_samples_per_s, p.loader_samples_per_s_per_worker)
    assert again.model_dump(exclude={"measured_at"}) == p.model_dump(exclude={"measured_at"})
    assert _files(prepared.dataset_dir) == before  # measuring writes nothing


def test_a_plan_is_per_data_part_for_every_strategy(prepared):
    # 3 ranks = 2 PS workers and a server; 2 ranks = one pipeline: the 2 prepared shards serve both.
    manifest = load_manifest(prepared.dataset_dir)
    ps = TrainingConfig(strategy="ps", world_size=3, ps={"servers": 1}, batch_size=128)
    pipeline = TrainingConfig(strategy="pipeline", world_size=2, batch_size=128)
    p_ps = plan_from_measurements(manifest, ps, 2_000.0, 1_000.0, cores=6)
    p_pp = plan_from_measurements(manifest, pipeline, 2_000.0, 1_000.0, cores=6)
    assert (p_ps.world_size, p_ps.local_batch) == (2, 64)  # the workers read the batch
    assert (p_pp.world_size, p_pp.local_batch) == (1, 128)  # both stages read the same batch
    # Every rank of the job shares the cores: 6 cores over 3 ranks cap a rank at 2 workers.
    assert (p_ps.max_loader_workers_per_rank, p_ps.loader_workers_per_rank) == (2, 2)
    assert (p_pp.max_loader_workers_per_rank, p_pp.loader_workers_per_rank) == (3, 3)
    # Measuring a split model's plan runs too (its rank reads like a data-parallel rank).
    _, measured = plan_dataset(ps, prepared.dataset_dir, budget_s=0.2)
    assert (measured.world_size, measured.local_batch) == (2, 64)


def _config(tmp: Path, cfg) -> Path:
    path = tmp / "job.toml"
    path.write_text(
        f'[pipelines]\nengine = "dask"\ndataset_dir = "{cfg.dataset_dir}"\n'
        f'[pipelines.source]\nformat = "synthetic"\npath = "{cfg.source.path}"\n'
        f"[pipelines.source.synthetic]\nrows = {ROWS}\npartitions = 2\n"
        f"[pipelines.layout]\nworld_size = 2\nrows_per_row_group = {TINY_ROW_GROUPS}\n"
        "[dask]\nn_workers = 1\n"
    )
    return path


def test_cli_plan_stores_the_plan_and_prepare_lays_shards_out_by_it(slow_loading, on_session_dask, tmp_path):
    """The CLI in this process (shardline_here), preparing on the session's Dask cluster."""
    cfg = _copy(slow_loading, tmp_path)
    config = _config(tmp_path, cfg)
    before = load_manifest(cfg.dataset_dir)
    assert before.plan is None

    # Wide enough that rich does not wrap the table's cells.
    proc = shardline_here("plan", str(config), cwd=tmp_path, env={"COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    for line in ("training (measured)", "loader (measured)", "loader workers per rank",
                 "predicted data-wait", "train shards", "rows per row group"):
        assert line in proc.stdout, proc.stdout
    # The ranks' grid (training.rank_grid): a row per rank, the train files it reads.
    grid = proc.stdout[proc.stdout.index("mesh: "):].splitlines()
    assert grid[1].split()[:2] == ["rank", "dp_replicate"] and len(grid) >= 4, grid  # training.world_size 2
    assert all("part " in row for row in grid[2:4]), grid
    planned = load_manifest(cfg.dataset_dir)
    p = planned.plan
    assert p is not None and p.train_samples_per_s > 0 and p.loader_samples_per_s_per_worker > 0
    assert ("target met" in proc.stdout) == p.target_met
    assert ("NOT met" in proc.stdout) == (not p.target_met)
    # Only the plan changed: same version, same shards.
    assert planned.model_dump(exclude={"plan"}) == before.model_dump(exclude={"plan"})

    proc = shardline_here("plan", str(config), "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    printed = BandwidthPlan.model_validate(json.loads(proc.stdout))
    assert printed == load_manifest(cfg.dataset_dir).plan
    p = printed

    proc = shardline_here("prepare", str(config), "--plan", *on_session_dask, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    after = load_manifest(cfg.dataset_dir)
    assert after.version_id != before.version_id and after.plan == p
    assert after.layout.rows_per_row_group == p.rows_per_row_group != TINY_ROW_GROUPS
    assert len(after.splits["train"].shards) == p.shards_per_rank * p.world_size
    for info in after.splits.values():
        for shard in info.shards:
            assert shard.row_groups == math.ceil(shard.rows / p.rows_per_row_group)


def test_prepare_by_a_plan_sets_train_shards_and_row_groups(slow_loading, dask_client, tmp_path):
    from shardline.engines import DaskEngine
    from shardline.pipelines.prepare import prepare

    cfg = _copy(slow_loading, tmp_path)
    version = load_manifest(cfg.dataset_dir).version_id
    plan = BandwidthPlan(loader_workers_per_rank=3, shards_per_rank=3, rows_per_row_group=1000, world_size=2)
    store_plan(cfg.dataset_dir, version, plan)
    m = prepare(DaskEngine(dask_client), cfg, by_plan=True)
    assert len(m.splits["train"].shards) == 6 and m.plan == plan
    assert [len(m.splits[s].shards) for s in ("val", "test")] == [2, 2]  # the size rule
    assert m.layout.rows_per_row_group == 1000
    for info in m.splits.values():
        assert all(s.row_groups == math.ceil(s.rows / 1000) for s in info.shards)
    rows = [s.rows for s in m.splits["train"].shards]
    assert max(rows) / min(rows) < 1.15

    # A plan that does not fit is refused before anything is written.
    store_plan(cfg.dataset_dir, m.version_id, plan.model_copy(update={"world_size": 4}))
    with pytest.raises(DataError, match="plan is for 4 ranks but pipelines.layout.world_size is 2"):
        prepare(DaskEngine(dask_client), cfg, by_plan=True)
    store_plan(cfg.dataset_dir, m.version_id, plan.model_copy(update={"shards_per_rank": 10_000}))
    with pytest.raises(DataError, match="the plan wants 20000 train shards"):
        prepare(DaskEngine(dask_client), cfg, by_plan=True)
    assert load_manifest(cfg.dataset_dir).version_id == m.version_id
    with pytest.raises(DataError, match="dataset changed while planning"):
        store_plan(cfg.dataset_dir, version, plan)


@pytest.mark.parametrize(
    "args, message",
    [
        (("plan",), "no manifest; run `shardline prepare` first"),
        (("prepare", "--plan"), "no bandwidth plan to lay shards out by; run `shardline plan` first"),
    ],
)
def test_no_dataset_is_one_line_and_writes_nothing(tmp_path, args, message):
    config = _config(tmp_path, small_pipeline(tmp_path))
    proc = shardline_here(args[0], str(config), *args[1:], cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["job.toml"]
