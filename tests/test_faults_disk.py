"""A full disk, for real: a 1 MiB tmpfs as the scoring output and as the dataset_dir.

A full disk is permanent (pipelines.failures): prepare and score end in one line, no
traceback, no task retried; a lease renewal that meets it leaves nothing behind that
would block the next run; once the disk is grown, the next run succeeds.
"""

from __future__ import annotations

import os

from shardline.serving.ledger import check_output_dir, output_lease

from .small_disk import fill, small_disk


def test_lease_renewal_on_a_full_disk_leaves_nothing_that_blocks_the_next_run(tmp_path):
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
