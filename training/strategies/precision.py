"""The job's numeric precision as one policy object: `training.precision` is read here
once, and every part that depends on it (the training step's autocast, a pipeline stage's,
FSDP2's parameter and reduction dtypes) asks this object, never the string."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from ..config import TrainingConfig

# Normalisation layers keep fp32 parameters under a bf16 FSDP policy (units of their own): a
# residual sum of fp32 and bf16 activations is fp32, and the CPU's layer_norm refuses an fp32
# input with bf16 weights (autocast does not cast them there); statistics need fp32 anyway.
NORMS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


@dataclass(frozen=True)
class Precision:
    """bf16: the forward and the loss under torch.autocast(bfloat16), weights, gradients'
    reduction and optimizer state in fp32; fp32: everything fp32."""

    bf16: bool = False

    @classmethod
    def of(cls, cfg: TrainingConfig) -> Precision:
        return cls(bf16=cfg.precision == "bf16")

    def autocast(self, device: torch.device) -> torch.autocast:
        """The training step's (and a pipeline stage's) autocast on `device`."""
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def fsdp_policy(self) -> MixedPrecisionPolicy:
        """bf16: parameters gathered (and so all-gathered) in bf16, gradients reduced in fp32,
        the sharded master weights and optimizer state fp32. The forward's inputs are not cast
        (cast_forward_inputs=False): a feature tensor carries category indices as floats, which
        bf16 holds exactly only up to 256; autocast (kept, as every layout runs it) casts what
        each op needs instead."""
        if not self.bf16:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)

    def norm_policy(self) -> MixedPrecisionPolicy | None:
        """The policy of a normalisation layer sharded as a unit of its own (NORMS); None
        where norms need no unit of their own (fp32 throughout)."""
        if not self.bf16:
            return None
        return MixedPrecisionPolicy(reduce_dtype=torch.float32, cast_forward_inputs=False)
