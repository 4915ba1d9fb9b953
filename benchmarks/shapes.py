"""`shardline bench shapes`: the shapes large data arrives in, each prepared on Spark and on
Dask, which must write the same shards (the same files, by sha256).

- many small files: `files` CSV files of `rows_per_file` rows against the same rows in
  FEW_FILES files: the driver's listing and describing time and peak RSS, the prepare's
  wall time (target: within SMALL_FILES_X of the few files'); and one bad file among them
  (a value that is not a number, in the middle file): refused in one line naming it, and
  nothing written;
- skew: a column where one value holds half the rows and a category with one level in
  DOMINANT of them (shardline shards by a hash of the row key, so neither moves a row):
  each split's shards within SHARD_SPREAD of each other's row counts;
- wide rows: one `width`-float vector column (Parquet); refused before generating when the
  disk cannot hold the raw values and the shards.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from . import significant
from .proc_tree import TreeSampler
from .scale_data import folder_bytes
from .bench_engines import ENGINES
from .scale_legs import FEATURES
from .shapes_data import DOMINANT, needed_bytes, skewed, small_files, few_files, vectors

FEW_FILES = 100
SMALL_FILES_X = 2.0
SHARD_SPREAD = 0.10
BAD_VALUE = "not-a-number"


def run(files: int = 100_000, rows_per_file: int = 1_000, skew_rows: int = 10_000_000, vector_rows: int = 10_000_000,
        width: int = 2048, data_dir: str = "shardline-data/bench-scale", engines=("spark", "dask"), progress=print) -> dict:
    data = Path(data_dir).resolve()
    work = data / "work-shapes"
    shutil.rmtree(work, ignore_errors=True)
    handles = {e: ENGINES[e].open(2) for e in engines}
    try:
        out = {"files": _files(data, work, handles, files, rows_per_file, progress),
               "skew": _skew(data, work, handles, skew_rows, progress),
               "vectors": _vectors(data, work, handles, vector_rows, width, progress)}
    finally:
        for e, h in handles.items():
            ENGINES[e].close(h)
        shutil.rmtree(work, ignore_errors=True)
    return {"benchmark": "shapes", **out}


def _prepare(raw: Path, out: Path, engine: str, handle, features: dict, fmt: str = "csv") -> dict:
    """One prepare through the API on `handle`, sampled: wall, driver peak RSS, the manifest's
    shards (rows and sha256 per split)."""
    from shardline import api

    cfg = {"pipelines": {"engine": engine, "dataset_dir": str(out), "features": features,
                         "source": {"format": fmt, "path": str(raw)}, "layout": {"world_size": 2}}}
    sampler = TreeSampler(spawned_as="dask_worker").start()
    start = time.perf_counter()
    try:
        r = api.prepare(cfg, **ENGINES[engine].given(handle))
    finally:
        figures = sampler.stop()
    seconds = time.perf_counter() - start
    m = r.manifest
    return {"seconds": seconds, "driver_peak_rss_mb": max(figures["peak_rss_mb"]["driver"]),
            "peak_rss_mb": figures["peak_rss_mb"], "disk_written_bytes": figures["disk_written_bytes"],
            "output_bytes": folder_bytes(out), "rows": sum(s.rows for s in m.splits.values()),
            "shard_rows": {s: [x.rows for x in i.shards] for s, i in m.splits.items()},
            "sha256": {s: [x.sha256 for x in i.shards] for s, i in m.splits.items()}}


def _driver_listing(raw: Path) -> dict:
    """prepare's driver work on the input alone: listing, describing, units, tasks."""
    from shardline.pipelines.config import SourceConfig
    from shardline.pipelines.raw import describe, plan_units
    from shardline.pipelines.sources import list_files
    from shardline.pipelines.unit_groups import group_units

    start = time.perf_counter()
    files = list_files(SourceConfig(format="csv", path=str(raw)))
    listed = time.perf_counter()
    described = describe(files, "csv", ",")
    units = plan_units(described)
    return {"files": len(files), "tasks": len(group_units(units)), "list_s": listed - start,
            "describe_s": time.perf_counter() - listed}


def _same(runs: dict) -> bool:
    shas = [r["sha256"] for r in runs.values()]
    return all(s == shas[0] for s in shas)


