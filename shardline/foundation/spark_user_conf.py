"""What the user gave Spark outside shardline's config, read as spark-submit reads it.

When shardline starts the JVM, pyspark runs spark-submit, which reads
`spark-defaults.conf` (or `--properties-file`) and `PYSPARK_SUBMIT_ARGS`. shardline
reads the same sources first, so that its defaults go only where they are silent
(a default passed to the builder would override them).
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

# Imported inside the functions that use them: pyspark (only with a Spark session: Dask and local jobs never
# import it).


def user_spark_conf() -> dict[str, str]:
    """What the user gave Spark outside shardline's config, as spark-submit will read it
    when pyspark starts the JVM: `spark-defaults.conf` (or `--properties-file`) and `--conf`
    / `--master` in `PYSPARK_SUBMIT_ARGS`, later ones winning."""
    args = shlex.split(os.environ.get("PYSPARK_SUBMIT_ARGS", ""))
    given: dict[str, str] = {}
    props_file, load_defaults = None, False
    for i, a in enumerate(args):
        value = args[i + 1] if i + 1 < len(args) else ""
        if a.startswith("--conf="):
            a, value = "--conf", a.removeprefix("--conf=")
        if a == "--conf":
            key, _, v = value.partition("=")
            given[key.strip()] = v
        elif a == "--master":
            given["spark.master"] = value
        elif a == "--properties-file":
            props_file = Path(value)
        elif a == "--load-spark-defaults":
            load_defaults = True
    files = [props_file] if props_file else []
    if props_file is None or load_defaults:
        conf_dir = os.environ.get("SPARK_CONF_DIR") or str(_spark_home() / "conf")
        files.append(Path(conf_dir) / "spark-defaults.conf")
    conf: dict[str, str] = {}
    for f in reversed(files):  # the properties file wins over spark-defaults.conf
        if f.is_file():
            conf.update({k: v for k, v in read_properties(f).items() if k.startswith("spark.")})
    return {**conf, **given}


def _spark_home() -> Path:
    if os.environ.get("SPARK_HOME"):
        return Path(os.environ["SPARK_HOME"])
    import pyspark

    return Path(pyspark.__file__).parent


_ESCAPES = {"t": "\t", "n": "\n", "r": "\r", "f": "\f"}


def read_properties(path: Path) -> dict[str, str]:
    """A Java properties file as Spark reads it (java.util.Properties, values trimmed)."""
    lines, pending = [], ""
    for raw in path.read_text(encoding="utf-8", errors="replace").splitlines():
        line = raw.lstrip()
        if not pending and (not line or line[0] in "#!"):
            continue
        trailing = len(line) - len(line.rstrip("\\"))
        if trailing % 2:  # an odd run of backslashes continues the line
            pending += line[:-1]
            continue
        lines.append(pending + line)
        pending = ""
    if pending:
        lines.append(pending)
    out = {}
    for line in lines:
        m = re.match(r"((?:\\.|[^\s=:\\])*)\s*[=:]?\s*(.*)$", line)
        out[_unescape(m[1])] = _unescape(m[2]).strip()
    return out


def _unescape(s: str) -> str:
    def one(m: re.Match) -> str:
        c = m[1]
        if c.startswith("u") and len(c) == 5:
            return chr(int(c[1:], 16))
        return _ESCAPES.get(c, c)

    return re.sub(r"\\(u[0-9a-fA-F]{4}|.)", one, s)
