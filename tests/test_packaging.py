"""Workers without shardline's environment: a packed venv shipped with spark-submit
`--archives env.tar.gz#env` and `PYSPARK_PYTHON=./env/bin/python`, run on a standalone
cluster (jobs/scripts/spark-standalone.sh) whose workers' Python is a plain interpreter
that has neither shardline nor its dependencies (docs/deploy.md, "Packing the environment")."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.fixtures_clusters import _start, _stop, _wait
from shardline.training.launchers import free_port

VENV = Path(sys.executable).parent.parent
# The interpreter the venv was made from: the same Python, none of the packages.
PLAIN = Path(sys.base_prefix) / "bin" / "python3"


# gzip's store-only level: a valid gzip stream, unpacked by Spark exactly as docs/deploy.md's
# `gzip -1` output is, without the minute or two of one-core compression on this loaded machine
# (the archive is about 2 GB instead of 650 MB; copying it locally costs seconds).
STORE = (
    "import gzip, shutil, sys\n"
    "with gzip.GzipFile(fileobj=sys.stdout.buffer, mode='wb', compresslevel=0, mtime=0) as z:\n"
    "    shutil.copyfileobj(sys.stdin.buffer, z, 1 << 20)\n"
)


def _not_shipped(venv: Path) -> list[str]:
    """site-packages' top-level entries that only distributions outside shardline's own
    requirements own: what the test, docs and bench extras (pytest, moto, pyright and node,
    mkdocs, torchvision), pip and ruff add to this venv. A worker's environment is what
    `pip install shardline` installs, so the archive leaves them out (392 MB and 36,000 of
    the 97,000 files here; unpacking costs about a second per 2,500 files, twice per
    application). The entries are found from the installed metadata, not listed by hand."""
    import importlib.metadata as md

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name as name

    dists = {name(d.metadata["Name"]): d for d in md.distributions(path=[str(p) for p in venv.glob("lib/python*/site-packages")])}
    needed, todo = set(), [("shardline", frozenset())]
    while todo:  # shardline's requirements, with their extras, and theirs, ...
        dist, extras = todo.pop()
        if (name(dist), extras) in needed:
            continue
        needed.add((name(dist), extras))
        requires = dists[name(dist)].requires if name(dist) in dists else None
        for line in requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ("", *extras)):
                todo.append((req.name, frozenset(req.extras)))
    shipped = {d for d, _ in needed}
    owners: dict[Path, set[bool]] = {}
    for key, dist in dists.items():
        for f in dist.files or []:
            path = Path(os.path.normpath(dist.locate_file(f)))  # RECORD's ../../../bin/... too
            rel = path.relative_to(venv) if path.is_relative_to(venv) else None
            if rel is not None and len(rel.parts) > 3 and rel.parts[2] == "site-packages":
                owners.setdefault(Path(*rel.parts[:4]), set()).add(key in shipped)
    return sorted(str(top) for top, shipped_by in owners.items() if shipped_by == {False})


def pack_venv(venv: Path, out: Path, left_out: list[str]) -> subprocess.Popen:
    """docs/deploy.md's command, started (the caller waits; its errors go to `out`.log),
    its `gzip -1` stage replaced by STORE. -h: Spark refuses archive entries that are symlinks
    leading outside the archive (bin/python is one); .tar.gz: Spark unpacks it with `tar`,
    which keeps the executable bits (a plain .tar lost them here). The editable install of
    shardline stays out: shardline ships its own packages. pyspark's jars stay out too (462 MB of
    the 2.5 GB): an executor's JVM is its worker's own Spark, and the Python workers it
    starts need no jars (this test shows it). So do the extras' packages (`left_out`,
    _not_shipped's): a worker needs shardline's requirements only."""
    entries = [e.name for e in venv.iterdir() if e.name != "lib64"]
    Path(f"{out}.exclude").write_text("".join(f"{e}\n" for e in left_out))
    with open(f"{out}.log", "wb") as errors:
        return subprocess.Popen(
            f"set -o pipefail; tar -h --exclude='__editable__*' --exclude='shardline-*.dist-info' "
            f"--exclude='pyspark/jars' -X {shlex.quote(f'{out}.exclude')} -cf - {' '.join(entries)} "
            f"| {shlex.quote(sys.executable)} -c {shlex.quote(STORE)} > {out}",
            shell=True, executable="bash", cwd=venv, stderr=errors, start_new_session=True,
        )


def _unpacked_bytes(venv: Path, left_out: list[str]) -> int:
    """What pack_venv's archive holds once unpacked (symlinks followed, as tar -h does)."""
    skip = {venv / "lib64", *venv.glob("lib/python*/site-packages/pyspark/jars"), *(venv / e for e in left_out)}
    total = 0
    for root, dirs, files in os.walk(venv, followlinks=True):
        dirs[:] = [d for d in dirs if Path(root, d) not in skip]
        total += sum(p.stat().st_size for p in (Path(root, f) for f in files) if p.exists() and p not in skip)
    return total


