"""Checkpoints with torch.distributed.checkpoint (DCP): one path for every mesh and for ps,
and resuming at another mesh.

Every rank writes what it holds of its state's tensors, in parallel, into one directory
per checkpoint beside the checkpoint's small file; nothing is gathered to one rank
(training.checkpoints.state splits a loop's nested state into DCP's tensors and the small
file's plain values). shardline's own loop keys its state by the plain model's parameter
names, the same for every layout (Parallel.checkpoint_parts: a plain-named module and its
optimizer):

    model.<name>                         a weight (or buffer) of the plain model
    optimizer.state.<name>.<key>         its optimizer state (AdamW: exp_avg, exp_avg_sq, step)

A tensor is whatever the rank holds: a DTensor where the mesh shards or splits it (FSDP2,
tensor parallel, both), a plain tensor where it does not (ddp's replicas: DCP writes each
once, spread over the ranks; a pipeline rank's stages; a parameter server's shard, as a
module: `module_of`; ps workers write nothing, their replicas are the servers' values).
The optimizers' hyperparameters are plain values: each rank's are in the small file. DCP's
load plans the reads for the ranks that load, so a checkpoint written by one mesh loads on
any other ({dp_shard 2, tp 2} on {dp_shard 4}, on {tp 2}, on {pp 2, tp 2}; 4 ranks on 2):
each rank reads the pieces of what it holds now. With no process group at all it reads
everything (`read_weights`: a checkpoint's plain weights, in one process;
training.checkpoints.state.read_tensors: a plain model and optimizer, in one process).

    checkpoint_dir/
      ckpt-000000120-9c0e2b.pt       small: step, epoch, loader position, each rank's plain
                                     values (schedule, loader, ...) and RNG, fingerprint;
                                     "sharded" names the directory below. No weights.
      ckpt-000000120-3f9a1c.dcp/     DCP: .metadata (rank 0, last) and __<rank>_0.distcp

The directory is complete before the small file that names it is written (dcp.save
returns on every rank after rank 0 wrote .metadata), and the small file is the commit.

The directory's name (`CheckpointStore.new_dcp_name`) and its pruning with the rotation are
the checkpoint folder's owner's (`training.checkpoints.store`); this module reads what is in
it and judges a resume at another mesh.

Resuming at another mesh (`fingerprint.MESH_FIELDS`: world_size, the mesh's degrees,
ps.servers, the plans): the weights and optimizer state reshard; the loader's order within
an epoch depends on how many ranks read data, so a checkpoint taken mid-epoch resumes only
with the same number of them; at an epoch end any number does (the next epoch's order is the
new world's). `check_resume` says so before anything starts.

Storage: the small file goes through `foundation.storage` like every checkpoint (the
LATEST pointer names it: the commit). The DCP directory goes through it too
(`training.checkpoints.dcp_storage`: DCP's file-system seam over pyarrow.fs/boto3), so it may be
local, a shared mount or an object store.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from shardline.foundation import failures, storage
from shardline.foundation.errors import ConfigError, StorageError, first_line

from .store import CheckpointStore
from .fingerprint import MESH_FIELDS, settings, upgraded
from ..config import TrainingConfig

# Imported inside the functions that use them: torch (~2 s: only where a model or a rank runs);
# training.checkpoints.dcp_storage (imports torch).

# The small file's layout (its "layout"): 2 since a loop's nested state is checkpointed
# (training.checkpoints.state: tensors in DCP, plain values per rank in the small file).
LAYOUT = 2

# torch.distributed.checkpoint is imported inside the functions that save or load: with
# DTensor and sympy it is ~0.6 s, which a driver that only reads the small file never needs.


def module_of(params: dict):
    """A module whose parameters are `params`, each under its dotted name (submodules made
    along the way): a rank holding parameters of no module of its own (a parameter server's
    shard) gets one whose state-dict names are the plain model's."""
    from torch import nn

    root = nn.Module()
    for name, p in params.items():
        *path, leaf = name.split(".")
        node = root
        for part in path:
            if not hasattr(node, part):
                node.add_module(part, nn.Module())
            node = getattr(node, part)
        node.register_parameter(leaf, p)
    return root


