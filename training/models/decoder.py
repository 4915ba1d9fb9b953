"""The built-in language model: a small decoder-only transformer (`training.model = "decoder"`)
for datasets of `pipelines.features.task = "next_token"`.

It reads the token column (int ids [batch, length]) and returns logits [batch, length,
vocab]: position i's logits predict token i+1 (training.task.next_token_loss). Causal
self-attention, pre-norm blocks (GPT-2's layout, no dropout), learned positions.

Its plans (training.models.plans): `pipeline_layers()` the embedding, each block, the
head, in forward order; `tp_plan()` per block q, k, v colwise and the attention's output
rowwise, ff1 colwise and ff2 rowwise (Megatron's split; each rank computes whole heads of
its slice, models.Attention); `fsdp_units()` every layer; `recompute_units()` the blocks.
The head is not tied to the embedding: tied weights would sit in the first and the last
pipeline stage at once, and in two FSDP units.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from shardline.foundation.errors import ConfigError

from .inputs import ModelInputs
from .builtin import Attention

INTEGER = ("uint8", "int32", "int64")


class TokenEmbedding(nn.Module):
    """Token ids -> their vectors plus a learned vector per position.

    Takes the token tensor positionally or as the keyword of its column's name (the loader's
    named tensors, `model(tokens=...)`); other named inputs are ignored."""

    def __init__(self, vocab: int, length: int, d_model: int, input_name: str):
        super().__init__()
        self.input_name = input_name
        self.token = nn.Embedding(vocab, d_model)
        self.position = nn.Parameter(torch.randn(length, d_model) * 0.02)

    def forward(self, *tokens: torch.Tensor, **named: torch.Tensor) -> torch.Tensor:
        ids = tokens[0] if tokens else named[self.input_name]
        return self.token(ids.long()) + self.position[: ids.shape[1]]


class CausalAttention(Attention):
    """models.Attention with each position attending to itself and the positions before it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (p(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for p in (self.q, self.k, self.v))
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(h.transpose(1, 2).flatten(2))


class DecoderBlock(nn.Module):
    """Pre-norm: x + attention(norm(x)), then x + ff2(gelu(ff1(norm(x))))."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = CausalAttention(d_model, heads)
        self.norm2 = nn.LayerNorm(d_model)
        self.ff1 = nn.Linear(d_model, 4 * d_model)
        self.ff2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.ff2(F.gelu(self.ff1(self.norm2(x))))


class LMHead(nn.Module):
    """Final norm, then a logit per token id at every position."""

    def __init__(self, d_model: int, vocab: int):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.linear = nn.Linear(d_model, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.norm(x))


class Decoder(nn.Module):
    """Token embedding, `layers` causal blocks (children block0, block1, ...), LM head."""

    def __init__(self, vocab: int, length: int, d_model: int, heads: int, layers: int, input_name: str = "tokens"):
        super().__init__()
        self.embed = TokenEmbedding(vocab, length, d_model, input_name)
        self.blocks = [f"block{i}" for i in range(layers)]
        for name in self.blocks:
            self.add_module(name, DecoderBlock(d_model, heads))
        self.head = LMHead(d_model, vocab)

    def forward(self, *tokens: torch.Tensor, **named: torch.Tensor) -> torch.Tensor:
        h = self.embed(*tokens, **named)
        for name in self.blocks:
            h = getattr(self, name)(h)
        return self.head(h)

    def pipeline_layers(self) -> list[str]:
        return ["embed", *self.blocks, "head"]

    def tp_plan(self) -> dict[str, str]:
        per_block = {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.out": "rowwise",
                     "ff1": "colwise", "ff2": "rowwise"}
        return {f"{b}.{path}": style for b in self.blocks for path, style in per_block.items()}

    def fsdp_units(self) -> list[nn.Module]:
        return [self.embed, *(getattr(self, b) for b in self.blocks), self.head]

    def recompute_units(self) -> list[nn.Module]:
        return [getattr(self, b) for b in self.blocks]


def token_input(inputs: ModelInputs) -> str:
    """The name of the input holding the token ids: the one integer tensor shaped as the label."""
    found = [n for n, t in inputs.inputs.items() if t.dtype in INTEGER and t.shape == inputs.label.shape]
    if len(found) != 1:
        raise ConfigError(
            "training.model decoder: the dataset needs one token column (an integer tensor of the label's "
            f"shape {inputs.label.shape}); its inputs are {', '.join(inputs.inputs) or 'none'}"
        )
    return found[0]


def decoder(inputs: ModelInputs, hidden: Sequence[int] = (128, 64), heads: int = 4) -> Decoder:
    """hidden[0] is d_model, len(hidden) the decoder blocks (the transformer's convention)."""
    if inputs.task != "next_token":
        raise ConfigError(
            f"training.model decoder is a language model: it needs pipelines.features.task = 'next_token' "
            f"(this dataset's task is {inputs.task})"
        )
    if hidden[0] % heads:
        raise ConfigError(
            f"training.hidden[0] (d_model {hidden[0]}) must be divisible by training.heads {heads}"
        )
    return Decoder(inputs.num_classes, inputs.label.shape[0], d_model=hidden[0], heads=heads,
                   layers=len(hidden), input_name=token_input(inputs))
