"""The user's code travels with the job (#36 item 3): zipped on the driver under a name its
content decides, shipped to Spark executors (classic, Connect) and Dask workers that do
not have it, and made current in each worker before the user's code is imported, so a
change between two runs of one long-lived session reaches them (no stale copy).

The standalone-cluster case (workers whose Python has neither shardline nor the user's
package) is in tests/test_packaging.py, beside the packed-venv machinery it reuses.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from shardline.foundation.code_travel import UserCode, code_zip, snapshot, top_names, use_code
from shardline.foundation.engine_config import DaskConfig
from shardline.engines.local.launch import launch_local

from .conftest import REPO
from .user_code_helpers import MODULE, read_value, value_rank, write_package

CLIENT = Path(__file__).resolve().parent / "user_code_client.py"


@pytest.fixture
def clean_imports():
    """What a test put on this process's path or imported of the user's package goes."""
    path = list(sys.path)
    try:
        yield
    finally:
        sys.path[:] = path
        for name in [n for n in sys.modules if n.split(".")[0] in ("shipped_pkg", "helper_mod")]:
            del sys.modules[name]
        importlib.invalidate_caches()


def test_the_zip_holds_each_folder_under_its_name_and_is_named_by_its_content(tmp_path):
    pkg = write_package(tmp_path / "v1", 1)
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"stale")
    helper = tmp_path / "helper_mod.py"
    helper.write_text("X = 1\n")
    path, code = code_zip([str(pkg), str(helper)])
    assert code.packages == ("shipped_pkg", "helper_mod")
    assert os.path.basename(path) == code.zip_name and code.zip_name.startswith("shardline-user-")
    with zipfile.ZipFile(path) as z:
        assert sorted(z.namelist()) == [
            "helper_mod.py", "shipped_pkg/__init__.py", "shipped_pkg/consts.py", "shipped_pkg/model.py",
        ]
    # The same content elsewhere (another checkout): the same name, the same bytes.
    again, same = code_zip([str(write_package(tmp_path / "copy", 1)), str(helper)])
    assert same.zip_name == code.zip_name and Path(again).read_bytes() == Path(path).read_bytes()
    # Changed content: another name, so Spark and Dask see a new artifact.
    _, changed = code_zip([str(write_package(tmp_path / "v1", 2)), str(helper)])
    assert changed.zip_name != code.zip_name


def test_a_worker_that_imported_an_older_zip_imports_the_new_one(tmp_path, clean_imports):
    """What a reused Spark Python worker or a Dask worker lives through: version 1 imported
    from its zip, then the task of the next run brings version 2's zip (Spark adds a task's
    artifacts at sys.path[1]); the modules already in sys.modules would shadow it."""
    old, old_code = code_zip([str(write_package(tmp_path / "v1", 1))])
    sys.path.insert(0, old)
    use_code(old_code)
    assert importlib.import_module(MODULE).value() == 1
    kept = sys.modules[MODULE]
    use_code(old_code)  # the same code again: what is loaded from it is kept
    assert sys.modules[MODULE] is kept

    new, new_code = code_zip([str(write_package(tmp_path / "v2", 2))])
    sys.path.insert(1, new)
    use_code(new_code)
    module = importlib.import_module(MODULE)
    assert module.value() == 2 and module.__file__.startswith(new + os.sep)
    assert sys.modules["shipped_pkg.consts"].__file__.startswith(new + os.sep)
    assert sys.path[0] == new


def test_a_zip_that_never_arrived_is_one_line():
    from shardline.foundation.errors import ShardlineError

    with pytest.raises(ShardlineError, match=r"the user's code \(shardline-user-0\.zip\) did not reach this worker"):
        use_code(UserCode(("shipped_pkg",), "shardline-user-0.zip"))


def test_local_ranks_import_the_users_folder_from_anywhere(tmp_path, clean_imports):
    """The fork server's path is that of its start: a package outside it (a code_paths entry
    elsewhere) is importable in the ranks, from the job's snapshot of it (a zip named by its
    content, which the ranks import even once the folder has changed), and a copy of the
    package imported earlier from another folder does not shadow it."""
    pkg = write_package(tmp_path / "elsewhere", 3)
    code = snapshot([str(pkg)])
    write_package(tmp_path / "elsewhere", 4)  # changed after the job took its snapshot
    ranks = launch_local(read_value, MODULE, world_size=2, timeout_s=120, code=code)
    assert [r["value"] for r in ranks] == [3, 3]
    assert all(r["file"] == os.path.join(code.zip_path, "shipped_pkg", "model.py") for r in ranks), ranks

    stale = write_package(tmp_path / "old", 1)
    sys.path.insert(0, str(stale.parent))
    assert importlib.import_module(MODULE).value() == 1
    # The folders used in place, no zip and no files (as ranks on the driver's host could).
    use_code(UserCode(tuple(n for n, _ in top_names([str(pkg)])), None, (str(pkg),)))
    assert importlib.import_module(MODULE).value() == 4


def test_two_code_paths_of_one_name_are_refused_in_one_line(tmp_path):
    from shardline.foundation.errors import ConfigError
    from shardline.training.config import TrainingConfig
    from shardline.training.user_code import job_code_folders

    a, b = write_package(tmp_path / "a", 1, "utils"), write_package(tmp_path / "b", 1, "utils")
    with pytest.raises(ConfigError, match=r"^training.code_paths: .* both would be imported as 'utils'$"):
        job_code_folders(TrainingConfig(code_paths=[str(a), str(b)]))
    assert job_code_folders(TrainingConfig(code_paths=[str(a)])) == [str(a)]


def test_classic_spark_python_workers_run_each_runs_version(spark, tmp_path):
    """The session's local master: its Python workers are reused from stage to stage, as a
    notebook's are; the driver's own path is left as it was (classic Spark's addPyFile would
    put the zip on it)."""
    from shardline.engines.spark.launch import launch_spark_barrier

    pkg = write_package(tmp_path, 1)
    path = list(sys.path)
    first = launch_spark_barrier(spark, value_rank(), MODULE, 2, 120, code=snapshot([str(pkg)]))
    write_package(tmp_path, 2)
    second = launch_spark_barrier(spark, value_rank(), MODULE, 2, 120, code=snapshot([str(pkg)]))
    assert [r["value"] for r in first] == [1, 1] and [r["value"] for r in second] == [2, 2], second
    for r in first + second:
        assert "/shardline-user-" in r["file"], r
    assert sys.path == path and "shipped_pkg" not in sys.modules


@pytest.mark.slow
@pytest.mark.cluster
def test_dask_workers_without_the_package_run_each_runs_version(dask_cli_cluster, tmp_path):
    """The CLI cluster's workers have neither shardline nor the user's package; the same
    worker processes run two launches, the package changed in between."""
    from shardline.foundation.sessions import dask_client
    from shardline.engines.dask.launch import launch_dask

    pkg = write_package(tmp_path, 1)
    client = dask_client(DaskConfig(address=dask_cli_cluster.address))  # ships shardline's own code
    try:
        def has_package() -> bool:  # nested: pickled by value
            import importlib.util

            return importlib.util.find_spec("shipped_pkg") is not None

        assert not any(client.run(has_package).values())
        first = launch_dask(client, value_rank(), MODULE, world_size=2, timeout_s=120, code=snapshot([str(pkg)]))
        write_package(tmp_path, 2)
        second = launch_dask(client, value_rank(), MODULE, world_size=2, timeout_s=120, code=snapshot([str(pkg)]))
    finally:
        client.close()
    assert [r["value"] for r in first] == [1, 1]
    assert [r["value"] for r in second] == [2, 2], second
    # Both launches' ranks forked by the same long-lived processes (each worker's rank server,
    # shardline.engines.dask.launch), which outlive a job as the workers do: the case that goes stale.
    assert [r["ppid"] for r in first] == [r["ppid"] for r in second]
    assert {r["pid"] for r in first}.isdisjoint(r["pid"] for r in second)
    for r in first + second:  # from the shipped zip, never the driver's folder
        assert "/shardline-user-" in r["file"] and not r["file"].startswith(str(tmp_path)), r
        assert os.path.dirname(r["consts"]) == os.path.dirname(r["file"]), r
    assert first[0]["file"] != second[0]["file"]


def run_client(args: list[str], cwd: Path, env: dict | None = None, timeout: float = 900) -> list[dict]:
    """tests/user_code_client.py in a process of its own (this one holds a classic session)."""
    env = {**{k: v for k, v in os.environ.items() if k not in ("SPARK_REMOTE",)}, "PYTHONPATH": str(REPO),
           **(env or {})}
    proc = subprocess.run([sys.executable, str(CLIENT), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return [json.loads(line.removeprefix("RESULT ")) for line in proc.stdout.splitlines()
            if line.startswith("RESULT ")]


@pytest.mark.slow
def test_spark_connect_executors_run_each_runs_version(connect_server, tmp_path):
    """One Connect session, two barrier stages, the package changed in between: the server's
    Python workers (reused within a session) import the new version. The package is in the
    client's working folder only, found there as `python -m` would."""
    runs = run_client(["--remote", connect_server.url, "--world-size", "2", "--values", "1,2"], cwd=tmp_path)
    assert [[r["value"] for r in ranks] for ranks in runs] == [[1, 1], [2, 2]], runs
    for r in runs[0] + runs[1]:
        assert "/shardline-user-" in r["file"] and not r["file"].startswith(str(tmp_path)), r
    assert runs[0][0]["file"] != runs[1][0]["file"]


