"""The hand-written side of `shardline bench train --images`: torchvision's ImageFolder, a
DataLoader with worker processes and DDP, under torchrun; what a user writes without shardline.

    python -m torch.distributed.run --nproc_per_node 2 benchmarks/torchvision_ddp.py '<payload json>'

The images are read from their files every epoch (ImageFolder + PILToTensor: uint8
[C, H, W], what shardline's loader yields), shuffled by a DistributedSampler, batched by a
DataLoader with `num_workers` processes (persistent, so an epoch does not restart them).
The same CNN (benchmarks/bench_cnn.py), AdamW and steps as shardline's side, timed by the
same loop (`train_loops.timed_steps`). Rank 0 prints RESULT_MARK + its figures as JSON.
"""

from __future__ import annotations

import datetime as dt
import gc
import importlib.util
import json
import sys
import time
from pathlib import Path

# Run as a script, Python puts benchmarks/ first on sys.path; the repo root is wanted.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

from shardline.benchmarks.train_loops import RESULT_MARK, timed_steps  # noqa: E402

# Imported inside the functions that use them: torch (~2 s: only where a model or a rank runs); torchvision
# (with torch); benchmarks.bench_cnn (imports torch).


def main(p: dict) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    _torchvision_without_its_ops()
    from torchvision import datasets, transforms

    from shardline.benchmarks.bench_cnn import BenchCNN

    started = time.time()
    torch.set_num_threads(p["threads"])
    dist.init_process_group("gloo", timeout=dt.timedelta(seconds=p["timeout_s"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        # The model lives in train()'s frame only, collected before the group is left: a DDP
        # model freed after destroy_process_group deadlocked at exit (its gloo group's
        # destructor joined a thread waiting for the GIL the destructor held).
        def train() -> dict:
            data = datasets.ImageFolder(p["images_dir"], transform=transforms.PILToTensor())
            sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=p["seed"],
                                         drop_last=True)
            workers = p["num_workers"]
            loader = DataLoader(data, batch_size=p["global_batch"] // world, sampler=sampler, drop_last=True,
                                num_workers=workers, persistent_workers=workers > 0, pin_memory=False)
            torch.manual_seed(p["seed"])
            model = DistributedDataParallel(BenchCNN(p["shape"][0], len(data.classes), p["width"]))
            opt = torch.optim.AdamW(model.parameters(), lr=p["lr"], weight_decay=p["weight_decay"])

            def step(x, y):
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x), y).backward()
                opt.step()

            def batches():
                for epoch in range(p["epochs"]):
                    sampler.set_epoch(epoch)
                    yield from loader

            return timed_steps(batches(), step, p["warmup"], p["steps"], rank)

        out = {**train(), "started_at": started}
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        print(RESULT_MARK + json.dumps(out), flush=True)


def _torchvision_without_its_ops() -> None:
    """torchvision 0.28.0 on PyPI is built for CUDA torch: beside torch's CPU build its compiled
    ops (_C.so) do not load, and `import torchvision` then fails registering fakes for two
    detection ops it never defined ("operator torchvision::nms does not exist"). Defining
    their schemas first lets its Python part import; ImageFolder, PILToTensor and the
    DataLoader use no compiled torchvision op."""
    import torch

    package = Path(importlib.util.find_spec("torchvision").origin).parent
    try:
        torch.ops.load_library(str(next(package.glob("_C*.so"))))
        return  # a torchvision built for this torch: nothing to do
    except (OSError, StopIteration):
        pass
    for op in ("nms", "qnms"):
        torch.library.define(f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
