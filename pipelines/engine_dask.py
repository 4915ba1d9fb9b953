"""The prepare engine on Dask: from_map/map_partitions over the shared row code.

Everything runs on the workers; the client receives only per-partition reports
and shard metadata, so its memory does not grow with the data.
"""

from __future__ import annotations

import json

import pandas as pd
import pyarrow as pa

from . import storage
from .config import PipelineConfig
from .rows import FILE_COL, HASH_COL, SHARD_COL, SPLIT_COL, shard_of
from .shards import SHARD_META_SCHEMA
from .sources import open_raw
from .synthetic import part_urls, remove_stale_parts, write_generated


def read_raw_file(url: str, fmt: str, delimiter: str, head: int | None = None) -> pd.DataFrame:
    """One raw file as pandas, with `_file`; CSV as text, as Spark reads it.

    `head`: only the first rows (for Dask's meta on the client: never a whole file there).
    """
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    with open_raw(url) as f:
        if fmt in ("parquet", "synthetic"):
            if head:
                pf = pq.ParquetFile(f)
                batch = next(pf.iter_batches(batch_size=head), None)
                df = (pa.Table.from_batches([batch]) if batch else pf.schema_arrow.empty_table()).to_pandas()
            else:
                df = pq.read_table(f).to_pandas()
        elif fmt == "csv":
            with open_raw(url) as header:  # a decompressing stream cannot seek back
                first = b""
                while b"\n" not in first and (chunk := header.read(1 << 16)):
                    first += chunk
            names = first.split(b"\n", 1)[0].decode().rstrip("\r").split(delimiter)
            opts = dict(
                parse_options=pcsv.ParseOptions(delimiter=delimiter),
                convert_options=pcsv.ConvertOptions(
                    column_types={n: pa.string() for n in names}, strings_can_be_null=True
                ),
            )
            if head:
                reader = pcsv.open_csv(f, **opts)
                batch = next(iter(reader), None)
                table = pa.Table.from_batches([batch]) if batch else reader.schema.empty_table()
            else:
                table = pcsv.read_csv(f, **opts)
            df = table.to_pandas()
        else:
            df = pd.read_json(f, lines=True, dtype=False, nrows=head)
    df[FILE_COL] = url
    return df


class DaskEngine:
    name = "dask"

    def __init__(self, client):
        import dask

        self.client = client
        self.version = dask.__version__
        # Keep raw text as object columns, as Spark hands them over: the shared
        # parser, not Dask's string conversion, decides what a value is.
        dask.config.set({"dataframe.convert-string": False})

    def generate(self, cfg: PipelineConfig) -> None:
        src, spec = cfg.source.synthetic, cfg.features
        out = storage.resolve(cfg.source.path, "pipelines.source.path")
        parts = part_urls(out, src)
        futures = [
            self.client.submit(write_generated, rng, url, src, spec, pure=False) for rng, url in parts
        ]
        self.client.gather(futures)
        remove_stale_parts(out, [url for _, url in parts])

    def read(self, files: list[str], cfg: PipelineConfig):
        import dask.dataframe as dd

        fmt, delim = cfg.source.format, cfg.source.csv_delimiter
        # meta from the head of the first file only; partitions keep their own dtypes.
        meta = read_raw_file(files[0], fmt, delim, head=100).iloc[:0]
        return dd.from_map(
            read_raw_file, files, fmt=fmt, delimiter=delim, meta=meta, enforce_metadata=False
        )

    def columns(self, frame) -> list[str]:
        return list(frame.columns)

    def reports(self, frame, fn) -> list[dict]:
        def each(df):
            return pd.DataFrame({"report": [json.dumps(fn(df))]})

        out = frame.map_partitions(each, meta={"report": object}, enforce_metadata=False)
        return [json.loads(r) for r in out.compute()["report"]]

    def parsed(self, frame, fn, schema):
        meta = schema.empty_table().to_pandas()
        return frame.map_partitions(fn, meta=meta, enforce_metadata=False)

    def duplicate_key(self, parsed, key: str, existing: list[str]):
        import dask.dataframe as dd

        keys = parsed[[key, FILE_COL]]
        if existing:
            old = dd.from_map(_shard_keys, existing, key=key, meta=keys._meta)
            keys = dd.concat([keys, old])
        nparts = max(1, keys.npartitions)
        found = keys.shuffle(on=key, npartitions=nparts).map_partitions(
            _first_duplicate, key, meta={key: "int64", "files": object}
        ).compute()
        if found.empty:
            return None
        return int(found[key].iat[0]), found["files"].iat[0]

    def write(self, parsed, shards: dict[str, int], writer) -> list[dict]:
        def each(df):
            rows = list(writer(pa.Table.from_pandas(df, preserve_index=False))) if len(df) else []
            table = pa.Table.from_batches(rows, SHARD_META_SCHEMA) if rows else SHARD_META_SCHEMA.empty_table()
            return table.to_pandas()

        meta = SHARD_META_SCHEMA.empty_table().to_pandas()
        tagged = parsed.map_partitions(_with_shard, shards, meta={**parsed.dtypes.to_dict(), SHARD_COL: "int32"})
        shuffled = tagged.shuffle(on=[SPLIT_COL, SHARD_COL], npartitions=sum(shards.values()))
        return shuffled.map_partitions(each, meta=meta).compute().to_dict("records")


def _with_shard(df: pd.DataFrame, shards: dict[str, int]) -> pd.DataFrame:
    return df.assign(**{SHARD_COL: shard_of(df[HASH_COL].to_numpy(), df[SPLIT_COL].to_numpy(), shards)})


def _shard_keys(path: str, key: str, head: int | None = None) -> pd.DataFrame:
    import pyarrow.parquet as pq

    with open_raw(path) as f:
        df = pq.read_table(f, columns=[key]).to_pandas()
    df[FILE_COL] = path
    return df


def _first_duplicate(df: pd.DataFrame, key: str) -> pd.DataFrame:
    counts = df[key].value_counts()
    dups = counts[counts > 1]
    if dups.empty:
        return pd.DataFrame({key: pd.Series([], dtype="int64"), "files": pd.Series([], dtype=object)})
    k = dups.index[0]
    return pd.DataFrame({key: [int(k)], "files": [sorted(set(df.loc[df[key] == k, FILE_COL]))]})
