"""Device placement by local rank (training/placement.py), checked on CPU.

No GPU exists here. What guards the GPU path: the choice itself is plain data (hosts,
device counts, Spark's task GPUs, Dask workers' CUDA_VISIBLE_DEVICES), given made-up
values below; every launcher hands each rank its slot on its host (real launches, CPU);
the loader's producer thread and the scoring task take the rank's or task's GPU.
"""

from __future__ import annotations

import os
import socket
import threading

import pytest
import torch
from pyspark.resource import ResourceInformation
from pyspark.taskcontext import BarrierTaskInfo

from shardline.foundation.errors import ShardlineError
from shardline.serving.models import choose_scoring_device, scoring_device, spark_task_gpus
from shardline.training import collectives, placement
from shardline.training.launchers import TrainingFailed
from shardline.engines.dask.launch import launch_dask
from shardline.training.launchers.guard import RankError, is_permanent
from shardline.engines.local.launch import launch_local
from shardline.engines.spark.launch import launch_spark_barrier, spark_slot
from shardline.training.loader.reader import ShardLoader
from shardline.training.placement import Slot, cuda_index, host_of, local_ranks, own_visible_gpus, rank_device


def cuda(i: int) -> torch.device:
    return torch.device("cuda", i)  # torch names a GPU without one present


# -- local ranks from each launcher's addresses --------------------------------------------


def test_local_ranks_from_spark_task_addresses():
    # BarrierTaskContext.getTaskInfos(): one per task, in partition (= rank) order, "host:port"
    # of the executor; two executors on one host have two ports.
    infos = [BarrierTaskInfo(a) for a in ("10.0.0.5:41000", "10.0.0.6:41000", "10.0.0.5:41002", "10.0.0.5:41000")]
    hosts = [host_of(i.address) for i in infos]
    assert hosts == ["10.0.0.5", "10.0.0.6", "10.0.0.5", "10.0.0.5"]
    assert local_ranks(hosts) == [(0, 3), (0, 1), (1, 3), (2, 3)]


def test_local_ranks_from_dask_worker_addresses():
    workers = ["tcp://10.0.0.5:40001", "tcp://10.0.0.5:40003", "tls://10.0.0.7:40001", "tcp://[fd00::2]:40001"]
    hosts = [host_of(a) for a in workers]
    assert hosts == ["10.0.0.5", "10.0.0.5", "10.0.0.7", "[fd00::2]"]
    assert local_ranks(hosts) == [(0, 2), (1, 2), (0, 1), (0, 1)]
    assert host_of("inproc://10.0.0.5/4242/3") == "10.0.0.5"


def test_each_rank_takes_the_gpu_of_its_local_rank_not_its_global_rank():
    # 4 ranks on 2 hosts of 2 GPUs: global rank % 4 GPUs would send ranks 2 and 3 to GPUs
    # 2 and 3, which their hosts do not have.
    slots = placement.slots(["a", "a", "b", "b"])
    assert [rank_device(s, device_count=2) for s in slots] == [cuda(0), cuda(1), cuda(0), cuda(1)]
    assert [rank_device(s, device_count=0) for s in slots] == [torch.device("cpu")] * 4


def test_more_ranks_on_a_host_than_gpus_is_refused_in_one_line():
    slot = placement.slots(["10.0.0.5", "10.0.0.6", "10.0.0.5", "10.0.0.5"])[2]
    with pytest.raises(ShardlineError) as refused:
        cuda_index(slot, device_count=2, visible="0,1")
    text = str(refused.value)
    assert text == ("3 ranks on host 10.0.0.5, but it has 2 GPU(s) (CUDA_VISIBLE_DEVICES=0,1): "
                    "lower training.world_size or add GPUs")
    # Permanent: the launch ends at once instead of relaunching into the same refusal.
    assert is_permanent(refused.value)
    failed = TrainingFailed.from_ranks("local", str(RankError.of(2, refused.value)), "no result")
    assert failed.permanent and "3 ranks on host 10.0.0.5, but it has 2 GPU(s)" in str(failed)
    assert "\n" not in str(failed)
    # As many ranks as GPUs is fine.
    assert cuda_index(placement.slots(["h", "h"])[1], device_count=2) == 1


