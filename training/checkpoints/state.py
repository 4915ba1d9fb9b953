"""Any nested checkpoint state, split into what DCP writes and what the small file keeps.

A loop's state (training.loop.context.LoopContext.save) is a nested dict of modules,
optimizers, `Stateful` objects (state_dict / load_state_dict: schedulers, loaders, a
strategy's rank), tensors and plain values. `split` turns it into

- `tensors`: {dotted path: tensor}, written by torch.distributed.checkpoint (DCP), each rank
  its part (a DTensor's shards; a tensor every rank holds, once) and read back resharded;
- `tree`: the same nesting with only the plain values (a tensor's place marked), which the
  checkpoint's small file keeps per rank (`pruned`: a subtree of tensors only is one mark)
  and `torch.load(weights_only=True)` reads back.

Nothing that is not a tensor goes through DCP: DCP unpickles non-tensor values when it
loads them, and loading a checkpoint never unpickles arbitrary objects (the design's rule);
values that differ from rank to rank would also be written once only.

Modules and optimizers go through torch's state-dict API (`get_state_dict`), which names a
DDP, FSDP2 or tensor-parallel module's tensors by the plain module's names, and an
optimizer's state by its parameters' names: an optimizer is paired with the module(s) of
the state that hold its parameters (by parameter identity).

`restore` reads a checkpoint into the same structure in place: modules, optimizers and
Stateful objects get `load_state_dict`-style calls, tensors are filled, plain values put
back into their dicts and lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from shardline.foundation.errors import DataError

# torch.distributed.checkpoint (with DTensor) is imported inside the functions that read or
# write: ~0.6 s a driver that only checks a config never needs (as training.checkpoints.sharded).

PLAIN = (bool, int, float, str, type(None))
TENSOR = {"<dcp tensor>": 1}  # a tensor's place in a tree: its value is in the DCP directory
# A subtree of tensors only (a module's weights, an optimizer's state): the small file keeps
# this mark alone, and a restore takes the subtree's shape from the state it fills.
TENSORS = {"<dcp tensors>": 1}


class StateError(DataError):
    """A state ctx.save cannot write or ctx.restore cannot fill (one line naming the entry)."""


def is_plain(value) -> bool:
    """Numbers, strings, booleans, None, and lists, tuples and str-keyed dicts of them: what
    the small file holds and `torch.load(weights_only=True)` reads."""
    if isinstance(value, PLAIN):
        return True
    if isinstance(value, (list, tuple)):
        return all(is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_plain(v) for k, v in value.items())
    return False


def is_stateful(value) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


@dataclass
class Entry:
    """One object of the state that is loaded by a call (a module, optimizer or Stateful):
    where it is, and how its loaded state dict goes back in."""

    path: str
    obj: object
    load: object  # callable(loaded state dict)


@dataclass
class Split:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    tree: dict = field(default_factory=dict)
    entries: list[Entry] = field(default_factory=list)
    # (container, key, path) of each plain value or tensor held directly in the state
    places: list[tuple[object, object, str]] = field(default_factory=list)


def split(state: dict, restoring: bool = False, name: str = "state") -> Split:
    """`state` as DCP tensors and a plain tree (see the module docstring). `restoring`: the
    tensors are the ones to read into (an optimizer gets its state tensors made first)."""
    if not isinstance(state, dict):
        raise StateError(f"{name} must be a dict (of modules, optimizers, tensors, ...), not a {type(state).__name__}")
    out = Split()
    modules = dict(_modules(state, ""))
    out.tree = _walk(state, "", out, modules, restoring, name)
    return out


def _walk(value, path: str, out: Split, modules: dict, restoring: bool, name: str):
    from ..strategies.base import Parallel

    where = f"{name}[{path!r}]" if path else name
    if isinstance(value, Parallel):  # a strategy's rank: its parts, as a dict of them
        value = value.checkpoint_parts(restoring)
    if isinstance(value, nn.Module):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        sd = get_model_state_dict(value)
        out.entries.append(Entry(path, value, lambda loaded, m=value: set_model_state_dict(m, loaded)))
        return _leaves(sd, path, out)
    if isinstance(value, torch.optim.Optimizer):
        return _optimizer(value, path, out, modules, where)
    if isinstance(value, torch.Tensor):
        out.tensors[path] = value
        return TENSOR
    if is_stateful(value):
        out.entries.append(Entry(path, value, value.load_state_dict))
        return _leaves(value.state_dict(), path, out)
    if isinstance(value, dict):
        return {k: _walk(v, _join(path, k), out, modules, restoring, name) for k, v in _items(value, where)}
    if isinstance(value, (list, tuple)) and not is_plain(value):
        return [_walk(v, _join(path, str(i)), out, modules, restoring, name) for i, v in enumerate(value)]
    if is_plain(value):
        return value
    raise StateError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}: a checkpoint takes modules, "
        "optimizers, Stateful objects (state_dict/load_state_dict), tensors, and plain numbers, strings, "
        "lists and dicts (a numpy value: make it a tensor or a Python number)"
    )


def _items(value: dict, where: str):
    for k, v in value.items():
        if not isinstance(k, str) or not k or "." in k:
            raise StateError(f"{where} has the key {k!r}: keys must be non-empty strings without '.'")
        yield k, v


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _leaves(value, path: str, out: Split):
    """A state dict's tensors to DCP (at their dotted paths), the rest kept in the tree."""
    if isinstance(value, torch.Tensor):
        out.tensors[path] = value
        return TENSOR
    if isinstance(value, dict):
        return {str(k): _leaves(v, _join(path, str(k)), out) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not is_plain(value):  # a plain tuple stays one (Adam's betas)
        return [_leaves(v, _join(path, str(i)), out) for i, v in enumerate(value)]
    if not is_plain(value):
        raise StateError(f"state[{path!r}] holds a {type(value).__name__}, which a checkpoint cannot keep")
    return value


def _modules(value, path: str):
    """(path, module) of every module in the state (not inside a module), for optimizers."""
    from ..strategies.base import Parallel

    if isinstance(value, Parallel):
        value = value.checkpoint_parts()
    if isinstance(value, nn.Module):
        yield path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _modules(v, _join(path, str(k)))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _modules(v, _join(path, str(i)))


def _optimizer(opt, path: str, out: Split, modules: dict, where: str):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model = paired_module(opt, modules, where)
    sd = get_optimizer_state_dict(model, opt)
    own = [list(g["params"]) for g in sd["param_groups"]]
    out.entries.append(Entry(path, opt, lambda loaded: set_optimizer_state_dict(model, opt, own_groups(loaded, own))))
    return _leaves(sd, path, out)


def own_groups(saved: dict, own: list[list[str]]) -> dict:
    """A saved optimizer state whose param groups name this rank's own parameters, group by
    group (`own`: each group's parameter names here), as Optimizer.load_state_dict pairs groups
    by position. Read at another mesh, the plain values are another rank's (loop.state.saved_tree),
    whose groups name the parameters *it* held (another pipeline stage, another ps shard); torch's
    state-dict API takes a group's hyperparameters only from a saved group naming one of this
    rank's parameters, and would leave a group without them (lr, betas). Every rank of a job
    runs one schedule, so a group's hyperparameters are the same on every rank."""
    groups = saved.get("param_groups")
    if not isinstance(groups, list) or len(groups) != len(own):
        return saved
    return {**saved, "param_groups": [{**g, "params": names} for g, names in zip(groups, own)]}


def paired_module(opt: torch.optim.Optimizer, modules: dict[str, nn.Module], where: str) -> nn.Module:
    """The module of the state holding `opt`'s parameters; several (one optimizer over two
    towers): a ModuleDict of them, named by their paths."""
    wanted = {id(p) for g in opt.param_groups for p in g["params"]}
    holders = {path: m for path, m in modules.items() if wanted & {id(p) for p in m.parameters()}}
    for path, m in holders.items():  # one module holding them all: the smallest such
        if wanted <= {id(p) for p in m.parameters()} and not any(
                other is not m and other in m.modules() and wanted <= {id(p) for p in other.parameters()}
                for other in holders.values()):
            return m
    covered = set().union(*({id(p) for p in m.parameters()} for m in holders.values())) if holders else set()
    if not holders or not wanted <= covered:
        raise StateError(
            f"{where}: the optimizer holds parameters of no module in the state: put the module(s) it "
            "optimises in the state too (ctx.save pairs an optimizer with its modules by their parameters)"
        )
    return nn.ModuleDict({_child_name(p): m for p, m in holders.items()})


def _child_name(path: str) -> str:
    """A state path as a ModuleDict key: no dots, and never one of ModuleDict's own attributes
    (a state entry named "items", "keys" or "train" would be refused as a child's name):
    those get a leading "/", which no other path has."""
    name = path.replace(".", "/")
    return f"/{name}" if hasattr(nn.ModuleDict, name) else name


def pruned(tree):
    """`tree` with each subtree of tensors only replaced by the TENSORS mark (the small file's copy)."""
    if tree == TENSOR:
        return tree
    if isinstance(tree, (dict, list)) and tree:
        values = list(tree.values()) if isinstance(tree, dict) else tree
        kept = [pruned(v) for v in values]
        if all(v in (TENSOR, TENSORS) for v in kept):
            return TENSORS
        return dict(zip(tree, kept)) if isinstance(tree, dict) else kept
    return tree


def merged(template, saved):
    """The saved tree with each TENSORS mark expanded from the state's own tree (`template`)."""
    if saved == TENSORS:
        return template
    if isinstance(saved, dict) and isinstance(template, dict):
        return {k: merged(template.get(k), v) for k, v in saved.items()}
    if isinstance(saved, list) and isinstance(template, list):
        return [merged(template[i] if i < len(template) else None, v) for i, v in enumerate(saved)]
    return saved


def rebuild(tree, tensors: dict[str, torch.Tensor], path: str = ""):
    """The state dict a tree and its loaded tensors make: each TENSOR mark replaced by its tensor."""
    if tree == TENSOR:
        return tensors[path]
    if isinstance(tree, dict):
        return {k: rebuild(v, tensors, _join(path, k)) for k, v in tree.items()}
    if isinstance(tree, list):
        return [rebuild(v, tensors, _join(path, str(i))) for i, v in enumerate(tree)]
    return tree


# -- DCP, on a directory (training.checkpoints.dcp_storage: any URL) --------------------------


def write_tensors(state: dict, directory: str) -> Split:
    """Write the state's tensors into the DCP directory, each rank its part. Collective."""
    import torch.distributed.checkpoint as dcp

    from . import dcp_storage
    from .sharded import rank_failure

    parts = split(state)
    w = dcp_storage.writer(directory)
    with rank_failure(directory, "write", w):
        dcp.save(parts.tensors, storage_writer=w)
    return parts


def read_tensors(state: dict, directory: str, saved_tree: dict | None = None) -> Split:
    """Read the state's tensors from the DCP directory, whichever ranks and mesh wrote them,
    and load every module, optimizer and Stateful of the state with them; plain values come
    from `saved_tree` (the small file's), else stay as they are. Collective."""
    import torch.distributed.checkpoint as dcp

    from . import dcp_storage
    from .sharded import rank_failure

    parts = split(state, restoring=True)
    reader = dcp_storage.reader(directory)
    with rank_failure(directory, "read"):
        saved = reader.read_metadata().state_dict_metadata
    check_tensors(parts.tensors, saved)
    with rank_failure(directory, "read"):
        dcp.load(parts.tensors, storage_reader=dcp_storage.reader(directory))
    tree = parts.tree if saved_tree is None else merged(parts.tree, saved_tree)
    for entry in parts.entries:
        try:
            saved_entry = _at(tree, entry.path)
        except (KeyError, IndexError, TypeError):
            raise StateError(f"the checkpoint has no entry '{entry.path}': the state given differs from the one saved") \
                from None
        entry.load(rebuild(saved_entry, parts.tensors, entry.path))
    return parts


def check_tensors(wanted: dict[str, torch.Tensor], saved: dict) -> None:
    """Every tensor to read is a tensor in the checkpoint (never a pickled value, which DCP
    would unpickle), of the same shape; one line naming the first that is not."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    for key, t in wanted.items():
        meta = saved.get(key)
        if meta is None:
            have = sorted({k.split(".")[0] for k in saved})
            raise StateError(f"the checkpoint has no tensor '{key}' (its entries: {', '.join(have)}): "
                             "the state given differs from the one saved")
        if not isinstance(meta, TensorStorageMetadata):
            raise StateError(f"the checkpoint's '{key}' is not a tensor: not read (it would be unpickled)")
        if list(meta.size) != list(t.shape):
            raise StateError(f"the checkpoint's '{key}' has shape {list(meta.size)}, the state's {list(t.shape)}")


def _at(tree, path: str):
    for key in path.split(".") if path else ():
        tree = tree[int(key)] if isinstance(tree, list) else tree[key]
    return tree
