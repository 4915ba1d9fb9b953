"""`shardline bench strategies`, `bench sharding` and `bench fsdp-limit`: their tables, what
each training strategy and layout costs per rank in speed and memory (the numbers come from
benchmarks/strategies.py, sharding.py and fsdp_limit.py)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .console import console


def print_strategies(result: dict) -> None:
    m = result["model"]
    table = Table(title=f"strategies, transformer d_model {m['d_model']} × {m['layers']} layers, "
                        f"global batch {result['global_batch']}, {result['steps']} steps, "
                        f"{result['cores']} cores, {result['device']}")
    table.add_column("", no_wrap=True)
    bubbles = ("pipeline_bubble", "pipeline_bubble_predicted", "pipeline_bubble_formula", "pipeline_cpu_wait")
    for col in ("ranks", "samples/s", "× single", "peak MB (max rank)", "bubble", "predicted", "formula",
                "cpu wait"):
        table.add_column(col, justify="right")
    for name, row in result["strategies"].items():
        table.add_row(
            name, str(row["world_size"]), f"{row['samples_per_s']:,.0f}", f"{row['ratio_vs_single']:.2f}",
            f"{max(row['peak_mb_per_rank']):.0f}",
            *(f"{row[k]:.2f}" if k in row else "" for k in bubbles),
        )
    Console().print(table)
    console.print("  × single: vs one process training the same model on the same batches, this run. "
                  "More ranks than cores share them: read ratios with the cores in mind.")
    console.print(f"  peak MB: {result['memory_measure']} of the rank that grew most (--json: every "
                  "rank's); bubble: the pipeline's "
                  "measured idle share; predicted: its schedule replayed with the measured action "
                  "times, communication free; formula: the schedule's with equal stages; cpu wait: "
                  "share of the step a rank was ready to run but had no core (outside its actions).")
    mem = result["memory"]
    hidden = mem["model"]["hidden"]
    widths = f"{len(hidden)} × {hidden[0]}" if len(set(hidden)) == 1 else " × ".join(map(str, hidden))
    table = Table(title=f"memory per rank, mlp {widths} ({mem['model']['parameters'] / 1e6:.1f}M weights), AdamW")
    table.add_column("", no_wrap=True)
    for col in ("ranks", "peak growth MB (max rank)", "× ddp", "peak total MB", "× ddp (totals)", "samples/s"):
        table.add_column(col, justify="right")

    def ratio(x):
        return f"{x:.2f}" if x is not None else ""

    for name, row in mem["strategies"].items():
        table.add_row(name, str(row["world_size"]), f"{max(row['peak_mb_per_rank']):.0f}", ratio(row["peak_vs_ddp"]),
                      f"{max(row['peak_total_mb_per_rank']):.0f}", ratio(row["peak_total_vs_ddp"]),
                      f"{row['samples_per_s']:,.0f}")
    Console().print(table)
    console.print(f"  peak: {mem['measure']}, from just before the model is built (fsdp builds it on "
                  "the meta device; rank 0 alone holds the plain weights while they are broadcast).")


def print_sharding(result: dict) -> None:
    from shardline.benchmarks.sharding import COMBINED, WITHIN_FSDP

    m = result["model"]
    table = Table(title=f"sharding at {result['world_size']} ranks: decoder d_model {m['d_model']} x {m['layers']} "
                        f"blocks, vocabulary {m['vocab']} ({m['parameters'] / 1e6:.1f}M weights), AdamW, global "
                        f"batch {result['global_batch']}, {result['cores']} cores, {result['device']}")
    table.add_column("", no_wrap=True)
    for col in ("peak MB per rank", "max", "x fsdp", "x ddp", "step s"):
        table.add_column(col, justify="right")
    for name, row in result["layouts"].items():
        table.add_row(name, " ".join(f"{v:.0f}" for v in row["peak_mb_per_rank"]),
                      f"{max(row['peak_mb_per_rank']):.0f}", f"{row['peak_vs_fsdp']:.2f}", f"{row['peak_vs_ddp']:.2f}",
                      f"{row['step_s']:.3f}")
    Console().print(table)
    for name in COMBINED:
        c = result["checks"][name]
        said = [f"within {WITHIN_FSDP} x fsdp: {'yes' if c[f'within_{WITHIN_FSDP}x_fsdp'] else '[red]no[/]'}",
                f"below ddp: {'yes' if c['below_ddp'] else '[red]no[/]'}",
                f"below tensor: {'yes' if c['below_tensor'] else '[red]no[/]'}"]
        console.print(f"  {name}: " + ", ".join(said))
    console.print(f"  peak: {result['memory_measure']}, from just before the model is built; step s: the "
                  "slowest rank's. More ranks than cores share them: step times are not a speed claim.")


def print_fsdp_limit(result: dict, budget_mb: int) -> None:
    m = result["model"]
    console.print(f"{result['world_size']} ranks, mlp {len(m['hidden'])} × {m['hidden'][0]} "
                  f"({m['parameters'] / 1e6:.1f}M weights), AdamW; each rank's address space limited to "
                  f"its own once set up + {budget_mb} MB (RLIMIT_AS)")
    for name, r in result["runs"].items():
        if r["trained"]:
            console.print(f"  {name}: trained {r['steps']} steps; peak RSS growth per rank "
                          f"{', '.join(f'{x:.0f}' for x in r['peak_mb_per_rank'])} MB")
        else:
            console.print(f"  {name}: did not train: {escape(r['error'])}")
    console.print(f"  ddp fails and fsdp trains under the same limit: {result['ddp_fails_fsdp_trains']}")