def test_spark_task_gpu_wins_over_the_local_rank():
    addresses = ["10.0.0.5:41000", "10.0.0.5:41002", "10.0.0.5:41004"]
    slot = spark_slot(1, addresses, "3")
    assert (slot.local_rank, slot.local_world, slot.gpu) == (1, 3, 3)
    assert rank_device(slot, device_count=4) == cuda(3)
    # Spark's assignment stands even where local ranks alone would be refused (3 ranks, 1
    # GPU seen: each task's executor was given one of its own).
    assert rank_device(spark_slot(2, addresses, "0"), device_count=1) == cuda(0)
    with pytest.raises(ShardlineError, match=r"^GPU 3 on host 10.0.0.5, given by Spark's task resources "
                                             r"\(spark.task.resource.gpu.amount\), is not one of the 2 GPU\(s\)"):
        rank_device(slot, device_count=2)
    with pytest.raises(RankError, match="task GPU address 'gpu-a', not a CUDA device index"):
        spark_slot(0, addresses, "gpu-a")
    # Without GPU scheduling: by local rank.
    assert rank_device(spark_slot(2, addresses, None), device_count=4) == cuda(2)


def test_dask_cuda_workers_each_use_their_own_gpu_as_device_0():
    hosts = ["10.0.0.5", "10.0.0.5", "10.0.0.5", "10.0.0.6"]
    # dask-cuda's LocalCUDACluster: each worker's list rotated to start with its own GPU.
    own = own_visible_gpus(hosts, ["0,1,2", "1,2,0", "2,0,1", "0"])
    assert own == [0, 0, 0, 0]
    slots = placement.slots(hosts, own, "its Dask worker's CUDA_VISIBLE_DEVICES (dask-cuda)")
    # By local rank, rank 1 would take device 1 of "1,2,0": GPU 2, rank 2's own.
    assert [rank_device(s, device_count=3) for s in slots[:3]] == [cuda(0)] * 3
    # One list for the host's workers (or none): they share its GPUs, by local rank.
    assert own_visible_gpus(hosts, ["0,1,2", "0,1,2", "0,1,2", "0"]) == [None, None, None, 0]
    assert own_visible_gpus(hosts, [None, None, None, None]) == [None] * 4
    # Two workers pinned to one GPU are not each given their own: refused as 2 ranks on 1 GPU.
    pinned = placement.slots(["h", "h"], own_visible_gpus(["h", "h"], ["1", "1"]))
    with pytest.raises(ShardlineError, match=r"^2 ranks on host h, but it has 1 GPU\(s\) \(CUDA_VISIBLE_DEVICES=1\)"):
        cuda_index(pinned[0], device_count=1, visible="1")


def test_init_process_group_gets_the_gpu_as_device_id_and_nothing_on_cpu():
    # torch 2.13 refuses device_id=cpu ("must be an accelerator with an index").
    assert placement.group_device(cuda(1)) == {"device_id": cuda(1)}
    assert placement.group_device(torch.device("cpu")) == {}


# -- real launches hand each rank its slot (CPU) -----------------------------------------------


