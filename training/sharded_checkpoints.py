"""Sharded checkpoints with torch.distributed.checkpoint (DCP), and resuming at another mesh.

A strategy whose rank holds DTensor shards (fsdp, tensor) checkpoints them with
DCP: every rank writes its own shards of the model and the optimizer state in
parallel, into one directory per checkpoint beside the checkpoint's small file
(`training.checkpoints`), and nothing is gathered to one rank. The state is keyed by
the plain model's parameter names (torch's state-dict API), and DCP's load plans the
reads for the mesh that loads it, so a checkpoint written by 4 ranks loads on 2 and
the reverse, or on one process with no group at all (`load_plain`).

    checkpoint_dir/
      ckpt-000000120.pt              small: step, epoch, loader position, schedule, RNG,
                                     fingerprint; "sharded" names the directory below
      ckpt-000000120-3f9a1c.dcp/     DCP: .metadata (rank 0, last) and __<rank>_0.distcp

The directory is complete before the small file that names it is written (dcp.save
returns on every rank after rank 0 wrote .metadata), and the small file is the commit.

Resuming at another mesh (world_size, dp, tp, dp_shard, tp_plan): the weights and
optimizer state reshard; the loader's order within an epoch depends on how many
ranks read data, so a checkpoint taken mid-epoch resumes only with the same number
of them; at an epoch end any number does (the next epoch's order is the new
world's). `check_resume` says so before anything starts. ddp's single-file
checkpoints (replicated state) reshard the same way; ps and pipeline ones (one
optimizer shard per rank, laid out for its ranks) do not.

Storage: the small file goes through `pipelines.storage` like every checkpoint (the
LATEST pointer names it: the commit). The DCP directory goes through it too
(`training.dcp_storage`: DCP's file-system seam over pyarrow.fs/boto3), so it may be
local, a shared mount or an object store.
"""

from __future__ import annotations

import uuid

from shardline.pipelines import storage
from shardline.pipelines.errors import ConfigError

from . import collectives
from .config import TrainingConfig

# torch.distributed.checkpoint is imported inside save() and load(): with DTensor and sympy
# it is ~0.6 s of every rank's start (each rank imports this module), and only fsdp and
# tensor ranks use it.

SUFFIX = ".dcp"
# The settings that shape only the mesh: a reshardable checkpoint may differ in them.
MESH_FIELDS = ("world_size", "dp", "tp", "dp_shard", "tp_plan")
# Strategies whose ranks write DCP shards.
SHARDED = ("fsdp", "tensor")
# Strategies whose checkpoints reshard (ddp: replicated state; fsdp, tensor: DCP).
RESHARDABLE = ("ddp", *SHARDED)


def new_name(global_step: int) -> str:
    """A fresh directory name, the same on every rank (rank 0's). Collective."""
    mine = f"ckpt-{global_step:09d}-{uuid.uuid4().hex[:6]}{SUFFIX}"
    return collectives.all_gather_object(mine)[0]


def save(model, optimizer, directory: str) -> None:
    """Every rank writes its shards of the model and optimizer state. Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from . import dcp_storage

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, storage_writer=dcp_storage.writer(directory))


def load(model, optimizer, directory: str) -> None:
    """Every rank reads the pieces of its own shards, whatever mesh wrote them. Collective.
    In a process with no process group it loads an ordinary model and optimizer (DCP then
    reads every piece itself): that is how a sharded checkpoint becomes a plain one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from . import dcp_storage

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, storage_reader=dcp_storage.reader(directory))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def _step(name: str) -> int:
    return int(name.split("-")[1].split(".")[0])


def prune(checkpoint_dir: str) -> None:
    """Remove the sharded directories no kept checkpoint can name: those older than the
    oldest one kept (every one, when none is). A directory a lost attempt wrote at a kept
    step goes once that step is rotated out."""
    from .checkpoints import checkpoint_paths

    heads = checkpoint_paths(checkpoint_dir)
    oldest = _step(storage.name(heads[0])) if heads else None
    for info in storage.list_dir_info(checkpoint_dir):
        name = info.base_name
        if name.startswith("ckpt-") and name.endswith(SUFFIX) and (oldest is None or _step(name) < oldest):
            storage.delete_tree(storage.join(checkpoint_dir, name))


def comparable(fingerprint: dict[str, str] | None) -> dict[str, str]:
    """The fingerprint a checkpoint must match to be from the same run: all but the mesh,
    which check_resume judges on the driver (it may change where the checkpoint reshards)."""
    return {k: v for k, v in (fingerprint or {}).items() if k not in MESH_FIELDS}


def check_resume(head: dict, cfg: TrainingConfig, data_world: int, where: str) -> bool:
    """Refuse, before anything starts, a resume the checkpoint cannot be resharded to
    (ConfigError naming the setting and why). True when the mesh differs from the one
    that wrote it (the ranks then reshard), False when it is the same."""
    saved = head.get("fingerprint", {})
    changed = [f for f in MESH_FIELDS if f in saved and saved[f] != str(getattr(cfg, f))]
    if not changed:
        return False
    was = ", ".join(f"training.{f} {saved[f]}" for f in changed)
    now = ", ".join(f"{getattr(cfg, f)}" for f in changed)
    if cfg.strategy not in RESHARDABLE:
        raise ConfigError(
            f"{where}: written with {was}, resumed with {now}: strategy '{cfg.strategy}' "
            f"checkpoints hold each rank's own optimizer state laid out for its ranks and cannot be "
            f"resharded (ddp, fsdp and tensor checkpoints can); resume with the same settings"
        )
    saved_world = head.get("loader", {}).get("world_size")
    if head.get("step_in_epoch", 0) != 0 and saved_world != data_world:
        raise ConfigError(
            f"{where}: written mid-epoch (epoch {head['epoch'] + 1}, step {head['step_in_epoch']}) "
            f"by {saved_world} data-parallel ranks, resumed with {data_world} ({was} -> {now}): the "
            f"loader's order within an epoch depends on how many ranks read data, so resume it with "
            f"the same data-parallel degree, or from a checkpoint taken at an epoch end"
        )
    return True