@dataclass(frozen=True)
class PackedCluster:
    master: str  # spark://127.0.0.1:<port>, one worker of one core, its Python a plain interpreter
    archive: Path  # the packed venv, for spark-submit --archives
    work: Path  # the worker's folder (spark-standalone.sh's --work-dir, with "-1")


@pytest.fixture(scope="module")
def packed_cluster(tmp_path_factory):
    """The packed venv and a standalone cluster whose worker's Python has none of it, shared
    by this module's tests; packed_run submits to it."""
    lacks = subprocess.run([str(PLAIN), "-c", "import pyarrow"], capture_output=True, text=True)
    assert lacks.returncode != 0, f"{PLAIN} has pyarrow: it cannot stand for a worker without the environment"
    tmp = tmp_path_factory.mktemp("packed")
    # spark-submit copies and unpacks the archive twice on this one machine: for the driver
    # (client mode, in Spark's scratch under the temp folder) and for the executor (in the
    # worker's folder); stored, not compressed, the archive and each copy are as big as what
    # they unpack to. Short of room, tar fails file by file deep in a JVM's stack trace: say
    # so first, instead.
    left_out = _not_shipped(VENV)  # ~2 s: read once, for the room needed and for tar
    need = 5 * _unpacked_bytes(VENV, left_out) + 2**30
    free = shutil.disk_usage(tmp).free
    assert free > need, f"{tmp}: {free / 2**30:.1f} GB free, this test needs {need / 2**30:.1f} GB"
    archive = tmp / "env.tar.gz"
    cluster = packing = None
    try:
        # Packing (tens of seconds: 2 GB read and written) and the cluster's start (two JVMs) overlap.
        packing = pack_venv(VENV, archive, left_out)
        port, webui = free_port(), free_port()
        log = tmp / "spark.log"
        # PYTHONPATH emptied: the workers must not see this checkout either. One worker, one
        # executor: each executor unpacks its own copy of the venv (about 2 GB), and a second
        # would prove nothing more.
        cluster = _start(["bash", str(REPO / "jobs/scripts/spark-standalone.sh"), "--venv", str(VENV),
                          "--workers", "1", "--python", str(PLAIN), "--port", str(port), "--webui-port", str(webui),
                          "--work-dir", str(tmp / "work")], log, {"PYTHONPATH": ""})
        _wait(lambda: "ready: " in log.read_text(errors="replace"), "spark-standalone.sh", [cluster], [log])
        assert packing.wait(timeout=1200) == 0, f"packing {VENV} failed: {Path(f'{archive}.log').read_text()[-2000:]}"
        yield PackedCluster(f"spark://127.0.0.1:{port}", archive, tmp / "work-1")
    finally:
        if packing is not None and packing.poll() is None:
            os.killpg(packing.pid, signal.SIGKILL)  # the pipeline's group: tar and the compressor too
            packing.wait()
        if cluster is not None:
            _stop([cluster])
        # Gigabytes: the archive and the executors' unpacked copies; pytest would keep them.
        archive.unlink(missing_ok=True)
        remove(*tmp.glob("work-*"))  # spark-standalone.sh gives worker i `--work-dir`-i


