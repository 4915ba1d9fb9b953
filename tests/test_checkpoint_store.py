"""The checkpoint store in-process, on a local folder and on the session's S3 server: its
checks only read (every byte of the folder as it was after each, refused or not), its
effects do what they say; and the user's code snapshot is exactly what ships."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from shardline.foundation import storage
from shardline.foundation.code_travel import _files, code_zip, snapshot
from shardline.foundation.errors import ConfigError, DataError, LeaseHeld
from shardline.training.checkpoints import fingerprint
from shardline.training.checkpoints.store import POINTER, CheckpointStore
from shardline.training.checkpoints.fingerprint import CheckpointUnreadable
from shardline.training.config import TrainingConfig

from .fixtures_s3 import new_bucket

CFG = TrainingConfig(hidden=[16], batch_size=64, epochs=2)


@pytest.fixture(params=["local", "s3"])
def folder(request, tmp_path) -> str:
    """An empty checkpoint folder: a local path, or a prefix in a fresh bucket."""
    if request.param == "s3":
        request.getfixturevalue("s3")
        return storage.join(new_bucket("ckpt"), "job")
    return str(tmp_path / "ckpt")


def _package(root: Path, activation: str = "relu") -> Path:
    pkg = root / "mynets"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "nets.py").write_text(f"import torch\n\ndef act(x):\n    return torch.{activation}(x)\n")
    return pkg


def _tree(url: str) -> dict[str, bytes]:
    """Every file under `url` and its bytes: what "nothing changed" compares."""
    return {f: storage.read_bytes(f) for f in storage.find_files(url)}


def _write(store: CheckpointStore, step: int, epoch: int, fp: dict, code_files: dict | None = None,
           keep: int = 3) -> str:
    """A checkpoint as rank 0 writes one: its DCP directory (a complete one: .metadata), then save."""
    dcp = f"ckpt-{step:09d}-{step:06x}.dcp"
    storage.write_bytes(storage.join(store.url, dcp, ".metadata"), b"metadata")
    state = {"sharded": dcp, "global_step": step, "epoch": epoch, "step_in_epoch": 0, "fingerprint": fp,
             "code_files": code_files or {}, "run_id": ""}
    return store.save(step, state, keep)


def test_save_rotates_points_and_prunes(folder):
    store = CheckpointStore(folder)
    code = snapshot([])
    fp = fingerprint.fingerprint(CFG, "v1", code)
    files = {"mynets/nets.py": "ab" * 32}
    written = [_write(store, s, 1, fp, files, keep=2) for s in (10, 20, 30, 40)]
    assert store.paths() == written[-2:]  # the newest two, oldest first
    assert store.latest() == written[-1]
    dcps = sorted(n for n in storage.list_dir(folder) if n.endswith(".dcp"))
    assert dcps == [f"ckpt-{s:09d}-{s:06x}.dcp" for s in (30, 40)]  # the rotated ones' went with them
    state = store.read(written[-1], fingerprint.comparable(fp))
    assert state["global_step"] == 40 and store.dcp_dir(written[-1], state).endswith(dcps[-1])
    assert store.owner() == fp  # from the pointer, which names whose folder this is
    pointer = json.loads(storage.read_bytes(storage.join(folder, POINTER)))
    assert pointer == {"name": storage.name(written[-1]), "step": 40, "epoch": 1, "fingerprint": fp,
                       "code_files": files}


def test_read_refuses_another_run_and_falls_back_past_an_unreadable_one(folder, capsys):
    store = CheckpointStore(folder)
    fp = fingerprint.fingerprint(CFG, "v1", snapshot([]))
    older = _write(store, 10, 1, fp)
    newest = _write(store, 20, 1, fp)
    other = fingerprint.fingerprint(CFG.model_copy(update={"lr": 0.5}), "v1", snapshot([]))
    with pytest.raises(DataError, match=r"different run: lr='0.003' \(config has '0.5'\) \(to resume with the "
                                        r"new value, allow it: --allow-changed lr\)"):
        store.read(newest, other)
    assert store.read(newest, other, allow_changed=["lr"])["global_step"] == 20
    storage.delete(storage.join(folder, f"ckpt-{20:09d}-{20:06x}.dcp", ".metadata"))  # its DCP write was lost
    with pytest.raises(CheckpointUnreadable, match="its DCP directory .* is missing or incomplete"):
        store.read(newest)
    found, state = store.readable(fp)
    assert found == older and state["global_step"] == 10
    assert "resuming from " + storage.name(older) in capsys.readouterr().err


def test_checks_only_read_and_refuse_in_one_line(folder, tmp_path):
    store = CheckpointStore(folder)
    pkg = _package(tmp_path / "code")
    code = snapshot([str(pkg)])
    fp = fingerprint.fingerprint(CFG, "v1", code)
    assert store.check_new(fp) == [] and storage.find_files(folder) == []  # an empty folder: nothing written
    with pytest.raises(DataError, match="no checkpoint to resume from"):
        store.check_resume(fp, code, CFG.epochs)
    _write(store, 10, 1, fp, code.files)
    before = _tree(folder)

    # Unchanged code, epochs left: a resume may go on.
    store.check_resume(fp, code, CFG.epochs)
    # Another job's checkpoints: a new job is refused, naming what differs.
    theirs = fingerprint.fingerprint(CFG.model_copy(update={"hidden": [32]}), "v1", code)
    with pytest.raises(DataError, match=r"holds another job's checkpoints \(hidden '\[16\]' \(this job: '\[32\]'\)\)"):
        store.check_new(theirs)
    # Edited code is the same job: a new run starts over (its resume compares the code).
    _package(tmp_path / "code", activation="tanh")  # the shapes are the same: still caught
    (pkg / "extra.py").write_text("X = 1\n")
    (pkg / "__init__.py").unlink()
    edited = snapshot([str(pkg)])
    assert store.check_new(fingerprint.fingerprint(CFG, "v1", edited)) == []
    with pytest.raises(ConfigError) as refused:
        store.check_resume(fingerprint.fingerprint(CFG, "v1", edited), edited, CFG.epochs)
    line = str(refused.value)
    assert refused.value.exit_code == 2 and "\n" not in line
    assert line == (f"{storage.display(folder)}: the code changed since the checkpoint: mynets/__init__.py removed, "
                    "mynets/extra.py added, mynets/nets.py changed; to resume with it: --allow-changed code"), line
    store.check_resume(fingerprint.fingerprint(CFG, "v1", edited), edited, CFG.epochs, ["code"])
    # Its last epoch done: a resume would train 0 steps.
    with pytest.raises(DataError, match=r"the newest checkpoint ends the job \(epoch 1 of training.epochs = 1"):
        store.check_resume(fp, code, 1)
    assert _tree(folder) == before  # every check, refused or not, only read


def test_a_checkpoint_from_before_the_code_digest_still_resumes(folder, tmp_path):
    store = CheckpointStore(folder)
    code = snapshot([str(_package(tmp_path / "code"))])
    old = fingerprint.fingerprint(CFG, "v1")  # no `code`: written before it was fingerprinted
    assert "code" not in old
    path = _write(store, 10, 1, old)
    assert store.code_changes(code) is None  # cannot be compared, so not refused
    new = fingerprint.fingerprint(CFG, "v1", code)
    store.check_resume(new, code, CFG.epochs)
    assert store.read(path, fingerprint.comparable(new))["global_step"] == 10
    assert store.check_new(new) == []


def test_own_folder_replaces_an_earlier_run_and_effects_do_what_they_say(folder, capsys):
    mine = fingerprint.fingerprint(CFG, "v1", snapshot([]))
    earlier = fingerprint.fingerprint(CFG.model_copy(update={"epochs": 5}), "v0", snapshot([]))
    _write(CheckpointStore(folder), 10, 1, earlier)
    with pytest.raises(DataError, match=r"another job's checkpoints \(epochs '5' \(this job: '2'\)\)"):
        CheckpointStore(folder).check_new(mine)  # a folder the user named: refused
    own = CheckpointStore(folder, own=True)
    assert own.check_new(mine) == ["epochs 5"]  # the job's own: its earlier run
    lease = own.hold(ttl_s=30)
    try:
        assert storage.exists(lease.url) and storage.name(lease.url) == "_lease.json"
        with pytest.raises(LeaseHeld, match="is in use by shardline train"):
            CheckpointStore(folder).hold(ttl_s=30)
        own.start_over(mine)
        assert "the checkpoints of its earlier run (epochs 5) are replaced" in capsys.readouterr().err
        assert own.latest() is None and own.paths() == []
        assert [n for n in storage.list_dir(folder) if n.endswith(".dcp")] == []
        own.announce(0)
        assert storage.exists(storage.join(folder, "ranks", "rank-0.json"))
    finally:
        own.release()
    assert not storage.exists(storage.join(folder, "_lease.json"))


def test_the_store_owns_its_pointer_and_its_ranks_files(folder):
    """#54 item 7: a copied folder's LATEST is written by the store (point_at), with the five
    fields save() writes, not two; the ranks' files are named by the store alone."""
    store = CheckpointStore(folder)
    fp = fingerprint.fingerprint(CFG, "v1", snapshot([]))
    first = _write(store, 10, 0, fp, {"mynets/nets.py": "cd" * 32})
    saved = json.loads(storage.read_bytes(storage.join(folder, POINTER)))
    _write(store, 20, 1, fp)
    store.point_at(first)  # back to the first, as the fault runner does after copying a prefix
    assert store.latest() == first
    assert json.loads(storage.read_bytes(storage.join(folder, POINTER))) == saved
    assert store.rank_file(3) == storage.join(folder, "ranks", "rank-3.json")
    assert store.stop_file == storage.join(folder, "ranks", "stop.json")
    assert store.ranks_dir == storage.join(folder, "ranks")


