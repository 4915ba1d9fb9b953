"""Rank functions for tests; importable by spawned processes, Spark and Dask workers."""

from __future__ import annotations

import itertools

import torch

from shardline.pipelines.manifest import load_manifest
from shardline.training.batch import rows, split, take
from shardline.training.config import TrainingConfig
from shardline.training.loader.reader import ShardLoader
from shardline.training.models.factory import create_model
from shardline.training.models.inputs import ModelInputs, TensorInput
from shardline.training.models.builtin import (
    FeatureCNN,
    FeatureTransformer,
    TabularMLP,
    apply_activation_checkpointing,
)
from shardline.training.models.decoder import Decoder
from shardline.training.strategies import strategy_for
from shardline.training.strategy_settings import TABLES

MODELS = {
    "mlp": lambda: TabularMLP(5, [4], [16, 8], 3, embedding_dim=3),
    "cnn": lambda: FeatureCNN(5, [4], channels=8, n_classes=3),
    "transformer": lambda: FeatureTransformer(5, [4], d_model=16, heads=4, layers=2, n_classes=3),
    # A language model (next_token): token_batches' sequences, VOCAB ids, LENGTH long.
    "decoder": lambda: Decoder(VOCAB, LENGTH, d_model=16, heads=4, layers=2),
}
VOCAB, LENGTH = 32, 12

# What a factory is told about global_batches' data: 5 numerics, 1 category of 4, 3 classes.
INPUTS = ModelInputs(
    task="classification", num_classes=3, class_names=["0", "1", "2"], numeric=[f"n{i}" for i in range(5)],
    vectors={}, categorical=["c"], cardinalities=[4], inputs={"features": TensorInput(dtype="float32", shape=[6])},
    label=TensorInput(dtype="int64", shape=[]),
)


# A sub-table's field by its own name (micro_batches, tp, servers): unique across the tables.
_TABLE_OF = {field: table for table, model in TABLES.items() for field in model.model_fields}


def training_config(**settings) -> TrainingConfig:
    """A TrainingConfig of `settings`, a sub-table's field given by its own name
    (`micro_batches=4, tp=2` for `pipeline={"micro_batches": 4}, mesh={"tp": 2}`), or its table whole."""
    nested: dict = {}
    for key, value in settings.items():
        table = _TABLE_OF.get(key)
        if table is None:
            nested[key] = {**nested.get(key, {}), **value} if key in TABLES else value
        else:
            nested.setdefault(table, {})[key] = value
    return TrainingConfig(**nested)


def _model(args: dict, cfg: TrainingConfig):
    """args["model"]: a MODELS name, or an import path built by the factory (cfg's model_args)
    for global_batches' data, or for args["data"]'s (a prepared dataset's folder)."""
    name = args.get("model", "mlp")
    if ":" in name:
        inputs = ModelInputs.from_manifest(load_manifest(args["data"])) if "data" in args else INPUTS
        return create_model(inputs, cfg.model_copy(update={"model": name}))
    return MODELS[name]()


# AdamW divides each update by sqrt(v): a gradient that is zero in exact arithmetic
# comes out as rounding noise that AdamW would scale up to whole steps. No model here has
# one (attention's key has no bias for that reason), so AdamW is compared like SGD.
OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.01),
}


