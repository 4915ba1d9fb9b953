"""A class-data archive (AppCDS) for the suite's JVMs, made once per JDK and Spark jars.

A short `local[2]` Spark job loads about 22,000 classes (`-Xlog:class+load`); the JDK's
own archive holds some 1,200 of them, the rest are read from the jars, parsed and
verified. Most of the suite's JVMs live seconds, so that is much of their cost.
HotSpot can instead map classes, already parsed and verified, from an archive that an
earlier JVM wrote as it exited (`-XX:ArchiveClassesAtExit`, JDK 13+). Measured here on a
`local[2]` session that groups, writes and reads 200,000 rows, with the suite's JVM flags:
11.7–13.5 CPU-s and 9.3–10.6 s without the archive, 7.3–7.7 CPU-s and 5.3–5.4 s with
it (three runs each).

The archive is written by one short Spark job the first time the suite runs on a clone
(about 30 s here, half of it the JVM writing 186 MB as it exits; in a thread beside the
first tests, conftest.jvm_class_archive) and kept in
`.pytest_cache/shardline/` under a key of the JDK's version and the jars' names and
sizes: another JDK or pyspark writes a new one, and the old one is removed. A JVM whose
classpath differs from the archive's (one given a `SPARK_CONF_DIR` with files in it, as
`test_spark_conf`'s are) cannot use it and starts as before: `-Xlog:cds*=off` keeps
HotSpot from saying so on the JVM's stdout. Like the JIT flags (conftest.TEST_JVM_OPTS),
the archive changes how fast classes load, not which: shardline never uses it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

# What the suite's JVMs do, in small: a session, a shuffle, Parquet written and read,
# and an Arrow UDF in a barrier stage (Python workers, as scoring and training use).
DUMP_JOB = """
import sys
from pyspark import SparkContext
from pyspark.sql import SparkSession
spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
df = spark.range(20000).selectExpr("id", "id % 7 AS k", "rand(0) AS x")
df.groupBy("k").count().collect()
df.repartition(2).write.parquet(sys.argv[1])
back = spark.read.parquet(sys.argv[1])
assert back.mapInArrow(lambda batches: batches, back.schema, barrier=True).count() == 20000
jvm = SparkContext._gateway.proc
spark.stop()
jvm.stdin.close()  # the JVM exits when its stdin closes, and writes the archive as it exits:
jvm.wait()         # wait for it, or the archive could be taken half-written
"""


def _java(env: Mapping[str, str]) -> str | None:
    home = env.get("JAVA_HOME")  # what spark-class runs
    return str(Path(home) / "bin" / "java") if home else shutil.which("java")


def _key(java: str, jvm_opts: str) -> str:
    import pyspark

    version = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=60).stderr
    jars = Path(pyspark.__file__).parent / "jars"
    listing = sorted(f"{p.name}:{p.stat().st_size}" for p in jars.iterdir())
    return hashlib.sha256("\n".join([version, jvm_opts, *listing]).encode()).hexdigest()[:16]


def find_archive(cache: Path, jvm_opts: str) -> tuple[Path | None, str]:
    """Where this JDK's and jars' archive is, or will be once written (a second: the key
    asks `java -version`); (None, why) if there can be none."""
    java = _java(os.environ)
    if java is None:
        return None, "no java found"
    try:
        return cache / f"spark-{_key(java, jvm_opts)}.jsa", ""
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{type(e).__name__}: {e}"


def write_archive(archive: Path, jvm_opts: str, env: dict[str, str]) -> str:
    """Write `archive` (its job runs in `env`) and remove other JDKs' and jars' archives;
    "" once written, or why not (the suite then runs without it, only slower)."""
    try:
        archive.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=archive.parent) as tmp:
            why = _dump(Path(tmp), jvm_opts, env)
            if why:
                return why
            os.replace(Path(tmp) / "spark.jsa", archive)  # whole or not at all, also beside another run
        for old in archive.parent.glob("spark-*.jsa"):  # another JDK's or pyspark's, 186 MB each
            if old != archive:
                old.unlink(missing_ok=True)  # a JVM that maps it keeps its pages
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{type(e).__name__}: {e}"
    return ""


def archive_flags(archive: Path) -> str:
    """The JVM flags that map classes from `archive`."""
    return f"-XX:SharedArchiveFile={archive} -Xlog:cds*=off"


def _dump(tmp: Path, jvm_opts: str, env: dict[str, str]) -> str:
    """Run DUMP_JOB with a JVM that writes tmp/spark.jsa as it exits; why not, if it did not."""
    env = {k: v for k, v in env.items() if k != "SPARK_CONF_DIR"}  # Spark's default classpath
    env["SPARK_SUBMIT_OPTS"] = f"{jvm_opts} -XX:ArchiveClassesAtExit={tmp / 'spark.jsa'}"
    env["PYSPARK_PYTHON"] = sys.executable  # the workers import pyarrow, as this Python does
    proc = subprocess.run([sys.executable, "-c", DUMP_JOB, str(tmp / "out")], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 or not (tmp / "spark.jsa").exists():
        last = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:] or ["(no output)"]
        return f"the job that writes it ended with {proc.returncode}: {last[0]}"
    return ""
