"""An MLflow server that dies mid-training and comes back (#17 item 2): training goes on,
checkpoints keep being written, the metrics kept meanwhile arrive once it is back, and
the weights are those of a run that never saw an outage."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from shardline.foundation import report
from shardline.engines import LocalEngine
from shardline.training.checkpoints.store import CheckpointStore
from shardline.training.config import TrackingConfig
from shardline.training.job import run_training

from .cli_inprocess import forget_tracking_uri
from .conftest import REPO, absolute_paths, shardline_here
from .fixtures_s3 import NO_JOB_RUNNER, free_port, stop_group, wait_until
from .mlflow_store import env_without_store
from .storage_helpers import hold_until_exists
from .test_checkpoints import _cfg, _equal

BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow  # two server starts and two trainings


# MLflow's HTTP client sleeps between its retries of a dead server (under shardline's bounded
# settings, 2-5 s a failing call: backoff 1 s doubling, plus jitter): time the outage costs
# rank 0 and the driver waiting, proving nothing. These are user settings that bound_http()
# leaves alone; the number of attempts and the timeout stay shardline's own.
NO_BACKOFF = {"MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0", "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0"}


class _Heard(report.Reporter):
    """The driver's reporter in a test: the lines it was handed, as a user's console gets them."""

    def __init__(self):
        self.lines: list[str] = []

    def line(self, text: str) -> None:
        self.lines.append(text)


def _start_server(root: Path, port: int) -> subprocess.Popen:
    env = {**env_without_store(), **NO_JOB_RUNNER}
    with open(root / "server.log", "a") as log:
        return subprocess.Popen(
            [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
             "--artifacts-destination", f"file://{root / 'artifacts'}"],
            cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


def _wait_healthy(proc: subprocess.Popen, port: int) -> None:
    def healthy() -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return r.status == 200

    wait_until(healthy, 300, "mlflow server", proc)


def _server(root: Path, port: int) -> subprocess.Popen:
    proc = _start_server(root, port)
    _wait_healthy(proc, port)
    return proc


class _Servers:
    """This module's MLflow servers, on one store: an empty one copied in (conftest's
    `new_store`), so no start creates its tables (MLflow's migrations, seconds of CPU on a
    loaded machine); each test keeps to its own experiment and registered model. The server
    the outage test brought back is left running for the next test to kill, not started anew."""

    def __init__(self, root: Path):
        self.root, self.left = root, None

    def leave(self, proc: subprocess.Popen, port: int) -> None:
        self.left = (proc, port)

    def running(self) -> tuple[subprocess.Popen, int]:
        """A healthy server (the one left running, else a new one) and its port: the caller's."""
        left, self.left = self.left, None
        if left is not None:
            try:
                _wait_healthy(*left)
                return left
            except Exception:  # it died meanwhile: a new one, as if none was left
                stop_group(left[0])
        port = free_port()
        return _server(self.root, port), port


