"""`shardline bench loader --images`: decoded images per second per core, ours vs a plain Pillow loop.

One run, one process. A folder of small images in class folders is generated
locally (half PNG, half JPEG; nothing downloaded), prepared with the images
source (`source.format = "images"`) on an in-process Dask cluster, and read back:

- ours: `training.loader.reader.ShardLoader` over the shards, shuffle on, with 1 and with
  N decoding threads (`workers`; N = the cores, at least 2): Parquet row groups ->
  PNG/JPEG bytes -> Pillow -> uint8 [B, C, H, W] batches through the shuffle buffer.
- pillow: a plain loop over the same image files: open, decode, convert to the
  declared mode, into a uint8 [B, C, H, W] batch (the same shape), in file order.
- pillow_in_memory: the same loop over the files' bytes read beforehand (untimed):
  Pillow's decode with no file system in the way, the stricter reference
  (`ratio.vs_pillow_in_memory`); ours reads its bytes from Parquet inside its clock.

"Per core" is images per CPU-second of this process (`time.process_time`, every
thread counted): what one core does, whatever else the machine runs, and the
figure the threads are judged by. `ratio.vs_pillow` is ours (1 thread) per core
over Pillow per core. The wall-clock rates give the scaling with threads. Each
figure is the best of REPEATS epochs (per-core and wall kept separately),
the methods alternating. Bytes on disk: the shard files per image vs the raw files.

petastorm is not measured here: see `petastorm_status`.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow

from shardline.benchmarks import significant
from shardline.engines import DaskEngine
from shardline.pipelines.config import PipelineConfig
from shardline.pipelines.manifest import load_manifest

# Imported inside the functions that use them: Pillow (only for images); torch (~2 s: only where a model or a
# rank runs); training.loader.reader (imports torch); Dask (only with a Dask client); pipelines.prepare
# (imports pandas).

TARGET_VS_PILLOW = 0.9
SHAPE = (3, 64, 64)  # [C, H, W]
CLASSES = ("cat", "dog", "fox", "owl")
BATCH_SIZE = 64
REPEATS = 7
# The loader decodes row groups in parallel, one per thread: the default 16,384 rows
# would make these few hundred images one row group and leave the second thread idle.
ROWS_PER_ROW_GROUP = 128
SEED = 0
MODES = {1: "L", 3: "RGB", 4: "RGBA"}


def make_images(root: Path, n: int, shape=SHAPE, seed: int = SEED, jpeg: bool = True) -> list[Path]:
    """`n` images under root/<class>/, alternately PNG and JPEG (quality 90; jpeg=False: all PNG), sorted.
    Smooth gradients plus noise: they compress like small photos, not like pure noise."""
    from PIL import Image

    c, h, w = shape
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    files = []
    for k in range(n):
        cls = CLASSES[k % len(CLASSES)]
        (root / cls).mkdir(parents=True, exist_ok=True)
        base = np.stack([(xx * rng.uniform(1, 4) + yy * rng.uniform(1, 4) + rng.uniform(0, 255)) % 256
                         for _ in range(c)], axis=-1)
        pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
        img = Image.fromarray(pixels[..., 0] if c == 1 else pixels, MODES[c])
        ext = "png" if k % 2 == 0 or c == 4 or not jpeg else "jpg"  # JPEG has no alpha
        path = root / cls / f"{k:05d}.{ext}"
        img.save(path, "PNG" if ext == "png" else "JPEG", quality=90)
        files.append(path)
    return sorted(files)


def pillow_batches(files: list, shape, batch: int):
    """The baseline: each file (a path, or its bytes as io.BytesIO) opened, decoded and
    converted by Pillow into a uint8 [batch, C, H, W] array, as torch; a short last batch
    is dropped, as ours drops it."""
    import torch
    from PIL import Image

    c, h, w = shape
    mode = MODES[c]
    whole = len(files) - len(files) % batch
    for lo in range(0, whole, batch):
        out = np.empty((batch, c, h, w), np.uint8)
        for i, f in enumerate(files[lo : lo + batch]):
            with Image.open(io.BytesIO(f) if isinstance(f, bytes) else f) as img:
                a = np.asarray(img.convert(mode))
            out[i] = a.reshape(h, w, c).transpose(2, 0, 1)
        yield {"image": torch.from_numpy(out)}


def ours_batches(manifest, dataset_dir: str, batch: int, workers: int):
    from shardline.training.loader.reader import ShardLoader

    yield from ShardLoader(manifest, dataset_dir, "train", 0, 1, batch, SEED, workers=workers).epoch(0)


def timed_epoch(batches, shape, batch: int) -> tuple[int, float, float]:
    """(images, wall seconds, CPU seconds of the process) of one pass; every batch must be
    uint8 [batch, *shape]."""
    import torch

    images = 0
    wall, cpu = time.perf_counter(), time.process_time()
    for b in batches:
        x = b["image"]
        if x.dtype != torch.uint8 or tuple(x.shape) != (batch, *shape):
            raise RuntimeError(f"bench loader --images: a batch of {x.dtype} {tuple(x.shape)}; "
                               f"expected uint8 {(batch, *shape)}")
        images += batch
    return images, time.perf_counter() - wall, time.process_time() - cpu


def petastorm_status() -> dict:
    """Why petastorm's reader is not measured on the images. Its image codec reads only datasets
    petastorm itself wrote (a Unischema, `materialize_dataset` on Spark), and no petastorm
    release imports with the pyarrow shardline needs (0.12.1 and 0.13.1 import
    `pyarrow.filesystem`, gone in pyarrow 16; dask.dataframe needs pyarrow >= 16)."""
    if importlib.util.find_spec("petastorm") is None:
        why = "not installed beside shardline"
    else:
        try:
            # pyright, run in shardline's venv, finds no petastorm there (its own venv has it).
            import petastorm  # noqa: F401  # pyright: ignore[reportMissingImports]
            why = None
        except Exception as e:  # its import fails on newer pyarrow/numpy
            why = f"import fails: {type(e).__name__}: {e}".splitlines()[0]
    reason = (f"{why}; petastorm 0.12.1/0.13.1 import pyarrow.filesystem, removed in pyarrow 16, and this "
              f"environment has pyarrow {pyarrow.__version__} (dask.dataframe needs >= 16); its image "
              f"codec reads only datasets petastorm wrote itself (Unischema + materialize_dataset)"
              if why else "importable, but its image codec reads only datasets petastorm wrote itself")
    return {"status": "not runnable here", "reason": reason}


def _prepare(images_dir: Path, dataset_dir: Path, shape, progress) -> None:
    """The images source prepared into `dataset_dir`, every image in train, on an in-process
    Dask cluster (threads: starting worker processes would cost more than the work)."""
    from distributed import Client, LocalCluster

    from shardline.pipelines.prepare import prepare

    cfg = PipelineConfig.model_validate({
        "dataset_dir": str(dataset_dir),
        "source": {"format": "images", "path": str(images_dir)},
        "features": {"images": {"image": {"shape": list(shape)}}},
        "split": {"train": 1.0, "val": 0.0, "test": 0.0},
        "layout": {"world_size": 1, "rows_per_row_group": ROWS_PER_ROW_GROUP},
    })
    progress(f"preparing {images_dir} (images source, Dask in-process)")
    # dashboard_address ":0": any free port (None still tries 8787 and warns when it is taken).
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        prepare(DaskEngine(client), cfg)


def _du(paths) -> int:
    return sum(Path(p).stat().st_size for p in paths)


def _best_epochs(methods: dict, shape, batch: int, repeats: int,
                 progress) -> tuple[dict[str, int], dict[str, float], dict[str, float]]:
    """Each method's epoch `repeats` times, the methods alternating: (samples, best wall
    seconds, best CPU seconds) per method."""
    samples: dict[str, int] = {}
    wall: dict[str, float] = {}
    cpu: dict[str, float] = {}
    for attempt in range(repeats):
        for name, batches in methods.items():
            progress(f"{name}: epoch {attempt + 1} of {repeats}")
            n, w, c = timed_epoch(batches(), shape, batch)
            samples[name] = n
            wall[name] = min(w, wall.get(name, w))
            # A clock tick (10 ms) can read 0 on a tiny epoch: never below a microsecond.
            cpu[name] = max(1e-6, min(c, cpu.get(name, c)))
    return samples, wall, cpu


def _ratios(ips: dict[str, float], per_core: dict[str, float], many: int) -> dict[str, float]:
    """Ours (1 thread) per core against Pillow's, from files and from memory; ours with `many`
    threads per core against Pillow's; and the scaling from 1 thread to `many`."""
    return {
        "vs_pillow": significant(per_core["ours_1"] / per_core["pillow"]),
        "vs_pillow_in_memory": significant(per_core["ours_1"] / per_core["pillow_in_memory"]),
        f"vs_pillow_{many}_threads": significant(per_core[f"ours_{many}"] / per_core["pillow"]),
        "threads_scaling": significant(ips[f"ours_{many}"] / ips["ours_1"]),
    }


