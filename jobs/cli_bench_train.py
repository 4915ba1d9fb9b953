"""`shardline bench train --images`, `--tokens` and `--loop`: training throughput against the loops
users write by hand (the numbers come from benchmarks/train_images.py, train_tokens.py and train_loop.py)."""

from __future__ import annotations

import json
import sys
from contextlib import redirect_stdout

import click
from rich.console import Console
from rich.table import Table

from .console import console


def bench_train_typed(kind: str, rows: int | None, steps: int | None, rounds: int | None, as_json: bool) -> None:
    if kind == "images":
        from shardline.benchmarks.train_images import ROUNDS, STEPS, run
    else:
        from shardline.benchmarks.train_tokens import ROUNDS, STEPS, run
    # torchrun's and Spark's children may print: keep stdout for the result.
    with redirect_stdout(sys.stderr):
        result = run(rows, progress=lambda msg: console.print(f"[dim]… {msg}[/]"), steps=steps or STEPS,
                     rounds=rounds or ROUNDS)
    if as_json:
        click.echo(json.dumps(result))
        return
    (_images if kind == "images" else _tokens)(result)
    console.print(f"  load average (1 min) at start and end: {', '.join(map(str, result['load_average']))} "
                  f"on {result['cores']} cores: ratios are within one run, absolute rates follow the load")


def _verdict(ratio: float, target: float, met: bool, above: bool = True) -> str:
    sign = "≥" if above else "≤"
    return f"{ratio:.3g} (target {sign} {target}: {'met' if met else 'NOT met'})"


def _images(r: dict) -> None:
    c, h, w = r["image_shape"]
    table = Table(title=f"train --images: {r['images']:,} PNG {c}×{h}×{w}, CNN, DDP {r['world_size']} ranks × "
                        f"{r['threads_per_rank']} thread(s), global batch {r['global_batch']}, {r['steps']} steps")
    for col in ("", "images/s", "data wait", "× torchvision"):
        table.add_column(col, justify="right")
    ips, wait, tv = r["images_per_s"], r["data_wait"], r["images_per_s"]["torchvision"]
    lay, bad = r["layouts"]["planned"], r["layouts"]["bad"]
    rows = (("shardline_local", f"shardline, local launcher (planned: {lay['rows_per_row_group']} rows/row group, "
                                f"{r['plan']['loader_workers_per_rank']} worker(s))", "planned"),
            ("shardline_spark", "shardline, Spark barrier stage (planned)", "planned_spark"),
            ("shardline_bad_layout", f"shardline, bad layout ({bad['rows_per_row_group']:,} rows/row group, "
                                     "1 worker)", "bad_layout"),
            ("torchvision", f"torchvision ImageFolder, DataLoader(num_workers={r['torchvision_num_workers']})",
             "torchvision"))
    for k, text, w_key in rows:
        table.add_row(text, f"{ips[k]:,.0f}", f"{wait[w_key]:.1%}", f"{ips[k] / tv:.2f}")
    Console().print(table)
    by = ", ".join(f"{k}: {v:,.0f}" for k, v in r["torchvision_by_workers"].items())
    console.print(f"  torchvision images/s by num_workers: {by}")
    m, t = r["met"], r["targets"]
    console.print(f"  ratio.vs_torchvision {_verdict(r['ratio']['vs_torchvision'], t['vs_torchvision'], m['vs_torchvision'])}; "
                  f"data wait at the planned layout {_verdict(wait['planned'], t['data_wait'], m['data_wait'], False)}")
    f = r["first_epoch"]
    console.print(f"  first epoch of a new user: shardline {f['shardline_s']:.1f} s (prepare {f['prepare_s']:.1f} s + "
                  f"training {f['train_s']:.1f} s) vs torchvision on the raw files {f['torchvision_s']:.1f} s "
                  "(not a target)")


def _tokens(r: dict) -> None:
    m = r["model"]
    table = Table(title=f"train --tokens: decoder d_model {m['d_model']} × {m['layers']} blocks, length "
                        f"{r['sequence_length']}, DDP {r['world_size']} ranks, global batch {r['global_batch']}, "
                        f"{r['steps']} steps")
    for col in ("", "tokens/s", "data wait"):
        table.add_column(col, justify="right")
    table.add_row(f"shardline (plan: {r['plan']['loader_workers_per_rank']} worker(s))",
                  f"{r['tokens_per_s']['shardline']:,.0f}", f"{r['data_wait']['shardline']:.1%}")
    table.add_row("nanoGPT-style uint16 memmap, torchrun", f"{r['tokens_per_s']['memmap']:,.0f}",
                  f"{r['data_wait']['memmap']:.1%}")
    Console().print(table)
    met, t = r["met"], r["targets"]
    console.print(f"  ratio.vs_memmap {_verdict(r['ratio']['vs_memmap'], t['vs_memmap'], met['vs_memmap'])}; "
                  f"data wait {_verdict(r['data_wait']['shardline'], t['data_wait'], met['data_wait'], False)}")


def bench_train_loop(rows: int | None, steps: int | None, rounds: int | None, as_json: bool) -> None:
    from shardline.benchmarks.train_loop import ROUNDS, STEPS, WARMUP, run

    steps = steps or STEPS
    with redirect_stdout(sys.stderr):  # torchrun's children and the ranks may print: stdout is the result's
        result = run(rows, progress=lambda msg: console.print(f"[dim]… {msg}[/]"), steps=steps,
                     warmup=min(WARMUP, max(1, steps // 2)), rounds=rounds or ROUNDS)
    if as_json:
        click.echo(json.dumps(result))
        return
    r = result
    table = Table(title=f"train --loop: a hand-written DDP loop, MLP {r['feature_width']}-"
                        f"{'-'.join(map(str, r['hidden']))}, {r['world_size']} ranks × {r['threads_per_rank']} "
                        f"thread(s), global batch {r['global_batch']}, {r['steps']} steps")
    for col in ("", "steps/s", "steps per CPU-s", "data wait"):
        table.add_column(col, justify="right")
    for side, text in (("shardline", "shardline loop (local launcher, ctx.loader)"),
                       ("torchrun", "torchrun (its shards read into memory first)")):
        table.add_row(text, f"{r['steps_per_s'][side]:,.1f}", f"{r['steps_per_cpu_s'][side]:,.1f}",
                      f"{r['data_wait'][side]:.1%}")
    Console().print(table)
    ratio, met, target = r["ratio"], r["met"], r["target"]
    console.print(f"  ratio.vs_torchrun {_verdict(ratio['vs_torchrun'], target['vs_torchrun'], met['vs_torchrun'])}; "
                  f"per CPU-second {ratio['per_cpu_vs_torchrun']:.3g}")
    console.print(f"  load average (1 min) at start and end: {', '.join(map(str, r['load_average']))} "
                  f"on {r['cores']} cores: ratios are within one run, absolute rates follow the load")
