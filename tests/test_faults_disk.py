"""A full disk, for real: a 1 MiB tmpfs as the scoring output and as the dataset_dir.

A full disk is permanent (foundation.failures): prepare and score end in one line, no
traceback, no task retried; a lease renewal that meets it leaves nothing behind that
would block the next run; once the disk is grown, the next run succeeds.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from shardline.pipelines.manifest import has_manifest
from shardline.serving.ledger import check_output_dir, output_lease, read_ledger

from .conftest import REPO, absolute_paths, shardline, shardline_here
from .serving_helpers import promo_model, raw_table, write_raw
from .small_disk import fill, grow, small_disk

QUICKSTART = str(REPO / "jobs" / "configs" / "quickstart.toml")
# Spark's and Dask's words for a retried task, and a traceback's first line: none may show.
RETRIED = ("failed 4 times", "failed 2 times", "Retrying", "retries", "Traceback")


def _one_line(r) -> str:
    err = r.stderr.strip()
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, err
    assert not any(w in err for w in RETRIED), err
    return lines[0]


@pytest.mark.slow
def test_lease_renewal_on_a_full_disk_leaves_nothing_that_blocks_the_next_run(tmp_path):
    """Full tier only (`make test-all`, marker `slow`): mounts a tmpfs, which needs root."""
    with small_disk(tmp_path / "disk") as disk:
        out = disk / "scores"
        out.mkdir()
        lease = output_lease(out).acquire()
        filler = None
        try:
            filler = fill(disk)
            assert lease.renew()  # a write that failed within the lease's time to live: kept
            assert sorted(os.listdir(out)) == ["_lease.json"]  # no 0-byte temporary
            check_output_dir(str(out))
        finally:
            if filler:
                filler.unlink()
            lease.release()
        # A temporary left by a holder killed mid-write: not foreign, and the next holder removes it.
        stale = out / "._lease.json.0123abcd.tmp"
        stale.write_bytes(b"")
        os.utime(stale, (1, 1))
        check_output_dir(str(out))
        with output_lease(out):
            assert not stale.exists()


def _prepare_args(tmp_path: Path, dataset: Path) -> list[str]:
    # ~3 MB of shards: more than the 1 MiB disk holds.
    return [QUICKSTART, *absolute_paths(tmp_path), "--set", f"pipelines.dataset_dir='{dataset}'",
            "--set", "pipelines.source.synthetic.rows=40000"]


@pytest.mark.slow
def test_full_disk_prepare_on_spark_is_one_line_and_not_retried(spark, tmp_path):
    """The failing run is a process of its own: its Spark master retries a failed task 4
    times (the session's does not). The run after the disk grew needs no retrying master:
    it runs in this process on the session's Spark (no second Python and JVM start).

    Full tier only (`make test-all`, marker `slow`): mounts a tmpfs, which needs root; and the CLI
    in a process of its own.
    """
    with small_disk(tmp_path / "disk") as disk:
        dataset = disk / "dataset"
        r = shardline("prepare", *_prepare_args(tmp_path, dataset), cwd=tmp_path)
        line = _one_line(r)
        # The master as the quickstart writes it, not the local[2,4] it runs as (#46).
        assert "  Spark master local[2]\n" in r.stderr and "local[2,4]" not in r.stderr, r.stderr
        assert "pipelines.dataset_dir" in line and "No space left on device" in line, line
        assert "not retried" in line
        # Nothing half-written: no version folder, no manifest (pipelines.manifest's names).
        assert not list(dataset.glob("v-*")) and not has_manifest(str(dataset))
        grow(disk)
        r = shardline_here("prepare", *_prepare_args(tmp_path, dataset), cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert has_manifest(str(dataset))


@pytest.mark.slow
def test_full_disk_prepare_on_dask_is_one_line_and_not_retried(on_session_dask, tmp_path):
    """Full tier only (`make test-all`, marker `slow`): mounts a tmpfs, which needs root."""
    with small_disk(tmp_path / "disk") as disk:
        dataset = disk / "dataset"
        args = ["prepare", *_prepare_args(tmp_path, dataset), "--engine", "dask", *on_session_dask]
        r = shardline_here(*args, cwd=tmp_path)
        line = _one_line(r)
        assert "pipelines.dataset_dir" in line and "No space left on device" in line, line
        # A write that met the full disk is not counted as a shard written (#46: "prepare
        # write: 4/4 shards written", then the error).
        assert not re.search(r"prepare write: (\d+)/\1 shards written", r.stderr), r.stderr
        grow(disk)
        r = shardline_here(*args, cwd=tmp_path)
        assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def promo(prepared, tracking_uri):
    return promo_model(prepared, tracking_uri)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["dask", "spark"])
def test_full_disk_score_is_one_line_and_the_next_score_succeeds(engine, promo, prepared, tracking_uri,
                                                                 request, tmp_path):
    """Full tier only (`make test-all`, marker `slow`): mounts a tmpfs, which needs root."""
    handle = ("--set", f"dask.address='{request.getfixturevalue('dask_client').scheduler.address}'") \
        if engine == "dask" else ()
    if engine == "spark":
        request.getfixturevalue("spark")  # the session's, which the CLI reuses
    src = tmp_path / "incoming"
    # Units of ~50 KB: the lease fits in what the full disk leaves, a unit's scores do not.
    write_raw(raw_table(prepared).slice(0, 3000), src, files=2)
    with small_disk(tmp_path / "disk") as disk:
        out = disk / "scores"
        args = ["score", "--model", "models:/promo/1", "--input", str(src), "--output", str(out),
                *absolute_paths(tmp_path), "--engine", engine, *handle]
        env = {"MLFLOW_TRACKING_URI": tracking_uri}
        out.mkdir()
        fill(disk, leave=16384)
        line = _one_line(shardline_here(*args, cwd=tmp_path, env=env))
        assert "No space left on device" in line and "not retried" in line, line
        grow(disk)
        r = shardline_here(*args, cwd=tmp_path, env=env)
        assert r.returncode == 0, r.stderr
        assert "3,000 rows from 2 file(s)" in r.stderr, r.stderr
        assert len(read_ledger(out / "model=promo" / "version=1")) == 2


def test_one_rule_sorts_permanent_from_transient_failures(tmp_path):
    """foundation.failures: what prepare, training, scoring and storage all ask."""
    import errno

    from shardline.foundation import failures
    from shardline.training.launchers.guard import is_permanent as rank_failure_is_permanent

    (tmp_path / "file").write_text("x")
    try:  # a real one: a path through a file
        open(tmp_path / "file" / "below", "w")
    except OSError as e:
        not_a_dir = e
    permanent = [OSError(errno.ENOSPC, "No space left on device"), OSError(errno.EROFS, "Read-only file system"),
                 PermissionError(errno.EACCES, "Permission denied"), not_a_dir,
                 OSError("[Errno 28] Error writing bytes to file. Detail: [errno 28] No space left on device"),
                 OSError("When creating bucket 'x': AWS Error NoSuchBucket: bucket does not exist")]
    transient = [ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), TimeoutError("timed out"),
                 OSError("AWS Error SLOW_DOWN during PutObject operation: SlowDown"),
                 OSError("HTTP 503 Service Unavailable: ServiceUnavailable")]
    assert all(failures.is_permanent(e) and not failures.is_transient(e) for e in permanent)
    # Its one line names the cause: the ancestor that is a file, not "Not a directory".
    assert failures.describe(not_a_dir) == f"{tmp_path / 'file' / 'below'}: {tmp_path / 'file'} is a file, not a directory"
    assert all(failures.is_transient(e) and not failures.is_permanent(e) for e in transient)
    assert all(rank_failure_is_permanent(e) for e in permanent)  # training relaunches none of them
    assert not any(rank_failure_is_permanent(e) for e in transient[:2])

    tries = []

    def flaky():
        tries.append(1)
        if len(tries) < 3:
            raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")
        return "done"

    assert failures.with_backoff(flaky, first_s=0.01) == "done" and len(tries) == 3
    tries.clear()

    def full():
        tries.append(1)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError):
        failures.with_backoff(full, first_s=0.01)
    assert len(tries) == 1  # never retried
