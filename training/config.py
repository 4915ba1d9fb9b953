"""Config owned by `training`: the trainer, its launcher and MLflow tracking."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field
from pydantic.fields import FieldInfo

from shardline.foundation.section import Section
from shardline.pipelines.manifest import BandwidthPlan

from .strategy_settings import DdpSettings, MeshSettings, PipelineSettings, PsSettings, TABLES, TensorSettings


class TrainingConfig(Section):
    launcher: Literal["spark", "dask", "local"] = Field(
        "spark",
        description="spark: a barrier stage; dask: one rank per Dask worker; "
        "local: processes on this machine.",
    )
    world_size: int = Field(2, ge=1, description="Ranks (processes) that train together.")
    strategy: str = Field(
        "ddp", description="Parallel strategy: ddp, fsdp, tensor, pipeline: shorthands for the device "
        "mesh ([training.mesh]), each naming the dimension that takes what the others leave of "
        "world_size (ddp: dp_replicate, fsdp: dp_shard, tensor: tp, pipeline: pp); ps: parameter "
        "servers, no mesh (training.strategies).",
    )
    # The device mesh and each strategy's own settings (training.strategy_settings).
    mesh: MeshSettings = Field(default_factory=MeshSettings, description="The device mesh's dimensions.")
    ddp: DdpSettings = Field(default_factory=DdpSettings, description="Plain data parallel's settings.")
    tensor: TensorSettings = Field(default_factory=TensorSettings, description="Tensor parallel's settings.")
    pipeline: PipelineSettings = Field(
        default_factory=PipelineSettings, description="Pipeline parallel's settings."
    )
    ps: PsSettings = Field(default_factory=PsSettings, description="strategy ps's settings.")
    model: str = Field(
        "mlp", description="The model: a built-in name (mlp, cnn, transformer; decoder for task "
        "next_token) or the import path "
        "of your own factory, 'package.module:callable', which receives the prepared inputs' "
        "description and training.model_args and returns an nn.Module.",
    )
    model_args: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for the model factory, called as "
        "factory(inputs, **model_args) (inputs: training.models.inputs.ModelInputs). A built-in takes "
        "training.hidden, heads and embedding_dim as its defaults, which these override.",
    )
    loop: str | None = Field(
        None, description="Your own training loop, 'package.module:function': a function of one "
        "argument, the loop context (training.loop.context.LoopContext), run on every rank inside "
        "the process group; it builds its models, reads ctx.loader(split), checkpoints with "
        "ctx.save / ctx.restore, logs with ctx.log and registers with ctx.register. Unset: "
        "shardline's own loop trains training.model.",
    )
    loop_args: dict[str, Any] = Field(
        default_factory=dict, description="The loop's own settings, given to it as ctx.args "
        "([training.loop_args] in the TOML).",
    )
    loss: str | None = Field(
        None, description="Your own loss, 'package.module:callable' taking (output, target) and "
        "returning a scalar tensor, or a built-in by name: next_token (logits [B, L, V] against "
        "the tokens one position ahead, pads ignored). Unset: cross-entropy for classification, "
        "MSE for regression, next_token for task next_token.",
    )
    metrics: list[str] = Field(
        default_factory=list, description="Your own metrics, each 'package.module:callable' taking "
        "(output, target) and returning a number; computed on the validation split and logged to "
        "MLflow under the callable's name.",
    )
    code_paths: list[str] = Field(
        default_factory=list, description="Folders (or .py files) of your own code shipped to every "
        "rank and executor and stored with the registered model, beside the package that "
        "training.model's import path names (found from the folder the command runs in).",
    )
    hidden: list[int] = Field(
        default_factory=lambda: [128, 64],
        description="mlp: hidden widths; cnn: hidden[0] channels; transformer: hidden[0] is "
        "d_model and len(hidden) the layers.",
    )
    heads: int = Field(4, ge=1, description="Attention heads (transformer).")
    embedding_dim: int = Field(8, ge=1, description="Width of each categorical embedding.")
    epochs: int = Field(5, ge=1, description="Passes over the train split.")
    batch_size: int = Field(
        512,
        ge=1,
        description="Global batch size, split evenly over ranks; the learning rate below "
        "is for this global batch, so changing world_size does not change the optimisation.",
    )
    lr: float = Field(3e-3, gt=0, description="Adam learning rate for `batch_size`.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    lr_schedule: Literal["constant", "cosine", "step"] = Field(
        "constant",
        description="After warmup: constant, cosine decay to 0 over the run, or x0.1 every third of it.",
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warmup from 0 over this many steps.")
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="bf16: forward and loss under torch.autocast (weights stay fp32)."
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute each block's activations in backward to save memory."
    )
    seed: int = Field(0, description="Seeds weights, shuffling and dropout.")
    loader_workers: int | None = Field(
        None, ge=0, description="Threads per rank decoding row groups ahead of training; 0 reads "
        "inline in the training thread; unset: the dataset's bandwidth plan's "
        "(`shardline plan`), else 1. Never changes the sample order.",
    )
    prefetch_depth: int = Field(
        8, ge=1, description="Batches queued ahead of the training step. Never changes the "
        "sample order. Below ~8 the hand-over of each batch between threads shows: "
        "with 2, `shardline bench loader` measured ~0.1 x raw pyarrow less than with 8.",
    )
    shuffle_buffer_rows: int = Field(
        65_536, ge=0, description="Rows mixed across row groups by the shuffle buffer (per rank; "
        "memory = rows x features x 4 bytes). Shard and row-group order are shuffled too.",
    )
    remainder: Literal["drop", "pad"] = Field(
        "drop", description="Ranks with unequal rows: drop runs every rank for the smallest "
        "rank's whole batches (leaving out other rows, freshly drawn each epoch); pad runs the "
        "largest rank's (rounded up to a whole batch) and repeats rows on the others.",
    )
    verify_shards: bool = Field(
        False, description="Check every shard's sha256 against the manifest before training "
        "(reads each shard once more).",
    )
    data_wait_warning: float = Field(
        0.05, ge=0, le=1, description="Rank 0 warns (once per job) when a rank waits for data "
        "longer than this share of its step time, the wait also being long enough to matter "
        "(data_wait_warning_min_s, data_wait_warning_min_steps).",
    )
    data_wait_warning_min_s: float = Field(
        5.0, ge=0, description="Seconds a rank must wait for data in one epoch before the "
        "data-wait warning fires: a short run's start-up wait is no bottleneck worth tuning.",
    )
    data_wait_warning_min_steps: int = Field(
        20, ge=0, description="Steps an epoch must take before the data-wait warning fires: "
        "over a few steps the first batch's wait alone is a large share.",
    )
    threads_per_rank: int = Field(
        1, ge=1, description="torch intra-op threads per rank; ranks x threads <= cores."
    )
    log_every_steps: int = Field(50, ge=1, description="Per-step metrics every N steps.")
    socket_ifname: str | None = Field(
        None, description="Network interface(s) the ranks' collectives use, comma-separated, "
        "exported as GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME in each rank before the process "
        "group starts: needed where a host name resolves to loopback (ranks on different hosts "
        "would advertise 127.0.0.1); unset: the environment's choice. Every host must have it.",
    )
    timeout_s: int = Field(
        300, ge=10, description="Process-group timeout: a stalled peer fails the job after it."
    )
    checkpoint_dir: str = Field(
        "shardline-data/checkpoints", description="Where checkpoints go, one job per directory; "
        "unset: a folder of the job's own, shardline-data/checkpoints/<experiment>/<registered "
        "model>-<hash of its settings and dataset> (training.checkpoints.fingerprint.job_dir). A new job "
        "clears its own earlier checkpoints and refuses a directory holding another job's.",
    )
    checkpoint_every_steps: int = Field(
        0, ge=0, description="Also checkpoint every N optimizer steps; 0: only at epoch ends."
    )
    keep_checkpoints: int = Field(3, ge=1, description="Newest checkpoints kept on disk.")
    resume: bool = Field(
        False, description="Continue from the latest checkpoint in checkpoint_dir (--resume)."
    )
    resume_allow_changed: list[str] = Field(
        default_factory=list, description="Fingerprint fields a resume may change (lr, weight_decay, "
        "lr_schedule, warmup_steps, epochs, dataset_version, code: the user's code files; "
        "--allow-changed); any other difference from the checkpoint's config or code is refused, "
        "naming the fields (the code: its files).",
    )
    max_restarts: int = Field(
        2, ge=0, description="Relaunches after a rank is lost (a killed process or worker); each "
        "resumes from the latest checkpoint. Permanent errors (permissions, a full disk, bad data) "
        "are never retried.",
    )
    lease_ttl_s: float = Field(
        60.0, ge=3, description="Life of the checkpoint directory's lease (one job per directory); "
        "the driver renews it every third of this, and ranks whose driver stopped renewing it stop "
        "within about this long.",
    )

    def setting(self, path: str) -> Any:
        """A setting by its name under `training` ("lr", "pipeline.micro_batches")."""
        value: Any = self
        for part in path.split("."):
            value = getattr(value, part)
        return value

    def loader_workers_for(self, plan: BandwidthPlan | None) -> int:
        """loader_workers if set, else the plan's workers per rank, else 1.

        The plan's figure is used whatever world size it was made for: workers only
        change throughput, never the sample order, so a stale plan cannot change results.
        """
        if self.loader_workers is not None:
            return self.loader_workers
        if plan is not None and plan.loader_workers_per_rank:
            return plan.loader_workers_per_rank
        return 1


def setting_field(path: str) -> FieldInfo:
    """The pydantic field of a training setting by its name ("lr", "pipeline.micro_batches")."""
    table, _, field = path.rpartition(".")
    return TABLES[table].model_fields[field] if table else TrainingConfig.model_fields[field]


class TrackingConfig(Section):
    tracking_uri: str | None = Field(
        None,
        description="MLflow tracking URI; default $MLFLOW_TRACKING_URI, else "
        "sqlite:///<cwd>/mlflow.db.",
    )
    experiment: str = Field("shardline", description="MLflow experiment name.")
    registered_model: str = Field(
        "shardline-model", description="Model Registry name the final model is registered as."
    )
    outage_wait_s: float = Field(
        300.0, ge=0,
        description="When training ends while the MLflow server is unreachable: how long the driver "
        "waits for it to send what was kept and register the model, before ending in one line that "
        "names the checkpoint holding the trained weights. Training itself never waits on MLflow.",
    )

    def resolved_uri(self) -> str:
        if self.tracking_uri:
            return self.tracking_uri
        if os.environ.get("MLFLOW_TRACKING_URI"):
            return os.environ["MLFLOW_TRACKING_URI"]
        return f"sqlite:///{Path.cwd() / 'mlflow.db'}"
