"""What a loop's registered model takes and gives, from the example batch given to ctx.register.

Inputs: with no example, or one that is exactly what the loader yields (the `features`
tensor, or all the dataset's named tensors), the model takes the dataset's inputs, as a
factory model does: batch scoring feeds it prepared shards, and the served pyfunc raw
rows (the dataset's transform inside). Otherwise its inputs are the example's own: each
named like a dataset column takes that column, the others are arrays of their dtype and
shape per row (a generator's noise, a query embedding), and a single tensor is given
positionally.

Output: the task's ([batch, classes] logits, a [batch] or [batch, 1] value, next_token's
[batch, length, vocab]) is scored as a factory model's is; any other (an embedding, a
generated image) is scored as one list column `output`, the row's values flattened.
"""

from __future__ import annotations

import torch
from torch import nn

from shardline.foundation.errors import ConfigError, first_line

from ..batch import forward
from ..models.inputs import ModelInputs

TASK, TENSOR = "task", "tensor"
# What a scorer decodes an input to (the manifest's tensor dtypes).
DTYPES = ("uint8", "int32", "int64", "float16", "bfloat16", "float32")


def describe_io(inputs: ModelInputs, module: nn.Module, example) -> dict:
    """{"inputs": {name: {dtype, shape}} or None (the dataset's), "positional": bool,
    "output": "task" | "tensor"} of the rebuilt module, run on the example (see the module docstring)."""
    if example is None:
        return {"inputs": None, "positional": not inputs.named, "output": TASK}
    named = _named(example)
    rows = next(iter(named.values())).pop("rows")
    for spec in named.values():
        spec.pop("rows", None)
    positional = not isinstance(example, dict)
    dataset = {n: {"dtype": t.dtype, "shape": list(t.shape)} for n, t in inputs.inputs.items()}
    own = None if named == dataset and positional == (not inputs.named) else named
    for name, spec in (own or {}).items():
        if spec["dtype"] == "bfloat16" and name not in dataset:
            raise ConfigError(f"ctx.register: example input '{name}' is bfloat16, which a scorer's request cannot "
                              "carry: give the example in float32 (cast it inside the model)")
    with torch.no_grad():
        try:
            out = forward(module, {k: v.cpu() for k, v in example.items()} if isinstance(example, dict)
                          else example.cpu())
        except Exception as e:  # noqa: BLE001 - the user's forward: its message is theirs to see
            raise ConfigError(f"ctx.register: the rebuilt model fails on the example with "
                              f"{first_line(e, with_type=True)}") from None
    if not isinstance(out, torch.Tensor):
        raise ConfigError(f"ctx.register: the model's output on the example is a {type(out).__name__}: a "
                          "registered model returns one tensor")
    return {"inputs": own, "positional": positional, "output": TASK if is_task_output(inputs, out, rows) else TENSOR}


def _named(example) -> dict[str, dict]:
    """{name: {dtype, shape (per row), rows}}: a single tensor is named "features"."""
    items = example.items() if isinstance(example, dict) else [("features", example)]
    out = {}
    for name, t in items:
        if not isinstance(t, torch.Tensor) or t.dim() < 1:
            raise ConfigError(f"ctx.register: example input '{name}' must be a tensor with a batch dimension "
                              f"(got {type(t).__name__})")
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise ConfigError(f"ctx.register: example input '{name}' is {dtype}: a registered model's inputs are "
                              f"{', '.join(DTYPES)}")
        out[name] = {"dtype": dtype, "shape": list(t.shape[1:]), "rows": len(t)}
    if len({s["rows"] for s in out.values()}) > 1:
        raise ConfigError("ctx.register: the example's inputs have different numbers of rows")
    return out


def is_task_output(inputs: ModelInputs, out: torch.Tensor, rows: int) -> bool:
    """The output is the dataset's task's: scored as prediction (and probabilities or loss)."""
    shape = list(out.shape)
    if inputs.task == "next_token":
        return shape == [rows, *inputs.label.shape, inputs.output_width]
    if inputs.task == "regression":
        return shape in ([rows], [rows, 1])
    return shape == [rows, inputs.output_width]
