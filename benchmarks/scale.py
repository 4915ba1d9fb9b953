"""`shardline bench scale`: a large dataset end to end on each engine, and how it grows.

Raw CSV of the quickstart's schema (benchmarks.scale_data, kept under --data-dir for
reruns), N rows and N/GROWTH rows. Per engine, on this machine's cores (Spark local[2],
Dask 2 workers): prepare, `steps` ddp steps on 2 ranks over the whole dataset, scoring the
test split; each stage's wall time, rows/s, peak RSS of the driver and of every executor,
worker and rank process, and disk bytes written (benchmarks.proc_tree). Growth ratios N
over N/GROWTH say what grows with rows. The forecast (`shardline plan --hosts 1 --cores C`,
shardline.forecasting, measured on a sample of the same raw data) is checked against each
leg: at 2 cores on both sizes, and at 1 core (local[1], 1 Dask worker, 1 rank) on N/GROWTH.

Targets (reported, never asserted by tests): prepare + steps + scoring at N under
TARGET_S on each engine; the driver's peak RSS at N within DRIVER_GROWTH of its peak at
N/GROWTH; data-wait at most DATA_WAIT; what each rank adds to its process within
RANK_GROWTH of it at N/GROWTH; every forecast stage within FORECAST_TOLERANCE of its run.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import shutil
from pathlib import Path

from . import significant
from .scale_data import folder_bytes, quickstart_csv
from .bench_engines import ENGINES
from .scale_legs import leg_config, run_leg

DEFAULT_ROWS = 300_000_000
GROWTH = 100
WARM_ROWS = 20_000
TARGET_S = 1800.0
DRIVER_GROWTH = RANK_GROWTH = 1.2
DATA_WAIT = 0.05
FORECAST_TOLERANCE = 0.25
STAGES = ("prepare", "train", "score")


def run(rows: int = DEFAULT_ROWS, data_dir: str = "shardline-data/bench-scale", steps: int = 2000,
        engines: tuple[str, ...] = ("spark", "dask"), one_core: bool = True, sample_rows: int | None = None,
        warm_up: bool = True, progress=print) -> dict:
    from shardline import forecasting as fc
    from shardline.config import load_config

    data = Path(data_dir).resolve()
    small = max(rows // GROWTH, WARM_ROWS)
    check_disk(data, rows)
    raw = {n: quickstart_csv(data, n, progress) for n in sorted({small, rows})}
    warm = quickstart_csv(data, WARM_ROWS, progress) if warm_up else None
    work = data / "work"
    shutil.rmtree(work, ignore_errors=True)
    tracking = f"sqlite:///{work / 'mlflow.db'}"
    work.mkdir(parents=True)
    measured = {}
    for n, folder in raw.items():
        progress(f"forecast: measuring a sample of {folder.name}")
        cfg = load_config(leg_config(folder, work / "forecast", "spark", 2, tracking, "forecast"))
        measured[n] = fc.measure(cfg, sample_rows or fc.SAMPLE_ROWS, progress=lambda _: None)
    legs = []
    try:
        for engine in engines:
            for cores in ((1, 2) if one_core else (2,)):
                handle = ENGINES[engine].open(cores)
                try:
                    # The first job on a fresh engine pays for imports and JIT the legs would
                    # otherwise charge to their first stage; --no-warm-up keeps that cost in.
                    if warm is not None:
                        progress(f"{engine} on {cores} core(s): warming up on {WARM_ROWS:,} rows (not reported)")
                        run_leg(warm, work / "warm", engine, cores, handle, tracking, 4, 1, lambda _: None)
                    for n in (sorted(raw) if cores == 2 else [small]):
                        cfg = load_config(leg_config(raw[n], work / "leg", engine, cores, tracking, "x"))
                        f = fc.forecast(measured[n], cfg, fc.Cluster(hosts=1, cores=cores), engine, steps)
                        leg = run_leg(raw[n], work / f"{engine}-{cores}-{n}", engine, cores, handle, tracking, steps,
                                      f.layout.loader_workers_per_rank, progress)
                        leg["rows"] = n
                        leg["forecast"] = check_forecast(f, leg)
                        legs.append(leg)
                finally:
                    ENGINES[engine].close(handle)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {**summarize(rows, small, steps, raw, measured, legs), "warm_up": warm_up}


# Disk a row takes at the peak of a leg: its raw CSV (~83 bytes, kept), its shards and the
# shuffle's spill (at 3M rows a leg wrote 137-153 bytes a row: 56 of shards, the rest spill).
RAW_BYTES_PER_ROW, LEG_BYTES_PER_ROW = 83, 155


def check_disk(data: Path, rows: int) -> None:
    """Refuse, in one line and before generating anything, a run the disk cannot hold."""
    from shardline.foundation.errors import DataError
    from .scale_data import MARKER

    kept = (data / f"raw-{rows}" / MARKER).exists()
    need = (0 if kept else RAW_BYTES_PER_ROW * rows) + LEG_BYTES_PER_ROW * rows
    where = data
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if need > free:
        raise DataError(f"{data}: bench scale at {rows:,} rows needs about {need / 1e9:.0f} GB of disk "
                        f"({'the raw data is kept; ' if kept else ''}raw CSV, shards, the shuffle's spill), "
                        f"{free / 1e9:.0f} GB free")


def check_forecast(f, leg: dict) -> dict:
    """Each stage's forecast seconds beside its run's: run / forecast, and whether that is
    within FORECAST_TOLERANCE; the epoch's forecast (not run) beside them."""
    forecast = {"prepare": f.prepare.seconds, "train": f.train_steps.seconds, "score": f.score.seconds}
    ran = {k: leg["stages"][k]["seconds"] for k in STAGES}
    forecast["total"], ran["total"] = sum(forecast.values()), sum(ran.values())
    ratio = {k: ran[k] / forecast[k] for k in forecast}
    phases = leg["stages"]["prepare"].get("phases", {})
    parts = f.prepare.parts
    by_phase = {"pass1": parts.get("pass1", 0.0), "pass2_shuffle_write": parts.get("pass2", 0.0) + parts.get("write", 0.0)}
    cpu = {"prepare": f.prepare.cpu_s, "train": f.train_steps.cpu_s, "score": f.score.cpu_s}
    return {"seconds": {k: significant(v) for k, v in forecast.items()},
            # CPU seconds: the work, which a busy machine does not stretch (the tree's, beside).
            "cpu_s": {k: significant(v) for k, v in cpu.items()},
            "ratio_cpu_run_vs_forecast": {k: significant(leg["stages"][k]["cpu_s"] / v) if v else None
                                          for k, v in cpu.items()},
            "prepare_phases": {k: {"run": significant(phases[k]), "forecast": significant(v)}
                               for k, v in by_phase.items() if k in phases},
            "ratio_run_vs_forecast": {k: significant(v) for k, v in ratio.items()},
            "within": {k: abs(v - 1) <= FORECAST_TOLERANCE for k, v in ratio.items()},
            "epoch_s": significant(f.epoch.seconds), "worker_mb": significant(f.prepare.worker_mb),
            "driver_mb": significant(f.prepare.driver_mb)}


