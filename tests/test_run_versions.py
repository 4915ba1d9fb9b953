"""`shardline run` keeps other versions' scores (#45 item 9): each run trains a new version,
which scores into its own version=V/ beside the earlier ones; only --force discards them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import shardline_here
from .defaults_helpers import tree


def _config(root: Path, dask_address: str) -> Path:
    """The quickstart's data at small size: prepare and score on the session's Dask
    scheduler, training on the local launcher (one rank)."""
    data = root / "data"
    cfg = root / "run.toml"
    cfg.write_text(f"""
[dask]
address = "{dask_address}"

[pipelines]
engine = "dask"
dataset_dir = "{data / 'dataset'}"

[pipelines.source]
format = "synthetic"
path = "{data / 'raw'}"

[pipelines.source.synthetic]
rows = 1500
partitions = 2

[pipelines.features]
key = "key"
label = "label"
numeric = ["x0", "x1", "x2", "x3", "x4", "x5", "x6", "x7"]
categorical = ["color"]

[pipelines.layout]
world_size = 1

[training]
launcher = "local"
world_size = 1
epochs = 1
batch_size = 64
checkpoint_dir = "{data / 'checkpoints'}"

[tracking]
tracking_uri = "sqlite:///{root / 'mlflow.db'}"
registered_model = "runs-keep"

[serving]
engine = "dask"
output_dir = "{data / 'scores'}"
""")
    return cfg


@pytest.mark.slow
def test_run_keeps_earlier_versions_scores(dask_client, new_store, tmp_path):
    from shardline.serving.ledger import read_ledger

    new_store(tmp_path / "mlflow.db")
    cfg = _config(tmp_path, dask_client.scheduler.address)
    scores = tmp_path / "data" / "scores" / "model=runs-keep"

    def run(*extra: str) -> tuple[dict, str]:
        proc = shardline_here("run", str(cfg), "--json", *extra, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout), proc.stderr

    first, _ = run()
    assert first["train"]["model_uri"] == "models:/runs-keep/1"
    test_rows = first["prepare"]["splits"]["test"]["rows"]
    assert first["score"]["rows"] == test_rows > 0
    v1 = scores / "version=1"
    ledger1, files1 = read_ledger(v1), tree(v1)
    assert ledger1 and sum(e["rows"] for e in ledger1.values()) == test_rows

    second, err = run()
    assert second["train"]["model_uri"] == "models:/runs-keep/2"
    assert second["score"]["rows"] == test_rows and second["score"]["discarded"] == []
    assert "discards" not in err
    assert tree(v1) == files1 and read_ledger(v1) == ledger1  # version 1's scores untouched
    ledger2 = read_ledger(scores / "version=2")
    assert sum(e["rows"] for e in ledger2.values()) == test_rows

    third, err = run("--force")  # the same meaning as score's: every version named, then discarded
    assert third["train"]["model_uri"] == "models:/runs-keep/3"
    for v, ledger in ((1, ledger1), (2, ledger2)):
        line = f"--force discards the scores of model runs-keep version {v}: {len(ledger)} unit(s), {test_rows:,} rows"
        assert any(d.startswith(line) for d in third["score"]["discarded"]), third["score"]["discarded"]
        assert line in err
        assert not read_ledger(scores / f"version={v}") and not list((scores / f"version={v}").rglob("*.parquet"))
    assert sum(e["rows"] for e in read_ledger(scores / "version=3").values()) == test_rows
