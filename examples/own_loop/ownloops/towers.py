"""A two-tower model on interaction rows: a user tower and an item tower, two forward passes
a step, an in-batch contrastive loss (each user's own item against the batch's others).

`train_towers(ctx)` is the loop (`training.loop = "ownloops.towers:train_towers"`); its
settings are `[training.loop_args]`: width, dim, temperature, lr, epochs, save_every. The
registered model is the item tower: a row's features in, its item's embedding out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Tower(nn.Module):
    """One side of a row: its `columns` of the features vector -> a unit-length embedding of `dim`."""

    def __init__(self, columns: list[int], width: int = 32, dim: int = 16):
        super().__init__()
        self.columns = list(columns)
        self.net = nn.Sequential(nn.Linear(len(columns), width), nn.ReLU(), nn.Linear(width, dim))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.net(features[:, self.columns]), dim=1)


def in_batch_loss(users: torch.Tensor, items: torch.Tensor, temperature: float) -> torch.Tensor:
    """Row i's user should score its own item i above every other item of the batch, and back."""
    logits = users @ items.T / temperature
    own = torch.arange(len(users), device=users.device)
    return (F.cross_entropy(logits, own) + F.cross_entropy(logits.T, own)) / 2


def train_towers(ctx):
    a = ctx.args
    names = ctx.inputs.numeric  # the features vector starts with the numeric columns, in this order
    side = {prefix: [i for i, name in enumerate(names) if name.startswith(prefix)] for prefix in ("user_", "item_")}
    torch.manual_seed(ctx.config.seed)
    users_plain = Tower(side["user_"], a["width"], a["dim"])
    items_plain = Tower(side["item_"], a["width"], a["dim"])
    users, items = ctx.prepare(users_plain), ctx.prepare(items_plain)  # ddp: a wrapper each
    opt = torch.optim.Adam([*users.parameters(), *items.parameters()], lr=a["lr"])  # one optimizer for both
    loader = ctx.loader("train")  # batches of (features, category)
    state = {"users": users, "items": items, "opt": opt, "loader": loader}
    step = ctx.restore(state) or 0
    loss = None  # the last step's: a restore at an epoch's end leaves that epoch no batch to take
    while loader.current_epoch < a["epochs"]:
        for features, _ in loader:
            x = ctx.to_device(features)
            # Two forward passes; the negatives are this rank's batch (its share of the global one).
            loss = in_batch_loss(users(x), items(x), a["temperature"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step % a["save_every"] == 0:
                ctx.save(state, step=step)
        if loss is not None:
            ctx.log({"loss": loss.item()}, step=step)
    # The item tower, rebuilt as Tower(columns, width, dim): it takes the dataset's rows, so
    # `shardline score` writes each key's item embedding (a list column `output`).
    example = torch.zeros(4, ctx.inputs.feature_width)  # a batch of the dataset's features: its rows in
    ctx.register(items_plain, example=example,
                 args={"columns": side["item_"], "width": a["width"], "dim": a["dim"]})
