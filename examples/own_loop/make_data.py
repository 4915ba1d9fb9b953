"""The example's data, generated here (nothing downloaded):

- digits: 16 x 16 grayscale PNGs of the digits 0-9 in class folders (`<folder>/<digit>/<n>.png`,
  the layout the `images` source reads), each drawn with Pillow's built-in font, shifted a
  pixel or two, at its own brightness, on noise;
- interactions: rows of a user's features and the features of the item the user picked (a
  Parquet file): the items a user picks follow the user's features, which a two-tower
  model learns;
- latents: a table of generator inputs to score: per key, a noise vector `z` (a list of
  LATENT float32s) and the `digit` to draw.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

SIZE = 16
LATENT = 16  # the generator's noise: ownloops/gan.py's default latent size
USER, ITEM = 6, 6  # feature columns of each side of an interaction


def digit(d: int, rng: np.random.Generator) -> np.ndarray:
    """One SIZE x SIZE uint8 image of the digit `d`."""
    from PIL import Image, ImageDraw, ImageFont

    img = Image.new("L", (SIZE, SIZE), 0)
    font = ImageFont.load_default(size=14)  # Pillow's own font: no file, no download
    left, top, right, bottom = font.getbbox(str(d))
    dx, dy = rng.integers(-2, 3, 2)
    at = ((SIZE - (right - left)) // 2 - left + dx, (SIZE - (bottom - top)) // 2 - top + dy)
    ImageDraw.Draw(img).text(at, str(d), fill=int(rng.integers(170, 256)), font=font)
    noise = rng.integers(0, 48, (SIZE, SIZE))
    return np.maximum(np.asarray(img, dtype=np.int64), noise).astype(np.uint8)


def write_digits(folder, per_class: int = 40, seed: int = 0) -> Path:
    """`per_class` images of each digit under `folder`/<digit>/; the folder."""
    from PIL import Image

    folder = Path(folder)
    rng = np.random.default_rng(seed)
    for d in range(10):
        (folder / str(d)).mkdir(parents=True, exist_ok=True)
        for n in range(per_class):
            Image.fromarray(digit(d, rng)).save(folder / str(d) / f"{n:04d}.png")
    return folder


def write_interactions(path, rows: int = 2000, seed: int = 0) -> Path:
    """Rows of key, user_0..user_{USER-1}, item_0..item_{ITEM-1} and the item's `category`
    (0-3, the dataset's label); the item's features are a fixed map of the user's plus noise."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    users = rng.normal(size=(rows, USER))
    taste = np.random.default_rng(1).normal(size=(USER, ITEM))  # how users pick items: fixed
    items = np.tanh(users @ taste) + 0.3 * rng.normal(size=(rows, ITEM))
    columns = {"key": np.arange(rows)}
    columns.update({f"user_{i}": users[:, i] for i in range(USER)})
    columns.update({f"item_{i}": items[:, i] for i in range(ITEM)})
    columns["category"] = np.digitize(items[:, 0], [-0.5, 0.0, 0.5]).astype(np.int64)
    pq.write_table(pa.table(columns), path)
    return path


def write_latents(path, rows: int = 20, seed: int = 0) -> Path:
    """The generator's scoring input: key, z (LATENT float32s), digit (rows cycle 0-9)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    z = np.random.default_rng(seed).normal(size=(rows, LATENT)).astype(np.float32)
    pq.write_table(pa.table({"key": np.arange(rows), "z": list(z), "digit": np.arange(rows) % 10}), path)
    return path


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "example-out")
    print(write_digits(out / "digits"), write_interactions(out / "interactions.parquet"),
          write_latents(out / "latents.parquet"))
