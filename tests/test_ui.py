"""`shardline ui`: a real MLflow server on a real store, loaded in headless Chromium."""

from __future__ import annotations

import json
import shlex
import socket
import shutil
import subprocess
import sys
import urllib.request

import mlflow
import pytest

from shardline.jobs.ui import ui_hint
from tests.conftest import shardline_here
from tests.fixtures_clusters import _start, _stop, _wait
from shardline.training.launchers import free_port

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _log_run(store: str) -> tuple[str, str]:
    client = mlflow.MlflowClient(tracking_uri=store)
    experiment = client.create_experiment("ui-check")
    run = client.create_run(experiment, run_name="ui-check-run")
    client.log_param(run.info.run_id, "lr", "0.1")
    client.log_metric(run.info.run_id, "val_accuracy", 0.875)
    client.set_terminated(run.info.run_id)
    return experiment, run.info.run_id


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
            return r.status == 200
    except OSError:
        return False


def _rendered(url: str, profile) -> str:
    """The page's DOM after its scripts ran and their requests answered (virtual time waits
    for pending fetches, so a slow server delays the dump instead of emptying it)."""
    out = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         f"--user-data-dir={profile}", "--virtual-time-budget=30000", "--dump-dom", url],
        capture_output=True, text=True, timeout=300,
    )
    return out.stdout


@pytest.mark.slow
def test_ui_shows_the_run_in_chromium(tmp_path):
    if CHROMIUM is None:
        pytest.fail("no chromium on PATH: `apt-get install -y chromium` (`make test-all` does it as root)")
    store = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    (tmp_path / "store").mkdir()
    experiment, run_id = _log_run(store)

    # Exactly what the run summary tells the user to type (from another folder: the long form).
    hint = ui_hint(store)
    assert hint.startswith("shardline ui --set tracking.tracking_uri=")
    port = free_port()
    log = tmp_path / "ui.log"
    proc = _start([sys.executable, "-m", "shardline.jobs.cli", *shlex.split(hint)[1:], "--port", str(port)], log)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: _healthy(url), "shardline ui", [proc], [log])
        # Loopback by default: the server bound 127.0.0.1, not every interface.
        listening = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True).stdout
        assert [line.split()[3] for line in listening.splitlines()] == [f"127.0.0.1:{port}"], listening

        with urllib.request.urlopen(f"{url}/api/2.0/mlflow/runs/get?run_id={run_id}", timeout=30) as r:
            assert json.loads(r.read())["run"]["info"]["run_name"] == "ui-check-run"

        page = f"{url}/#/experiments/{experiment}/runs/{run_id}"
        dom = ""
        for attempt in range(3):  # a loaded machine may dump before the run's data arrived
            dom = _rendered(page, tmp_path / f"chromium{attempt}")
            if "ui-check-run" in dom and "val_accuracy" in dom:
                break
        assert "ui-check-run" in dom and "val_accuracy" in dom, dom[-2000:]

        # A server URL as the store: the server is the UI; `shardline ui` checks it and says so.
        served = shardline_here("ui", "--set", f"tracking.tracking_uri='{url}'", cwd=tmp_path)
        assert served.returncode == 0, served.stderr
        assert f"open {url}" in served.stderr
        assert ui_hint(url) == url
    finally:
        _stop([proc])


def test_ui_refuses_a_missing_store(tmp_path):
    """Run from the wrong folder: one line naming the setting, not an empty UI."""
    proc = shardline_here("ui", cwd=tmp_path)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "tracking.tracking_uri" in lines[0] and "no MLflow store" in lines[0], proc.stderr
    assert not (tmp_path / "mlflow.db").exists()


def test_ui_refuses_an_unreachable_server_and_a_busy_port(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    proc = shardline_here("ui", "--set", f"tracking.tracking_uri='{dead}'", cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and dead in proc.stderr and "/health" in proc.stderr, proc.stderr

    (tmp_path / "mlflow.db").write_bytes(b"")  # a store exists; the port is the problem

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = shardline_here("ui", "--port", str(port), cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and f"--port {port}" in proc.stderr, proc.stderr


def test_summary_hint_is_the_short_form_for_this_folders_store(tmp_path, monkeypatch):
    """`shardline run` in a folder with the default store tells the user `shardline ui`,
    which opens exactly that store from there (the Chromium test runs the long form)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert ui_hint(store) == "shardline ui"
    proc = shardline_here("ui", cwd=tmp_path)  # no store yet: the error names the same file
    assert proc.returncode == 1 and repr(store) in proc.stderr, proc.stderr
