"""Losses, fn(output, target) -> scalar tensor, and metrics, fn(output, target) -> number."""

import torch.nn.functional as F


def smoothed_ce(output, target):
    """Cross-entropy with label smoothing: other gradients than the task's plain cross-entropy."""
    return F.cross_entropy(output, target, label_smoothing=0.2)


def shifted_ce(output, target):
    """Cross-entropy + 1: the task's gradients, a loss exactly 1 above it."""
    return F.cross_entropy(output, target) + 1.0


def one_argument(output):
    return output.sum()


def ce(output, target) -> float:
    return F.cross_entropy(output, target).item()


def top1(output, target) -> float:
    return (output.argmax(1) == target).float().mean().item()
