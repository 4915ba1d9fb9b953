"""Bad storage input through the real CLI: one line, non-zero exit, before any engine starts,
nothing written. Credentials are checked for real: a second S3 server runs with moto's IAM
authentication on, with an admin and a read-only user. Every case that reaches an S3
endpoint runs the CLI in a process of its own, with its own AWS variables (this process
caches its S3 clients); the refusals that read no bucket run in the test's process.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from .conftest import shardline, shardline_here
from .fixtures_s3 import AWS_ENV, free_port, start_moto, stop_group

ENGINE_STARTED = ("Starting Spark", "Starting Dask")


@pytest.fixture(scope="module")
def iam_s3(tmp_path_factory):
    """A moto server that checks signatures and IAM policies: (endpoint, admin env, read-only env)."""
    import boto3

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    # The first 4 requests (the IAM setup below) are let through; every later one is checked.
    proc = start_moto(port, tmp_path_factory.mktemp("moto-iam") / "moto.log", {"INITIAL_NO_AUTH_ACTION_COUNT": "4"})
    try:
        iam = boto3.client("iam", endpoint_url=endpoint, region_name="us-east-1",
                           aws_access_key_id="setup", aws_secret_access_key="setup")
        allow_all = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
        iam.create_user(UserName="admin")
        admin = iam.create_access_key(UserName="admin")["AccessKey"]
        iam.put_user_policy(UserName="admin", PolicyName="all", PolicyDocument=json.dumps(allow_all))
        iam.create_user(UserName="reader")
        admin_env = {**AWS_ENV, "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": admin["AccessKeyId"],
                     "AWS_SECRET_ACCESS_KEY": admin["SecretAccessKey"]}
        as_admin = {"endpoint_url": endpoint, "region_name": "us-east-1",
                    "aws_access_key_id": admin["AccessKeyId"], "aws_secret_access_key": admin["SecretAccessKey"]}
        reader = boto3.client("iam", **as_admin).create_access_key(UserName="reader")["AccessKey"]
        read_only = {"Version": "2012-10-17", "Statement": [
            {"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket"], "Resource": "*"}]}
        boto3.client("iam", **as_admin).put_user_policy(
            UserName="reader", PolicyName="read", PolicyDocument=json.dumps(read_only))
        boto3.client("s3", **as_admin).create_bucket(Bucket="guarded")
        reader_env = {**admin_env, "AWS_ACCESS_KEY_ID": reader["AccessKeyId"],
                      "AWS_SECRET_ACCESS_KEY": reader["SecretAccessKey"]}
        yield endpoint, admin_env, reader_env
    finally:
        stop_group(proc)


def _config(tmp: Path, **sections) -> Path:
    lines = []
    for section, fields in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in fields.items()]
    path = tmp / "job.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _one_line(proc, code: int, fragment: str) -> str:
    """The error: one line (a stage's progress line may precede it), no traceback, no engine."""
    assert proc.returncode == code, proc.stderr
    errors = [ln for ln in proc.stderr.strip().splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and fragment in errors[0] and "Traceback" not in proc.stderr, proc.stderr
    assert not any(s in proc.stderr for s in ENGINE_STARTED), proc.stderr
    return errors[0]


def _cli_without_aws(*args, cwd: Path, env: dict):
    """The CLI with no AWS variable but those in `env` (the session's are dropped)."""
    import os
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != "MLFLOW_TRACKING_URI"}
    return subprocess.run([sys.executable, "-m", "shardline.jobs.cli", *args], cwd=cwd, env={**base, **env},
                          capture_output=True, text=True, timeout=600)


def _bucket_keys(env: dict, bucket: str) -> list[str]:
    import boto3

    s3 = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                      aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
    return [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]


def _prepare_config(tmp: Path, dataset_dir: str) -> Path:
    return _config(tmp, pipelines={"dataset_dir": dataset_dir},
                   **{"pipelines.source": {"format": "parquet", "path": str(tmp / "raw")}})


@pytest.mark.slow
def test_unreachable_endpoint(s3, tmp_path):
    """Full tier only (`make test-all`, marker `slow`): the CLI in a process of its own."""
    closed = f"http://127.0.0.1:{free_port()}"
    proc = shardline("prepare", str(_prepare_config(tmp_path, "s3://any-bucket/ds")), cwd=tmp_path,
                     env={"AWS_ENDPOINT_URL": closed})
    line = _one_line(proc, 1, f"pipelines.dataset_dir: s3://any-bucket/ds: cannot reach the S3 endpoint {closed}")
    assert "AWS_ENDPOINT_URL" in line
    assert [p.name for p in tmp_path.iterdir()] == ["job.toml"]


@pytest.mark.slow
def test_missing_bucket(s3, tmp_path):
    """Full tier only (`make test-all`, marker `slow`): the CLI in a process of its own."""
    proc = shardline("prepare", str(_prepare_config(tmp_path, "s3://no-such-bucket/ds")), cwd=tmp_path)
    _one_line(proc, 1, "pipelines.dataset_dir: s3://no-such-bucket/ds: bucket 'no-such-bucket' does not exist")


@pytest.mark.slow
def test_no_credentials(iam_s3, tmp_path):
    """Full tier only (`make test-all`, marker `slow`): the CLI in a process of its own."""
    endpoint, admin, _ = iam_s3
    # Nothing in the environment, no ~/.aws files to fall back on, no instance metadata.
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_DEFAULT_REGION": "us-east-1", "HOME": str(tmp_path),
           "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
           "AWS_EC2_METADATA_DISABLED": "true"}
    proc = _cli_without_aws("prepare", str(_prepare_config(tmp_path, "s3://guarded/ds")), cwd=tmp_path, env=env)
    _one_line(proc, 1, "s3://guarded/ds: no AWS credentials found")
    assert _bucket_keys(admin, "guarded") == []


