"""Generated PNG images in class folders, the layout the `images` source reads:
<folder>/<class>/<n>.png. Three classes a small CNN tells apart: noise with a bright
horizontal bar, a vertical bar, or a square in the middle. Nothing is downloaded."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from PIL import Image

CLASSES = ("horizontal", "vertical", "square")


def image(cls: str, rng: np.random.Generator, size: int = 16) -> np.ndarray:
    a = rng.integers(0, 96, (size, size, 3), dtype=np.uint8)
    at = int(rng.integers(2, size - 4))
    if cls == "horizontal":
        a[at : at + 2, :, :] = 255
    elif cls == "vertical":
        a[:, at : at + 2, :] = 255
    else:
        q = size // 4
        a[q : size - q, q : size - q, :] = 255
    return a


def write_images(folder, per_class: int = 64, size: int = 16, seed: int = 0) -> Path:
    """`per_class` images of size x size for each class under `folder`; the folder."""
    folder = Path(folder)
    rng = np.random.default_rng(seed)
    for cls in CLASSES:
        (folder / cls).mkdir(parents=True, exist_ok=True)
        for n in range(per_class):
            Image.fromarray(image(cls, rng, size)).save(folder / cls / f"{n:04d}.png")
    return folder


if __name__ == "__main__":
    print(write_images(sys.argv[1] if len(sys.argv) > 1 else "example-out/images"))