def test_the_folder_is_decided_once_by_the_store(tmp_path, monkeypatch):
    """shardline/config.py asks CheckpointStore.job_folder, as TrainingJob does (for_job)."""
    from shardline.config import checkpoint_store, load_config, resolve_paths

    monkeypatch.chdir(tmp_path)
    given = load_config(None, {"training.hidden": [16]})
    resolved = resolve_paths(given, [])
    store = checkpoint_store(given, resolved)
    t, k = given.training, given.tracking
    assert store == CheckpointStore.for_job(t, k.experiment, k.registered_model, given.pipelines.dataset_dir)
    assert store.own and CheckpointStore.job_folder(t, k.experiment, k.registered_model, "x")[1]
    named = load_config(given, {"training.checkpoint_dir": "mine"})
    assert CheckpointStore.job_folder(named.training, "e", "m", "d") == ("mine", False)
    assert not checkpoint_store(named, resolve_paths(named, [])).own


def test_for_job_names_the_own_folder_without_the_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    unset = CheckpointStore.for_job(CFG, "exp", "model", "data")
    assert unset.own and unset.url == str(tmp_path / fingerprint.job_dir(CFG, "exp", "model", "data"))
    # The code is not in the folder's name (job_dir takes no code): a resume after an edit finds it.
    assert CheckpointStore.for_job(CFG, "exp", "model", "data") == unset
    named = CheckpointStore.for_job(CFG.model_copy(update={"checkpoint_dir": str(tmp_path / "mine")}), "exp",
                                    "model", "data")
    assert not named.own and named.url == str(tmp_path / "mine")


def test_the_code_snapshot_is_what_ships(tmp_path):
    pkg = _package(tmp_path / "code")
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "nets.cpython-311.pyc").write_bytes(b"cache")  # never shipped, never hashed
    single = tmp_path / "helpers.py"
    single.write_text("Y = 2\n")
    folders = [str(pkg), str(single)]
    snap = snapshot(folders)
    with zipfile.ZipFile(code_zip(folders)[0]) as z:
        shipped = {n: hashlib.sha256(z.read(n)).hexdigest() for n in z.namelist()}
    assert snap.files == shipped == {n: hashlib.sha256(p.read_bytes()).hexdigest() for n, p in _files(folders)}
    assert set(snap.files) == {"mynets/__init__.py", "mynets/nets.py", "helpers.py"}
    assert snapshot(folders) == snap and len(snap.digest) == 64
    _package(tmp_path / "code", activation="tanh")
    edited = snapshot(folders)
    assert edited.digest != snap.digest and edited.changes(snap.files) == ["mynets/nets.py changed"]
    assert snapshot([]).files == {} and snapshot([]).digest == ""  # a built-in model: no user code