def peak(stage: dict, role: str) -> float:
    """The largest peak RSS of any process of `role` in a stage (0: none ran)."""
    return max(stage["peak_rss_mb"].get(role, [0.0]))


def growth(small: dict, big: dict) -> dict:
    """big over small: each stage's seconds and rows/s, the driver's and the ranks' peak RSS."""
    out = {}
    for k in STAGES:
        a, b = small["stages"][k], big["stages"][k]
        out[k] = {"seconds": significant(b["seconds"] / a["seconds"]),
                  "rows_per_s": significant(b["rows_per_s"] / a["rows_per_s"]) if a["rows_per_s"] else None}
    driver = lambda leg: max(peak(s, "driver") for s in leg["stages"].values())  # noqa: E731
    added = lambda leg: max(leg["stages"]["train"]["rank_added_mb"])  # noqa: E731
    out["driver_peak_rss"] = significant(driver(big) / driver(small))
    # What a rank adds to its process (loader, model, buffers), largest rank: its process may
    # hold what earlier stages' tasks left, the same at any size of unit and shard.
    out["rank_added_rss"] = significant(added(big) / max(1.0, added(small)))
    return out


def summarize(rows: int, small: int, steps: int, raw: dict, measured: dict, legs: list[dict]) -> dict:
    by = {(leg["engine"], leg["cores"], leg["rows"]): leg for leg in legs}
    engines = sorted({leg["engine"] for leg in legs})
    grown = {e: growth(by[(e, 2, small)], by[(e, 2, rows)]) for e in engines
             if (e, 2, small) in by and (e, 2, rows) in by and small != rows}
    met, missed = {}, []
    for e in engines:
        big = by.get((e, 2, rows))
        if big is None:
            continue
        total = sum(big["stages"][k]["seconds"] for k in STAGES)
        checks = {
            "under_30_min": total <= TARGET_S,
            "data_wait": big["stages"]["train"]["data_wait"] <= DATA_WAIT,
            "driver_growth": e not in grown or grown[e]["driver_peak_rss"] <= DRIVER_GROWTH,
            "rank_growth": e not in grown or grown[e]["rank_added_rss"] <= RANK_GROWTH,
            "forecast": all(leg["forecast"]["within"][k] for leg in legs if leg["engine"] == e for k in STAGES),
        }
        met[e] = checks
        missed += [why(e, k, big, grown.get(e), legs) for k, ok in checks.items() if not ok]
    return {
        "benchmark": "scale", "rows": rows, "small_rows": small, "steps": steps,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cores": len(os.sched_getaffinity(0)), "platform": platform.platform(),
                    "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)},
        "raw": {str(n): {"path": str(f), "bytes": folder_bytes(f), "files": sum(1 for _ in f.glob("*.csv"))}
                for n, f in raw.items()},
        "measured": {str(n): m.model_dump(mode="json") for n, m in measured.items()},
        "legs": legs, "growth": grown,
        "targets": {"total_s": TARGET_S, "driver_growth": DRIVER_GROWTH, "rank_growth": RANK_GROWTH,
                    "data_wait": DATA_WAIT, "forecast_tolerance": FORECAST_TOLERANCE},
        "met": met, "missed": missed,
    }


