"""The CNN `shardline bench train --images` trains on both sides: shardline builds it as a
user model (`training.model = "shardline.benchmarks.bench_cnn:build"`), the torchvision
loop constructs it directly. It takes uint8 [B, C, H, W] and scales it itself, so both
loaders hand it the same thing (ours decodes to uint8, torchvision's `PILToTensor` too)."""

from __future__ import annotations

from torch import nn


class BenchCNN(nn.Module):
    def __init__(self, channels: int, classes: int, width: int = 16):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.head = nn.Linear(2 * width, classes)

    def forward(self, image):
        return self.head(self.features(image.float() / 255))


def build(inputs, width: int = 16) -> BenchCNN:
    """shardline's factory: `inputs` (training.models.inputs.ModelInputs) gives channels and classes."""
    return BenchCNN(inputs.inputs["image"].shape[0], inputs.num_classes, width)