def run(n_images: int = 512, workdir: str | None = None, progress=print, shape=SHAPE,
        batch_size: int = BATCH_SIZE, repeats: int = REPEATS) -> dict:
    import torch

    cores = len(os.sched_getaffinity(0))
    many = max(2, cores)
    batch = min(batch_size, n_images)
    root = Path(tempfile.mkdtemp(prefix="shardline-bench-images-", dir=workdir))
    threads = torch.get_num_threads()
    try:
        progress(f"generating {n_images} images of {list(shape)} (PNG and JPEG) in {len(CLASSES)} class folders")
        files = make_images(root / "images", n_images, shape)
        dataset = root / "dataset"
        _prepare(root / "images", dataset, shape, progress)
        manifest = load_manifest(str(dataset))
        shard_paths = [dataset / s.path for info in manifest.splits.values() for s in info.shards]
        raw_bytes, shard_bytes = _du(files), _du(shard_paths)
        n_train = manifest.splits["train"].rows

        blobs = [f.read_bytes() for f in files]
        torch.set_num_threads(1)  # one process, one torch thread; ours adds its decoding threads
        samples, wall, cpu = _best_epochs({
            "pillow": lambda: pillow_batches(files, shape, batch),
            "pillow_in_memory": lambda: pillow_batches(blobs, shape, batch),
            "ours_1": lambda: ours_batches(manifest, str(dataset), batch, 1),
            f"ours_{many}": lambda: ours_batches(manifest, str(dataset), batch, many),
        }, shape, batch, repeats, progress)
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(root, ignore_errors=True)

    ips = {k: significant(samples[k] / wall[k]) for k in wall}
    per_core = {k: significant(samples[k] / cpu[k]) for k in cpu}
    ratio = _ratios(ips, per_core, many)
    bytes_per_image = {"raw": significant(raw_bytes / n_images), "shards": significant(shard_bytes / n_train)}
    return {
        "benchmark": "loader-images",
        "images": n_images,
        "train_images": n_train,
        "image_shape": list(shape),
        "formats": {"PNG": sum(f.suffix == ".png" for f in files), "JPEG": sum(f.suffix == ".jpg" for f in files)},
        "batch_size": batch,
        "rows_per_row_group": ROWS_PER_ROW_GROUP,
        "cores": cores,
        "loader_threads": [1, many],
        "repeats": repeats,
        "samples": samples,
        "seconds": {k: significant(v) for k, v in wall.items()},
        "cpu_seconds": {k: significant(v) for k, v in cpu.items()},
        "images_per_s": ips,
        "images_per_core_s": per_core,
        "ratio": ratio,
        "targets": {"vs_pillow": TARGET_VS_PILLOW},
        "met": {"vs_pillow": ratio["vs_pillow"] >= TARGET_VS_PILLOW},
        "bytes_per_image": bytes_per_image,
        "bytes_ratio_shards_vs_raw": significant(bytes_per_image["shards"] / bytes_per_image["raw"]),
        "petastorm": petastorm_status(),
    }


if __name__ == "__main__":  # pragma: no cover
    print(json.dumps(run(int(sys.argv[1]) if len(sys.argv) > 1 else 512), indent=1))
