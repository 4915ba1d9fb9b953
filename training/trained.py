"""The trained model on the driver, once the ranks are done: the module a loop registered
(shardline's own loop: training.model) rebuilt with its weights, logged in the job's run
and registered (training.job runs this last)."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

import torch

from .loop.register import call_factory
from .mlflow_outage import when_reachable
from .models.builtin import build_model
from .models.registered import log_trained_model
from .tracking import describe_version, log_curves

if TYPE_CHECKING:
    from .job import TrainingJob


def log_trained(job: TrainingJob, result: dict, run_id: str, register: bool) -> tuple[torch.nn.Module | None, str]:
    """The curves, and the registered model logged in the run and registered (register False:
    logged only); (the model, its version), (None, "") when the loop registered none."""
    tracking, uri, latest = job.tracking, job.tracking_uri, job.store.latest

    # The driver's own calls: a server down as training ends is waited for like one down during it.
    def reachable(call):
        return when_reachable(call, uri, tracking.outage_wait_s, latest())

    reachable(lambda: log_curves(run_id, [k for k in result["metrics"] if not k.startswith("rank")]))
    registered = result.get("registered")
    if registered is None:
        return None, ""
    model = registered_module(job, registered)
    name = tracking.registered_model if register else None
    version = reachable(lambda: log_trained_model(model, job.manifest, job.cfg, name, job.code, loop_model=registered))
    if version:
        reachable(lambda: describe_version(tracking.registered_model, version, job.cfg, job.manifest,
                                           job.dataset_dir, result["metrics"]))
    return model, version


def registered_module(job: TrainingJob, registered: dict) -> torch.nn.Module:
    """The module the ranks registered, with its trained weights: the model the checks built
    (from this job's code), or the loop's factory's (training.loop.register)."""
    weights = torch.load(io.BytesIO(registered["state_dict"]), weights_only=True)
    if registered["factory"] is None:
        model = job.model if job.model is not None else build_model(job.manifest, job.cfg)
    else:
        model = call_factory(registered["factory"], registered["args"], job.cfg.code_paths)
    model.load_state_dict(weights)
    return model
