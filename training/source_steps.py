"""A batch too large for the data, refused from the raw source, before anything is prepared.

`shardline run` prepares, then trains. `job.check_steps` refuses a job whose ranks would
take 0 optimizer steps an epoch, from the prepared dataset's exact rows per rank: under
`run` that was after Spark had started and prepare had run (the default global batch of
512 on a 442-row table). The source's row count is known before that where it is cheap
to know: a synthetic source's setting, Parquet footers, an images folder's files, a small
CSV or JSON-lines source's lines. The split is a hash of each key, so the rows a rank will
get are a binomial draw: the job is refused here only when even a generous bound (4
standard deviations above the expected rows) is less than one step, and the batch it
suggests is one the rows very likely allow (4 below). Anything closer is left to the exact
check after prepare.
"""

from __future__ import annotations

import math

from shardline.foundation import storage
from shardline.pipelines.config import PipelineConfig
from shardline.foundation.errors import DataError
from shardline.pipelines.raw import RawFile

from .config import TrainingConfig
from .strategies import strategy_for

# Text sources are counted line by line only up to this size: a large source is no small dataset.
COUNT_TEXT_BYTES = 64 << 20
SIGMAS = 4.0


def source_rows(pipelines: PipelineConfig, files: list[RawFile]) -> int | None:
    """Rows of the raw source (an upper bound for text: a quoted newline counts too), or
    None when they are not known without reading a large source."""
    src = pipelines.source
    if src.format == "synthetic":
        return src.synthetic.rows
    if src.format == "parquet":
        return sum(sum(f.row_groups) for f in files)
    if src.format == "images":
        return sum(len(f.files) for f in files)
    if src.format in ("csv", "json"):
        total, read = 0, 0
        for f in files:
            lines, last = 0, b"\n"
            with storage.open_input(f.url) as stream:
                while chunk := stream.read(1 << 20):
                    read += len(chunk)
                    if read > COUNT_TEXT_BYTES:
                        return None
                    lines, last = lines + chunk.count(b"\n"), chunk[-1:]
            lines += last != b"\n"  # a last line without its newline
            total += max(lines - (src.format == "csv"), 0)  # a CSV's header
        return total
    return None


def check_steps_from_source(cfg: TrainingConfig, pipelines: PipelineConfig, files: list[RawFile]) -> None:
    """Refuse, before prepare, a global batch the source's rows cannot give one step an
    epoch (remainder "drop": the smallest rank's share must hold a whole local batch)."""
    if cfg.remainder != "drop":
        return  # "pad": every rank with a row takes a step
    rows = source_rows(pipelines, files)
    data_world = strategy_for(cfg).data_world
    local = cfg.batch_size // data_world
    if not rows or local < 1:
        return  # unknown, or check_steps' own refusal once prepared
    p = pipelines.split.train / data_world  # a row's chance to be train and land on a given rank
    mean, sd = rows * p, math.sqrt(rows * p * (1 - p))
    if mean + SIGMAS * sd >= local:
        return
    likely = int(mean - SIGMAS * sd)
    fix = (f"set training.batch_size to at most {likely * data_world}" if likely >= 1
           else f"use more rows or fewer than {data_world} data-parallel ranks")
    raise DataError(
        f"training.batch_size {cfg.batch_size} is {local} rows per step on each of {data_world} "
        f"data-parallel rank(s), but the source's {rows:,} rows give each rank about {mean:.0f} train "
        f"rows (pipelines.split.train = {pipelines.split.train:g}): every epoch would take 0 optimizer "
        f"steps and the model would not train; {fix} (checked before prepare, from the source's row count)"
    )
