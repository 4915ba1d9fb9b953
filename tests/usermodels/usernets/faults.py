"""A user's model with a bug that shows only in training: its forward raises in train mode,
so the driver's one-batch check (eval mode) passes and every rank fails at its first step."""

from torch import nn


class RaisesInTraining(nn.Module):
    def __init__(self, inputs):
        super().__init__()
        self.linear = nn.Linear(inputs.feature_width, inputs.output_width)

    def forward(self, x):
        if self.training:
            raise ValueError("boom: this model fails in training")
        return self.linear(x)


def raises_in_training(inputs) -> RaisesInTraining:
    return RaisesInTraining(inputs)


class RaisesAlways(nn.Module):
    """A bug the driver's one-batch check meets first (its forward raises in eval mode too)."""

    def __init__(self, inputs):
        super().__init__()
        self.linear = nn.Linear(inputs.feature_width, inputs.output_width)

    def forward(self, x):
        raise ValueError("boom: this model always fails")


def raises_always(inputs) -> RaisesAlways:
    return RaisesAlways(inputs)
