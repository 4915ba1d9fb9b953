"""foundation.storage and foundation.lease on a local disk: URLs, the commit steps, leases.

The same primitives against a real S3 server are in test_s3_storage.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardline.foundation import commit, storage
from shardline.foundation.errors import ConfigError, LeaseHeld, StorageError
from shardline.foundation.lease import LEASE_NAME, Lease, LeaseLost

from .storage_helpers import create_only_race


def test_resolve_makes_local_paths_absolute_and_keeps_urls(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert storage.resolve("data/x", "pipelines.dataset_dir") == str(tmp_path / "data/x")
    assert storage.resolve("~/x", "s") == os.path.expanduser("~/x")
    for url in ("s3://bkt/a/b", "gs://bkt/a", "abfs://c@acct.dfs.core.windows.net/p", "hdfs://nn:8020/p", "file:///abs/p"):
        assert storage.resolve(url, "s") == url
    assert storage.resolve("s3://bkt/prefix/", "s") == "s3://bkt/prefix"


@pytest.mark.parametrize(
    "path, fragment",
    [
        ("s3a://bkt/x", "use s3://bkt/x"),
        ("ftp://host/x", "scheme 'ftp' is not supported"),
        ("file://relative/x", "must be absolute"),
        ("s3:///x", "names no bucket"),
        ("", "empty path"),
    ],
)
def test_resolve_refuses_what_no_task_could_open(path, fragment):
    with pytest.raises(ConfigError, match=fragment):
        storage.resolve(path, "training.checkpoint_dir")


def test_relative_path_on_a_cluster_is_refused_naming_what_to_use(tmp_path):
    cluster = "spark.master = 'spark://10.0.0.1:7077'"
    with pytest.raises(ConfigError) as e:
        storage.resolve("shardline-data/ckpt", "training.checkpoint_dir", cluster)
    msg = str(e.value)
    assert msg.startswith("training.checkpoint_dir = 'shardline-data/ckpt' is a relative path")
    assert "s3://bucket/prefix" in msg and "\n" not in msg
    # Absolute paths and URLs are the user's call (a shared mount is fine).
    assert storage.resolve(str(tmp_path), "s", cluster) == str(tmp_path)
    assert storage.resolve("s3://b/x", "s", cluster) == "s3://b/x"


def test_write_publishes_whole_files_and_nothing_on_error(tmp_path):
    url = str(tmp_path / "d" / "f.bin")
    with storage.write(url) as f:
        f.write(b"abc")
    assert storage.read_bytes(url) == b"abc"
    with pytest.raises(RuntimeError):
        with storage.write(url) as f:
            f.write(b"partial")
            raise RuntimeError("boom")
    assert storage.read_bytes(url) == b"abc"
    assert os.listdir(tmp_path / "d") == ["f.bin"]  # no temp file left


def test_listing_and_deleting(tmp_path):
    for rel in ("a/1.txt", "a/b/2.txt", "c.txt"):
        storage.write_bytes(str(tmp_path / rel), b"x")
    assert storage.list_dir(str(tmp_path)) == ["a", "c.txt"]
    assert storage.find_files(str(tmp_path / "a")) == [str(tmp_path / "a/1.txt"), str(tmp_path / "a/b/2.txt")]
    assert storage.list_dir(str(tmp_path / "nope")) == []
    assert storage.is_dir(str(tmp_path / "a")) and storage.is_file(str(tmp_path / "c.txt"))
    storage.delete_tree(str(tmp_path / "a"))
    storage.delete(str(tmp_path / "c.txt"))
    storage.delete(str(tmp_path / "c.txt"))  # already gone: fine
    assert storage.list_dir(str(tmp_path)) == []


def test_create_only_and_replace_if(tmp_path):
    url = str(tmp_path / "m" / "manifest-1.json")
    tag = commit.create_only(url, b"one")
    assert tag and commit.create_only(url, b"two") is None
    assert commit.read_tagged(url) == (b"one", tag)
    new = commit.replace_if(url, b"three", tag)
    assert new and commit.replace_if(url, b"four", tag) is None  # stale tag
    assert storage.read_bytes(url) == b"three"
    assert not commit.delete_if(url, tag) and commit.delete_if(url, new)
    assert commit.read_tagged(url) is None
    assert sorted(os.listdir(tmp_path / "m")) == []


def test_create_only_has_one_winner_among_processes(tmp_path):
    url = str(tmp_path / "commit.json")
    results = create_only_race(url, 6)
    assert sorted(results) == ["lost"] * 5 + ["won"]
    assert storage.read_bytes(url).decode() == str(results.index("won"))


def test_check_access_names_the_setting_and_the_problem(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    storage.check_access(str(ro / "new" / "dir"), "serving.output_dir", write=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageError, match=r"^serving.output_dir: .*/file exists and is not a directory$"):
        storage.check_access(str(tmp_path / "file"), "serving.output_dir", write=True)
    # Under a file: the cause is the file, not permissions (access() denies a plain file's X).
    for write in (True, False):
        with pytest.raises(StorageError, match=r"^pipelines.dataset_dir: .*/file/a/b: .*/file is a file, not a directory$"):
            storage.check_access(str(tmp_path / "file" / "a" / "b"), "pipelines.dataset_dir", write=write)
    if os.geteuid() != 0:  # root writes anywhere: the permission case needs a normal user
        ro.chmod(0o500)
        with pytest.raises(StorageError, match="permission denied"):
            storage.check_access(str(ro / "x"), "serving.output_dir", write=True)


# -- leases ------------------------------------------------------------------------------


def test_lease_is_exclusive_names_its_holder_and_is_released(tmp_path):
    url = str(tmp_path / LEASE_NAME)
    with Lease(url, "shardline prepare", what="dataset") as held:
        holder = Lease.holder(url)
        assert (holder.job, holder.pid) == ("shardline prepare", os.getpid())
        with pytest.raises(LeaseHeld) as e:
            Lease(url, "shardline prepare", what="dataset").acquire()
        msg = str(e.value)
        assert f"dataset {tmp_path} is in use by shardline prepare (host " in msg
        assert f"pid {os.getpid()}, since {holder.since})" in msg
        held.check()
    assert not os.path.exists(url)


def test_lease_heartbeat_renews_it(tmp_path):
    url = str(tmp_path / LEASE_NAME)
    with Lease(url, "job", ttl_s=1.5):
        first = Lease.holder(url).expires_at
        deadline = time.monotonic() + 60
        while Lease.holder(url).expires_at == first and time.monotonic() < deadline:
            time.sleep(0.05)
        assert Lease.holder(url).expires_at > first
        assert Lease.holder(url).stale(time.time()) is None


def test_expired_lease_is_taken_over_and_its_old_holder_cannot_commit(tmp_path):
    url = str(tmp_path / LEASE_NAME)
    stalled = Lease(url, "stalled job", ttl_s=0.5).acquire()
    stalled._stop.set()  # a holder that stopped renewing (a stopped process, a long GC)
    stalled._thread.join()
    deadline = time.monotonic() + 30
    while Lease.holder(url).stale(time.time()) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    with Lease(url, "new job") as new:
        previous, why = new.took_over
        assert previous.job == "stalled job" and why.startswith("expired")
        assert not stalled.renew()
        with pytest.raises(LeaseLost, match="taken over by new job"):
            stalled.check()
        stalled.release()  # must not delete the new holder's lease
        assert Lease.holder(url).job == "new job"


def test_lease_of_a_killed_process_on_this_host_is_taken_over_at_once(tmp_path):
    url = str(tmp_path / LEASE_NAME)
    code = (
        "import sys, time; from shardline.foundation.lease import Lease; "
        "Lease(sys.argv[1], 'victim', ttl_s=3600).acquire(); print('held', flush=True); time.sleep(3600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, url], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(LeaseHeld, match="in use by victim"):
            Lease(url, "me").acquire()
        proc.kill()
        proc.wait()
        with Lease(url, "me") as lease:
            assert lease.took_over[1] == f"its process {proc.pid} on this host is gone"
    finally:
        proc.kill()
        proc.wait()


def test_a_lease_from_another_host_waits_for_its_expiry(tmp_path):
    url = str(tmp_path / LEASE_NAME)
    other = {
        "job": "remote", "host": "elsewhere", "pid": 1, "since": "2026-01-01T00:00:00+00:00",
        "expires_at": time.time() + 3600, "boot_id": "b", "pid_ns": "pid:[1]", "pid_start": "1",
    }
    Path(url).write_text(json.dumps(other))
    with pytest.raises(LeaseHeld, match=r"in use by remote \(host elsewhere, pid 1"):
        Lease(url, "me").acquire()
    Path(url).write_text(json.dumps({**other, "expires_at": time.time() - 5}))
    with Lease(url, "me") as lease:
        assert lease.took_over[1].startswith("expired")
