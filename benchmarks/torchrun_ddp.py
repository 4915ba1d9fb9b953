"""The plain-torchrun side of `shardline bench train`: the same rank function, the group from env.

    python -m torch.distributed.run --nproc_per_node 2 benchmarks/torchrun_ddp.py '<payload json>'

Rank 0 prints one line, RESULT_MARK + its result as JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# Run as a script, Python puts benchmarks/ first on sys.path; the repo root is wanted.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

from shardline.benchmarks.train import RESULT_MARK, env_rank  # noqa: E402


def main() -> None:
    result = env_rank(json.loads(sys.argv[1]))
    if result["rank"] == 0:
        print(RESULT_MARK + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