def global_batches(steps: int, batch: int, n_numeric: int = 5, card: int = 4, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        num = torch.randn(batch, n_numeric, generator=g)
        cat = torch.randint(0, card + 1, (batch, 1), generator=g).float()
        yield torch.cat([num, cat], 1), torch.randint(0, 3, (batch,), generator=g)


def token_batches(steps: int, batch: int, seed: int = 3):
    """({"tokens": int32 [batch, LENGTH]}, label): the label is the tokens as int64 with the last
    few positions of every row pads (-100, as the loader marks them), as many in each row,
    so every rank's and micro-batch's mean covers as many tokens as the global batch's."""
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        tokens = torch.randint(1, VOCAB, (batch, LENGTH), generator=g, dtype=torch.int32)
        pads = 1 + step % 4
        tokens[:, LENGTH - pads:] = 0
        label = tokens.long()
        label[:, LENGTH - pads:] = -100
        yield {"tokens": tokens}, label


def batches_of(args: dict):
    """The global batches (inputs, y) a run of `args` trains on: global_batches (token_batches
    for the decoder), or with args["data"] the first `steps` batches of that prepared dataset's train split, read as
    one rank reads it (the features tensor, or named tensors: training.batch)."""
    if "data" not in args:
        make = token_batches if args.get("model") == "decoder" else global_batches
        yield from make(args["steps"], args["batch"])
        return
    d = args["data"]
    loader = ShardLoader(load_manifest(d), d, "train", 0, 1, args["batch"], seed=3, workers=0)
    epochs = (batch for epoch in itertools.count() for batch in loader.epoch(epoch))
    for batch in itertools.islice(epochs, args["steps"]):
        yield split(batch)


def train_steps(rank: int, world_size: int, args: dict) -> dict:
    """`steps` optimizer steps of `strategy` over `world_size` ranks; the rank reads
    slice data_rank of every global batch. world_size 1 is single-process training.

    args: strategy, steps, batch, and optionally model, optimizer ("sgd", the default, or
    "adamw") and cfg (training_config's settings: precision, activation_checkpointing,
    grad_compression, dp_replicate/dp_shard/tp/pp, servers, micro_batches ...).
    Returns the plain model's weights after training (every rank: full_state_dict()).
    """
    strategy = args["strategy"] if world_size > 1 else "ddp"
    settings = args.get("cfg", {}) if world_size > 1 else _numerics(args.get("cfg", {}))
    cfg = training_config(world_size=world_size, strategy=strategy, batch_size=args["batch"], **settings)

    def build():  # seeded: what every rank (or fsdp's rank 0 alone) builds, as the worker does
        torch.manual_seed(0)
        model = _model(args, cfg)
        if cfg.activation_checkpointing:
            apply_activation_checkpointing(model)
        return model

    chosen = strategy_for(cfg)
    with torch.device("meta"):  # the check reads the model's structure only
        chosen.check(cfg, build())
    parallel = chosen.setup(
        chosen.model_for(build, torch.device("cpu")), cfg, rank, world_size, torch.device("cpu"),
        OPTIMIZERS[args.get("optimizer", "sgd")],
    )
    for x, y in batches_of(args):
        if parallel.data_rank is None:
            parallel.step(None, None)
            continue
        local = args["batch"] // parallel.data_world
        part = slice(parallel.data_rank * local, (parallel.data_rank + 1) * local)
        parallel.step(take(x, part), y[part])
    return {k: v.detach().clone() for k, v in parallel.full_state_dict().items()}


def _numerics(cfg: dict) -> dict:
    """The settings that change single-process arithmetic (the reference keeps them)."""
    keep = ("precision", "activation_checkpointing", "loss", "model_args", "code_paths")
    return {k: v for k, v in cfg.items() if k in keep}


def train_variants(rank: int, world_size: int, args: dict) -> list[dict]:
    """train_steps for each of args["variants"] (dicts merged over args) in one process
    group: one launch for many comparisons."""
    common = {k: v for k, v in args.items() if k != "variants"}
    return [train_steps(rank, world_size, {**common, **v}) for v in args["variants"]]


def unsynchronised(args: dict, parts: int) -> dict:
    """Single-process training on only the first of `parts` slices of each global batch:
    what one data-parallel rank computes if its gradients are never combined with the
    others'. A tolerance that accepts this cannot tell a broken strategy from a working one."""
    cfg = training_config(world_size=1, batch_size=args["batch"], **_numerics(args.get("cfg", {})))
    torch.manual_seed(0)
    model = _model(args, cfg)
    parallel = strategy_for(cfg).setup(
        model, cfg, 0, 1, torch.device("cpu"), OPTIMIZERS[args.get("optimizer", "sgd")]
    )
    for x, y in batches_of(args):
        n = rows(x) // parts
        parallel.step(take(x, slice(0, n)), y[:n])
    return {k: v.detach().clone() for k, v in parallel.full_state_dict().items()}


def relative_distance(a: dict, b: dict) -> float:
    """||a - b|| / ||b|| over every weight of the model together."""
    assert a.keys() == b.keys()
    num = sum(((a[k] - b[k]).double() ** 2).sum() for k in b) ** 0.5
    den = sum((b[k].double() ** 2).sum() for k in b) ** 0.5
    return float(num / den)


def resumed(rank: int, world_size: int, args: dict) -> dict:
    """AdamW (moments and step counts a wrong resume would lose) on the transformer:
    4 steps straight, and 2 steps, a resume into a fresh setup (other seed), 2 more.
    args: strategy, cfg (training_config's settings), directory (for the DCP checkpoint).
    Returns both runs' plain weights."""
    cfg = training_config(world_size=world_size, strategy=args["strategy"], batch_size=8, **args.get("cfg", {}))

    def fresh(seed):
        def build():
            torch.manual_seed(seed)
            return MODELS["transformer"]()

        strategy = strategy_for(cfg)
        return strategy.setup(strategy.model_for(build, torch.device("cpu")), cfg, rank, world_size,
                              torch.device("cpu"), OPTIMIZERS["adamw"])

    straight, first = fresh(0), fresh(0)
    n = 8 // straight.data_world
    part = slice((straight.data_rank or 0) * n, ((straight.data_rank or 0) + 1) * n)
    batches = [(x[part], y[part]) for x, y in global_batches(4, 8)]
    for x, y in batches:
        straight.step(x, y)
    for x, y in batches[:2]:
        first.step(x, y)
    second = fresh(1)
    # What each rank holds, through DCP (the worker's checkpoints).
    first.save_checkpoint(args["directory"])
    second.load_checkpoint(args["directory"])
    for x, y in batches[2:]:
        second.step(x, y)
    return {"straight": straight.full_state_dict(), "resumed": second.full_state_dict()}
