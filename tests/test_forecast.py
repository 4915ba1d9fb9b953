"""The forecast's model (shardline.forecasting.model) on chosen figures, never on a machine's
speed: how each stage's time and memory follow rows, files, cores, ranks and GPUs, and the
layout it picks. No process is started (#56 item 4)."""

from __future__ import annotations

import pytest

from shardline.config import load_config
from shardline.forecasting import Cluster, Measured, costs, forecast
from shardline.forecasting.measure import InputShape, PrepareRates
from shardline.forecasting.rates import ModelRates

CFG = load_config({"training": {"world_size": 2, "batch_size": 512, "threads_per_rank": 1},
                   "pipelines": {"layout": {"world_size": 2}}})


def measured(rows: int = 10_000_000, files: int = 10, tasks: int = 40, **model) -> Measured:
    m = {"train_samples_per_s": 50_000.0, "loader_samples_per_s": 1_000_000.0, "forward_samples_per_s": 200_000.0,
         "score_rows_per_s": 100_000.0, "parameters": 10_000, "score_bytes_per_row": 40.0, "row_bytes": 52.0,
         "device": "cpu", **model}
    return Measured(
        input=InputShape(files=files, units=tasks, tasks=tasks, rows=rows, rows_estimated=False, bytes=rows * 80,
                         largest_unit_rows=rows // tasks, list_s=0.5, describe_s=1.5),
        prepare=PrepareRates(rows=300_000, files=1, tasks={}, transport_bytes_per_row=60.0, shard_bytes_per_row=40.0,
                             s_per_row={"pass1": 2e-6, "pass2": 3e-6, "shuffle": 1e-7, "write": 1e-6},
                             mb_per_row={"pass1": 1e-4, "pass2": 1e-4, "shuffle": 1e-4, "write": 2e-4},
                             driver_mb=150.0),
        model=ModelRates(**m), seconds=3.0)


def test_prepare_grows_with_rows_and_shrinks_with_cores():
    one, ten = (forecast(measured(rows=n, tasks=400), CFG, Cluster(hosts=1, cores=2), "spark") for n in (10**7, 10**8))
    c = costs.ENGINES["spark"]
    for phase, job in (("pass1", c.job_s), ("pass2", c.shuffle_job_s)):
        fixed = job + 400 / 2 * c.task_s  # a job's start and waves of tasks: the same at both sizes
        assert ten.prepare.parts[phase] - fixed == pytest.approx(10 * (one.prepare.parts[phase] - fixed))
    four = forecast(measured(rows=10**7, tasks=400), CFG, Cluster(hosts=2, cores=2), "spark")
    job, waves = c.job_s, 400 / 2 * c.task_s
    assert four.prepare.parts["pass1"] - job - waves / 2 == pytest.approx((one.prepare.parts["pass1"] - job - waves) / 2)
    # Tasks run in waves of the cores: 3 equal tasks on 2 cores take two tasks' time.
    three = forecast(measured(rows=3 * 10**6, tasks=3), CFG, Cluster(hosts=1, cores=2), "spark")
    per_task = 10**6 * 2e-6 / c.efficiency + c.task_s
    assert three.prepare.parts["pass1"] == pytest.approx(c.job_s + 2 * per_task)
    # The driver's listing and describing are its own: cores do not share them.
    assert four.prepare.parts["driver"] == one.prepare.parts["driver"] == pytest.approx(2.0)


def test_fewer_tasks_than_cores_use_only_as_many_cores():
    wide = forecast(measured(tasks=1), CFG, Cluster(hosts=8, cores=4), "dask")
    narrow = forecast(measured(tasks=1), CFG, Cluster(hosts=1, cores=1), "dask")
    assert wide.prepare.parts["pass1"] == pytest.approx(narrow.prepare.parts["pass1"])


def test_driver_memory_follows_files_not_rows():
    base = forecast(measured(rows=10**7, files=10), CFG, Cluster(hosts=1, cores=2), "spark")
    more_rows = forecast(measured(rows=10**9, files=10), CFG, Cluster(hosts=1, cores=2), "spark")
    more_files = forecast(measured(rows=10**7, files=100_010), CFG, Cluster(hosts=1, cores=2), "spark")
    shards = lambda f: sum(f.layout.shards.values())  # noqa: E731
    assert more_rows.prepare.driver_mb - base.prepare.driver_mb == pytest.approx(
        costs.DRIVER_MB_PER_SHARD * (shards(more_rows) - shards(base)))
    assert more_files.prepare.driver_mb - base.prepare.driver_mb == pytest.approx(100_000 * costs.DRIVER_MB_PER_FILE)


def test_a_step_is_compute_loader_cpu_and_the_all_reduce():
    m = measured(train_samples_per_s=25_600.0, loader_samples_per_s=256_000.0, parameters=10**6)
    one = forecast(m, load_config(CFG, {"training.batch_size": 256}), Cluster(hosts=1, cores=1), "spark", steps=100)
    assert one.layout.ranks == 1 and one.train_steps.parts["allreduce_per_step"] == 0
    # One rank on one core: its compute (256 / 25,600 s) and its loader's CPU (256 / 256,000 s) in turn.
    assert one.train_steps.parts["steps"] == pytest.approx(100 * (0.01 + 0.001))
    two = forecast(m, CFG, Cluster(hosts=1, cores=2), "spark", steps=100)
    assert two.layout.ranks == 2 and two.layout.local_batch == 256
    # Two ranks: DDP's own CPU on the step, and the gradients' all-reduce (bytes and latency).
    allreduce = 2 * (2 - 1) / 2 * 10**6 * 4 / costs.LOOPBACK_BYTES_PER_S + costs.ALLREDUCE_LATENCY_S
    assert two.train_steps.parts["steps"] == pytest.approx(100 * (0.01 * costs.DDP_STEP_X + 0.001 + allreduce))
    across = forecast(m, CFG, Cluster(hosts=2, cores=1), "spark", steps=100)
    assert across.train_steps.parts["allreduce_per_step"] == pytest.approx(
        10**6 * 4 / costs.NETWORK_BYTES_PER_S + costs.ALLREDUCE_LATENCY_S)


def test_an_epoch_is_every_train_row_once_then_evaluation():
    f = forecast(measured(rows=10**7), CFG, Cluster(hosts=1, cores=2), "dask")
    steps = f.splits["train"] // 2 // 256
    per_step = f.train_steps.parts["steps"] / f.steps
    assert f.epoch.parts["steps"] == pytest.approx(steps * per_step)
    assert f.epoch.parts["evaluate"] == pytest.approx(f.splits["val"] / (2 * 200_000.0))
    assert f.total_s == pytest.approx(f.prepare.seconds + f.epoch.seconds + f.score.seconds)
    assert sum(f.splits.values()) == pytest.approx(10**7, abs=2)


def test_gpus_set_the_ranks_and_a_cpu_measure_says_so():
    f = forecast(measured(), CFG, Cluster(hosts=2, cores=8, gpus=4), "spark")
    assert f.layout.ranks == 8 and f.layout.local_batch == 512 // 8
    assert any("no GPU here" in n for n in f.notes)
    cpu = forecast(measured(), CFG, Cluster(hosts=2, cores=8), "spark")
    assert cpu.layout.ranks == 16 and not cpu.notes


def test_memory_settings_cover_the_largest_stage():
    f = forecast(measured(), CFG, Cluster(hosts=3, cores=4), "spark")
    per_core = max(f.prepare.worker_mb, f.train_steps.worker_mb, f.score.worker_mb) * 1.5
    set_mb = int(f.layout.settings["spark.executor.memory"].rstrip("m"))
    assert set_mb >= per_core * 4 and set_mb % 256 == 0 and set_mb - per_core * 4 < 256
    assert f.layout.settings["spark.executor.instances"] == "3"
    # A rank holds DDP's five copies of the weights on top of torch.
    bigger = forecast(measured(parameters=10**8), CFG, Cluster(hosts=3, cores=4), "spark")
    assert bigger.train_steps.worker_mb - f.train_steps.worker_mb == pytest.approx(
        (10**8 - 10_000) * costs.TRAIN_BYTES_PER_WEIGHT / 1e6)
