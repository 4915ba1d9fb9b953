"""spark-submit conventions: the user's Spark settings survive shardline's defaults.

A user's `spark.ui.enabled` and `spark.sql.shuffle.partitions`, given with
spark-submit `--conf` or in `spark-defaults.conf`, are what the running Spark
has; shardline fills in only what nobody set. Each case about how a JVM starts runs its
own in a subprocess, as a user's command would; a session setting is set on the session's.
A JVM costs ~15 s: cases that can share one do (one spark-submit runs two shardline
commands and reports its settings; one driver checks the user's sources and shardline's
fill-ins together).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardline.training.launchers import free_port

from .conftest import REPO, TEST_JVM_OPTS, absolute_paths, shardline, small_pipeline
from .mlflow_store import empty_store

BIN = Path(sys.executable).parent
QUICKSTART = REPO / "jobs" / "configs" / "quickstart.toml"
LOG4J = REPO / "shardline" / "foundation" / "log4j2.properties"
KEYS = [
    "spark.ui.enabled", "spark.sql.shuffle.partitions", "spark.sql.execution.arrow.maxRecordsPerBatch",
    "spark.ui.showConsoleProgress", "spark.master", "spark.sql.execution.arrow.pyspark.enabled",
]
# A driver that starts Spark through shardline's session factory and reports what Spark has.
# Before that, the shardline commands (JSON list of argument lists, argv[4]) run in this
# process, as jobs/spark_submit.py runs one (it is `jobs.cli.main()`): their exit codes and
# output under "cli".
DRIVER = f"""
import json, os, socket, sys
sys.path.insert(0, {str(REPO / "tests")!r})
from cli_inprocess import run_cli
from shardline.foundation.engine_config import SparkConfig
from shardline.foundation.sessions import spark_session
cli = [run_cli(args, os.getcwd()) for args in json.loads(sys.argv[4] if sys.argv[4:] else "[]")]
spark = spark_session(SparkConfig.model_validate(json.loads(sys.argv[1])))
out = {{k: spark.conf.get(k, None) for k in {KEYS!r}}}
out["cli"] = cli
with socket.socket() as s:  # the web UI, if Spark runs one, listens on spark.ui.port
    out["ui_listening"] = s.connect_ex(("127.0.0.1", int(sys.argv[2]))) == 0
def jvm_env(batches):  # Python workers inherit the JVM's environment
    import os, pandas as pd
    for _ in batches:
        yield pd.DataFrame({{"ip": [os.environ.get("SPARK_LOCAL_IP", "")]}})
if sys.argv[3] == "--workers":  # a Python worker's start: only the case that checks it pays it
    out["jvm_SPARK_LOCAL_IP"] = spark.range(1).mapInPandas(jvm_env, "ip string").collect()[0]["ip"]
