"""A rank's weights and optimizer state keyed by the plain model's names, as checkpoint state.

A strategy that holds plain tensors of its own (a pipeline rank its stages, a parameter
server its shard) has no module whose state-dict names are the plain model's, so torch's
state-dict API cannot name its optimizer's state. These two `Stateful` objects (what
torch.distributed.checkpoint takes: `state_dict()` / `load_state_dict()`) name them
instead, the same names every strategy's checkpoint uses (training.checkpoints.sharded):

    model.<name>                         a weight (or buffer) of the plain model
    optimizer.state.<name>.<key>         its optimizer state (AdamW: exp_avg, exp_avg_sq, step)

so a checkpoint reshards over any mesh: each rank reads the names it holds now.
"""

from __future__ import annotations

import torch


class NamedTensors:
    """Tensors by name, loaded in place (a rank's share of the plain model's weights)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, value in state.items():
                if self.tensors[name] is not value:
                    self.tensors[name].copy_(value)


class NamedOptimizer:
    """An optimizer whose parameters are named `names` (in its param_groups' order).

    Its state is made before it is read (a step of zero gradients at learning rate 0, as
    torch's state-dict API does), so a fresh optimizer has tensors to load into; the
    hyperparameters are plain values (the param_groups, without the parameters, which
    differ from rank to rank)."""

    def __init__(self, optimizer: torch.optim.Optimizer, names: list[str]):
        self.optimizer, self.names = optimizer, names

    def state_dict(self) -> dict:
        init_state(self.optimizer)
        own = self.optimizer.state_dict()
        return {
            "state": {self.names[i]: dict(s) for i, s in own["state"].items()},
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in own["param_groups"]],
        }

    def load_state_dict(self, state: dict) -> None:
        own = self.optimizer.state_dict()
        self.optimizer.load_state_dict({
            "state": {i: state["state"][n] for i, n in enumerate(self.names) if n in state["state"]},
            "param_groups": [{**saved, "params": g["params"]}
                             for saved, g in zip(state["param_groups"], own["param_groups"], strict=True)],
        })


def optimizer_names(named_parameters, optimizer) -> list[str]:
    """The plain model's name of each of `optimizer`'s parameters, in its state dict's order
    (param_groups flattened), from (name, parameter) pairs of what the rank holds."""
    names = {id(p): n for n, p in named_parameters}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def init_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state tensors without changing a parameter: one step of zero
    gradients at learning rate 0 (torch.distributed.checkpoint.state_dict does the same)."""
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if any(p.grad is not None for p in params):
        return  # a step is under way: its state is made by it
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
