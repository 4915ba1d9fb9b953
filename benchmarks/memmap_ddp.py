"""The hand-written side of `shardline bench train --tokens`: a nanoGPT-style loop under torchrun.

    python -m torch.distributed.run --nproc_per_node 2 benchmarks/memmap_ddp.py '<payload json>'

nanoGPT's `get_batch`: the token ids are one `np.memmap` of uint16; each sample is a
random window of `length` ids (x) and the same window one id later (y), drawn on the
training thread (no loader). The model is shardline's built-in decoder
(training/models/decoder.py `Decoder`, the same sizes), wrapped in DDP, AdamW; the loss is
cross-entropy over every position of the window. Timed by `train_loops.timed_steps`, as
shardline's side. Rank 0 prints RESULT_MARK + its figures as JSON.
"""

from __future__ import annotations

import datetime as dt
import gc
import json
import sys
from pathlib import Path

import numpy as np

# Run as a script, Python puts benchmarks/ first on sys.path; the repo root is wanted.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

from shardline.benchmarks.train_loops import RESULT_MARK, timed_steps  # noqa: E402

# Imported inside the functions that use them: torch (~2 s: only where a model or a rank runs);
# training.models.decoder (imports torch).


def main(p: dict) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from shardline.training.models.decoder import Decoder

    torch.set_num_threads(p["threads"])
    dist.init_process_group("gloo", timeout=dt.timedelta(seconds=p["timeout_s"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        # The model lives in train()'s frame only, collected before the group is left: a DDP
        # model freed after destroy_process_group deadlocked at exit (its gloo group's
        # destructor joined a thread waiting for the GIL the destructor held).
        def train() -> dict:
            data = np.memmap(p["tokens"], dtype=np.uint16, mode="r")
            length, local = p["length"], p["global_batch"] // world
            g = torch.Generator().manual_seed(p["seed"] + rank)

            def get_batch():
                ix = torch.randint(len(data) - length, (local,), generator=g)
                x = torch.stack([torch.from_numpy(data[i : i + length].astype(np.int64)) for i in ix])
                y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + length].astype(np.int64)) for i in ix])
                return x, y

            def batches():
                while True:
                    yield get_batch()

            torch.manual_seed(p["seed"])
            model = DistributedDataParallel(Decoder(p["vocab"], length, p["d_model"], p["heads"], p["layers"]))
            opt = torch.optim.AdamW(model.parameters(), lr=p["lr"], weight_decay=p["weight_decay"])

            def step(x, y):
                logits = model(x)
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()

            return timed_steps(batches(), step, p["warmup"], p["steps"], rank)

        out = train()
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        print(RESULT_MARK + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
