"""The torch module inside a registered model, stored so that loading it never unpickles.

A pickled module (`torch.save(model)`) runs whatever its bytes say when loaded: anyone who
can write the registry would run code on every scorer. So the module is stored as data
only: its weights as safetensors, and a JSON file naming what rebuilds it, the model
factory (`training.model`, a built-in name or the user's 'pkg.mod:callable') with the
TrainingConfig fields a factory reads and the dataset's manifest. Loading calls
`build_model(manifest, cfg)` again, as training did, and fills in the weights. The user's
own code (the factory's package, `training.code_paths`) travels in the model's code folder
beside shardline's: code the user chose to ship, imported like any installed package.

A regression model trained on the standardised label (training.task.label_scale) is
loaded wrapped in `LabelUnits`, which un-standardises its output: batch scores, the
estimators and the served pyfunc all get values in the label's units from this one place.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

from shardline.pipelines.manifest import ShardManifest

from ..config import TrainingConfig
from ..strategy_settings import renamed
from ..user_code import job_code_folders

# Imported inside the functions that use them: safetensors (with torch); torch (~2 s: only where a model or a
# rank runs); training.models.builtin (imports torch); training.task (imports torch).

FORMAT = 1
WEIGHTS_FILE = "weights.safetensors"
MODULE_FILE = "module.json"


def write_module(model, manifest, cfg, directory: str, loop_model: dict | None = None) -> tuple[str, str]:
    """Write `model`'s weights and its rebuild description into `directory`; their paths.
    loop_model: what a loop's ctx.register said (training.loop.register): the factory that
    rebuilds the module when it is not training.model's, and the model's inputs and output."""
    from safetensors.torch import save_model

    weights, module = os.path.join(directory, WEIGHTS_FILE), os.path.join(directory, MODULE_FILE)
    # save_model, not save_file(state_dict): tied parameters (one tensor under two names)
    # are stored once, and load_model ties them again.
    save_model(model, weights)
    # The whole training section: build_model gets the config it got in training (the
    # factory's name and arguments, the built-ins' shape settings, the seed).
    own = loop_model or {}
    Path(module).write_text(json.dumps({
        "format": FORMAT,
        "training": cfg.model_dump(mode="json"),
        "manifest": manifest.model_dump(mode="json"),
        # A loop's model of its own class: `path`(**args) rebuilds it (no inputs given).
        **({"factory": {"path": own["factory"], "args": own["args"]}} if own.get("factory") else {}),
        **({"io": io_of(own)} if io_of(own) else {}),
    }))
    return weights, module


def io_of(loop_model: dict | None) -> dict:
    """A loop model's own inputs or output (training.loop.io), as module.json and the MLmodel
    keep them; {} for a model of the dataset's inputs and the task's output (as every factory model)."""
    if not loop_model or (loop_model.get("inputs") is None and loop_model.get("output", "task") == "task"):
        return {}
    return {k: loop_model[k] for k in ("inputs", "positional", "output")}


def read_module(weights: str, module: str):
    """The torch module `write_module` stored, on the CPU, in eval mode. The factory's code
    must be importable (the model's code folder on sys.path: `code_on_path`)."""
    import torch
    from safetensors.torch import load_model

    from .builtin import build_model
    from ..task import LabelUnits, label_scale
    from ..user_code import import_object

    d = json.loads(Path(module).read_text())
    if d.get("format") != FORMAT:
        raise ValueError(f"{module}: format {d.get('format')!r} is not one this shardline reads ({FORMAT})")
    manifest = ShardManifest.model_validate(d["manifest"])
    # Settings a later shardline no longer has are left out (they cannot shape the module it
    # builds); code_paths were the training machine's folders, whose code is in the model now.
    # Models written before the mesh and the strategy sub-tables hold their settings under
    # earlier names: read under today's (no line: nobody typed them).
    stored, _ = renamed(d["training"])
    known = {k: v for k, v in stored.items() if k in TrainingConfig.model_fields}
    cfg = TrainingConfig(**{**known, "code_paths": []})
    # build_model seeds torch's generator; a scorer's own random state is none of its business.
    with torch.random.fork_rng(devices=[]):
        if "factory" in d:  # a loop's model of its own class (training.loop.register)
            model = import_object(d["factory"]["path"], "the registered model's factory")(**d["factory"]["args"])
        else:
            model = build_model(manifest, cfg)
    load_model(model, weights, strict=True, device="cpu")
    io = d.get("io") or {}
    # A regression model that learnt the standardised label answers in the label's units.
    scale = label_scale(manifest, cfg.loss)
    if scale is not None and io.get("output", "task") == "task":
        model = LabelUnits(model, *scale)
    model.shardline_io = io  # what a loop's model takes and gives (serving reads it); {}: the dataset's
    return model.eval()



def code_folders(cfg) -> list[str]:
    """The user's code to store with the model: the factory's, the loss's and the metrics'
    packages (unless installed) and `training.code_paths`: the folders the job shipped."""
    return job_code_folders(cfg)


@contextmanager
def code_on_path(code_dir: str | None):
    """The model's code folder importable while the module is built, then off sys.path.

    First on the path, so the model's own packages are the ones imported; shardline itself,
    already imported, is not re-imported from the model's copy (a submodule import goes
    through the imported package's __path__). Modules imported from it stay in sys.modules
    after: the folder may be deleted once the module is built."""
    if not code_dir or not os.path.isdir(code_dir):
        yield
        return
    sys.path.insert(0, code_dir)
    try:
        yield
    finally:
        if code_dir in sys.path:
            sys.path.remove(code_dir)
        sys.path_importer_cache.pop(code_dir, None)