out["driver_SPARK_LOCAL_IP"] = __import__("os").environ.get("SPARK_LOCAL_IP")
print("RESULT " + json.dumps(out), flush=True)
spark.stop()
"""


def _env(tmp: Path, conf_lines: list[str] | None = None) -> dict:
    conf_dir = tmp / "conf"
    conf_dir.mkdir(exist_ok=True)
    (conf_dir / "spark-defaults.conf").write_text("\n".join(conf_lines or []) + "\n")
    env = {k: v for k, v in os.environ.items() if k != "SPARK_LOCAL_IP"}
    # A user's SPARK_SUBMIT_OPTS: the suite's JVM flags only (conftest.TEST_JVM_OPTS).
    return {**env, "SPARK_CONF_DIR": str(conf_dir), "PYSPARK_PYTHON": sys.executable,
            "PYSPARK_DRIVER_PYTHON": sys.executable, "SPARK_SUBMIT_OPTS": TEST_JVM_OPTS}


def _run(cmd: list[str], tmp: Path, env: dict) -> tuple[dict, subprocess.CompletedProcess]:
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(result.removeprefix("RESULT ")), proc


def _submit_shardline(tmp: Path, spark_args: list[str], *shardline_args: str) -> subprocess.CompletedProcess:
    """`spark-submit SPARK_ARGS jobs/spark_submit.py SHARDLINE_ARGS` on the quickstart config."""
    cmd = [str(BIN / "spark-submit"), *spark_args, str(REPO / "jobs" / "spark_submit.py"),
           shardline_args[0], str(QUICKSTART), *shardline_args[1:]]
    return subprocess.run(cmd, cwd=tmp, env=_env(tmp), capture_output=True, text=True, timeout=600)


def _error_lines(text: str) -> list[str]:
    # spark-submit merges the Python driver's stderr into its stdout.
    return [ln for ln in text.splitlines() if ln.startswith("error:")]


def _driver(tmp: Path) -> Path:
    script = tmp / "driver.py"
    script.write_text(DRIVER)
    return script


@pytest.mark.slow
def test_spark_submit_conf_and_spark_defaults_conf_win_over_shardlines_defaults(prepared, tmp_path):
    """One spark-submit JVM for both of the user's sources: the UI from spark-defaults.conf,
    the shuffle partitions from --conf, which also beats the file's value (Spark's own order);
    shardline's value only where nobody set one. The same JVM runs two shardline commands
    first, each refused by name before it does anything: a JVM setting only the config names
    (spark-submit started the JVM, it can no longer apply), and spark.task.cpus leaving fewer
    task slots than ranks (a prepared dataset and a batch it trains with: those are checked
    before Spark starts).

    Full tier only (`make test-all`, marker `slow`): a spark-submit JVM of its own.
    """
    ui = free_port()
    env = _env(tmp_path, ["spark.ui.enabled true", f"spark.ui.port={ui}", "spark.sql.shuffle.partitions : 5"])
    commands = [
        ["prepare", str(QUICKSTART), "--set", "spark.conf={'spark.ui.showConsoleProgress' = 'true'}"],
        ["train", str(QUICKSTART), "--set", f"training.checkpoint_dir='{tmp_path / 'ckpt'}'",
         "--set", f"pipelines.dataset_dir='{prepared.dataset_dir}'", "--set", "training.batch_size=256"],
    ]  # fmt: skip
    cmd = [
        str(BIN / "spark-submit"), "--master", "local[2]", "--conf", "spark.task.cpus=2",
        "--conf", "spark.sql.shuffle.partitions=7",
        # The documented form for what must be set before the JVM starts (README).
        "--driver-java-options", f"-Dlog4j2.configurationFile=file:{LOG4J}",
        str(_driver(tmp_path)), "{}", str(ui), "-", json.dumps(commands),
    ]  # fmt: skip
    got, proc = _run(cmd, tmp_path, env)
    (prep_code, prep_out, prep_err), (train_code, train_out, train_err) = got["cli"]
    assert prep_code == 2, prep_out[-2000:] + prep_err[-2000:]
    assert _error_lines(prep_out + prep_err) == [
        "error: spark.conf.spark.ui.showConsoleProgress: a JVM setting cannot be set once spark-submit "
        "has started Spark; pass it to spark-submit as --conf spark.ui.showConsoleProgress=true"
    ], prep_err[-2000:]
    assert train_code == 1, train_out[-2000:] + train_err[-2000:]
    assert _error_lines(train_out + train_err) == [
        "error: training.world_size 2 is greater than the 1 task slots of Spark master local[2] "
        "(spark.task.cpus=2): a barrier stage needs them all at once"
    ], train_err[-2000:]
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "shardline-data").exists()
    assert got["spark.ui.enabled"] == "true" and got["ui_listening"], got  # spark-defaults.conf's
    assert got["spark.sql.shuffle.partitions"] == "7"  # --conf's (shardline's is 4, the file's 5)
    assert got["spark.sql.execution.arrow.maxRecordsPerBatch"] == "65536"  # unset: shardline's
    assert got["spark.master"] == "local[2]"
    jvm_output = [ln for ln in (proc.stdout + proc.stderr).splitlines() if not ln.startswith("RESULT ")]
    assert not [ln for ln in jvm_output if " INFO " in ln], jvm_output[-20:]  # the log4j configuration took effect


@pytest.mark.slow
def test_user_settings_win_and_shardline_fills_in_the_rest_when_shardline_starts_spark(tmp_path):
    """One JVM started by shardline's session factory: the user's site file sets a JVM
    setting and a session setting (they win), the job's [spark].conf beats the file, and
    shardline's defaults fill in what nobody set, of both kinds.

    Full tier only (`make test-all`, marker `slow`): a Python and JVM of its own.
    """
    ui = free_port()
    env = _env(tmp_path, [
        "# the user's site settings", f"spark.ui.port {ui}", "spark.ui.showConsoleProgress   true",
        "spark.sql.execution.arrow.pyspark.enabled=false", "spark.sql.execution.arrow.maxRecordsPerBatch 1000",
    ])  # fmt: skip
    # [spark].conf is this job's own config: it wins over the site's spark-defaults.conf.
    cfg = {"conf": {"spark.sql.execution.arrow.maxRecordsPerBatch": "2000"}}
    got, proc = _run([sys.executable, str(_driver(tmp_path)), json.dumps(cfg), str(ui), "--workers"], tmp_path, env)
    assert got["spark.ui.showConsoleProgress"] == "true", got  # the file's JVM setting (shardline's: false)
    assert got["spark.sql.execution.arrow.pyspark.enabled"] == "false"  # the file's session setting (shardline's: true)
    assert got["spark.sql.execution.arrow.maxRecordsPerBatch"] == "2000"
    # Nobody set these: shardline's.
    assert got["spark.ui.enabled"] == "false" and not got["ui_listening"], got
    assert got["spark.sql.shuffle.partitions"] == "4"
    assert got["spark.master"] == "local[2,4]"  # local mode retries tasks (spark_setup.local_with_retries)
    # Set where the JVM reads them when it starts: the bind address (put back in this
    # process afterwards), and the log4j configuration (quiet).
    assert got["jvm_SPARK_LOCAL_IP"] == "127.0.0.1" and got["driver_SPARK_LOCAL_IP"] is None
    assert " INFO " not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_a_missing_archive_under_spark_submit_is_one_line_naming_it(tmp_path):
    """A SparkContext that cannot start (here: `--archives` names no file) was a Py4J
    traceback; now one line with Java's own cause, exit 2, and no dataset written.

    Full tier only (`make test-all`, marker `slow`): a spark-submit JVM of its own.
    """
    missing = tmp_path / "nowhere" / "env.tar.gz"
    proc = _submit_shardline(
        tmp_path, ["--master", "local[1]", "--archives", f"{missing}#env"],
        "prepare", *absolute_paths(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert _error_lines(proc.stdout) == [
        f"error: spark-submit: Spark could not start (java.nio.file.NoSuchFileException: {missing}); "
        "check the files and settings given to it (--archives, --files, --py-files, --jars, --conf)"
    ], proc.stdout[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not any(tmp_path.rglob("*.parquet"))


# The shardline commands (JSON list of argument lists, argv[1]) run one after the other in
# one process, as `shardline` runs one (tests/cli_inprocess.py): their exit codes and output
# printed as JSON. Each command starts its own SparkContext, with its own settings: the one
# before it is stopped (the CLI leaves its session running, for the process's exit to stop).
COMMANDS_ON_ONE_JVM = f"""
import json, os, sys
sys.path.insert(0, {str(REPO / "tests")!r})
from cli_inprocess import run_cli
from pyspark.sql import SparkSession
out = []
for args in json.loads(sys.argv[1]):
    out.append(run_cli(args, os.getcwd()))
    if SparkSession.getActiveSession() is not None:
        SparkSession.getActiveSession().stop()
