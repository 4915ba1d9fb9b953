"""What the forecast measures, in seconds, on the user's own data: the whole input listed
and described as prepare's driver does, then the head of it (SAMPLE_ROWS rows) prepared in
this process (sample_engine), and the model trained, the loader drained and the test split
scored on that sample (rates). Every figure is per core: one thread does the work."""

from __future__ import annotations

import os
import tempfile
import time

from pydantic import BaseModel

from shardline.foundation import report, storage
from shardline.pipelines.chunks import CHUNK_ROWS
from shardline.pipelines.config import PipelineConfig
from shardline.pipelines.raw import describe, plan_units
from shardline.pipelines.sources import list_files
from shardline.pipelines.unit_groups import group_units

from .rates import ModelRates, measure_model
from .sample import SAMPLE_ROWS, check_source, copy_head, synthetic_head
from .sample_engine import PHASES, SampleEngine, rss_mb


class InputShape(BaseModel):
    """The whole input, as prepare's driver will see it."""

    files: int
    units: int
    tasks: int  # engine tasks of each pass (pipelines.unit_groups)
    rows: int
    rows_estimated: bool  # CSV/JSON: from the bytes and the sample's bytes per row
    bytes: int
    largest_unit_rows: int
    list_s: float
    describe_s: float


class PrepareRates(BaseModel):
    """prepare's code on the sample, one thread: seconds per row of each phase."""

    rows: int
    files: int
    s_per_row: dict[str, float]  # pass1, pass2, shuffle (IPC round trip), write
    tasks: dict[str, int]
    transport_bytes_per_row: float
    shard_bytes_per_row: float
    mb_per_row: dict[str, float]  # peak RSS growth per row in flight, per phase
    driver_mb: float  # this process's RSS before anything was measured


class Measured(BaseModel):
    input: InputShape
    prepare: PrepareRates
    model: ModelRates
    seconds: float  # what measuring took


def measure(cfg, sample_rows: int = SAMPLE_ROWS, progress=report.note) -> Measured:
    """cfg: a resolved ShardlineConfig. Nothing of the user's is written: the sample and
    its dataset live in a temporary folder, removed after."""
    start, driver_mb = time.perf_counter(), rss_mb()
    p = cfg.pipelines
    check_source(p.source)
    shape, described = _input_shape(p)
    progress(f"input: {shape.files:,} file(s), {shape.rows:,} rows"
             f"{' (estimated from bytes)' if shape.rows_estimated else ''}, {shape.tasks:,} task(s) a pass")
    with tempfile.TemporaryDirectory(prefix="shardline-forecast-") as tmp:
        rates, manifest, sample_cfg = _prepare_sample(p, described, sample_rows, tmp, driver_mb)
        if shape.rows_estimated:
            raw = sum(os.path.getsize(os.path.join(tmp, "raw", n)) for n in os.listdir(os.path.join(tmp, "raw")))
            shape = shape.model_copy(update={"rows": max(rates.rows, round(shape.bytes * rates.rows / max(1, raw)))})
        progress(f"sample: {rates.rows:,} rows prepared in this process; measuring the model, loader and scoring")
        model = measure_model(manifest, sample_cfg.dataset_dir, cfg.training, cfg.serving)
    return Measured(input=shape, prepare=rates, model=model, seconds=time.perf_counter() - start)


def _input_shape(p: PipelineConfig) -> tuple[InputShape, list]:
    """The input's shape, and its files described (none for a synthetic source)."""
    src = p.source
    if src.format == "synthetic":
        s = src.synthetic
        per_file = -(-s.rows // s.partitions)
        return InputShape(files=s.partitions, units=s.partitions, tasks=s.partitions, rows=s.rows,
                          rows_estimated=False, bytes=0, largest_unit_rows=per_file, list_s=0.0,
                          describe_s=0.0), []
    t0 = time.perf_counter()
    files = list_files(src)
    t1 = time.perf_counter()
    described = describe(files, src.format, src.csv_delimiter)
    t2 = time.perf_counter()
    units = plan_units(described)
    counted = src.format == "parquet"
    return InputShape(
        files=len(files), units=len(units), tasks=len(group_units(units)),
        rows=sum(u.rows for u in units) if counted else 0, rows_estimated=not counted,
        bytes=sum(f.size for f in described), largest_unit_rows=max((u.rows for u in units), default=0),
        list_s=t1 - t0, describe_s=t2 - t1,
    ), described


class _Quiet(report.Reporter):
    def line(self, text: str) -> None:
        pass


def _prepare_sample(p: PipelineConfig, described: list, rows: int, tmp: str, driver_mb: float):
    """The sample's raw files under tmp/raw, prepared into tmp/dataset by SampleEngine."""
    from shardline.pipelines.prepare import prepare

    src, raw = p.source, os.path.join(tmp, "raw")
    if src.format == "synthetic":
        copied, files, fmt = synthetic_head(src, rows, raw), 1, "parquet"
    else:
        (copied, files), fmt = copy_head(described, src.format, rows, raw), src.format
    sample = p.model_copy(update={
        "dataset_dir": os.path.join(tmp, "dataset"),
        "source": src.model_copy(update={"format": fmt, "path": raw}),
    })
    engine = SampleEngine()
    with report.using(_Quiet()):  # prepare's own lines are not the forecast's
        manifest = prepare(engine, sample)
    n = max(1, copied)
    # A pass-1 task holds one chunk of small files or one batch of a big file at a time.
    engine.rows_in_flight["pass1"] = min(n, max(CHUNK_ROWS, max(u.rows for u in plan_units(
        describe(list_files(sample.source), fmt, src.csv_delimiter)))))
    shards = [s for info in manifest.splits.values() for s in info.shards]
    rates = PrepareRates(
        rows=copied, files=files,
        s_per_row={k: engine.seconds[k] / n for k in PHASES},
        tasks=dict(engine.tasks),
        transport_bytes_per_row=engine.transport_bytes / n,
        shard_bytes_per_row=sum(s.bytes for s in shards) / n,
        mb_per_row={k: engine.peak_mb[k] / max(1, engine.rows_in_flight[k] or n) for k in PHASES},
        driver_mb=driver_mb,
    )
    return rates, manifest, sample.model_copy(update={"dataset_dir": storage.resolve(sample.dataset_dir, "dataset")})
