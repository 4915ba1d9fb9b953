"""Static tools see shardline as a user's code imports it (#53.24): pyright, run on a user's
script outside the repository with this venv's Python, resolves `import shardline` (the
editable install is a plain path in a .pth file, pyproject.toml's package-dir) and knows
the API's signatures (`shardline/__init__.py`'s TYPE_CHECKING imports, `py.typed`), so a
wrong keyword is reported where it is written.

Full tier (marker `slow`): pyright starts node and reads torch's, pyarrow's and pandas'
stubs, 5-15 s on this machine. `make typecheck` (CI) runs pyright on the package itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

PYRIGHT = Path(sys.executable).parent / "pyright"

SCRIPT = '''\
import shardline
from shardline.dask import ShardlineEstimator

result: shardline.TrainResult = shardline.train("job.toml", ["training.epochs=1"])
print(result.model_uri, shardline.prepare("job.toml").dataset_dir)
ShardlineEstimator("job.toml", lr=1e-3)
shardline.train("job.toml", epochz=3)
'''


def _pyright(script: Path) -> list[dict]:
    proc = subprocess.run([str(PYRIGHT), "--outputjson", "--pythonpath", sys.executable, script.name],
                          cwd=script.parent, capture_output=True, text=True, timeout=600)
    assert proc.stdout.startswith("{"), proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(proc.stdout)["generalDiagnostics"]


def test_pyright_resolves_shardline_and_reports_a_wrong_keyword(tmp_path):
    # A user's folder of its own: no pyproject.toml, so pyright's defaults, as a user gets them.
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    found = [(d["range"]["start"]["line"] + 1, d["severity"], d["message"]) for d in _pyright(script)]
    # Line 7 only: the import resolves, TrainResult and the signatures are known, the
    # estimator's lr is a parameter of its own.
    assert found == [(7, "error", 'No parameter named "epochz"')], found
