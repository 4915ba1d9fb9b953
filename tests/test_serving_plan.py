"""What a scoring job plans to do, read-only and without an engine: which files each model
version scores (--backfill), a changed file, an earlier release's flat output, a prepared
dataset whose features differ from the version's training data, --status."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from shardline.foundation.errors import DataError
from shardline.serving.inputs import list_units
from shardline.serving.ledger import entry_bytes, output_name, version_dir
from shardline.serving.score import plan

from .conftest import shardline_here
from .serving_helpers import promo_model, raw_table, write_raw


@pytest.fixture(scope="module")
def promo(prepared, tracking_uri):
    return promo_model(prepared, tracking_uri)


def _commit_by_hand(d: Path, unit, version: str, rows: int = 10, fingerprint: str | None = None,
                    name: str | None = None) -> None:
    """A ledger entry (and its output file) as a job of `promo` `version` would have left it."""
    name = name or output_name(unit.unit_id)
    (d / "_ledger").mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(b"")
    entry = {"unit": unit.path, "unit_id": unit.unit_id, "fingerprint": fingerprint or unit.fingerprint,
             "output": name, "rows": rows, "model_name": "promo", "model_version": version,
             "model_uri": f"models:/promo/{version}", "scored_at": "2026-01-01T00:00:00+00:00"}
    (d / "_ledger" / f"{unit.unit_id}.json").write_bytes(entry_bytes(entry))


def _names(units) -> list[str]:
    return sorted(Path(u.path).name for u in units)


def test_backfill_new_and_all_and_a_changed_file(promo, prepared, tracking_uri, tmp_path):
    src, out = tmp_path / "in", tmp_path / "scores"
    write_raw(raw_table(prepared).slice(0, 300), src, files=3)
    u0, u1, u2 = list_units(str(src), "test")
    v1 = Path(version_dir(str(out), "promo", "1"))
    _commit_by_hand(v1, u0, "1")
    _commit_by_hand(v1, u1, "1", fingerprint="an-older-copy")  # part-0001 changed since

    p = plan("models:/promo/2", tracking_uri, str(src), str(out), incremental=True)
    assert p.backfill == "new" and p.dir == str(out / "model=promo" / "version=2")
    assert (_names(p.todo), _names(p.left), p.skipped) == (
        ["part-0001.parquet", "part-0002.parquet"], ["part-0000.parquet"], []
    )
    p = plan("models:/promo/2", tracking_uri, str(src), str(out), incremental=True, backfill="all")
    assert (_names(p.todo), p.left) == (["part-0000.parquet", "part-0001.parquet", "part-0002.parquet"], [])
    # Version 1 itself: its unchanged file is done, its changed one is scored again.
    p = plan("models:/promo/1", tracking_uri, str(src), str(out), incremental=True)
    assert (_names(p.todo), _names(p.skipped)) == (["part-0001.parquet", "part-0002.parquet"], ["part-0000.parquet"])
    assert not (out / "model=promo" / "version=2").exists()  # planning writes nothing


def test_an_explicit_score_of_a_newer_version_scores_its_input(promo, prepared, tracking_uri, tmp_path):
    """`shardline score --model models:/promo/2` where version 1 scored the input: not
    "nothing to score"; --backfill is for --incremental runs and refused without it."""
    src, out = tmp_path / "in", tmp_path / "scores"
    write_raw(raw_table(prepared).slice(0, 200), src, files=2)
    u0, u1 = list_units(str(src), "test")
    v1 = Path(version_dir(str(out), "promo", "1"))
    _commit_by_hand(v1, u0, "1")
    _commit_by_hand(v1, u1, "1")

    p = plan("models:/promo/2", tracking_uri, str(src), str(out))
    assert (_names(p.todo), p.left, p.skipped) == (["part-0000.parquet", "part-0001.parquet"], [], [])
    # The same run scheduled (--incremental, --backfill new): files version 1 has are left out.
    p = plan("models:/promo/2", tracking_uri, str(src), str(out), incremental=True)
    assert (p.todo, _names(p.left)) == ([], ["part-0000.parquet", "part-0001.parquet"])

    r = shardline_here("score", "--model", "models:/promo/2", "--input", str(src), "--output", str(out),
                       "--backfill", "new", "--engine", "dask", cwd=tmp_path, env={"MLFLOW_TRACKING_URI": tracking_uri})
    assert r.returncode == 2, r.stderr
    assert "--backfill applies to --incremental (scheduled) runs" in r.stderr
    assert "Starting" not in r.stderr


def test_prepared_input_with_other_feature_columns_names_them(promo, prepared, tracking_uri, tmp_path):
    copy = tmp_path / "dataset"
    shutil.copytree(prepared.dataset_dir, copy)
    newest = sorted((copy / "_manifests").glob("manifest-*.json"))[-1]
    manifest = json.loads(newest.read_text())
    numeric = manifest["feature_spec"]["numeric"]
    manifest["feature_spec"]["numeric"] = [c for c in numeric if c != "x7"] + ["x9"]
    newest.write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"prepared with other feature columns \('x7', 'x9' differ\) than the "
                                        r"data model models:/promo/2 \(version 2\) was trained on") as e:
        plan("models:/promo/2", tracking_uri, str(copy), str(tmp_path / "scores"))
    assert "\n" not in str(e.value) and not (tmp_path / "scores").exists()
