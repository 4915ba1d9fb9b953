"""ctx.save and ctx.restore: a loop's nested state through the job's checkpoint store.

The state is split (training.checkpoints.state) into tensors, which every rank writes into
the checkpoint's DCP directory (`CheckpointStore.new_dcp_name`), and plain values, which
are gathered to rank 0 with each rank's RNG states and kept, per rank, in the checkpoint's
small file; rank 0 commits it (`CheckpointStore.save`: the file, then `LATEST`, then the
rotation), unless the job's driver stopped it (launchers.guard). The same store and
protocol as every checkpoint of shardline's: shardline's own loop saves through here too.

The small file (plain tensors, numbers and strings only: `torch.load(weights_only=True)`):

    layout         training.checkpoints.sharded.LAYOUT
    sharded        the DCP directory's name
    ranks          each rank's plain values, nested as its state (a tensor's place marked)
    rng            each rank's RNG states (CPU, and its GPU's on CUDA): they differ per rank
    global_step    the step given to ctx.save
    epoch          whole epochs done (a loop that counts them), else None
    loader, step_in_epoch   the first loader of the state: its position (mesh checks)
    fingerprint, code_files, run_id   whose checkpoint it is (training.checkpoints.fingerprint)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shardline.foundation import storage

from .. import collectives
from ..checkpoints import fingerprint
from ..checkpoints.sharded import LAYOUT
from ..checkpoints.state import TENSORS, StateError, is_plain, pruned, read_tensors, write_tensors
from ..launchers.guard import stop_if_job_over
from ..loader.reader import ShardLoader
from .tracking import reporter

if TYPE_CHECKING:
    from .context import LoopContext


def save_state(ctx: LoopContext, state: dict, step: int, *, epoch: int | None, artifact: bool) -> str | None:
    """ctx.save (see its docstring). Collective; the committed checkpoint's URL on rank 0."""
    store, job = ctx._store, ctx._job
    name = store.new_dcp_name(step)
    directory = storage.join(store.url, name)
    try:
        parts = write_tensors(state, directory)
    except StateError as e:
        raise StateError(f"ctx.save: {e}") from None
    # Pruned below the top: the top-level entries stay named (a restore checks them).
    tree = {k: pruned(v) for k, v in parts.tree.items()}
    gathered = collectives.gather_object({"tree": tree, "rng": rng_state(ctx.device)}, dst=0)
    if ctx.rank != 0:
        return None
    loader = first_loader(state)
    position = loader.state_dict() if loader is not None else {}
    head = {
        "layout": LAYOUT, "sharded": name,
        "ranks": [g["tree"] for g in gathered], "rng": [g["rng"] for g in gathered],
        "global_step": step, "epoch": epoch,
        "step_in_epoch": position.get("batches", 0), "loader": position,
        "fingerprint": job.fingerprint or {},
        # The code's per-file digests: a resume over changed code names the files.
        "code_files": job.code.files if job.code else {},
        "run_id": job.run_id or "",
    }
    stop_if_job_over()  # an interrupted job commits no more checkpoints (launchers.guard)
    path = store.save(step, head, ctx.config.keep_checkpoints)  # and rotates, DCP directories too
    reporter(ctx).checkpoint(path, step, artifact, directory)
    return path


def restore_state(ctx: LoopContext, state: dict) -> int | None:
    """ctx.restore (see its docstring). Collective; the checkpoint's step, or None."""
    job, store = ctx._job, ctx._store
    if job.resume_from is None:
        return None
    head = store.read(job.resume_from, fingerprint.comparable(job.fingerprint), ctx.config.resume_allow_changed)
    where = storage.name(job.resume_from)
    if head.get("layout") != LAYOUT:
        raise StateError(f"ctx.restore: {where} was written by an earlier shardline (checkpoint layout "
                         f"{head.get('layout', 1)}; this one reads {LAYOUT})")
    same_world = len(head["ranks"]) == ctx.world_size
    try:
        tree = saved_tree(state, head["ranks"], ctx.rank if same_world else None)
        read_tensors(state, store.dcp_dir(job.resume_from, head), saved_tree=tree)
        put_plain(state, tree, "")
    except StateError as e:
        raise StateError(f"ctx.restore: {where}: {e}") from None
    # At the world size that saved them each rank takes back its own generators; at another
    # the ranks keep theirs, freshly seeded (a rank's stream is not another's to continue).
    if same_world:
        set_rng_state(head["rng"][ctx.rank], ctx.device)
    ctx.step = int(head["global_step"])
    return ctx.step


def saved_tree(state: dict, trees: list[dict], own: int | None) -> dict:
    """The plain values this rank reads back, entry by entry: its own (at the world size that
    wrote them), else the first rank's that has the entry (a parameter server's schedule is
    on the servers only). An entry the checkpoint lacks, or has beyond the state's, is refused."""
    mine = trees[own] if own is not None else None
    if mine is not None:
        extra = [k for k in mine if k not in state]
        if extra:
            raise StateError(f"it has the entry '{extra[0]}', which the state given lacks")
    out = {}
    for key in state:
        found = [t for t in ([mine] if mine is not None and key in mine else trees) if key in t]
        if not found:
            raise StateError(f"it has no entry '{key}' (its entries: {', '.join(trees[0]) or 'none'}): "
                             "the state given differs from the one saved")
        out[key] = found[0][key]
    return out


def put_plain(container, tree, path: str) -> None:
    """The saved plain values back into the state's dicts and lists, in place."""
    from ..checkpoints.state import is_stateful
    from ..strategies.base import Parallel

    if tree == TENSORS:  # nothing but tensors under here: DCP loaded them
        return
    keys = container.keys() if isinstance(container, dict) else range(len(container))
    for key in keys:
        value = container[key]
        if isinstance(value, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer, Parallel)) or is_stateful(value):
            continue  # loaded by DCP or by its own load_state_dict
        saved = tree[key]
        if isinstance(value, dict) or (isinstance(value, (list, tuple)) and not is_plain(value)):
            put_plain(value, saved, f"{path}.{key}" if path else str(key))
        elif isinstance(container, tuple):
            raise StateError(f"a plain value inside the tuple at '{path}' cannot be put back: use a list")
        else:
            container[key] = saved


def first_loader(state) -> ShardLoader | None:
    """The first ShardLoader in the state: its position is the checkpoint's (mesh checks)."""
    if isinstance(state, ShardLoader):
        return state
    values = state.values() if isinstance(state, dict) else state if isinstance(state, (list, tuple)) else ()
    for v in values:
        found = first_loader(v)
        if found is not None:
            return found
    return None


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """The generators a step may draw from: the CPU's, and the rank's GPU's when it has one."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Restore `rng_state(device)`. A GPU state is restored on a GPU rank only (a CPU resume
    of a GPU run draws nothing from it)."""
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
