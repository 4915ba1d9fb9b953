"""The loss and the metrics of a task: classification, regression or next_token.

The task is the dataset's (`pipelines.features.task`), carried by the label tensor's
dtype in the manifest: int64 class indices for classification, float32 values for
regression. Strategies call `task_loss` on whatever labels the loader gives them, so
no strategy needs to know the task.

classification: cross-entropy over the model's K logits; accuracy.
regression: mean squared error of the model's single output; RMSE, MAE and R^2
(1 - SSE/SST, SST about the mean of the same rows) reported beside the loss.
next_token: a language model's logits [B, L, V] against its own tokens [B, L] one
position ahead (position i predicts token i+1), over the positions whose target is not a
pad (the loader marks them IGNORE_INDEX); perplexity (exp of the mean token loss) and
token accuracy beside the loss, all per counted token. The built-in loss by name:
training.loss = "next_token".

Regression with the default loss learns the standardised label: (y - mean) / std with the
train split's statistics (the manifest's `statistics.label`, `label_scale`). A label far
from 0, or in the thousands, would otherwise leave a model initialised near 0 with a huge
loss and gradients that the default learning rate cannot follow (a 442-row set trained to
R^2 -4.4). The loader standardises the label; the figures are given back in the label's
units; the registered model un-standardises its output (training.models.files), so scores
and the served model speak the label's units too. A user's own loss gets the label as it
is: its scale is the user's choice.

The user's own (training.loss, training.metrics: 'package.module:callable'): a loss
`fn(output, target) -> scalar tensor` replaces the task's, in training and in val_loss;
each metric `fn(output, target) -> number` is computed once per epoch over the whole
validation split (every rank's outputs gathered) and logged as `val_<name>`, the name
its import path ends with.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from shardline.pipelines.manifest import ShardManifest

from . import collectives
from .config import TrainingConfig
from .loader.columns import IGNORE_INDEX  # a target position no loss counts: the loader marks pads so
from .user_code import import_user_object

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

CLASSIFICATION, REGRESSION, NEXT_TOKEN = "classification", "regression", "next_token"
TASKS = (CLASSIFICATION, REGRESSION, NEXT_TOKEN)
# Per-epoch figures each task logs for a split ("train", "val"), the loss first.
_FIGURES = {CLASSIFICATION: ("loss", "accuracy"), REGRESSION: ("loss", "rmse", "mae", "r2"),
            NEXT_TOKEN: ("loss", "perplexity", "accuracy")}
# Sums reduced over ranks, from which the figures are computed: classification
# (loss sum, correct, rows); regression (squared errors, absolute errors, y, y^2, rows);
# next_token (loss sum, correct tokens, counted tokens).
_SUMS = {CLASSIFICATION: 3, REGRESSION: 5, NEXT_TOKEN: 3}
LOWER_IS_BETTER = ("loss", "rmse", "mae", "perplexity")
# Losses by name (training.loss), beside import paths.
BUILTIN_LOSSES = ("next_token",)


def task_of(manifest: ShardManifest) -> str:
    if manifest.feature_spec.task == NEXT_TOKEN:
        return NEXT_TOKEN
    return REGRESSION if manifest.tensors["label"].dtype == "float32" else CLASSIFICATION


def label_scale(manifest: ShardManifest, loss: str | None) -> tuple[float, float] | None:
    """(mean, std) the label is standardised with in training, or None: regression with the
    default loss (`loss`: training.loss) on a dataset whose manifest has the label's statistics."""
    stats = manifest.statistics.label
    if task_of(manifest) != REGRESSION or loss is not None or stats is None:
        return None
    return stats.mean, stats.std


class LabelUnits(torch.nn.Module):
    """A model that learnt the standardised label (`label_scale`), giving values in the
    label's units: what training.models.files loads for scoring and serving."""

    def __init__(self, inner: torch.nn.Module, mean: float, std: float):
        super().__init__()
        self.inner, self.mean, self.std = inner, float(mean), float(std)

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs) * self.std + self.mean


def task_loss(outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean loss of a batch: MSE for float labels (regression), next-token cross-entropy
    for token sequences [B, L], else cross-entropy."""
    if y.is_floating_point():
        # The model has one output per row; [n, 1] against [n] would broadcast to [n, n].
        return F.mse_loss(outputs.float().squeeze(-1), y.float())
    if y.dim() == 2:
        return next_token_loss(outputs, y)
    return F.cross_entropy(outputs, y)


def _shifted(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits of positions 0..L-2 as [B*(L-1), V], their targets, tokens 1..L-1, as [B*(L-1)])."""
    return logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1).long()


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits [B, L, V] at positions 0..L-2 against tokens 1..L-1,
    over the targets that are not IGNORE_INDEX (pads). A batch of pads only gives 0, not NaN.
    Position L-1 is given the target IGNORE_INDEX rather than sliced off: the logits then
    stay one contiguous view, where a slice is a [B, L-1, V] copy in the forward and a
    zero-filled [B, L, V] gradient it is copied into in the backward, on every step."""
    last = tokens.new_full((tokens.shape[0], 1), IGNORE_INDEX, dtype=torch.long)
    t = torch.cat([tokens[:, 1:].long(), last], dim=1).reshape(-1)
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), t, ignore_index=IGNORE_INDEX,
                            reduction="sum")
    return total / (t != IGNORE_INDEX).sum().clamp(min=1)


def loss_for(cfg: TrainingConfig) -> LossFn:
    """training.loss if set (a built-in name, or imported here: on the driver and in each
    rank), else the task's."""
    if cfg.loss is None:
        return task_loss
    if cfg.loss == "next_token":
        return next_token_loss
    return import_user_object(cfg.loss, "training.loss", cfg.code_paths)


