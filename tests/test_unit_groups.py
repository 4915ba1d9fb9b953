"""Many small files: units grouped into tasks and parsed together in chunks give exactly what
one unit at a time gives (counts, first problems by file and row, positions, rows); the
driver describes files by their headers with one schema object per distinct schema.

All in this process, no engine (#56 item 3: the shapes large data arrives in)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from shardline.pipelines.chunks import CHUNK_ROWS, read_chunks
from shardline.pipelines.config import PipelineConfig
from shardline.pipelines.raw import Unit, describe, plan_units
from shardline.pipelines.sources import list_files
from shardline.pipelines.tasks import (Parts, PrepareTask, merge_reports, report_unit, report_units,
                                       shuffle_rows, shuffle_units)
from shardline.pipelines.unit_groups import GROUP_UNITS, UnitGroup, group_units

FEATURES = {"key": "key", "label": "label", "numeric": ["a", "b"], "categorical": ["city"]}


def write_csvs(folder: Path, files: int, rows: int, bad: tuple[int, int] | None = None) -> Path:
    """`files` CSV files of `rows` rows each; bad = (file, row): that row's `a` is not a number."""
    folder.mkdir(parents=True, exist_ok=True)
    cities = ["paris", "lima", "oslo"]
    for i in range(files):
        lines = ["key,a,b,city,label"]
        for r in range(rows):
            k = i * rows + r
            a = "oops" if bad == (i, r) else f"{(k * 37) % 101 / 10:.2f}"
            lines.append(f"{k},{a},{k % 7 - 3.5},{cities[k % 3]},{k % 3}")
        (folder / f"part-{i:04d}.csv").write_text("\n".join(lines) + "\n")
    return folder


def units_of(folder: Path) -> list[Unit]:
    cfg = PipelineConfig.model_validate({"source": {"format": "csv", "path": str(folder)}, "features": FEATURES})
    return plan_units(describe(list_files(cfg.source), "csv", ","))


def task() -> PrepareTask:
    cfg = PipelineConfig.model_validate({"features": FEATURES})
    return PrepareTask(spec=cfg.features, split=cfg.split, drop_bad=False, num_classes=3)


def test_groups_are_consecutive_and_bounded():
    units = [Unit(i, f"file:///u{i}.csv", "csv", rows=r) for i, r in enumerate([10] * 50 + [10**6, 10, 10])]
    groups = group_units(units, rows=100)
    assert [u for g in groups for u in g.units] == units  # every unit once, in order
    assert all(sum(u.rows for u in g.units) <= 100 or len(g.units) == 1 for g in groups)
    assert [len(g.units) for g in groups] == [10] * 5 + [1, 2]  # the big unit alone
    many = [Unit(i, f"file:///u{i}.csv", "csv", rows=0) for i in range(GROUP_UNITS + 1)]
    assert [len(g.units) for g in group_units(many)] == [GROUP_UNITS, 1]
    images = [Unit(i, "file:///imgs", "images", files=("a.png",)) for i in range(3)]
    assert [len(g.units) for g in group_units(images)] == [1, 1, 1]


def test_chunks_join_small_units_and_say_where_each_row_came_from(tmp_path):
    units = units_of(write_csvs(tmp_path / "raw", files=30, rows=7))
    chunks = list(read_chunks(units, ["key", "a"], ","))
    assert len(chunks) == 1 and chunks[0][0].num_rows == 30 * 7  # 210 rows < CHUNK_ROWS: one parse
    table, where = chunks[0]
    for i in (0, 6, 7, 100, 209):
        unit, row = where.locate(i)
        assert (unit.index, row) == (i // 7, i % 7)
        assert table.column("key")[i].as_py() == str(i)  # CSV values come as text; keys are rows in order
    rows = np.array([0, 8, 209])
    assert list(where.positions(rows)) == [(0 << 32) | 0, (1 << 32) | 1, (29 << 32) | 6]


def test_a_group_reports_as_its_units_one_by_one(tmp_path):
    units = units_of(write_csvs(tmp_path / "raw", files=40, rows=5, bad=(23, 2)))
    t = task()
    grouped = report_units(units, t)
    one_by_one = merge_reports([report_unit(u, t) for u in units])
    assert grouped["rows"] == one_by_one["rows"] and grouped["fatal_rows"] == one_by_one["fatal_rows"] == 1
    bad = grouped["problems"]["bad"]["a"]
    assert bad == one_by_one["problems"]["bad"]["a"]
    assert bad["at"] == [23, 2] and bad["file"].endswith("part-0023.csv") and bad["value"] == "oops"
    assert grouped["categories"] == one_by_one["categories"]
    for col, (n, mean, m2) in grouped["moments"].items():
        assert (n, mean, m2) == pytest.approx(one_by_one["moments"][col], rel=1e-12)


def test_an_unreadable_file_among_many_is_named_in_order(tmp_path):
    folder = write_csvs(tmp_path / "raw", files=12, rows=3)
    units = units_of(folder)
    (folder / "part-0007.csv").write_bytes(b"key,a,b,city,label\n1,2,\"unterminated\n")  # after describe
    rep = report_units(units, task())
    assert rep["error"].startswith(f"{folder}/part-0007.csv: not readable csv"), rep["error"]


def test_pass_two_gives_the_same_rows_and_positions(tmp_path):
    units = units_of(write_csvs(tmp_path / "raw", files=25, rows=9))
    t, parts = task(), Parts((2, 2, 2))
    stats = _fit(t, units)
    grouped = pa.concat_tables(shuffle_units(units, t, stats, parts))
    single = pa.concat_tables([x for u in units for x in shuffle_rows(u, t, stats, parts)])
    assert grouped.sort_by("_pos").equals(single.sort_by("_pos"))
    assert grouped.num_rows == 25 * 9


def test_big_units_stream_alone(tmp_path):
    units = units_of(write_csvs(tmp_path / "raw", files=2, rows=3))
    big = [Unit(u.index, u.url, u.fmt, rows=CHUNK_ROWS, bytes=u.bytes) for u in units]
    chunks = list(read_chunks(big, ["key"], ","))
    assert [w.single.index for _, w in chunks] == [0, 1]


def test_the_driver_shares_one_schema_object_across_files(tmp_path):
    folder = write_csvs(tmp_path / "raw", files=20, rows=2)
    described = describe(list_files(PipelineConfig.model_validate(
        {"source": {"format": "csv", "path": str(folder)}}).source), "csv", ",")
    assert len({id(f.schema) for f in described}) == 1
    assert described[0].schema.names == ["key", "a", "b", "city", "label"]
    assert all(f.size == (folder / Path(f.url).name).stat().st_size for f in described)
    assert isinstance(group_units(plan_units(described))[0], UnitGroup)


def _fit(t: PrepareTask, units):
    from shardline.pipelines.prepare import _fit

    return _fit(report_units(units, t), t.spec)