def remove(*folders: Path) -> None:
    """`rm -rf`: an unpacked venv is 80,000 files, which shutil.rmtree took two minutes to
    remove beside a CPU hog (Python work per file); rm's C loop takes seconds."""
    if folders:
        subprocess.run(["rm", "-rf", "--", *map(str, folders)], timeout=600)  # as ignore_errors did


def submit(cluster: PackedCluster, args: list[str], cwd: Path, timeout: float = 1800) -> subprocess.CompletedProcess:
    """spark-submit to the packed cluster: executors run the archive's Python, the driver
    this venv's with this checkout on its path; the application's executor folder (its
    unpacked copy of the venv) is removed afterwards."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYSPARK_DRIVER_PYTHON": sys.executable,
           "PYSPARK_PYTHON": "./env/bin/python", "SPARK_LOCAL_IP": "127.0.0.1"}
    try:
        return subprocess.run(
            [str(VENV / "bin" / "spark-submit"), "--master", cluster.master,
             "--archives", f"{cluster.archive}#env", "--conf", "spark.executor.cores=1", "--conf", "spark.cores.max=1",
             "--driver-java-options", f"-Dlog4j2.configurationFile=file:{REPO / 'shardline/foundation/log4j2.properties'}",
             *args],
            cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
    finally:
        remove(*cluster.work.glob("app-*"))


@dataclass(frozen=True)
class PackedRun:
    prepared: str  # what the application wrote before tests/packed_client.py's PREPARED line, and stderr
    client: str  # stdout after that line: tests/user_code_client.py's
    dataset: Path  # prepare's dataset folder
    folder: Path  # the folder the driver ran from (the user's package is written there)
    out: str  # all of it, for failure messages


@pytest.fixture(scope="module")
def packed_run(packed_cluster, tmp_path_factory) -> PackedRun:
    """ONE application for this module's checks (tests/packed_client.py): each application
    unpacks the 2 GB archive for its driver and for its executor, so `prepare` through
    jobs/spark_submit.py and then the user's-package stages share one."""
    folder = tmp_path_factory.mktemp("packed-run")
    dataset = folder / "dataset"
    proc = submit(packed_cluster, [
        str(REPO / "tests/packed_client.py"),
        "prepare", str(REPO / "jobs/configs/quickstart.toml"),
        "--set", "pipelines.source.synthetic.rows=4000",
        "--set", f"pipelines.dataset_dir='{dataset}'", "--set", f"pipelines.source.path='{folder / 'raw'}'",
        "--", "--world-size", "1", "--values", "1,2",
    ], cwd=folder)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    prepared, mark, client = proc.stdout.partition("PREPARED\n")
    assert mark, out[-3000:]
    return PackedRun(prepared + proc.stderr, client, dataset, folder, out)


@pytest.mark.slow
@pytest.mark.cluster
def test_packed_venv_runs_on_workers_without_the_environment(packed_run):
    # The environment probe ran on an executor, with the unpacked archive's Python.
    line = " ".join(packed_run.prepared.split())  # rich wraps long lines
    assert "executors: Python 3.11 (" in line and "/env/bin/python on " in line, line[-2000:]
    assert "torch 2.13.0" in line
    assert "train: 3," in line and (packed_run.dataset / "_manifests").is_dir()


@pytest.mark.slow
@pytest.mark.cluster
def test_the_users_package_reaches_workers_without_it_and_a_change_reaches_them_too(packed_run):
    """The user's package, in the folder the driver runs from only, imported by a barrier
    stage's rank on the cluster (whose Python has neither shardline nor the package); then
    changed, and the same application's next stage imports the new version
    (tests/user_code_client.py, run after `prepare` in the same application)."""
    from tests.user_code_helpers import MODULE

    runs = [json.loads(ln.removeprefix("RESULT ")) for ln in packed_run.client.splitlines() if ln.startswith("RESULT ")]
    assert [[r["value"] for r in ranks] for ranks in runs] == [[1], [2]], packed_run.out[-3000:]
    for (r,) in runs:  # from the shipped zip in the executor's folder, not the driver's package
        assert "shardline-user-" in r["file"] and not r["file"].startswith(str(packed_run.folder)), r
        assert r["file"].endswith(MODULE.replace(".", "/") + ".py")
    assert runs[0][0]["file"] != runs[1][0]["file"]