@pytest.fixture(autouse=True)
def _session_store_after(monkeypatch):
    """run_training with a server's URI makes it this process's MLflow URI (mlflow's global and
    MLFLOW_TRACKING_URI, as a job's driver wants): the session's store again after each test,
    for the tests that run after this module (test_api checks that URI is left alone)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", os.environ["MLFLOW_TRACKING_URI"])
    yield
    forget_tracking_uri()  # then monkeypatch puts the variable back


@pytest.fixture(scope="module")
def servers(tmp_path_factory, new_store):
    servers = _Servers(tmp_path_factory.mktemp("mlflow-server"))
    new_store(servers.root / "mlflow.db", "mlflow-artifacts:/0")  # as the server would make it
    yield servers
    if servers.left is not None:
        stop_group(servers.left[0])


def test_training_survives_an_mlflow_outage_and_its_metrics_arrive_after(prepared, servers, tmp_path,
                                                                        monkeypatch):
    from mlflow.tracking import MlflowClient

    for k, v in NO_BACKOFF.items():  # the driver's calls, and the ranks' (they get this environment)
        monkeypatch.setenv(k, v)
    # Two epochs: the server is killed in the first (rank 0 holds at its end until it is
    # down) and the second writes the three checkpoints (every 10 of its ~37 steps, and its
    # end) the outage must last.
    epochs = 2
    root = servers.root
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # The server starts while the reference trains (it takes as long): the outage run needs it
    # only after, and it is waited for healthy before that run starts, as before.
    procs = [_start_server(root, port)]
    try:
        reference = run_training(_cfg(tmp_path / "ref", epochs=epochs), TrackingConfig(experiment="outage-ref"),
                                 prepared.dataset_dir, LocalEngine(), register=False)
        _wait_healthy(procs[0], port)
    except BaseException:
        stop_group(procs[0])
        raise
    cfg = _cfg(tmp_path / "outage", epochs=epochs)
    killed = tmp_path / "server-killed"
    seen: dict[str, int] = {}
    done = threading.Event()

    def outage() -> None:
        """Kill the server after the first checkpoint; bring it back once three more
        were written while it was down (training went on without it)."""
        while not done.is_set() and not CheckpointStore(cfg.checkpoint_dir).paths():
            time.sleep(0.02)
        if done.is_set():
            return
        stop_group(procs[0])
        seen["at_kill"] = len(CheckpointStore(cfg.checkpoint_dir).paths())
        killed.write_text("down")
        while not done.is_set() and len(CheckpointStore(cfg.checkpoint_dir).paths()) < seen["at_kill"] + 3:
            time.sleep(0.05)
        seen["at_return"] = len(CheckpointStore(cfg.checkpoint_dir).paths())
        procs.append(_server(root, port))

    watcher = threading.Thread(target=outage)
    watcher.start()
    try:
        # Rank 0 waits after its first epoch until the server is down: the outage falls inside
        # training however slow the watcher is (a run beside CPU hogs once saw the server
        # killed only as the job ended).
        heard = _Heard()
        with report.using(heard):  # the driver's console: what rank 0 says must reach it (#53 item 15)
            result = run_training(cfg, TrackingConfig(tracking_uri=url, experiment="outage", registered_model="outage"),
                                  prepared.dataset_dir, LocalEngine(),
                                  epoch_hook=functools.partial(hold_until_exists, str(killed)))
        done.set()
        watcher.join()
        assert seen.get("at_return", 0) >= seen.get("at_kill", 99) + 3, seen  # written while it was down
        _equal(result.weights, reference.weights)
        client = MlflowClient(url)
        run = client.get_run(result.run_id)
        assert run.info.status == "FINISHED"
        # Every epoch's figures arrived, those kept during the outage included, in order.
        assert [m.step for m in client.get_metric_history(result.run_id, "val_accuracy")] == list(range(epochs))
        # The per-step loss logged while the server was down arrived too: as many points as
        # the run without an outage has, at the same steps.
        ref_client = MlflowClient(reference.tracking_uri)
        steps = [m.step for m in ref_client.get_metric_history(reference.run_id, "train_loss_step")]
        assert sorted(m.step for m in client.get_metric_history(result.run_id, "train_loss_step")) == sorted(steps)
        assert client.get_model_version("outage", result.model_version).run_id == result.run_id
        # docs/guide/faults.md's lines, on the driver's console: the first checkpoint the outage
        # kept out of the artifacts, once; the count at the end when more than one was.
        said = [ln for ln in heard.lines if "not logged" in ln]
        assert said and said[0].startswith("[shardline] MLflow unreachable: checkpoint ckpt-"), heard.lines
        assert said[0].endswith("not logged as an artifact, nor those after it while MLflow is down "
                                "(counted at the end)"), said
        assert all(" checkpoints in all not logged as artifacts (each is in training.checkpoint_dir)" in ln
                   for ln in said[1:]) and len(said) <= 2, said
        servers.leave(procs.pop(), port)  # the server brought back, healthy: the next test's
    finally:
        done.set()
        watcher.join()
        for p in procs:
            stop_group(p)


def test_run_with_mlflow_unreachable_is_one_line_before_anything_starts(tmp_path):
    """`shardline run` prepares before it trains: a dead server is said first, in seconds,
    with nothing generated or prepared."""
    proc = shardline_here("run", str(REPO / "jobs" / "configs" / "quickstart.toml"), *absolute_paths(tmp_path),
                          "--set", "tracking.tracking_uri='http://127.0.0.1:9'", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert errors == ["error: tracking.tracking_uri: MLflow at http://127.0.0.1:9 is not reachable "
                      "([Errno 111] Connection refused)"], proc.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_the_drivers_last_calls_wait_for_a_server_that_went_away(monkeypatch):
    """After training the driver's own calls (curves, model, version) are tried again while the
    server is unreachable: answered once it is back, one line naming the checkpoint if never."""
    from mlflow.tracking import MlflowClient

    from shardline.foundation.errors import ShardlineError
    from shardline.training.mlflow_outage import when_reachable

    # Each failing call is the real client's, attempts and all, without its sleeps between
    # them (2-5 s a call here; minutes under MLflow's own defaults when no training ran first).
    for k, v in NO_BACKOFF.items():
        monkeypatch.setenv(k, v)
    nobody = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    attempts = []

    def down_twice():  # the real client's failure twice, then an answer
        attempts.append(1)
        if len(attempts) <= 2:
            return MlflowClient(nobody).search_experiments()
        return "answered"

    assert when_reachable(down_twice, nobody, wait_s=300, checkpoint="ck", retry_s=0.1) == "answered"
    assert len(attempts) == 3
    with pytest.raises(ShardlineError) as gone:
        when_reachable(lambda: MlflowClient(nobody).search_experiments(), nobody, wait_s=0, checkpoint="/ck/ckpt-1.pt")
    assert str(gone.value).startswith(f"tracking.tracking_uri: MLflow at {nobody} has been unreachable")
    assert "the trained weights are in checkpoint /ck/ckpt-1.pt, the model is not registered" in str(gone.value)
    with pytest.raises(ValueError):  # not an outage: raised at once, not retried
        when_reachable(lambda: int("x"), nobody, wait_s=300, checkpoint=None, retry_s=0.1)


def test_a_server_gone_for_good_ends_in_the_jobs_one_line_after_saying_it_waits(prepared, servers, tmp_path,
                                                                                monkeypatch, capfd):
    """The server dies during training and never comes back: the driver says it waits (not a
    silent minute), then ends in its one line, not in MLflow's failure to close the run."""
    from shardline.foundation.errors import ShardlineError

    for k, v in NO_BACKOFF.items():
        monkeypatch.setenv(k, v)
    proc, port = servers.running()
    cfg = _cfg(tmp_path / "gone", epochs=2, world_size=1)
    killed = tmp_path / "server-killed"
    done = threading.Event()

    def kill_after_first_checkpoint() -> None:
        while not done.is_set() and not CheckpointStore(cfg.checkpoint_dir).paths():
            time.sleep(0.02)
        stop_group(proc)
        killed.write_text("down")

    watcher = threading.Thread(target=kill_after_first_checkpoint)
    watcher.start()
    try:
        with pytest.raises(ShardlineError) as gone:
            run_training(cfg, TrackingConfig(tracking_uri=f"http://127.0.0.1:{port}", experiment="gone",
                                             registered_model="gone", outage_wait_s=2),
                         prepared.dataset_dir, LocalEngine(), epoch_hook=functools.partial(hold_until_exists, str(killed)))
    finally:
        done.set()
        watcher.join()
        stop_group(proc)
    line = str(gone.value)
    assert "\n" not in line and line.startswith(f"tracking.tracking_uri: MLflow at http://127.0.0.1:{port} "
                                                "has been unreachable since training was running"), line
    newest = CheckpointStore(cfg.checkpoint_dir).latest()
    assert f"the trained weights are in checkpoint {newest}, the model is not registered" in line
    err = capfd.readouterr().err
    assert f"[shardline] training is done; MLflow at http://127.0.0.1:{port} is unreachable" in err, err[-3000:]
    assert "waiting up to" in err and f"the trained weights are in checkpoint {newest}" in err
