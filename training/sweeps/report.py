"""What a sweep leaves: each trial's outcome, the best trial registered under the alias,
and the parent run's summary (trials.csv, trials.md, sweep.png and counts as metrics)."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..mlflow_quiet import registry_said_nothing
from .study import decode


@dataclass
class TrialOutcome:
    number: int
    state: str  # complete | pruned | failed | running | waiting
    value: float | None  # objective: final for complete, last reported for pruned
    params: dict
    epochs: int  # epochs reported to the pruner
    run_id: str | None
    error: str | None
    seconds: float | None


def outcome(t) -> TrialOutcome:
    from optuna.trial import TrialState

    state = {
        TrialState.COMPLETE: "complete",
        TrialState.PRUNED: "pruned",
        TrialState.FAIL: "failed",
        TrialState.RUNNING: "running",
        TrialState.WAITING: "waiting",
    }[t.state]
    value = t.value if state == "complete" else None
    if state == "pruned" and t.intermediate_values:
        value = t.intermediate_values[max(t.intermediate_values)]
    seconds = None
    if t.datetime_start and t.datetime_complete:
        seconds = (t.datetime_complete - t.datetime_start).total_seconds()
    return TrialOutcome(
        t.number, state, value, {n: decode(n, v) for n, v in t.params.items()},
        len(t.intermediate_values), t.user_attrs.get("mlflow_run_id"), t.user_attrs.get("error"),
        seconds,
    )


def register_best(client, name: str, alias: str, run_id: str) -> str:
    """Register the best trial's logged model and point the alias at it (once per best run)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    try:
        current = client.get_model_version_by_alias(name, alias)
        if current.run_id == run_id:
            return str(current.version)
    except MlflowException:
        pass  # no such model or alias yet
    # MLflow 3 keeps a logged model under its own id (models:/m-...), not in the run's artifacts.
    run = client.get_run(run_id)
    logged = client.search_logged_models(
        [run.info.experiment_id], filter_string=f"source_run_id = '{run_id}'"
    )
    source = logged[0].model_uri if logged else f"runs:/{run_id}/model"
    with registry_said_nothing():
        version = mlflow.register_model(source, name).version
    client.set_registered_model_alias(name, alias, version)
    return str(version)


def log_summary(client, parent: str, study, outcomes, sweep, direction, best) -> None:
    """sweep/trials.csv, sweep/trials.md and sweep/sweep.png on the parent run; counts as metrics."""
    import csv

    importances = _importances(study)
    names = list(sweep.space)
    header = ["trial", "state", sweep.objective, "epochs", "seconds", *names, "run_id", "error"]
    rows = [
        [t.number, t.state, _num(t.value), t.epochs, _num(t.seconds),
         *[_cell(t.params.get(n)) for n in names], t.run_id or "", t.error or ""]
        for t in outcomes
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        with open(Path(tmp) / "trials.csv", "w", newline="") as f:
            csv.writer(f).writerows([header, *rows])
        md = [f"# sweep {sweep.name}: {sweep.objective} ({direction})", ""]
        if best:
            md += [f"best: trial {best.number}, {sweep.objective} {best.value:.4g}, {fmt_params(best.params)}", ""]
        md += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        md += ["| " + " | ".join(_short(c).replace("|", "/") for c in r) + " |" for r in rows]
        if importances:
            md += ["", "parameter importance: " + ", ".join(f"{k} {v:.2f}" for k, v in importances.items())]
        (Path(tmp) / "trials.md").write_text("\n".join(md) + "\n")
        _plot(Path(tmp) / "sweep.png", outcomes, sweep.objective, direction, importances)
        client.log_artifacts(parent, tmp, "sweep")
    metrics = {f"trials_{s}": sum(t.state == s for t in outcomes) for s in ("complete", "pruned", "failed")}
    if best:
        metrics[f"best_{sweep.objective}"] = best.value
    metrics.update({f"importance.{k}": v for k, v in importances.items()})
    for k, v in metrics.items():
        client.log_metric(parent, k, v)


def _importances(study) -> dict[str, float]:
    import optuna
    from optuna.trial import TrialState

    if len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))) < 2:
        return {}
    try:
        return optuna.importance.get_param_importances(study)
    except (ValueError, RuntimeError, ZeroDivisionError):
        return {}  # e.g. every completed trial had the same parameters


def _plot(path: Path, outcomes, objective: str, direction: str, importances: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.8))
    styles = {"complete": ("o", "tab:blue"), "pruned": ("x", "tab:orange")}
    for state, (marker, color) in styles.items():
        pts = [(t.number, t.value) for t in outcomes if t.state == state and t.value is not None]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, color=color, label=state)
    complete = sorted((t.number, t.value) for t in outcomes if t.state == "complete")
    if complete:
        pick = max if direction == "maximize" else min
        best = [pick(v for _, v in complete[: i + 1]) for i in range(len(complete))]
        ax.step([n for n, _ in complete], best, where="post", color="tab:green", label="best so far")
    failed = [t.number for t in outcomes if t.state == "failed"]
    for n in failed:
        ax.axvline(n, color="tab:red", alpha=0.3, lw=3, label="failed" if n == failed[0] else None)
    ax.set(xlabel="trial", ylabel=objective, title=f"{objective} per trial")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend()
    ax.grid(alpha=0.3)
    if importances:
        keys = list(importances)[::-1]
        bx.barh(keys, [importances[k] for k in keys], color="tab:purple")
        bx.set(xlabel="importance", title="parameter importance")
    else:
        bx.text(0.5, 0.5, "needs 2 or more complete trials\nwith different parameters",
                ha="center", va="center", transform=bx.transAxes)
        bx.set_axis_off()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _num(v) -> str:
    return "" if v is None else f"{v:.6g}"


def _short(cell) -> str:
    try:
        return f"{float(cell):.4g}" if "." in cell else cell
    except (TypeError, ValueError):
        return str(cell)


def _cell(v) -> str:
    return "" if v is None else json.dumps(v) if isinstance(v, list) else str(v)


def fmt_params(params: dict) -> str:
    return ", ".join(f"{k}={_cell(v) if not isinstance(v, float) else f'{v:.4g}'}" for k, v in params.items())
