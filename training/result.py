"""What a training job gives back: one result for the API, the CLI's --json and the tests.
Torch-free, so `import shardline` pulls in no engine."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from shardline.foundation.redact import redact


@dataclass
class TrainResult:
    """What a training job gives back (`shardline.train` returns it; `to_dict` is the CLI's --json)."""

    run_id: str
    model_uri: str | None  # models:/NAME/VERSION, runs:/ID/model when only logged; None: a loop registered none
    model_name: str
    model_version: str  # "" when not registered
    tracking_uri: str
    metrics: dict[str, float]
    checkpoint_dir: str
    launcher: str
    stopped_early: bool = False  # the epoch hook (a sweep's pruner) stopped it before training.epochs
    # The final plain-model state dict, and rank 0's tensor collectives by (call, device
    # type), each checked against the rank's device (training.collectives): for tests and
    # benchmarks, not for --json.
    weights: dict = field(default_factory=dict, repr=False)
    collective_calls: dict = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict:
        # Not asdict(): it would deep-copy every weight only to leave them out.

        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("weights", "collective_calls")}
        # Printed (--json): a tracking URI's password masked, as in every line; the object keeps it.
        return {**out, "metrics": dict(self.metrics), "tracking_uri": redact(self.tracking_uri)}
