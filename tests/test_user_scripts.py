"""A user's own script trains on the local launcher as written (#53 item 22): one without an
`if __name__ == "__main__":` guard, and one piped to `python -`.

Ranks used to be multiprocessing children, which import the caller's `__main__`: the
guardless script ran its whole body again in each rank (and its `shardline.train` there
failed the ranks), the piped one failed every rank with `FileNotFoundError: '<stdin>'`,
twice, before "restarting from the start". The ranks are now forked by a rank server, a
fresh interpreter running a shardline module (training.launchers.rank_server); a function
the script defines travels to them by value (cloudpickle).

Full tier only (`make test-all`, marker `slow`): each case is a Python process of its own,
with its imports and its rank server (~25 s each on the 2-core machine under load).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .mlflow_store import empty_store

pytestmark = pytest.mark.slow

# No main guard: everything below runs when the script runs, and must run once.
SCRIPT = """
import json, os, sys
import shardline
from shardline.engines.local.launch import launch_local

with open(sys.argv[1], "a") as f:
    f.write(f"{os.getpid()}\\n")


def where(rank, world_size, payload):  # defined here, in __main__: it travels by value
    return {"rank": rank, "pid": os.getpid(), "payload": payload}


ranks = launch_local(where, "from the script", world_size=2, timeout_s=300)
trained = shardline.train(None, json.loads(sys.argv[2]))
shapes = {name: list(w.shape) for name, w in trained.weights.items()}
print("RESULT " + json.dumps({"ranks": ranks, "version": trained.model_version, "shapes": shapes}))
"""


@pytest.mark.parametrize("how", ["file", "stdin"])
def test_a_script_without_a_main_guard_trains_and_runs_its_body_once(prepared, tmp_path, how):
    body_runs = tmp_path / "body-runs"
    empty_store(tmp_path)
    overrides = {
        "pipelines.dataset_dir": prepared.dataset_dir, "training.launcher": "local",
        "training.world_size": 2, "training.epochs": 1, "training.batch_size": 256, "training.hidden": [16],
        "training.checkpoint_dir": str(tmp_path / "ckpt"), "tracking.tracking_uri": f"sqlite:///{tmp_path}/mlflow.db",
        "tracking.experiment": f"script-{how}", "tracking.registered_model": f"script-{how}",
    }
    args = [str(body_runs), json.dumps(overrides)]
    if how == "file":
        script = tmp_path / "train_it.py"
        script.write_text(SCRIPT)
        cmd, stdin = [sys.executable, str(script), *args], None
    else:
        cmd, stdin = [sys.executable, "-", *args], SCRIPT  # `cat train_it.py | python - ...`
    proc = subprocess.run(cmd, input=stdin, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    # The body ran in the script's own process only: not again in a rank, nor in a restart.
    runs = body_runs.read_text().split()
    assert len(runs) == 1, f"the script's body ran {len(runs)} times\n{proc.stderr[-2000:]}"
    ranks = result["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and {r["payload"] for r in ranks} == {"from the script"}
    assert len({r["pid"] for r in ranks} | {int(runs[0])}) == 3  # two rank processes, not the script's
    assert [16] in result["shapes"].values() and result["version"] == "1"  # training.hidden [16], registered
    assert "restarting from" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]