print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def refused_on_the_cluster(prepared, spark_standalone, tmp_path_factory) -> dict:
    """Two training commands refused on the session's standalone cluster, run in ONE
    Python and JVM (each costs ~15 s): first the one Spark's own barrier check refuses
    (it needs the cluster's executors), then one with dynamic allocation (refused before
    any executor starts). {name: (exit code, stdout, stderr, tmp)}."""
    tmp = tmp_path_factory.mktemp("refused-on-cluster")
    master = spark_standalone.master
    data = ["--set", f"pipelines.dataset_dir='{prepared.dataset_dir}'", "--set", "training.batch_size=256"]
    commands = {
        # Nothing in the settings bounds the cluster's slots (no spark.cores.max). One try
        # of Spark's check, 1 s after the first (a user's value wins, as every user conf does;
        # shardline's defaults are 15 tries 2 s apart, Spark's own 40 tries 15 s apart): the
        # message is the same. The cluster has 2 one-core workers; three ranks, one a
        # parameter server, so the dataset's 2 shards feed the 2 data ranks.
        "fewer_slots": [
            "train", str(QUICKSTART), "--set", f"spark.master='{master}'",
            "--set", "spark.conf={'spark.driver.host' = '127.0.0.1', 'spark.driver.bindAddress' = '127.0.0.1', "
                      "'spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures' = '1', "
                      "'spark.scheduler.barrier.maxConcurrentTasksCheck.interval' = '1s', "
                      f"'spark.executor.extraJavaOptions' = '{spark_standalone.executor_java_opts}'}}",
            "--set", "training.strategy='ps'", "--set", "training.ps.servers=1", "--world-size", "3",
            *data, "--set", f"training.checkpoint_dir='{tmp / 'ckpt-fewer'}'",
        ],
        "dynamic_allocation": [
            "train", str(QUICKSTART),
            "--set", f"spark.master='{master}'",
            "--set", "spark.conf={'spark.dynamicAllocation.enabled' = 'true'}",
            *absolute_paths(tmp), *data, "--set", f"training.checkpoint_dir='{tmp / 'ckpt-dynamic'}'",
        ],
    }  # fmt: skip
    empty_store(tmp)  # the training's default store, without MLflow's migrations
    program = tmp / "commands.py"
    program.write_text(COMMANDS_ON_ONE_JVM)
    env = {**_env(tmp), **spark_standalone.env}
    env.pop("MLFLOW_TRACKING_URI", None)  # as `shardline()`: the default store is cwd's
    proc = subprocess.run([sys.executable, str(program), json.dumps(list(commands.values()))], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    got = json.loads(result.removeprefix("RESULT "))
    return {name: (*r, tmp) for name, r in zip(commands, got, strict=True)}


@pytest.mark.cluster
def test_dynamic_allocation_is_refused_for_training(refused_on_the_cluster):
    """Spark refuses barrier stages under dynamic allocation [SPARK-24942]: say so up front,
    on a real standalone master (the session's), before any task runs."""
    code, _, err, tmp = refused_on_the_cluster["dynamic_allocation"]
    assert code == 1, err[-3000:]
    assert _error_lines(err) == [
        "error: spark.dynamicAllocation.enabled is true: Spark refuses barrier stages (shardline's "
        "training ranks) under dynamic allocation [SPARK-24942]; set it to false for this job"
    ], err[-2000:]
    assert not (tmp / "ckpt-dynamic").exists()


@pytest.mark.cluster
def test_a_cluster_with_fewer_slots_than_ranks_is_one_line_from_sparks_own_check(refused_on_the_cluster,
                                                                                  spark_standalone):
    """Nothing in the settings bounds a standalone cluster's slots, so Spark's own barrier
    check decides (after its tries), and the error names the setting."""
    code, _, err, _ = refused_on_the_cluster["fewer_slots"]
    assert code == 1, err[-3000:]
    assert _error_lines(err) == [
        "error: training.world_size 3: Spark could not give the barrier stage 3 task slots at once "
        f"(Spark master {spark_standalone.master} has fewer)"
    ], err[-2000:]


@pytest.mark.slow
def test_a_standalone_master_nobody_answers_at_is_one_line(tmp_path):
    """Full tier only (`make test-all`, marker `slow`): the CLI in a process of its own."""
    port = free_port()  # nothing listens there: Spark alone would retry, then print a stack
    proc = shardline(
        "prepare", str(QUICKSTART),
        "--set", f"spark.master='spark://127.0.0.1:{port}'", *absolute_paths(tmp_path),
        cwd=tmp_path, env=_env(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert _error_lines(proc.stderr) == [
        f"error: spark.master spark://127.0.0.1:{port}: no Spark master answers there (Connection refused)"
    ], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "shardline-data").exists()


def test_arrow_disabled_for_pandas_conversions_changes_nothing(spark, tmp_path):
    """shardline's stages are mapInArrow/mapInPandas, which use Arrow whatever this says.

    A session (SQL) setting: set on the session's own Spark for one prepare. That a user's
    spark-submit --conf reaches the session is test_spark_submit_conf_and_spark_defaults_conf_win_over_shardlines_defaults'."""
    from shardline.engines import SparkEngine
    from shardline.pipelines.prepare import prepare

    key = "spark.sql.execution.arrow.pyspark.enabled"
    before = spark.conf.get(key)
    spark.conf.set(key, "false")
    try:
        manifest = prepare(SparkEngine(spark), small_pipeline(tmp_path, rows=2000))
    finally:
        spark.conf.set(key, before)
    assert sum(s.rows for s in manifest.splits.values()) == 2000


def test_user_settings_are_read_as_spark_submit_reads_them(tmp_path, monkeypatch):
    """No JVM: the sources shardline reads before starting one, in spark-submit's order."""
    from shardline.foundation.spark_user_conf import user_spark_conf

    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    (conf_dir / "spark-defaults.conf").write_text(
        "# a comment\n! another\nspark.ui.enabled   true\nspark.sql.shuffle.partitions=7\n"
        "spark.driver.extraJavaOptions : -Da=1 \\\n    -Db=2\nnot.spark 1\n"
    )
    (tmp_path / "job.conf").write_text("spark.sql.shuffle.partitions 9\nspark.app.name job\n")
    monkeypatch.setenv("SPARK_CONF_DIR", str(conf_dir))
    monkeypatch.delenv("PYSPARK_SUBMIT_ARGS", raising=False)
    assert user_spark_conf() == {
        "spark.ui.enabled": "true", "spark.sql.shuffle.partitions": "7",
        "spark.driver.extraJavaOptions": "-Da=1 -Db=2",
    }  # fmt: skip
    monkeypatch.setenv(
        "PYSPARK_SUBMIT_ARGS",
        "--master local[3] --conf spark.ui.enabled=false --conf=spark.ui.port=4321 pyspark-shell",
    )
    got = user_spark_conf()
    assert (got["spark.master"], got["spark.ui.enabled"], got["spark.ui.port"]) == ("local[3]", "false", "4321")
    # --properties-file replaces spark-defaults.conf, unless --load-spark-defaults (it wins then).
    monkeypatch.setenv("PYSPARK_SUBMIT_ARGS", f"--properties-file {tmp_path / 'job.conf'} pyspark-shell")
    assert user_spark_conf() == {"spark.sql.shuffle.partitions": "9", "spark.app.name": "job"}
    monkeypatch.setenv(
        "PYSPARK_SUBMIT_ARGS", f"--properties-file {tmp_path / 'job.conf'} --load-spark-defaults pyspark-shell"
    )
    got = user_spark_conf()
    assert (got["spark.sql.shuffle.partitions"], got["spark.ui.enabled"]) == ("9", "true")


USERS_SESSION = """
import sys
from pyspark.sql import SparkSession
import shardline
from shardline.foundation.errors import ShardlineError
# The user's own local session, made as a tutorial makes it: nothing says which Python.
spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
try:
    r = shardline.prepare({"pipelines": {"dataset_dir": sys.argv[1], "source": {"format": "synthetic",
                           "path": sys.argv[2], "synthetic": {"rows": 2000, "partitions": 2}},
                           "layout": {"world_size": 2}}}, spark=spark)
    print("ROWS", sum(s.rows for s in r.manifest.splits.values()), flush=True)
except ShardlineError as e:
    print("ERROR", e, flush=True)
spark.stop()
"""


@pytest.mark.slow  # a JVM of its own
def test_a_users_local_session_from_an_unactivated_venv_runs_this_python(tmp_path):
    """#46: `.venv/bin/python script.py` (the venv not activated) with the script's own local
    SparkSession: Spark's Python workers ran the `python3` first on PATH, which has none of
    shardline's packages, and prepare failed after minutes in ~160 lines. shardline's tasks
    now run the driver's own interpreter. The `python3` on PATH here is the base Python the
    venv was made from (no pyarrow, no shardline), ahead of everything else."""
    on_path = tmp_path / "bin"
    on_path.mkdir()
    python3 = on_path / "python3"
    python3.write_text(f"#!/bin/sh\nexec {Path(sys.base_prefix) / 'bin' / 'python3'} \"$@\"\n")
    python3.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "PYTHONPATH",
                                                          "VIRTUAL_ENV", "MLFLOW_TRACKING_URI")}
    env["PATH"] = os.pathsep.join([str(on_path), *(p for p in os.environ["PATH"].split(os.pathsep)
                                                   if Path(p).resolve() != BIN.resolve())])
    args = [sys.executable, "-c", USERS_SESSION, str(tmp_path / "dataset"), str(tmp_path / "raw")]
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ROWS 2000" in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]

    # The session told to run that Python (PYSPARK_PYTHON): not shardline's to change, so its
    # workers are checked by one probe task before the job, and it ends in one line.
    told = subprocess.run(args, cwd=tmp_path, env={**env, "PYSPARK_PYTHON": str(python3)}, capture_output=True,
                          text=True, timeout=600)
    errors = [ln for ln in told.stdout.splitlines() if ln.startswith("ERROR")]
    assert len(errors) == 1, told.stdout + told.stderr[-3000:]
    error = errors[0]
    assert error.startswith(f"ERROR Spark executors cannot import pyarrow (Spark master local[2]): set "
                            f"PYSPARK_PYTHON"), told.stdout + told.stderr[-3000:]
    assert "Traceback" not in told.stderr and "ModuleNotFoundError" not in told.stderr, told.stderr[-3000:]
