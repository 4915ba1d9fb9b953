"""A small CNN of the example's own: it takes the dataset's image column by its name,
`image`, as uint8 [batch, C, H, W] (the loader's decode of the PNGs), and scales it itself."""

from torch import nn


class SmallCNN(nn.Module):
    def __init__(self, channels: int, classes: int, width: int):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.head = nn.Linear(2 * width, classes)

    def forward(self, image):
        return self.head(self.features(image.float() / 255))

    def fsdp_units(self):
        """Sharded one unit at a time under `strategy = "fsdp"` (the default would be the whole model)."""
        return [self.features, self.head]


def build(inputs, width: int = 16) -> SmallCNN:
    """`inputs` (shardline's ModelInputs) says the image's shape and the number of classes."""
    return SmallCNN(inputs.inputs["image"].shape[0], inputs.num_classes, width)