def test_the_code_zip_is_removed_when_its_process_ends():
    # A killed process's zips are swept by the next one: foundation.zips, tested with the
    # user's code zip in tests/test_user_code_travel.py.
    code = "from shardline.foundation.code_travel import shardline_zip\nimport os\np = shardline_zip()\nassert os.path.getsize(p) > 0\nprint(p)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    path = proc.stdout.strip()
    assert path.endswith(".zip") and not os.path.exists(path)


def _copy_of_the_repo(dest: Path) -> Path:
    """The checkout as it is (uncommitted changes too), links kept, without venv, git and
    outputs: pip builds in the source folder, which must not be this checkout."""
    skip = shutil.ignore_patterns(".venv", ".git", "site", "build", "dist", "*.egg-info", "__pycache__",
                                  ".pytest_cache", "mlruns", "mlflow.db", "shardline-data")
    return Path(shutil.copytree(REPO, dest, symlinks=True, ignore=skip))


def _pip(*args: str, cwd: Path) -> str:
    """This venv's pip (a recent one, as `make venv` installs) on another interpreter
    (`--python`), with build isolation: setuptools from the index, as a user's install gets it."""
    proc = subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    return out


@pytest.mark.slow
def test_install_and_wheel_print_no_setuptools_warnings_and_claim_only_shardline(tmp_path):
    """#53.9 and #53.24: `pip install -e .` and a wheel build print none of setuptools'
    "Package would be ignored" warnings (nor any other); the wheel holds the data files;
    the editable install is a plain path (static tools follow it) under which only
    `shardline` is importable. Full tier (marker `slow`): two builds in fresh isolated
    environments, 20-60 s."""
    src = _copy_of_the_repo(tmp_path / "src")
    subprocess.run([str(PLAIN), "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True, timeout=300)
    python = tmp_path / "venv" / "bin" / "python"
    out = _pip("--python", str(python), "install", "--no-deps", "-e", ".", cwd=src)
    assert "would be ignored" not in out and "Warning" not in out, out[-3000:]
    # The .pth is one folder that holds the link to shardline/ and nothing else (but the
    # build's metadata, shardline.egg-info, which is no module).
    (pth,) = (tmp_path / "venv").glob("lib/python*/site-packages/__editable__.shardline-*.pth")
    folder = Path(pth.read_text().strip())
    assert [p.name for p in folder.iterdir() if not p.name.endswith(".egg-info")] == ["shardline"] and (folder / "shardline").resolve() == src / "shardline"
    probe = ("import importlib.util as u, shardline, shardline.jobs, os\n"
             "print(shardline.__file__, [n for n in ('training', 'jobs', 'pipelines') if u.find_spec(n)])")
    # -I: neither PYTHONPATH (the suite's, this checkout) nor the working folder on the path.
    proc = subprocess.run([str(python), "-I", "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [str(folder / "shardline" / "__init__.py"), "[]"], proc.stdout

    out = _pip("wheel", "--no-deps", "-w", str(tmp_path / "wheels"), ".", cwd=src)
    assert "would be ignored" not in out and "Warning" not in out, out[-3000:]
    import zipfile

    (wheel,) = (tmp_path / "wheels").glob("shardline-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    data = {"shardline/py.typed", "shardline/foundation/log4j2.properties",
            "shardline/jobs/configs/quickstart.toml", "shardline/jobs/scripts/dask-cluster.sh",
            "shardline/jobs/schedules/shardline-score.timer", "shardline/training/job.py"}
    assert data <= names, sorted(data - names)
    assert {n.split("/")[0] for n in names} == {"shardline", wheel.name.split("-py3")[0] + ".dist-info"}
