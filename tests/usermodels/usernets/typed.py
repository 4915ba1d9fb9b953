"""A model of named inputs (a dataset with image and tensor columns), as a user writes one:
its forward takes the columns by the names the pipeline config gave them, each in its own
dtype: `photo` uint8 [B, C, H, W], `grid` uint8 [B, 2, 3], `tokens` int32 [B, length]."""

import torch
from torch import nn

from .nets import Residual


class Inputs(nn.Module):
    """The named inputs to one [B, width] vector: a convolution of the scaled image, an
    embedding of the tokens (mean over the sequence) and the grid's values, then a Linear."""

    def __init__(self, inputs, width: int):
        super().__init__()
        channels = inputs.inputs["photo"].shape[0]
        self.conv = nn.Conv2d(channels, 4, 3, padding=1)
        self.embed = nn.Embedding(100, 4)
        grid = inputs.inputs["grid"].shape
        self.linear = nn.Linear(4 + 4 + grid[0] * grid[1], width)

    def forward(self, photo, grid, tokens):
        assert photo.dtype == torch.uint8 and grid.dtype == torch.uint8 and tokens.dtype == torch.int32
        image = torch.relu(self.conv(photo.float() / 255)).mean((2, 3))
        words = self.embed(tokens.long()).mean(1)
        return torch.relu(self.linear(torch.cat([image, words, grid.flatten(1).float() / 255], 1)))


class TypedNet(nn.Module):
    """Declares its plans: its first pipeline layer takes the named inputs."""

    def __init__(self, inputs, width: int):
        super().__init__()
        self.inputs = Inputs(inputs, width)
        self.block = Residual(width)
        self.head = nn.Linear(width, inputs.output_width)

    def forward(self, photo, grid, tokens):
        return self.head(self.block(self.inputs(photo=photo, grid=grid, tokens=tokens)))

    def tp_plan(self):
        return {"block.up": "colwise", "block.down": "rowwise"}

    def pipeline_layers(self):
        return ["inputs", "block", "head"]

    def fsdp_units(self):
        return [self.inputs, self.block, self.head]


def build(inputs, width: int = 16) -> TypedNet:
    return TypedNet(inputs, width)
