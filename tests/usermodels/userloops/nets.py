"""The loops' models: plain modules, rebuilt by a registered model as Class(**args)."""

import torch
from torch import nn


class Encoder(nn.Module):
    def __init__(self, features: int, width: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, width), nn.ReLU(), nn.Linear(width, width))

    def forward(self, x):
        return self.net(x)


class Classifier(nn.Module):
    """An encoder and a head: two modules a loop prepares and steps each on its own."""

    def __init__(self, features: int, width: int, classes: int):
        super().__init__()
        self.encoder = Encoder(features, width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.encoder(x))


class Planless(nn.Module):
    """No tp_plan(): strategy tensor cannot split it."""

    def __init__(self, features: int, classes: int):
        super().__init__()
        self.linear = nn.Linear(features, classes)

    def forward(self, x):
        return self.linear(torch.relu(x))
