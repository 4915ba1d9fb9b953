"""prepare's engine run in this process on one thread, each phase timed: the forecast's
per-core prepare rates are those of prepare's own code (pipelines.prepare), on the sample.

Phases are timed in CPU seconds of this process (time.process_time, every thread): the
work, which a busy machine stretches in wall time but not in CPU time.

An engine's shuffle is the one thing no engine-neutral code does: here the rows of pass 2
are written as one Arrow IPC stream and read back grouped by part, the least any shuffle
does with them (Spark and Dask move Arrow batches, then spill and fetch). The forecast
scales that by each engine's measured cost over it (forecast.costs).
"""

from __future__ import annotations

import json
import time

import pyarrow as pa
import pyarrow.compute as pc

from shardline.pipelines.tasks import PART_COL

PHASES = ("pass1", "pass2", "shuffle", "write")


def rss_mb(field: str = "VmRSS") -> float:
    """A figure of /proc/self/status (VmRSS, VmHWM) in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def reset_peak() -> float:
    """This process's RSS high-water mark (VmHWM) set back to its RSS now; that RSS, MB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss_mb()


class SampleEngine:
    name = "in-process"
    version = "forecast"

    def __init__(self):
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.tasks = dict.fromkeys(PHASES, 0)
        self.transport_bytes = 0
        # Peak RSS growth of a phase over its start (MB), and the most rows one call held:
        # a worker's memory per row in flight.
        self.peak_mb = dict.fromkeys(PHASES, 0.0)
        self.rows_in_flight = dict.fromkeys(PHASES, 0)

    def listen_address(self) -> str:
        return "127.0.0.1"  # the tasks run in this process (prepare's progress listener)

    def run(self, fn, items: list) -> list:
        start, base = time.process_time(), reset_peak()
        out = [json.loads(json.dumps(fn(item))) for item in items]  # results travel as JSON, as on Spark
        self._done("pass1", start, base, len(items))
        return out

    def shuffle_write(self, sources: list, read, schema: pa.Schema, parts: int, write, out_schema: pa.Schema) -> list[dict]:
        start, base = time.process_time(), reset_peak()
        tables = [t for s in sources for t in read(s)]
        # Every row is held here (a task streams them to the shuffle): memory per row held.
        self.rows_in_flight["pass2"] = self.rows_in_flight["shuffle"] = sum(t.num_rows for t in tables)
        self._done("pass2", start, base, len(sources))

        start, base = time.process_time(), reset_peak()
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, schema) as w:
            for t in tables:
                w.write_table(t.cast(schema))
        buf = sink.getvalue()
        self.transport_bytes += buf.size
        del tables
        rows = pa.ipc.open_stream(buf).read_all()
        rows = rows.take(pc.sort_indices(rows, [(PART_COL, "ascending")]))
        self._done("shuffle", start, base, 1)

        start, base = time.process_time(), reset_peak()
        out = []
        part_of = rows.column(PART_COL).to_numpy()
        for p in range(parts):
            lo, hi = part_of.searchsorted(p), part_of.searchsorted(p, "right")
            if hi > lo:
                self.rows_in_flight["write"] = max(self.rows_in_flight["write"], int(hi - lo))
                for b in write(rows.slice(lo, hi - lo)):
                    out.extend(pa.Table.from_batches([b], out_schema).to_pylist())
        self._done("write", start, base, parts)
        return out

    def _done(self, phase: str, start: float, base_mb: float, tasks: int) -> None:
        self.seconds[phase] += time.process_time() - start
        self.tasks[phase] += tasks
        self.peak_mb[phase] = max(self.peak_mb[phase], rss_mb("VmHWM") - base_mb)