@pytest.mark.slow
def test_wrong_credentials(iam_s3, tmp_path):
    """Full tier only (`make test-all`, marker `slow`): the CLI in a process of its own."""
    endpoint, admin, _ = iam_s3
    env = {**admin, "AWS_SECRET_ACCESS_KEY": "not-the-secret"}
    proc = shardline("prepare", str(_prepare_config(tmp_path, "s3://guarded/ds")), cwd=tmp_path, env=env)
    _one_line(proc, 1, "s3://guarded/ds: the AWS credentials were rejected (SignatureDoesNotMatch)")


@pytest.mark.slow
def test_access_denied_on_write(iam_s3, tmp_path):
    """Full tier only (`make test-all`, marker `slow`): the CLI in a process of its own."""
    endpoint, admin, reader = iam_s3
    (tmp_path / "raw").mkdir()
    proc = shardline("prepare", str(_prepare_config(tmp_path, "s3://guarded/ds")), cwd=tmp_path, env=reader)
    _one_line(proc, 1, "pipelines.dataset_dir: s3://guarded/ds: access denied: these credentials may not write here")
    assert _bucket_keys(admin, "guarded") == []
    # The same credentials may read: listing is allowed, only the write is refused.
    proc = shardline("score", str(_config(tmp_path, serving={"output_dir": "s3://guarded/scores"})),
                     "--model", "models:/m/1", "--input", "s3://guarded/ds", cwd=tmp_path, env=reader)
    _one_line(proc, 1, "serving.output_dir: s3://guarded/scores: access denied")
    assert _bucket_keys(admin, "guarded") == []


@pytest.mark.parametrize(
    "args, setting",
    [
        (("train", "--set", "spark.master='spark://10.1.2.3:7077'"), "training.checkpoint_dir = 'ckpt'"),
        (("prepare", "--set", "dask.address='tcp://10.1.2.3:8786'", "--engine", "dask"),
         "pipelines.source.path = 'raw'"),
        (("score", "--model", "models:/m/1", "--output", "scores", "--engine", "dask",
          "--set", "dask.address='tcp://10.1.2.3:8786'"), "serving.output_dir = 'scores'"),
    ],
)
def test_relative_path_on_a_cluster_says_what_to_use(tmp_path, args, setting):
    # Only the paths a command uses are checked: train never reads the raw source.
    config = _config(tmp_path, pipelines={"dataset_dir": "s3://b/ds"}, training={"checkpoint_dir": "ckpt"},
                     **{"pipelines.source": {"path": "raw"}})
    proc = shardline_here(args[0], str(config), *args[1:], cwd=tmp_path)
    line = _one_line(proc, 2, f"error: {setting} is a relative path")
    assert "runs tasks on other hosts" in line and "s3://bucket/prefix" in line
    assert [p.name for p in tmp_path.iterdir()] == ["job.toml"]


def test_relative_sqlite_tracking_on_a_cluster_says_to_use_a_server(tmp_path):
    config = _config(tmp_path, pipelines={"dataset_dir": "s3://b/ds"}, training={"checkpoint_dir": "s3://b/ckpt"},
                     tracking={"tracking_uri": "sqlite:///mlflow.db"})
    proc = shardline_here("train", str(config), "--set", "spark.master='spark://10.1.2.3:7077'", cwd=tmp_path)
    line = _one_line(proc, 2, "tracking.tracking_uri = 'sqlite:///mlflow.db' is a SQLite file relative to this folder")
    assert "use an MLflow tracking server" in line
    assert [p.name for p in tmp_path.iterdir()] == ["job.toml"]


def test_local_paths_on_a_cluster_get_a_note(tmp_path):
    """Absolute local paths are the user's call on a cluster (a shared filesystem): said once."""
    config = _config(tmp_path, pipelines={"dataset_dir": str(tmp_path / "missing")},
                     training={"checkpoint_dir": str(tmp_path / "ckpt")})
    # A misspelt model stops the job right after the note, before Spark would try the master.
    proc = shardline_here("train", str(config), "--set", "spark.master='spark://10.1.2.3:7077'",
                          "--set", "training.model=nope", cwd=tmp_path)
    assert proc.returncode == 2 and "unknown model 'nope'" in proc.stderr, proc.stderr
    notes = [ln for ln in proc.stderr.splitlines() if ln.startswith("[shardline] note:")]
    assert len(notes) == 1 and "pipelines.dataset_dir, training.checkpoint_dir and tracking.tracking_uri " \
        "are paths on this machine: every host must see them" in notes[0], proc.stderr


@pytest.mark.parametrize("bad", ["../outside/shard-00000.parquet", "/etc/passwd", "s3://elsewhere/x.parquet"])
def test_manifest_shard_paths_outside_the_dataset_are_refused(prepared, tmp_path, bad):
    from shardline.pipelines.manifest import load_manifest, manifest_url

    src = load_manifest(prepared.dataset_dir)
    dataset = tmp_path / "ds"
    shutil.copytree(prepared.dataset_dir, dataset)
    raw = json.loads(Path(manifest_url(prepared.dataset_dir, src.sequence)).read_text())
    raw["splits"]["train"]["shards"][1]["path"] = bad
    Path(manifest_url(str(dataset), src.sequence)).write_text(json.dumps(raw))
    config = _config(tmp_path, pipelines={"dataset_dir": str(dataset)}, training={"checkpoint_dir": str(tmp_path / "c")})
    proc = shardline_here("train", str(config), "--launcher", "local", cwd=tmp_path)
    _one_line(proc, 1, f"invalid manifest at splits.train.shards.1.path: shard path {bad!r} is not a "
                       f"relative path inside the dataset")
    assert not (tmp_path / "c").exists()
