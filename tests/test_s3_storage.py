"""foundation.storage and leases against a real S3-protocol server (moto_server on loopback)."""

from __future__ import annotations

import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardline.foundation import commit, storage
from shardline.foundation.errors import LeaseHeld
from shardline.foundation.lease import LEASE_NAME, Lease, LeaseLost

from .storage_helpers import create_only_race

from .fixtures_s3 import s3_keys


def test_files_round_trip_and_parquet_reads_by_range(bucket):
    table = pa.table({"k": pa.array(range(10_000), pa.int64())})
    url = storage.join(bucket, "d", "t.parquet")
    with storage.write(url) as f:
        pq.write_table(table, f, row_group_size=1000)
    pf = pq.ParquetFile(storage.open_input(url))
    assert pf.metadata.num_row_groups == 10
    assert pf.read_row_group(7).column("k").to_pylist() == list(range(7000, 8000))
    assert storage.is_file(url) and storage.is_dir(storage.join(bucket, "d"))
    assert storage.size(url) == len(storage.read_bytes(url))
    assert storage.list_dir(bucket) == ["d"] and storage.find_files(bucket) == [url]


def test_a_failed_write_leaves_no_object(bucket):
    url = storage.join(bucket, "x.bin")
    with pytest.raises(RuntimeError):
        with storage.write(url) as f:
            f.write(b"half")
            raise RuntimeError("task died")
    assert not storage.exists(url) and s3_keys(bucket) == []


def test_big_objects_are_spooled_and_uploaded_whole(bucket):
    data = bytes(range(256)) * (80 * 1024)  # 20 MiB: past the spool and boto3's multipart threshold
    url = storage.join(bucket, "big.bin")
    with storage.write(url) as f:
        for i in range(0, len(data), 1 << 20):
            f.write(data[i : i + (1 << 20)])
    assert storage.read_bytes(url) == data


def test_conditional_writes(bucket):
    url = storage.join(bucket, "_manifests", "manifest-000000001.json")
    tag = commit.create_only(url, b"one")
    assert tag and commit.create_only(url, b"two") is None
    assert commit.read_tagged(url) == (b"one", tag)
    new = commit.replace_if(url, b"three", tag)
    assert new and commit.replace_if(url, b"four", tag) is None
    assert not commit.delete_if(url, tag) and commit.delete_if(url, new)
    assert commit.read_tagged(url) is None
    assert commit.replace_if(url, b"five", new) is None  # gone: nothing to replace


def test_create_only_has_one_winner_among_processes(bucket):
    url = storage.join(bucket, "commit.json")
    results = create_only_race(url, 4)
    assert sorted(results) == ["lost"] * 3 + ["won"]
    assert storage.read_bytes(url).decode() == str(results.index("won"))


def test_lease_on_s3(bucket):
    url = storage.join(bucket, "scores", LEASE_NAME)
    with Lease(url, "shardline score", what="output", ttl_s=1.5) as held:
        with pytest.raises(LeaseHeld, match=rf"output {bucket}/scores is in use by shardline score"):
            Lease(url, "another", what="output").acquire()
        first = Lease.holder(url).expires_at
        deadline = time.monotonic() + 60
        while Lease.holder(url).expires_at == first and time.monotonic() < deadline:
            time.sleep(0.1)
        assert Lease.holder(url).expires_at > first  # renewed by its heartbeat
        held.check()
    assert s3_keys(bucket) == []


def test_expired_lease_on_s3_is_taken_over_by_exactly_one(bucket):
    url = storage.join(bucket, LEASE_NAME)
    stalled = Lease(url, "stalled", ttl_s=0.5).acquire()
    stalled._stop.set()
    stalled._thread.join()
    deadline = time.monotonic() + 30
    while Lease.holder(url).stale(time.time()) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    # Each contender stays alive until all have answered: a winner that exited would
    # leave a dead holder's lease, which the next one may rightly take over.
    code = (
        "import sys; from shardline.foundation.lease import Lease; from shardline.foundation.errors import LeaseHeld\n"
        "try:\n    Lease(sys.argv[1], 'contender', ttl_s=600).acquire(); print('won', flush=True)\n"
        "except LeaseHeld:\n    print('refused', flush=True)\n"
        "sys.stdin.read()"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    try:
        results = sorted(p.stdout.readline().strip() for p in procs)
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=120)
    assert results == ["refused", "refused", "won"]
    with pytest.raises(LeaseLost):
        stalled.renew() or stalled.check()


def test_compressed_raw_files_stream_decompressed_from_both_stores(bucket, tmp_path):
    import gzip

    from shardline.pipelines.sources import open_raw

    text = b"key,x\n" + b"".join(b"%d,%d.5\n" % (i, i) for i in range(50_000))
    for url in (storage.join(bucket, "raw", "a.csv.gz"), str(tmp_path / "a.csv.gz")):
        storage.write_bytes(url, gzip.compress(text))
        with open_raw(url) as f:
            assert f.read() == text
        with storage.open_stream(url, compression=None) as f:
            assert gzip.decompress(f.read()) == text


def test_delete_tree_of_a_bucket_root_empties_it_and_keeps_the_bucket(bucket):
    for key in ("a/1", "a/b/2", "c"):
        storage.write_bytes(storage.join(bucket, key), b"x")
    storage.delete_tree(storage.join(bucket, "a"))
    assert s3_keys(bucket) == ["c"]
    storage.delete_tree(bucket)
    assert s3_keys(bucket) == [] and storage.list_dir(bucket) == []
    storage.write_bytes(storage.join(bucket, "again"), b"x")  # the bucket is still there
