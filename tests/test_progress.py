"""foundation.progress: ranks' lines reach the driver's console over a socket, and a rank
whose driver cannot be reached prints them itself instead of waiting. The console's own
lines reach a log unbroken."""

from __future__ import annotations

import io
import subprocess
import sys
import time

import pytest

from shardline.foundation import progress
from shardline.training.launchers import free_port

from .conftest import REPO


def _wait_for(out: io.StringIO, text: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_lines_from_another_process_reach_the_listener_in_order():
    out = io.StringIO()
    with progress.ProgressListener("127.0.0.1", out=out) as listener:
        code = (
            "from shardline.foundation import progress\n"
            f"for i in range(3): progress.say({listener.address!r}, f'[shardline] epoch {{i + 1}}/3: ok')\n"
        )
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        _wait_for(out, "epoch 3/3")
    assert out.getvalue().splitlines() == [f"[shardline] epoch {i}/3: ok" for i in (1, 2, 3)]
    assert proc.stderr == ""  # sent, not printed by the sender


def test_an_unreachable_driver_makes_the_rank_print_the_line_itself():
    nobody = f"127.0.0.1:{free_port()}"  # nothing listens there
    code = f"from shardline.foundation import progress\nprogress.say({nobody!r}, 'epoch 1/1: ok')\nprogress.say({nobody!r}, 'epoch 2/2: ok')\n"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr.splitlines() == ["epoch 1/1: ok", "epoch 2/2: ok"], proc.stderr


def test_local_ranks_route_to_loopback():
    assert progress.listen_address("local") == "127.0.0.1"
    assert progress._route_to("localhost") == "127.0.0.1"


def test_a_stage_counts_its_units_ticks_and_prints_no_tick():
    out = io.StringIO()
    with progress.ProgressListener("127.0.0.1", out=out) as listener:
        with listener.stage("score", 3, "units scored") as stage:
            code = (
                "from shardline.foundation import progress\n"
                f"for rows in (10, 20, 1000): progress.tick({listener.address!r}, {stage.key!r}, rows)\n"
            )
            proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    lines = out.getvalue().splitlines()
    assert lines[0] == "[shardline] score: 1/3 units scored (10 rows)"  # the first at once
    assert lines[-1] == "[shardline] score: 3/3 units scored (1,030 rows)"  # the last always
    assert "\x1e" not in out.getvalue()


def test_a_retried_unit_counts_once_and_no_count_passes_its_total():
    """A unit scored, ticked and then retried (its task lost before it reported) ticks
    again: counted by name once; unnamed ticks (prepare's tasks) are capped at the total."""
    out = io.StringIO()
    with progress.ProgressListener("127.0.0.1", out=out) as listener:
        with (listener.stage("score", 2, "units scored") as named,
              listener.stage("prepare pass 1", 2, "units read") as unnamed):
            code = (
                "from shardline.foundation import progress\n"
                f"a = {listener.address!r}\n"
                f"for _ in range(3): progress.tick(a, {unnamed.key!r})\n"
                f"for unit, rows in (('u1', 10), ('u1', 10), ('u2', 5)): progress.tick(a, {named.key!r}, rows, unit=unit)\n"
            )
            proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0 and proc.stderr == "", proc.stderr
            # One connection, read in order: the unnamed ticks all arrived before u2's.
            _wait_for(out, "score: 2/2")
    lines = out.getvalue().splitlines()
    score = [ln for ln in lines if "score:" in ln]
    assert score[-1] == "[shardline] score: 2/2 units scored (15 rows)", lines
    assert "[shardline] score: 2/2 units scored (10 rows)" not in lines  # u1's retry not counted
    read = [ln for ln in lines if "prepare pass 1:" in ln]
    assert read[-1] == "[shardline] prepare pass 1: 2/2 units read" and read.count(read[-1]) == 1, lines
    assert not [ln for ln in lines if "3/2" in ln], lines


def test_a_tick_without_a_listener_is_silent():
    nobody = f"127.0.0.1:{free_port()}"
    code = f"from shardline.foundation import progress\nprogress.tick({nobody!r}, 's0', 5)\nprogress.tick(None, 's0')\n"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


@pytest.mark.parametrize("engine", ["spark", "dask"])
def test_prepare_and_scoring_count_their_units_on_the_driver(engine, engines, prepared, tracking_uri, tmp_path, capfd):
    from shardline.pipelines.manifest import load_manifest
    from shardline.pipelines.prepare import prepare
    from .serving_helpers import score

    from .conftest import small_pipeline
    from .serving_helpers import trained_model

    cfg = small_pipeline(tmp_path, rows=2000)
    capfd.readouterr()
    manifest = prepare(engines[engine], cfg)
    err = capfd.readouterr().err
    units = len(manifest.sources)
    assert f"[shardline] prepare pass 1: {units}/{units} units read" in err, err[-3000:]
    assert f"[shardline] prepare pass 2: {units}/{units} units read and routed" in err, err[-3000:]
    shards = sum(len(s.shards) for s in manifest.splits.values())
    assert f"[shardline] prepare write: {shards}/" in err, err[-3000:]

    model = trained_model(prepared)
    handle = engines[engine].spark if engine == "spark" else engines[engine].client
    test = load_manifest(prepared.dataset_dir).splits["test"]
    capfd.readouterr()
    score(engine, handle, model.model_uri, tracking_uri, prepared.dataset_dir, str(tmp_path / "scores"))
    err = capfd.readouterr().err
    n = len(test.shards)
    assert f"[shardline] score: {n}/{n} units scored ({test.rows:,} rows)" in err, err[-3000:]


def test_a_long_lived_task_process_keeps_only_its_newest_connections():
    for i in range(progress.KEEP_SENDERS + 3):  # job after job, each with its own listener
        out = io.StringIO()
        with progress.ProgressListener("127.0.0.1", out=out) as listener:
            progress.say(listener.address, f"job {i}")
            _wait_for(out, f"job {i}")
        assert out.getvalue() == f"job {i}\n"
    assert len(progress._senders) <= progress.KEEP_SENDERS


def test_console_lines_reach_a_log_unbroken():
    """spark-submit's and a scheduler's logs are no terminal: a long path stays on its line."""
    path = "/data/" + "/".join(["a-long-folder-name"] * 8) + "/env/bin/python"
    code = (f"from shardline.jobs.console import ConsoleReporter\nfrom shardline.foundation import report\n"
            f"report.use(ConsoleReporter())\nwith report.stage('Preparing into {path}'):\n"
            f"    report.note('{path} on vm')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 3 and all(path in line for line in lines), lines


def test_the_listener_prints_only_lines_from_its_own_job():
    """The port is reachable by anyone on the network: lines without the job's token (the
    tail of the address every sender is handed) are neither printed nor counted."""
    import socket

    out = io.StringIO()
    with progress.ProgressListener("127.0.0.1", out=out) as listener:
        where, _, token = listener.address.partition("/")
        assert len(token) >= 32
        host, port = where.rsplit(":", 1)
        with progress.ProgressListener("127.0.0.1", out=io.StringIO()) as other:
            strangers = [b"[shardline] epoch 9/9: forged\n",
                         f"{other.address.partition('/')[2]}\n[shardline] epoch 8/9: another job's\n".encode()]
        with listener.stage("scoring", 1, "units") as stage:
            for payload in strangers + [f"{progress.TICK}{stage.key} 5\n".encode()]:
                with socket.create_connection((host, int(port)), timeout=30) as s:
                    s.sendall(payload)
            with socket.create_connection((host, int(port)), timeout=30) as s:
                s.sendall(f"{token}\n[shardline] epoch 1/9: ours\n".encode())
                _wait_for(out, "epoch 1/9: ours")
    # the forged tick did not count either: the stage ends with none of its unit done
    assert out.getvalue().splitlines() == ["[shardline] epoch 1/9: ours", "[shardline] scoring: 0/1 units"]


def test_the_library_reports_through_the_reporter_its_caller_chose(caplog):
    """foundation.report: the library's stage, note and warning lines go to the process's
    reporter: plain lines by default (a notebook, spark-submit's log), the `shardline`
    logger when a program routes its logs, the CLI's console when the command runs."""
    import logging

    from shardline.foundation import report

    out = io.StringIO()
    with report.using(report.PlainReporter(out)):
        with report.stage("Preparing [pipelines] data"):
            report.note("inferred 3 classes")
            report.warn("a warning")
        report.line("[shardline] a status line")
    lines = out.getvalue().splitlines()
    assert lines[0] == "→ Preparing [pipelines] data …" and lines[1:3] == ["  inferred 3 classes", "  a warning"]
    assert lines[3].startswith("✓ Preparing [pipelines] data (") and lines[4] == "[shardline] a status line"
    with caplog.at_level(logging.INFO, logger="shardline"), report.using(report.LoggingReporter()):
        report.note("to the logger")
        report.warn("careful")
    got = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    assert ("shardline", logging.INFO, "  to the logger") in got and ("shardline", logging.WARNING, "careful") in got
    assert isinstance(report.current(), report.PlainReporter)  # `using` put the default back


def test_the_drivers_own_status_lines_go_to_the_reporter(tmp_path, capsys):
    """#53 item 21: lines the library printed past the reporter (a notebook's LoggingReporter
    never saw them): the checkpoint store's, the MLflow wait's, the rank guard's."""
    from shardline.foundation import report
    from shardline.training.checkpoints import fingerprint
    from shardline.training.checkpoints.store import CheckpointStore
    from shardline.training.config import TrainingConfig
    from shardline.training.launchers.guard import DriverGuard
    from shardline.training.mlflow_outage import when_reachable

    cfg = TrainingConfig(hidden=[8])
    fp = fingerprint.fingerprint(cfg, "v")
    store = CheckpointStore(str(tmp_path / "ckpt"), own=True)
    for step in (1, 2):
        store.save(step, {"fingerprint": fp, "epoch": 0, "global_step": step}, keep=3)
    (tmp_path / "ckpt" / CheckpointStore(store.url).latest().rsplit("/", 1)[1]).write_bytes(b"cut short")
    (tmp_path / "file").write_text("not a folder")
    guard = DriverGuard("unused", str(tmp_path / "file" / "ranks" / "stop.json"), "job", ttl_s=30)

    def down():
        raise ConnectionError("Connection refused")

    out = io.StringIO()
    with report.using(report.PlainReporter(out)):
        assert store.readable()[0].endswith(".pt")  # the cut one is passed over, said once
        guard.stop()  # its stop file cannot be written
        with pytest.raises(Exception, match="has been unreachable"):
            when_reachable(down, "http://127.0.0.1:9", wait_s=0.3, checkpoint="ck", retry_s=0.1)
        store.start_over(fingerprint.fingerprint(cfg.model_copy(update={"epochs": 9}), "v"))
    said = out.getvalue()
    assert "the newest readable one" in said and "could not tell the ranks to stop" in said, said
    assert "training is done; MLflow at http://127.0.0.1:9 is unreachable" in said, said
    assert "starting over in this job's own checkpoint folder" in said, said
    assert capsys.readouterr().err == ""  # nothing past the reporter