def _files(data, work, handles, files, rows_per_file, progress) -> dict:
    rows = files * rows_per_file
    small = small_files(data, files, rows_per_file, progress)
    few = few_files(data, rows, FEW_FILES, progress)
    out = {"files": files, "rows_per_file": rows_per_file, "driver": _driver_listing(small),
           "few_files_driver": _driver_listing(few), "small": {}, "few": {}}
    for e, h in handles.items():
        progress(f"{e}: {rows:,} rows in {FEW_FILES} files")
        out["few"][e] = _prepare(few, work / f"few-{e}", e, h, FEATURES)
        progress(f"{e}: the same rows in {files:,} files")
        out["small"][e] = _prepare(small, work / f"small-{e}", e, h, FEATURES)
        shutil.rmtree(work, ignore_errors=True)
    out["ratio_small_vs_few"] = {e: significant(out["small"][e]["seconds"] / out["few"][e]["seconds"]) for e in handles}
    out["met_within_2x"] = {e: r <= SMALL_FILES_X for e, r in out["ratio_small_vs_few"].items()}
    out["same_shards"] = _same(out["small"]) and _same(out["few"])
    out["bad_file"] = _bad_file(small, work, handles, files, progress)
    return out


def _bad_file(small: Path, work: Path, handles, files: int, progress) -> dict:
    """The small files again (hard links) with the middle one's first value of x3 replaced by
    BAD_VALUE: each engine must refuse naming that file, and leave no dataset."""
    from shardline.foundation.errors import DataError

    bad_dir = work / "bad-input"
    bad_dir.mkdir(parents=True)
    names = sorted(n for n in os.listdir(small) if n.endswith(".csv"))
    bad_name = names[len(names) // 2]
    for n in names:
        if n != bad_name:
            os.link(small / n, bad_dir / n)
    lines = (small / bad_name).read_text().splitlines()
    cells = lines[1].split(",")
    cells[2] = BAD_VALUE  # x1 is column 2: key, x0, x1, ...
    (bad_dir / bad_name).write_text("\n".join([lines[0], ",".join(cells), *lines[2:]]) + "\n")
    out = {"file": bad_name, "files": len(names)}
    for e, h in handles.items():
        progress(f"{e}: one bad file among {len(names):,}")
        target = work / f"bad-{e}"
        start = time.perf_counter()
        try:
            _prepare(bad_dir, target, e, h, FEATURES)
            line = None
        except DataError as err:
            line = str(err)
        out[e] = {"error": line, "seconds": significant(time.perf_counter() - start),
                  "names_the_file": bool(line) and bad_name in line and "\n" not in line,
                  "nothing_written": not target.exists()}
    return out


def _skew(data, work, handles, rows, progress) -> dict:
    raw = skewed(data, rows, progress)
    features = {**FEATURES, "categorical": ["color", "user"]}
    runs = {}
    for e, h in handles.items():
        progress(f"{e}: {rows:,} rows, one user in half of them, one color in {DOMINANT:.0%}")
        runs[e] = _prepare(raw, work / f"skew-{e}", e, h, features)
        shutil.rmtree(work / f"skew-{e}", ignore_errors=True)
    spread = {s: significant(max(v) / min(v) - 1) if v and min(v) else None
              for s, v in next(iter(runs.values()))["shard_rows"].items()}
    return {"rows": rows, "runs": runs, "spread": spread, "same_shards": _same(runs),
            "met_spread": all(x is not None and x <= SHARD_SPREAD for x in spread.values())}


def _vectors(data, work, handles, rows, width, progress) -> dict:
    need, free = needed_bytes(rows, width), shutil.disk_usage(data).free
    if need > free:
        return {"rows": rows, "width": width, "skipped": f"needs {need / 1e9:.0f} GB of disk (raw values and "
                f"shards), {free / 1e9:.0f} GB free under {data}"}
    raw = vectors(data, rows, width, progress)
    features = {"key": "key", "label": "label", "numeric": [], "categorical": [], "vectors": {"emb": width},
                "classes": 3}
    runs = {}
    for e, h in handles.items():
        progress(f"{e}: {rows:,} rows of a {width}-float vector")
        runs[e] = _prepare(raw, work / f"vectors-{e}", e, h, features, fmt="parquet")
        shutil.rmtree(work / f"vectors-{e}", ignore_errors=True)
    return {"rows": rows, "width": width, "raw_bytes": folder_bytes(raw), "runs": runs, "same_shards": _same(runs)}
