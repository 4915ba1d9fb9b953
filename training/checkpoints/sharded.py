"""Checkpoints with torch.distributed.checkpoint (DCP): one path for every mesh and for ps,
and resuming at another mesh.

Every rank writes what it holds of the model and the optimizer state, in parallel, into
one directory per checkpoint beside the checkpoint's small file
(`training.checkpoints.fingerprint`); nothing is gathered to one rank. A rank's state is
its Parallel's `state_dict()` (`state_of`), keyed by the plain model's names, the same for
every layout:

    model.<name>                         a weight (or buffer) of the plain model
    optimizer.state.<name>.<key>         its optimizer state (AdamW: exp_avg, exp_avg_sq, step)
    optimizer.param_groups               hyperparameters (lr, betas, ...)

A tensor is whatever the rank holds: a DTensor where the mesh shards or splits it (FSDP2,
tensor parallel, both), a plain tensor where it does not (ddp's replicas: DCP writes each
once, spread over the ranks; a pipeline rank's stages; a parameter server's shard). DCP's
load plans the reads for the ranks that load, so a checkpoint written by one mesh loads on
any other ({dp_shard 2, tp 2} on {dp_shard 4}, on {tp 2}, on {pp 2, tp 2}; 4 ranks on 2):
each rank reads the pieces of what it holds now. With no process group at all it reads
everything (`read_weights`, `load_into`: a checkpoint in one process).

    checkpoint_dir/
      ckpt-000000120-9c0e2b.pt       small: step, epoch, loader position, each rank's
                                     schedule and RNG, fingerprint; "sharded" names the
                                     directory below. No weights.
      ckpt-000000120-3f9a1c.dcp/     DCP: .metadata (rank 0, last) and __<rank>_0.distcp

The directory is complete before the small file that names it is written (dcp.save
returns on every rank after rank 0 wrote .metadata), and the small file is the commit.

The directory's name (`CheckpointStore.new_dcp_name`) and its pruning with the rotation are
the checkpoint folder's owner's (`training.checkpoints.store`); this module writes and reads
what is in it.

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
from shardline.foundation.errors import ConfigError, StorageError

from .store import CheckpointStore, error_cause
from .fingerprint import MESH_FIELDS, settings, upgraded
from ..config import TrainingConfig

# torch.distributed.checkpoint is imported inside the functions that save or load: with
# DTensor and sympy it is ~0.6 s, which a driver that only reads the small file never needs.


def state_of(parts: dict) -> dict:
    """A rank's checkpoint state (the module's docstring) from its parts
    (Parallel.checkpoint_parts: a plain-named module and its optimizer): the tensors
    themselves, not copies (DCP loads into them in place); the optimizer's state keyed by its
    parameters' names in the module. An optimizer that never stepped gets its state first
    (`materialise`): a load needs the tensors to read into."""
    module, optimizer = parts.get("model"), parts.get("optimizer")
    state: dict = {"model": module.state_dict() if module is not None else {}}
    if optimizer is None:
        return state
    if not optimizer.state:
        materialise(optimizer)
    names = {id(p): n for n, p in module.named_parameters()}
    state["optimizer"] = {
        # The optimizer's own per-parameter dicts: DCP sets their non-tensor values in place too.
        "state": {names[id(p)]: s for p, s in optimizer.state.items()},
        # Without "params" (indices, which differ between ranks): the same on every rank
        # holding an optimizer, since every rank runs the same schedule.
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
    }
    return state


def load_state(parts: dict, state: dict) -> None:
    """Put `state` (state_of's layout, read by DCP) into the parts' module and optimizer.
    What DCP read in place (into the very tensors state_of gave) is left as it is."""
    import torch

    module, optimizer = parts.get("model"), parts.get("optimizer")
    if module is not None:
        with torch.no_grad():
            for name, target in module.state_dict().items():
                got = state.get("model", {}).get(name)
                if got is not None and not _same(got, target):
                    target.copy_(got)
    if optimizer is None or "optimizer" not in state:
        return
    names = {id(p): n for n, p in module.named_parameters()}
    saved = state["optimizer"]
    for p, own in optimizer.state.items():
        for key, value in saved["state"].get(names[id(p)], {}).items():
            if isinstance(value, torch.Tensor) and isinstance(own.get(key), torch.Tensor):
                if not _same(value, own[key]):
                    own[key].copy_(value)
            else:
                own[key] = value
    for group, hyper in zip(optimizer.param_groups, saved["param_groups"], strict=True):
        group.update({k: v for k, v in hyper.items() if k != "params"})


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


def _same(a, b) -> bool:
    local = (lambda t: t.to_local() if hasattr(t, "to_local") else t)
    return local(a).data_ptr() == local(b).data_ptr()


def materialise(optimizer) -> None:
    """Give an optimizer that never stepped its per-parameter state, equal to a fresh one's:
    one step with zero gradients at learning rate 0 (as torch's get_state_dict does), its
    `step` counters then put back to 0. For torch's optimizers that is exactly the state the
    first real step would start from (Adam's moments 0, SGD's momentum buffer 0), so the
    same state saved before any step resumes like a fresh start. Gradients and learning
    rates are put back as they were."""
    import torch

    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if not params:
        return
    grads = [p.grad for p in params]
    rates = [g["lr"] for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, rates):
        g["lr"] = lr
    for p, grad in zip(params, grads):
        p.grad = grad
    for s in optimizer.state.values():
        if "step" in s:
            s["step"] = torch.zeros_like(s["step"]) if isinstance(s["step"], torch.Tensor) else 0


def save(state: dict, directory: str) -> None:
    """Write a rank's state (state_of) into the DCP directory. Collective."""
    import torch.distributed.checkpoint as dcp

    from . import dcp_storage

    w = dcp_storage.writer(directory)
    with _rank_failure(directory, "write", w):
        dcp.save(state, storage_writer=w)


def load(state: dict, directory: str) -> None:
    """Read into `state` (state_of's tensors, in place) what the checkpoint holds under
    their names, whichever ranks and mesh wrote them. Optimizer state the checkpoint does
    not hold (a parameter that had no gradient when it was written) is left out of the read.
    Collective; with no process group, one process reads every piece itself."""
    import torch.distributed.checkpoint as dcp

    from . import dcp_storage

    saved = dcp_storage.reader(directory).read_metadata().state_dict_metadata
    optim = state.get("optimizer", {}).get("state", {})
    for name, own in optim.items():
        # A copy (the optimizer's own dict keeps its entries): load_state carries its values over.
        optim[name] = {k: v for k, v in own.items() if f"optimizer.state.{name}.{k}" in saved}
    with _rank_failure(directory, "read"):
        dcp.load(state, storage_reader=dcp_storage.reader(directory))


def load_into(model, optimizer, directory: str) -> None:
    """A plain model (and optimizer) in one process, read from a checkpoint of any mesh."""
    parts = {"model": model, **({"optimizer": optimizer} if optimizer is not None else {})}
    state = state_of(parts)
    load(state, directory)
    load_state(parts, state)


@contextmanager
def _rank_failure(directory: str, doing: str, writer=None) -> Iterator[None]:
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
                f"training.checkpoint_dir: cannot {doing} {storage.display(directory)} ({error_cause(cause)})"
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
    with _rank_failure(directory, "read"):
        dcp.load(state, storage_reader=dcp_storage.reader(directory))
    return state["model"]


def check_resume(head: dict, cfg: TrainingConfig, data_world: int, where: str) -> bool:
    """Refuse, before anything starts, a resume the checkpoint cannot be resharded to
    (ConfigError naming the setting and why). True when the mesh differs from the one
    that wrote it (the ranks then reshard), False when it is the same."""
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
            f"{where}: written mid-epoch (epoch {head['epoch'] + 1}, step {head['step_in_epoch']}) "
            f"by {saved_world} data-parallel ranks, resumed with {data_world} ({moved}): the "
            f"loader's order within an epoch depends on how many ranks read data, so resume it with "
            f"the same data-parallel degree, or from a checkpoint taken at an epoch end"
        )
    return True
