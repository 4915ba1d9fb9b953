"""Encoded image columns and the `images` source (a folder of class folders). Pillow.

Shards keep images as they came (PNG or JPEG bytes, Arrow binary): decoding is the
loader's work, in its threads (Pillow releases the GIL while it decodes). Prepare
decodes every image once to check it, so a training job never meets a corrupt one:
- "bad_image": missing (a path to no file), not PNG or JPEG, or does not decode;
- "image_size": another width or height than declared, and `resize` is off.
Both are bad rows (`on_bad_rows`). The channel count is not checked: the loader
converts every image to the declared C (1: gray, 3: RGB, 4: RGBA), as ImageFolder does.
"""

from __future__ import annotations

import io

import numpy as np
import pandas as pd
import pyarrow as pa

from shardline.foundation import storage
from .config import ImageColumn
from shardline.foundation.errors import DataError

# Imported inside the functions that use them: Pillow (only for images).

IMAGE_KINDS = ("bad_image", "image_size")
FORMATS = ("PNG", "JPEG")
SUFFIXES = (".png", ".jpg", ".jpeg")
MODES = {1: "L", 3: "RGB", 4: "RGBA"}
# The images source's columns.
IMAGE_SCHEMA = pa.schema([("key", pa.int64()), ("path", pa.string()), ("label", pa.string()), ("image", pa.binary())])
# Images per unit of the images source (one task each).
UNIT_FILES = 2048


def check_image(data: bytes, spec: ImageColumn) -> str | None:
    """None if `data` decodes as a PNG/JPEG usable as `spec`, else the problem's kind."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.format not in FORMATS:
                return "bad_image"
            img.load()  # the whole image: a truncated or damaged one fails here
            size = img.size
    except Exception:  # Pillow raises many types for damaged input
        return "bad_image"
    _, h, w = spec.shape
    return None if spec.resize or size == (w, h) else "image_size"


def parse_images(col, spec: ImageColumn, base: str | None) -> tuple[pa.Array, dict[str, np.ndarray]]:
    """(binary: each row's encoded image, empty where bad; problems kind -> mask).

    A binary column holds the images; a text column paths to image files (URLs, or
    relative to `base`, the raw file's folder)."""
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    n = len(col)
    problems = {k: np.zeros(n, bool) for k in IMAGE_KINDS}
    t = col.type
    text = pa.types.is_string(t) or pa.types.is_large_string(t)
    binary = pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t)
    out: list[bytes] = []
    for i, v in enumerate(col.to_pylist() if text or binary else [None] * n):
        data = _read(v.strip(), base) if text and v is not None and v.strip() else v if binary else None
        kind = "bad_image" if data is None else check_image(data, spec)
        if kind is not None:
            problems[kind][i] = True
            data = b""
        out.append(data)
    return pa.array(out, pa.binary()), {k: m for k, m in problems.items() if m.any()}


def _read(path: str, base: str | None) -> bytes | None:
    url = path if "://" in path or path.startswith("/") or base is None else storage.join(base, path)
    url = url if "://" in url else f"file://{url}"
    try:
        return storage.read_bytes(url)
    except Exception:  # missing or unreadable: the row's image is bad
        return None


def decode_images(arr: pa.Array, spec: ImageColumn, where: str) -> np.ndarray:
    """A binary column of PNG/JPEG bytes as uint8 [rows, C, H, W].

    The loop is the loader's hot path (`shardline bench loader --images`): Pillow is
    asked only for PNG and JPEG (no probing of every plugin), an image already in the
    wanted mode is not converted (a copy), and its pixels go through one bytes buffer
    (`np.asarray(img)` takes a slower route to the same copy): ~15% less CPU per
    64 x 64 image than open, convert, asarray, with Pillow's decode itself ~85% of it."""
    from PIL import Image

    arr = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    c, h, w = spec.shape
    mode = MODES[c]
    out = np.empty((len(arr), c, h, w), np.uint8)
    for i, data in enumerate(arr.to_pylist()):
        try:
            with Image.open(io.BytesIO(data), formats=FORMATS) as img:
                if img.mode != mode:
                    img = img.convert(mode)
                if img.size != (w, h):
                    img = img.resize((w, h), Image.Resampling.BILINEAR)
                pixels = np.frombuffer(img.tobytes(), np.uint8)
        except Exception as e:
            raise DataError(f"{where}: row {i}: image does not decode ({e})") from None
        out[i] = pixels.reshape(h, w, c).transpose(2, 0, 1)
    return out


# -- the images source: <path>/<class>/<image> -------------------------------------------


def class_files(root: str, shown: str) -> list[str]:
    """Image files (URLs) of `root`'s class folders, sorted; one line if there are none
    or an image lies outside a class folder."""
    found = [f for f in storage.find_files(root) if f.lower().endswith(SUFFIXES)]
    rel = [f[len(root) + 1 :] for f in found]
    hidden = [r for r in rel if any(p.startswith((".", "_")) for p in r.split("/"))]
    rel = [r for r in rel if r not in hidden]
    loose = [r for r in rel if "/" not in r]
    if len(loose) == len(rel):
        found = f"; found {len(loose)} image(s) directly in it" if loose else ""
        raise DataError(f"{shown}: no class folders with images (images go in {shown}/<class name>/*.png{found})")
    if loose:
        raise DataError(f"{shown}: image '{loose[0]}' is not in a class folder (images go in {shown}/<class name>/)")
    return sorted(f"{root}/{r}" for r in rel)


def class_names(files: list[str], root: str) -> list[str]:
    return sorted({f[len(root) + 1 :].split("/", 1)[0] for f in files})


def path_keys(paths: list[str]) -> np.ndarray:
    """A non-negative int64 per relative path (pandas' stable hashing): the same on every
    run and engine, and a new image appended later gets its own key."""
    h = pd.util.hash_pandas_object(pd.Series(paths, dtype=object), index=False).to_numpy()
    return (h >> np.uint64(1)).astype(np.int64)


def read_images(root: str, files: tuple[str, ...], columns: list[str]) -> pa.Table:
    """The images source's rows for `files`: key, path (under root), label (class), image."""
    rel = [f[len(root) + 1 :] for f in files]
    data = {
        "key": pa.array(path_keys(rel)),
        "path": pa.array(rel, pa.string()),
        "label": pa.array([r.split("/", 1)[0] for r in rel], pa.string()),
    }
    if "image" in columns:
        data["image"] = pa.array([_read(f, None) for f in files], pa.binary())
    return pa.table({c: data[c] for c in columns if c in data})
