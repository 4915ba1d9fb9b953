"""The plain-torchrun side of `shardline bench train --loop`: the hand-written loop, the group from env.

    python -m torch.distributed.run --nproc_per_node 2 benchmarks/torchrun_loop.py '<payload json>'

Rank 0 prints one line, RESULT_MARK + its result as JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# Run as a script, Python puts benchmarks/ first on sys.path; the repo root is wanted.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

from shardline.benchmarks.train_loop import torchrun_rank  # noqa: E402
from shardline.benchmarks.train_loops import RESULT_MARK  # noqa: E402


def main() -> None:
    result = torchrun_rank(json.loads(sys.argv[1]))
    if result["rank"] == 0:
        print(RESULT_MARK + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
