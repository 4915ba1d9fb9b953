"""Evaluation on the validation split, every rank at once: loss and the task's figures
summed on each rank's device and reduced once, the user's metrics on rank 0 over the whole
split, and sharded models run in lockstep (their forward is collective)."""

from __future__ import annotations

import torch

from . import collectives, task
from .batch import split as split_batch, take, to_device
from .loader.reader import ShardLoader


@torch.no_grad()
def evaluate(run, val: ShardLoader | None, device, kind: str, loss_fn, user_metrics: dict,
              lockstep: bool = False, scale: tuple[float, float] | None = None) -> dict[str, float]:
    """Every rank calls it; ranks without a share of the split (val None) add nothing.
    `run`: the model's outputs on a batch's inputs (a plain model in eval mode, or a sharded
    model's forward_eval). lockstep: `run` is collective (a sharded model's), so every rank
    runs it as often as the rank with the most batches (`in_lockstep`). The user's metrics
    (rank 0's figures) see the whole split's outputs at once, in the label's units (`scale`:
    the label was standardised)."""
    sums = task.zero_sums(kind)
    kept = []  # (outputs, targets) on the CPU, only when there are user metrics
    batches = (split_batch(b) for b in val.all_batches(4096)) if val is not None else iter(())
    if lockstep:
        batches = in_lockstep(batches, run, device)
    for x, y in batches:
        outputs = run(to_device(x, device))
        y = y.to(device)
        # Summed on the device: no host round trip per batch.
        sums += task.batch_sums(kind, outputs, y, loss_fn(outputs, y))
        if user_metrics:
            o, t = outputs.float().cpu(), y.cpu()
            if scale is not None:
                o, t = o * scale[1] + scale[0], t * scale[1] + scale[0]
            kept.append((o, t))
    collectives.all_reduce(sums)
    figures = task.figures(kind, "val", sums, scale)
    if user_metrics:
        figures.update(user_figures(user_metrics, kept))
    return figures


def in_lockstep(batches, run, device):
    """`batches` ((inputs, target) pairs), while every rank runs `run` the same number of times:
    each round the ranks agree whether any still has a batch, and one that has run out runs `run` on a
    one-row pad (the first row some rank read; its output is not counted)."""
    batches = iter(batches)
    batch = next(batches, None)
    rows = collectives.all_gather_object(take(batch[0], slice(0, 1)) if batch is not None else None)
    pad = next((r for r in rows if r is not None), None)
    while True:
        more = collectives.tensor([1.0 if batch is not None else 0.0])
        collectives.all_reduce(more)
        if more.item() == 0:
            return
        if batch is None:
            run(to_device(pad, device))
        else:
            yield batch
            batch = next(batches, None)


def user_figures(fns: dict, kept: list) -> dict[str, float]:
    """Each training.metrics function on the whole validation split, on rank 0 (collective)."""
    parts = collectives.gather_object(kept, dst=0)
    pairs = [pair for part in parts or () for pair in part]
    if not pairs:
        return {}
    out, y = torch.cat([o for o, _ in pairs]), torch.cat([t for _, t in pairs])
    return {name: float(fn(out, y)) for name, fn in fns.items()}