@contextmanager
def rank_failure(directory: str, doing: str, writer=None) -> Iterator[None]:
    """DCP's failures as the rest of shardline's: DCP raises a CheckpointException (a
    BaseException) that wraps each rank's error. This rank's OSError (which the local
    writer keeps: dcp_storage.NotingFileSystem), else the first rank's error, is raised
    instead, so the launchers' one rule (foundation.failures) sees it: a full disk or a
    read-only store is one StorageError line and no relaunch; a lost connection relaunches."""
    from torch.distributed.checkpoint.api import CheckpointException

    import torch.distributed as dist

    try:
        yield
    except CheckpointException as e:
        me = dist.get_rank() if dist.is_initialized() else 0
        own = e.failures.get(me)
        cause = getattr(getattr(writer, "fs", None), "failed", None) or (
            own[0] if isinstance(own, tuple) else own)
        if cause is None:
            # Only other ranks failed: theirs are the errors that say why, and the launchers
            # report them. This one is a lost peer's (transient: never the reason shown).
            raise ConnectionError(
                f"rank(s) {', '.join(map(str, sorted(e.failures)))} failed to {doing} "
                f"{storage.display(directory)}"
            ) from None
        if not isinstance(cause, BaseException):
            raise
        if failures.is_permanent(cause):
            raise StorageError(
                f"training.checkpoint_dir: cannot {doing} {storage.display(directory)} ({first_line(cause, 160, with_type=True)})"
            ) from None
        raise cause from None


def _empty(meta):
    import torch

    size = getattr(meta, "size", None)
    if size is None:  # a non-tensor value (BytesStorageMetadata): DCP puts the object in its place
        return None
    return torch.empty(size, dtype=meta.properties.dtype)


def read_weights(head_url: str) -> dict:
    """The plain model's weights of a checkpoint (its small file's URL), read in this
    process with no process group: every piece, whichever ranks and strategy wrote them."""
    import torch.distributed.checkpoint as dcp

    from . import dcp_storage

    store = CheckpointStore.holding(head_url)
    directory = store.dcp_dir(head_url, store.read(head_url))
    saved = dcp_storage.reader(directory).read_metadata().state_dict_metadata
    weights = {k[len("model."):]: _empty(m) for k, m in saved.items() if k.startswith("model.")}
    state = {"model": weights}
    with rank_failure(directory, "read"):
        dcp.load(state, storage_reader=dcp_storage.reader(directory))
    return state["model"]


def check_resume(head: dict, cfg: TrainingConfig, data_world: int, where: str) -> bool:
    """Refuse, before anything starts, a resume the checkpoint cannot be resharded to
    (ConfigError naming the setting and why). True when the mesh differs from the one
    that wrote it (the ranks then reshard), False when it is the same."""
    if "sharded" in head and head.get("layout") != LAYOUT:
        # Until loops wrote any nested state, the optimizers' hyperparameters were pickled
        # into the DCP directory and each rank's schedule was a fixed entry of the small file.
        raise ConfigError(
            f"{where}: written by an earlier shardline (checkpoint layout {head.get('layout', 1)}; this one "
            f"reads {LAYOUT}): train from the start (without --resume), or resume it with the shardline that wrote it"
        )
    if "sharded" not in head:
        # Until every strategy wrote DCP, ddp, pipeline and ps checkpoints held the weights
        # in the small file, laid out for the ranks that wrote them.
        raise ConfigError(
            f"{where}: written by an earlier shardline (the weights in the checkpoint file itself, "
            f"not in a .dcp directory beside it), which this version does not resume: train from the "
            f"start (without --resume), or resume it with the shardline that wrote it"
        )
    saved = upgraded(head.get("fingerprint", {}))
    ours = settings(cfg, MESH_FIELDS)
    changed = [f for f in MESH_FIELDS if f in saved and saved[f] != ours[f]]
    if not changed:
        return False
    moved = ", ".join(f"training.{f} {saved[f]} -> {ours[f]}" for f in changed)
    saved_world = head.get("loader", {}).get("world_size")
    if head.get("step_in_epoch", 0) != 0 and saved_world != data_world:
        raise ConfigError(
            f"{where}: written mid-epoch ({_epoch_of(head)}step {head['step_in_epoch']}) "
            f"by {saved_world} data-parallel ranks, resumed with {data_world} ({moved}): the "
            f"loader's order within an epoch depends on how many ranks read data, so resume it with "
            f"the same data-parallel degree, or from a checkpoint taken at an epoch end"
        )
    return True


def _epoch_of(head: dict) -> str:
    """"epoch 3, " of a checkpoint that counts epochs (a user's loop may not)."""
    return f"epoch {head['epoch'] + 1}, " if isinstance(head.get("epoch"), int) else ""
