"""Secrets in URIs never reach the terminal, the logs or MLflow (issue #40)."""

from __future__ import annotations

import re

import pytest

from shardline.foundation.errors import ShardlineError
from shardline.foundation.redact import redact
from shardline.training.launchers import free_port
from shardline.training.tracking import check_reachable
from tests.conftest import shardline_here


@pytest.mark.parametrize(
    "uri, shown",
    [
        ("postgresql://u:secret@db.example:5432/mlflow", "postgresql://u:***@db.example:5432/mlflow"),
        ("mysql+pymysql://root:secret@db/optuna", "mysql+pymysql://root:***@db/optuna"),
        ("https://alice:se%40cret@mlflow.example/", "https://alice:***@mlflow.example/"),
        ("https://h/api?user=a&password=secret&x=1", "https://h/api?user=a&password=***&x=1"),
        ("https://h/x?token=secret", "https://h/x?token=***"),
        ("https://acct.blob/c/f?sv=1&sig=secret", "https://acct.blob/c/f?sv=1&sig=***"),
        ("s3://b/k?X-Amz-Signature=secret&X-Amz-Security-Token=secret", "s3://b/k?X-Amz-Signature=***&X-Amz-Security-Token=***"),
        ("sc://h:15002/;token=secret;user_id=me", "sc://h:15002/;token=***;user_id=me"),
        # A bare token as the whole user part (issue #46); a user name alone looks the same.
        ("https://secret@git.example/org/repo.git", "https://***@git.example/org/repo.git"),
        ("http://user@host/", "http://***@host/"),
    ],
)
def test_redact_masks_the_secret_and_keeps_the_rest(uri, shown):
    assert redact(uri) == shown
    message = f"tracking.tracking_uri: MLflow at {uri} is not reachable (refused)"
    assert redact(message) == f"tracking.tracking_uri: MLflow at {shown} is not reachable (refused)"


@pytest.mark.parametrize(
    "text",
    ["sqlite:////tmp/mlflow.db", "http://127.0.0.1:5000", "s3://bucket/data/part-0.parquet",
     "training.lr = 0.1", "https://h/a:b/c@d", "git@github.com:org/repo.git",
     "abfs://container@acct.dfs.core.windows.net/p", "wasbs://container@acct.blob.core.windows.net/p"],
)
def test_redact_leaves_uris_without_secrets_alone(text):
    assert redact(text) == text


def test_errors_and_displayed_urls_are_masked_where_they_are_made():
    """A Python caller sees the error as made (its traceback, a notebook), not the CLI's
    last line: the text is masked in the exception itself, and in storage.display."""
    from shardline.foundation import storage
    from shardline.foundation.errors import DataError

    e = DataError("s3://AKIA:secret@bucket/data: no rows; also https://secret@h/x and ?token=secret")
    assert "secret" not in str(e) and "secret" not in repr(e) and "secret" not in str(e.args)
    assert str(e) == "s3://AKIA:***@bucket/data: no rows; also https://***@h/x and ?token=***"
    assert storage.display("https://secret@host/data?sig=secret") == "https://***@host/data?sig=***"
    assert storage.display("/data/raw/a.csv") == "/data/raw/a.csv"


def test_unreachable_tracking_server_error_hides_the_password():
    uri = f"http://u:secret@127.0.0.1:{free_port()}"
    with pytest.raises(ShardlineError) as e:
        check_reachable(uri, timeout_s=30)
    assert "secret" not in str(e.value) and "u:***@127.0.0.1" in str(e.value)


def test_cli_never_prints_the_password_of_a_tracking_uri(tmp_path):
    """`shardline ui` on a server that does not answer fails at once, naming the URI."""
    port = free_port()
    proc = shardline_here("ui", "--set", f"tracking.tracking_uri='http://u:secret@127.0.0.1:{port}'", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert f"u:***@127.0.0.1:{port}" in proc.stderr, proc.stderr
    assert "secret" not in proc.stderr + proc.stdout


def test_cli_error_lines_are_redacted_whatever_raised_them(tmp_path):
    """The CLI's last line masks secrets even in a message no call site thought of."""
    store = tmp_path / "nowhere" / "mlflow.db"
    proc = shardline_here("ui", "--set", f"tracking.tracking_uri='sqlite:///{store}?password=secret'", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "password=***" in proc.stderr and "secret" not in proc.stderr + proc.stdout, proc.stderr


@pytest.mark.slow
def test_train_on_a_server_whose_uri_has_a_user_and_password(prepared, mlflow_server, tmp_path):
    """#46: `http://u:pw@host:port` was refused ("Name or service not known": urllib took
    `u:pw@127.0.0.1` for the host) although MLflow's client takes it; MLflow's own "View
    run" lines then printed the password. The real CLI in a process of its own, so that
    every line of the driver and its ranks is seen."""
    from mlflow.tracking import MlflowClient

    from tests.conftest import shardline

    uri = mlflow_server.replace("http://", "http://u:pw@")
    (tmp_path / "job.toml").write_text(
        f"[pipelines]\ndataset_dir = '{prepared.dataset_dir}'\n"
        f"[training]\nlauncher = 'local'\nworld_size = 2\nepochs = 1\nbatch_size = 64\nhidden = [16]\n"
        f"checkpoint_dir = '{tmp_path / 'ckpt'}'\n"
        f"[tracking]\ntracking_uri = '{uri}'\nexperiment = 'credentials'\nregistered_model = 'credentials'\n"
    )
    proc = shardline("train", "job.toml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pw" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    [run_id] = re.findall(r"^  run (\w+); model models:/credentials/\d+$", proc.stdout + proc.stderr, re.M)
    assert MlflowClient(mlflow_server).get_run(run_id).info.status == "FINISHED"


def test_the_json_result_masks_the_tracking_uri():
    """`--json` prints the result's to_dict(): the URI there is masked, the object keeps it."""
    from shardline.api import TrainResult

    r = TrainResult("id", "models:/m/1", "m", "1", "http://u:pw@127.0.0.1:5000", {}, "/c", "local")
    assert r.to_dict()["tracking_uri"] == "http://u:***@127.0.0.1:5000"
    assert r.tracking_uri == "http://u:pw@127.0.0.1:5000"