def user_metrics(cfg: TrainingConfig) -> dict[str, Callable]:
    """training.metrics, imported, by the name each is logged under (user_metric_names)."""
    fns = [import_user_object(p, f"training.metrics[{i}]", cfg.code_paths) for i, p in enumerate(cfg.metrics)]
    return dict(zip(user_metric_names(cfg), fns))


def user_metric_names(cfg: TrainingConfig) -> list[str]:
    """What training.metrics log: val_<the callable's name as its import path spells it>
    ('pkg.mod:f1' logs val_f1), known without importing it."""
    return [f"val_{path.rpartition(':')[2].rpartition('.')[2]}" for path in cfg.metrics]


def metric_names(task: str, split: str) -> list[str]:
    return [f"{split}_{f}" for f in _FIGURES[task]]


def zero_sums(task: str) -> torch.Tensor:
    """The epoch's sums, on the rank's device: they travel in a collective (training.collectives)."""
    return collectives.zeros(_SUMS[task], dtype=torch.float64)


@torch.no_grad()
def batch_sums(task: str, outputs: torch.Tensor, y: torch.Tensor, mean_loss: torch.Tensor) -> torch.Tensor:
    """One batch's contribution to the epoch's sums (see _SUMS), on the outputs' device: no
    host round trip per batch."""
    if task == NEXT_TOKEN:
        x, t = _shifted(outputs.detach(), y)
        counted = t != IGNORE_INDEX
        n = counted.sum().double()
        correct = ((x.argmax(-1) == t) & counted).sum().double()
        return torch.stack([mean_loss.detach().double() * n, correct, n])
    n = torch.tensor(float(len(y)), dtype=torch.float64, device=outputs.device)
    if task == CLASSIFICATION:
        correct = (outputs.argmax(1) == y).sum().double()
        return torch.stack([mean_loss.detach().double() * n, correct, n])
    err = outputs.detach().double().squeeze(-1) - y.double()
    yd = y.double()
    return torch.stack([(err * err).sum(), err.abs().sum(), yd.sum(), (yd * yd).sum(), n])


def figures(task: str, split: str, sums: torch.Tensor, scale: tuple[float, float] | None = None) -> dict[str, float]:
    """The split's figures from sums reduced over every rank; {} when no row was counted.
    scale: the label's (mean, std) when the sums are of the standardised label
    (`label_scale`): errors are given back in the label's units (R^2 has none)."""
    s = sums.tolist()
    n = s[-1]
    if n <= 0:
        return {}
    if task == CLASSIFICATION:
        return {f"{split}_loss": s[0] / n, f"{split}_accuracy": s[1] / n}
    if task == NEXT_TOKEN:
        loss = s[0] / n
        # Capped: exp of a diverged loss would raise OverflowError rather than say it is huge.
        return {f"{split}_loss": loss, f"{split}_perplexity": math.exp(min(loss, 700.0)),
                f"{split}_accuracy": s[1] / n}
    sse, sae, sy, syy = s[:4]
    sst = syy - sy * sy / n
    std = scale[1] if scale is not None else 1.0
    return {
        f"{split}_loss": sse / n * std * std,
        f"{split}_rmse": math.sqrt(sse / n) * std,
        f"{split}_mae": sae / n * std,
        # Labels all equal: R^2 is undefined; NaN says so rather than a made-up figure.
        f"{split}_r2": 1.0 - sse / sst if sst > 0 else float("nan"),
    }


@torch.no_grad()
def next_token_rows(logits: torch.Tensor, label: torch.Tensor) -> dict[str, torch.Tensor]:
    """What scoring a next_token dataset writes per row, from the model's logits [B, L, V]
    and the loader's label [B, L] (pads IGNORE_INDEX): `loss`, the row's mean next-token
    loss over its counted targets (NaN when it has none); `tokens`, how many it counted;
    `next_token`, the id the model predicts after the row's last non-pad position (-1 for
    a row of pads only)."""
    x, t = logits[:, :-1].float(), label[:, 1:].long()
    per_position = F.cross_entropy(x.transpose(1, 2), t, ignore_index=IGNORE_INDEX, reduction="none")
    counted = (t != IGNORE_INDEX).sum(1)
    loss = torch.where(counted > 0, per_position.sum(1) / counted.clamp(min=1), torch.nan)
    real = label != IGNORE_INDEX
    positions = torch.arange(label.shape[1], device=label.device).expand_as(label)
    last = torch.where(real, positions, -1).max(1).values
    predicted = logits[torch.arange(len(label), device=label.device), last.clamp(min=0)].argmax(-1)
    return {"loss": loss.double(), "tokens": counted, "next_token": torch.where(last >= 0, predicted, -1)}