def why(engine: str, check: str, big: dict, grown: dict | None, legs: list[dict]) -> str:
    """One line: which stage missed which target, and the figures that say why."""
    st = big["stages"]
    if check == "under_30_min":
        parts = ", ".join(f"{k} {st[k]['seconds']:.0f} s" for k in STAGES)
        slowest = max(STAGES, key=lambda k: st[k]["seconds"])
        return f"{engine}: prepare + steps + scoring over {TARGET_S:.0f} s ({parts}); most in {slowest}"
    if check == "data_wait":
        return (f"{engine}: train waited for data {st['train']['data_wait']:.1%} of its steps (ranks "
                f"{', '.join(f'{w:.1%}' for w in st['train']['data_wait_by_rank'])}): the loader is short")
    if check == "driver_growth":
        stage = max(STAGES, key=lambda k: peak(st[k], "driver"))
        return f"{engine}: the driver's peak RSS grew {grown['driver_peak_rss']:.2f}x with rows (largest in {stage})"
    if check == "rank_growth":
        return (f"{engine}: a rank added {grown['rank_added_rss']:.2f}x the memory with rows (ranks added "
                f"{', '.join(f'{x:.0f}' for x in st['train']['rank_added_mb'])} MB to their processes)")
    off = [f"{leg['cores']} core(s) {leg['rows']:,} rows {k} {leg['forecast']['ratio_run_vs_forecast'][k]:.2f}x"
           for leg in legs if leg["engine"] == engine for k in STAGES if not leg["forecast"]["within"][k]]
    return f"{engine}: forecast off by more than {FORECAST_TOLERANCE:.0%}: " + "; ".join(off)