def where(rank: int, world_size: int, _) -> dict:
    return {"slot": placement.here(), "device": collectives.device(), "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}


def test_local_launch_places_ranks_by_local_rank_before_the_group():
    ranks = launch_local(where, None, world_size=2, timeout_s=120)
    host = socket.gethostname()
    assert [r["slot"] for r in ranks] == [Slot(host, 0, 2), Slot(host, 1, 2)]
    assert [r["device"] for r in ranks] == [torch.device("cpu")] * 2


def test_spark_launch_places_ranks_from_the_barrier_tasks(spark):
    ranks = launch_spark_barrier(spark, where, None, world_size=2, timeout_s=120)
    slots = [r["slot"] for r in ranks]
    assert [(s.local_rank, s.local_world, s.gpu) for s in slots] == [(0, 2, None), (1, 2, None)]
    assert slots[0].host == slots[1].host != ""


def _visible() -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def _set_visible(value: str | None) -> None:
    if value is None:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = value


def test_dask_launch_gives_dask_cuda_workers_their_own_device_0(dask_client):
    workers = sorted(dask_client.scheduler_info()["workers"])[:2]
    before = dask_client.run(_visible, workers=workers)
    try:
        # What dask-cuda's workers carry: the same GPUs, each worker's own first.
        for addr, value in zip(workers, ("0,1", "1,0")):
            dask_client.run(_set_visible, value, workers=[addr])
        ranks = launch_dask(dask_client, where, None, world_size=2, timeout_s=120, workers=workers)
        assert [r["visible"] for r in ranks] == ["0,1", "1,0"]
        slots = [r["slot"] for r in ranks]
        assert [(s.local_rank, s.local_world, s.gpu) for s in slots] == [(0, 2, 0), (1, 2, 0)]
        assert slots[0].host == host_of(workers[0])
        assert all("dask-cuda" in s.given_by for s in slots)

        for addr in workers:  # one list for both: they split it by local rank
            dask_client.run(_set_visible, "0,1", workers=[addr])
        slots = [r["slot"] for r in launch_dask(dask_client, where, None, world_size=2, timeout_s=120,
                                                 workers=workers)]
        assert [(s.local_rank, s.gpu) for s in slots] == [(0, None), (1, None)]
    finally:
        for addr in workers:
            dask_client.run(_set_visible, before[addr], workers=[addr])


# -- the loader's producer thread and the scoring task ------------------------------------------


def test_the_rank_device_is_entered_in_a_thread_only_on_a_gpu():
    before = collectives.device()
    calls = []
    try:
        collectives.bind(cuda(1))  # a GPU rank's binding (no GPU needed to name one)
        collectives.enter_rank_device(set_device=calls.append)
        collectives.bind(torch.device("cpu"))
        collectives.enter_rank_device(set_device=calls.append)
    finally:
        collectives.bind(before)
    assert calls == [cuda(1)]
    # The loader's producer calls exactly this.
    assert ShardLoader.on_thread_start is collectives.enter_rank_device


@pytest.fixture(scope="module")
def dataset(dask_client, tmp_path_factory):
    from shardline.engines import DaskEngine
    from shardline.pipelines.manifest import load_manifest
    from shardline.pipelines.prepare import prepare

    from .conftest import small_pipeline

    cfg = small_pipeline(tmp_path_factory.mktemp("placement"), rows=1500)
    prepare(DaskEngine(dask_client), cfg)
    return load_manifest(cfg.dataset_dir), cfg.dataset_dir


def test_the_loaders_producer_thread_enters_the_rank_device_before_its_first_batch(dataset):
    manifest, directory = dataset
    events = []
    loader = ShardLoader(manifest, directory, "train", 0, 2, 16, seed=1, workers=1, prefetch=2)
    loader.on_thread_start = lambda: events.append(("enter", threading.current_thread()))
    for _ in loader.epoch(0):
        events.append(("batch", threading.current_thread()))
    enters = [t for kind, t in events if kind == "enter"]
    assert len(enters) == 1 and events[0][0] == "enter"
    producer = enters[0]
    assert producer is not threading.current_thread() and not producer.name.startswith("shardline-decode")
    assert sum(kind == "batch" for kind, _ in events) == loader.steps_per_epoch() > 0


def test_scoring_takes_the_gpu_spark_gave_its_task():
    resources = {"gpu": ResourceInformation("gpu", ["1"])}
    assert spark_task_gpus(resources) == ["1"]
    assert spark_task_gpus({}) == spark_task_gpus(None) == []
    assert choose_scoring_device(spark_task_gpus(resources), device_count=2, current=0) == cuda(1)
    # No Spark GPU: the current device (a dask-cuda worker's own GPU is its device 0).
    assert choose_scoring_device([], device_count=2, current=0) == cuda(0)
    assert choose_scoring_device(["1"], device_count=0, current=0) == torch.device("cpu")
    with pytest.raises(ShardlineError, match=r"GPU '2', which is not one of the 2 CUDA device\(s\)"):
        choose_scoring_device(["2"], device_count=2, current=0)
    # Here: not in a Spark task, no CUDA.
    assert scoring_device() == torch.device("cpu")