def test_the_zips_go_with_their_process_and_a_killed_ones_with_the_next(tmp_path):
    """atexit never runs on SIGKILL: the next process to make a zip removes the folder of a
    process that is gone, and only such folders (each is locked while its process lives)."""
    pkg = write_package(tmp_path, 1)
    make = (f"from shardline.foundation.code_travel import code_zip\nimport time\n"
            f"print(code_zip([{str(pkg)!r}])[0], flush=True)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    live, killed = (subprocess.Popen([sys.executable, "-c", make + "time.sleep(600)"], stdout=subprocess.PIPE,
                                     text=True, env=env) for _ in range(2))
    try:
        live_zip, killed_zip = live.stdout.readline().strip(), killed.stdout.readline().strip()
        assert os.path.dirname(live_zip) != os.path.dirname(killed_zip)
        killed.kill()
        killed.wait(timeout=30)
        assert os.path.exists(killed_zip)
        proc = subprocess.run([sys.executable, "-c", make], capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 0, proc.stderr
        assert not os.path.exists(os.path.dirname(killed_zip)), "a SIGKILLed process's zips were left"
        assert os.path.exists(live_zip), "a live process's zip was removed"
        assert not os.path.exists(os.path.dirname(proc.stdout.strip()))  # gone at its exit
    finally:
        for p in (live, killed):
            p.kill()
            p.wait(timeout=30)
        from shardline.foundation.zips import remove_orphans

        remove_orphans(os.path.dirname(os.path.dirname(live_zip)))
    assert not os.path.exists(live_zip)


@pytest.mark.slow
@pytest.mark.cluster
def test_scoring_ships_the_code_a_model_needs_to_dask_workers_without_it(
    dask_cli_cluster, prepared, tracking_uri, tmp_path, clean_imports
):
    """A registered model whose class is the user's (pickled by reference, as a model of
    theirs logged with mlflow.pytorch is): the CLI cluster's workers can unpickle it only
    from the code the scoring job ships (without `user_code`: ModuleNotFoundError)."""
    from shardline.foundation.sessions import dask_client
    from .serving_helpers import score

    from .serving_helpers import read_scores, register_wrapped

    pkg = write_package(tmp_path / "code", 1)
    (pkg / "wrap.py").write_text(
        "import torch\n\n\nclass Wrapped(torch.nn.Module):\n    def __init__(self, inner):\n"
        "        super().__init__()\n        self.inner = inner\n\n    def forward(self, x):\n"
        "        return self.inner(x)\n"
    )
    sys.path.insert(0, str(pkg.parent))
    wrapped = importlib.import_module("shipped_pkg.wrap").Wrapped
    uri = register_wrapped(prepared, tracking_uri, "user-code-scoring", wrapped)
    client = dask_client(DaskConfig(address=dask_cli_cluster.address))
    try:
        result = score("dask", client, uri, tracking_uri, prepared.dataset_dir, str(tmp_path / "out"),
                       user_code=[str(pkg)], allow_pickled=True)
    finally:
        client.close()
    assert result.rows == read_scores(tmp_path / "out").num_rows > 0



def test_a_task_whose_working_folder_was_removed_still_runs_torch(tmp_path):
    """A reused Spark Python worker can sit in a removed folder (a Connect session's); torch
    imported there aborts the process at its first matrix product. A Spark task's payload
    (foundation.environ.TaskPayload: here a reference to torch.ones, whose unpickling imports
    torch) is opened only after the task has left such a folder. The control unpickles the
    same bytes in place, and aborts."""
    import pickle

    import torch

    from shardline.foundation.environ import TaskPayload

    blob = tmp_path / "payload.pickle"
    blob.write_bytes(pickle.dumps(TaskPayload(torch.ones)))
    script = (
        "import os, pickle, shutil, sys\n"
        "payload = pickle.loads(open(sys.argv[3], 'rb').read())\n"
        "assert 'torch' not in sys.modules  # the task's own modules are torch-free\n"
        "os.chdir(sys.argv[1]); shutil.rmtree(sys.argv[1])\n"
        "ones = payload.open() if sys.argv[2] == 'task' else pickle.loads(payload._blob)\n"
        "a = ones(64, 64); print(float((a @ a).sum()))\n"
    )
    runs = {}
    for mode in ("task", "control"):
        folder = tmp_path / mode
        folder.mkdir()
        runs[mode] = subprocess.run([sys.executable, "-c", script, str(folder), mode, str(blob)],
                                    capture_output=True, text=True, timeout=300)
    assert runs["task"].returncode == 0 and runs["task"].stdout.strip() == str(64.0**3), runs["task"].stderr
    assert runs["control"].returncode != 0 and "Cannot load" in runs["control"].stdout + runs["control"].stderr
