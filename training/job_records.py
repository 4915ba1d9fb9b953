"""What a training job's driver writes about the job itself (training.job), beside what its
ranks report into the run: a resume announced on the console and its allowed changes in the
run, a new job's params (its settings, the mesh as resolved, the dataset version), and the
checkpoint's own run continued when this MLflow store has it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardline.foundation import report, storage
from shardline.foundation.code_travel import UserCode
from shardline.pipelines.manifest import ShardManifest

from .config import TrainingConfig
from .tracking import log_dataset_input, log_forecast

if TYPE_CHECKING:
    from .job import Resume

# Imported inside the functions that use them: MLflow (~2.5 s: only where MLflow is called).


def announce_resume(resume: Resume, code: UserCode, epochs: int) -> tuple[str | None, list[str]]:
    """The lines of a resume: where it continues, what changed since (allowed), and a checkpoint
    too old to say which code wrote it. Returns the checkpoint's run id and the code files changed."""
    head = resume.head
    code_changes = code.changes(head.get("code_files") or {}) if "code" in resume.changed else []
    report.line(f"[shardline] resuming from {storage.display(resume.url)} (step "
                f"{head.get('global_step')}, epoch {head.get('epoch')} of {epochs} done)"
                + "".join(f"; {k} {old} -> {new}" if k != "code" else f"; code changed: {', '.join(code_changes)}"
                          for k, (old, new) in resume.changed.items()))
    if code.files and "code" not in head.get("fingerprint", {}):
        report.line(f"[shardline] {storage.display(resume.url)} was written before checkpoints kept the "
                    "code's digest: this job's code cannot be compared with the one that wrote it")
    return head["run_id"] or None, code_changes


def log_new_job(cfg: TrainingConfig, mesh: dict, manifest: ShardManifest, dataset_dir: str, code: UserCode) -> None:
    """A new job's params: the settings and the mesh (as settings), the dataset version and its rows;
    the dataset as the run's input, and the forecast `shardline plan --hosts` made, if any."""
    import mlflow

    mlflow.log_params({**_flat(cfg.model_dump()), **{f"mesh.{k}": v for k, v in mesh.items()}})
    mlflow.log_params({
        "dataset_dir": dataset_dir, "dataset_version": manifest.version_id,
        "dataset_sequence": manifest.sequence,
        **{f"rows_{s}": info.rows for s, info in manifest.splits.items()},
        # Values prepare filled in (on_invalid_features = impute), per column in the manifest.
        "imputed_values": sum(manifest.imputed_values.values()),
        # Which code trained it (the fingerprint's `code`): a user's model only.
        **({"code_digest": code.digest} if code.files else {}),
    })
    log_dataset_input(manifest, dataset_dir)
    log_forecast(dataset_dir)  # `shardline plan --hosts`'s, when it made one


def log_changed(changed: dict[str, tuple], step: int, code_changes: list[str] = ()) -> None:
    """A resume's allowed changes (--allow-changed lr) in the run: MLflow params cannot
    change, so each new value is a param of its own (`lr.from_step_120`) and a tag says
    what changed, from when. The code's: its digest, and a tag naming the files."""
    import mlflow

    mlflow.log_params({f"{k}.from_step_{step}": new for k, (_, new) in changed.items()})
    for k, (old, new) in changed.items():
        mlflow.set_tag(f"shardline.resume_changed.{k}", f"{old} -> {new} from step {step}")
    if code_changes:
        mlflow.set_tag("shardline.resume_changed.code_files", ", ".join(code_changes)[:5000])


def continue_run(run_id: str) -> str | None:
    """Resume into the checkpoint's own run (and experiment), if this store has it."""
    import mlflow
    from mlflow.exceptions import MlflowException

    try:
        run = mlflow.get_run(run_id)
    except MlflowException:
        return None  # another tracking store: the resumed job gets a new run
    mlflow.set_experiment(experiment_id=run.info.experiment_id)
    return run_id


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
