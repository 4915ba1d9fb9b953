"""The device mesh's shape: its four named dimensions, which rank sits where, and how a
config's strategy name and `[training.mesh]` resolve to it. No torch here: the driver
resolves and checks the mesh (and fingerprints it) before anything heavy is imported;
`training.strategies.parallelize` builds torch's DeviceMesh from it on the ranks.

Ranks are laid out row-major over DIMENSIONS, pp outermost and tp innermost (torchtitan's
order): the tp ranks of one model shard are neighbours, so when hosts fill with consecutive
ranks (the local launcher, one Spark executor's or Dask host's slots) a model's tensor-parallel
all-reduces, the most frequent and the largest, stay on one host; the pipeline's point-to-point
sends, the least frequent, are the ones that cross hosts first.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from math import prod

from shardline.foundation.errors import ConfigError

# Outermost first: rank = ((pp_i * dp_replicate + r_i) * dp_shard + s_i) * tp + t_i.
DIMENSIONS = ("pp", "dp_replicate", "dp_shard", "tp")
# The data-parallel dimensions: each of their coordinates reads its own part of every batch.
DATA = ("dp_replicate", "dp_shard")
# A strategy name is a shorthand: the dimension that takes what the others leave of world_size.
FILLED_BY = {"ddp": "dp_replicate", "fsdp": "dp_shard", "tensor": "tp", "pipeline": "pp"}
# ... and when that one is given, the replicas take the rest.


@dataclass(frozen=True)
class MeshShape:
    """The degrees of the job's mesh (each >= 1; their product is the world size)."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    @property
    def world(self) -> int:
        return prod(self.sizes)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(getattr(self, d) for d in DIMENSIONS)

    @property
    def data_world(self) -> int:
        """How many parts each global batch is read in."""
        return self.dp_replicate * self.dp_shard

    @property
    def splits_model(self) -> bool:
        """True where a rank holds less than the whole model (sharded, split or staged)."""
        return self.dp_shard > 1 or self.tp > 1 or self.pp > 1

    def coordinates(self, rank: int) -> dict[str, int]:
        """The rank's index along each dimension."""
        out = {}
        for d in reversed(DIMENSIONS):
            rank, out[d] = divmod(rank, getattr(self, d))
        return {d: out[d] for d in DIMENSIONS}

    def rank_at(self, **coordinates: int) -> int:
        rank = 0
        for d in DIMENSIONS:
            rank = rank * getattr(self, d) + coordinates.get(d, 0)
        return rank

    def data_rank(self, rank: int) -> int:
        """Which part of each global batch the rank reads: its replica, then its shard."""
        c = self.coordinates(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def reports(self, rank: int) -> bool:
        """One rank per data part counts its loss: tp index 0 on the last pipeline stage
        (the ranks of one tensor-parallel group compute the same logits)."""
        c = self.coordinates(rank)
        return c["tp"] == 0 and c["pp"] == self.pp - 1

    def group(self, rank: int, dims: tuple[str, ...]) -> list[int]:
        """The ranks that differ from `rank` only along `dims` (its sub-mesh over them)."""
        base = self.coordinates(rank)
        ranks = [base]
        for d in dims:
            ranks = [{**c, d: i} for c in ranks for i in range(getattr(self, d))]
        return sorted(self.rank_at(**c) for c in ranks)

    def named(self) -> str:
        """"dp_shard 2 x tp 2": the dimensions above 1 (a single rank: "1 rank")."""
        used = [f"{d} {getattr(self, d)}" for d in DIMENSIONS if getattr(self, d) > 1]
        return " x ".join(used) or "1 rank"

    def as_settings(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def split_tp_groups(shape: MeshShape, hosts: list[str]) -> list[list[int]]:
    """The tensor-parallel groups whose ranks run on more than one host (`hosts[rank]`).
    Consecutive ranks on one host keep every tp group there (tp is innermost); a launcher
    whose placement interleaves hosts (a Spark barrier stage's tasks) may not."""
    groups = {tuple(shape.group(r, ("tp",))) for r in range(shape.world)}
    return sorted(list(g) for g in groups if len({hosts[r] for r in g}) > 1)


def resolve(strategy: str, world_size: int, given: dict[str, int | None]) -> MeshShape | None:
    """The mesh a config asks for: `given` is [training.mesh] as written (None: unset).
    The dimension the strategy name fills takes what the others leave; every other unset
    one is 1 (but dp_replicate, which takes what is left when the strategy's own dimension
    is given too: `strategy = "tensor"`, tp 2 on 4 ranks is 2 replicas of a tp pair). None for a strategy with no mesh (ps), which refuses any dimension above 1.
    A mesh that cannot be laid out on world_size ranks is refused in one line."""
    set_ = {d: v for d, v in given.items() if v is not None}
    fill = FILLED_BY.get(strategy)
    if fill is None:
        split = [f"training.mesh.{d} = {v}" for d, v in set_.items() if v > 1]
        if split:
            raise ConfigError(f"{split[0]}: strategy '{strategy}' has no device mesh (its servers own whole parameters)")
        return None
    # The strategy's own dimension takes what the others leave; given too, the replicas do.
    fill = next((d for d in (fill, "dp_replicate") if d not in set_), None)
    if fill is not None:
        others = prod(set_.values())
        if world_size % others:
            raise ConfigError(
                f"training.mesh {_product(set_)} = {others} must divide training.world_size {world_size}"
            )
        set_[fill] = world_size // others
    shape = MeshShape(**{d: set_.get(d, 1) for d in DIMENSIONS})
    if shape.world != world_size:
        raise ConfigError(
            f"training.mesh {_product(shape.as_settings())} = {shape.world} must equal training.world_size {world_size}"
        )
    return shape


def _product(degrees: dict[str, int]) -> str:
    """The degrees above 1, in the mesh's order: "dp_replicate 2 x dp_shard 3"."""
    return " x ".join(f"{d} {degrees[d]}" for d in DIMENSIONS if degrees.get(d, 1) > 1) or "1"


def mesh_of(cfg) -> MeshShape | None:
    """The mesh of a TrainingConfig (resolve)."""
    return resolve(cfg.strategy, cfg.world_size, cfg.mesh.model_dump())
