"""Names read from stored JSON stay in their folder (issue #40): a ledger entry's `output`
(deleted by `forget`) and the checkpoint pointer's `name` (joined and loaded) are refused,
with one line naming the file, when they are not shardline's own names."""

from __future__ import annotations

import json

import pytest

from shardline.foundation.errors import DataError
from shardline.serving import ledger
from shardline.training.checkpoints.store import CheckpointStore, POINTER

from .serving_helpers import committed_files

UID = "0123456789abcdef"


def _version_dir(tmp_path):
    out = tmp_path / "out"
    d = ledger.version_dir(str(out), "m", "1")
    (tmp_path / "out" / "model=m" / "version=1" / "_ledger").mkdir(parents=True)
    return out, d


def _entry(output: str, unit_id: str = UID) -> dict:
    return {"unit_id": unit_id, "output": output, "rows": 3, "model_name": "m", "model_version": "1"}


@pytest.mark.parametrize("output", ["../../../victim.txt", "{victim}", "sub/scores-x.parquet",
                                    "scores-..parquet", "", 7])
def test_tampered_ledger_output_is_refused_and_nothing_is_deleted(tmp_path, output):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    out, d = _version_dir(tmp_path)
    output = str(victim) if output == "{victim}" else output
    entry_file = tmp_path / "out" / "model=m" / "version=1" / "_ledger" / f"{UID}.json"
    entry_file.write_text(json.dumps(_entry(output)))

    for read in (lambda: ledger.all_scores(str(out)), lambda: ledger.read_entry(d, UID),
                 lambda: committed_files(str(out))):
        with pytest.raises(DataError) as e:
            read()
        assert "corrupt scoring ledger entry" in str(e.value) and str(entry_file) in str(e.value)
        assert "\n" not in str(e.value)
    assert victim.read_text() == "keep me"


def test_ledger_entry_naming_another_unit_is_refused(tmp_path):
    out, d = _version_dir(tmp_path)
    (tmp_path / "out" / "model=m" / "version=1" / "_ledger" / f"{UID}.json").write_text(
        json.dumps(_entry("scores-x.parquet", unit_id="../../x")))
    with pytest.raises(DataError, match="unit_id"):
        ledger.read_ledger(d)


def test_own_ledger_entries_are_read_and_forgotten(tmp_path):
    out, d = _version_dir(tmp_path)
    scores = tmp_path / "out" / "model=m" / "version=1" / ledger.output_name(UID)
    scores.write_bytes(b"parquet")
    ledger.commit(d, _entry(ledger.output_name(UID)))
    [s] = ledger.all_scores(str(out))
    assert list(s.entries) == [UID]
    ledger.forget(d, list(s.entries.values()))
    assert not scores.exists() and ledger.read_ledger(d) == {}


@pytest.mark.parametrize("name", ["../outside.pt", "{outside}", "ckpt-000000001-abcdef.pt/../../outside.pt",
                                  "ckpt-000000001-abcdef.pt\n", None, ["ckpt-000000001.pt"]])
def test_tampered_checkpoint_pointer_is_refused(tmp_path, name):
    outside = tmp_path / "outside.pt"
    outside.write_bytes(b"not ours")
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    (ckpts / "ckpt-000000001-abcdef.pt").write_bytes(b"ours")
    name = str(outside) if name == "{outside}" else name
    (ckpts / POINTER).write_text(json.dumps({"name": name, "step": 1}))
    with pytest.raises(DataError) as e:
        CheckpointStore(str(ckpts)).latest()
    assert "corrupt checkpoint pointer" in str(e.value) and str(ckpts / "LATEST") in str(e.value)
    assert "\n" not in str(e.value)


def test_own_checkpoint_pointer_is_followed(tmp_path):
    (tmp_path / "ckpt-000000002-abcdef.pt").write_bytes(b"ours")
    (tmp_path / POINTER).write_text(json.dumps({"name": "ckpt-000000002-abcdef.pt", "step": 2}))
    assert CheckpointStore(str(tmp_path)).latest() == str(tmp_path / "ckpt-000000002-abcdef.pt")


@pytest.mark.parametrize("sharded", ["../outside.dcp", "{outside}", "ckpt-000000001-abcdef.dcp/../../outside",
                                     "ckpt-000000001.dcp", 7])
def test_tampered_dcp_directory_name_is_refused(tmp_path, sharded):
    """The small file's `sharded` name is joined to the folder and read by every rank (#46):
    confined like the pointer's name."""
    import torch

    outside = tmp_path / "outside.dcp"
    (outside / ".metadata").parent.mkdir()
    (outside / ".metadata").write_bytes(b"not ours")
    ckpts = tmp_path / "ckpts"
    (ckpts / "ckpt-000000001-abcdef.dcp").mkdir(parents=True)
    (ckpts / "ckpt-000000001-abcdef.dcp" / ".metadata").write_bytes(b"ours")
    head = ckpts / "ckpt-000000001-abcdef.pt"
    sharded = str(outside) if sharded == "{outside}" else sharded
    torch.save({"epoch": 0, "sharded": sharded}, head)
    with pytest.raises(DataError) as e:
        CheckpointStore(str(ckpts)).read(str(head))
    assert "corrupt checkpoint" in str(e.value) and "not followed" in str(e.value), str(e.value)
    torch.save({"epoch": 0, "sharded": "ckpt-000000001-abcdef.dcp"}, head)
    assert CheckpointStore(str(ckpts)).read(str(head))["sharded"] == "ckpt-000000001-abcdef.dcp"
