"""Pipeline schedules: torch.distributed.pipelining's by name, the order in which each
rank runs its actions, and a replay of those orders in time.

An action is (stage, kind, micro-batch): kind F is a forward, B a full backward, I a
backward for the input only and W the weight gradient it leaves for later (zero-bubble
schedules split B into I and W). torch prints them as `2F0` (stage 2, forward of
micro-batch 0); so do we.

The replay runs each rank's list in order, an action starting as soon as the rank is
free and its input has arrived (the activation from the stage before, the gradient from
the stage after), communication taking no time. With equal unit times it draws the grid
the driver prints before training and gives the schedule's own bubble; with the action
times a step measured on the ranks it predicts that step's bubble (pipeline_timing.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

Action = tuple[int, str, int]  # (stage, kind, micro-batch)
# The time unit of the grid and of the schedule's own bubble: a full backward costs about
# two forwards (it computes the gradients of the inputs and of the weights); I and W one each.
UNIT_TIME = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


@dataclass(frozen=True)
class Schedule:
    torch_class: type
    stages_per_rank: int | None  # None: any number from 2 (training.pipeline_stages_per_rank)
    summary: str


SCHEDULES: dict[str, Schedule] = {
    "gpipe": Schedule(ScheduleGPipe, 1, "all forwards, then all backwards"),
    "1f1b": Schedule(Schedule1F1B, 1, "after a warm-up, one forward then one backward"),
    "interleaved-1f1b": Schedule(
        ScheduleInterleaved1F1B, None, "1F1B over several stages per rank, looped: rank r holds "
        "stages r, r+p, ...",
    ),
    "zbv": Schedule(
        ScheduleZBVZeroBubble, 2, "zero bubble, V-shaped: rank r holds stages r and 2p-1-r, "
        "weight gradients (W) fill the idle slots",
    ),
}


def label(action: Action) -> str:
    stage, kind, mb = action
    return f"{stage}{kind}{mb}"


@dataclass
class _StageShape:
    """What a torch schedule's constructor reads from its stages to lay out every rank's
    actions. The schedule is built on the driver, before any process group exists; the
    ranks build the same class on real PipelineStages (tests compare the two)."""

    num_stages: int
    group_size: int
    group_rank: int = 0
    submod: None = None
    stage_index_to_group_rank: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Layout:
    """One pipeline's schedule: which stages each rank holds and the order of its actions."""

    name: str
    ranks: int  # p, the pipeline's ranks
    stages_per_rank: int
    micro_batches: int
    stage_rank: dict[int, int]  # stage -> the rank holding it
    orders: list[list[Action]]  # orders[rank]: its compute actions, in the order it runs them

    @property
    def stages(self) -> int:
        return self.ranks * self.stages_per_rank

    def rank_stages(self, rank: int) -> list[int]:
        return sorted(s for s, r in self.stage_rank.items() if r == rank)


def layout(name: str, ranks: int, stages_per_rank: int, micro_batches: int) -> Layout:
    """The layout torch's `name` schedule runs. ValueError (torch's message) if it refuses."""
    p, v, m = ranks, stages_per_rank, micro_batches
    cls = SCHEDULES[name].torch_class
    if v == 1:
        # Single-stage schedules run a hand-written loop: their `pipeline_order` is only a
        # picture, and torch 2.13's for 1F1B numbers the last stage's micro-batches from 1.
        # So the order is the loop's, written out here; constructing the class still runs
        # torch's own checks (1F1B refuses m < p), and tests compare the order with the one
        # the executor records.
        cls(_StageShape(p, p), m)
        orders = [_single_stage_order(name, p, m, s) for s in range(p)]
        return Layout(name, p, 1, m, {s: s for s in range(p)}, orders)
    shapes = [_StageShape(p * v, p) for _ in range(v)]
    schedule = cls(shapes, m)
    # The runtime executes pipeline_order_with_comms[rank]: the compute actions, in order,
    # with the sends and receives it derived from them.
    orders = [
        [(a.stage_index, a.computation_type.value, a.microbatch_index)
         for a in schedule.pipeline_order_with_comms[r] if a.computation_type.value in UNIT_TIME]
        for r in range(p)
    ]
    return Layout(name, p, v, m, dict(shapes[0].stage_index_to_group_rank), orders)


def _single_stage_order(name: str, p: int, m: int, stage: int) -> list[Action]:
    forwards = [(stage, "F", i) for i in range(m)]
    backwards = [(stage, "B", i) for i in range(m)]
    if name == "gpipe":
        return forwards + backwards
    # Schedule1F1B: min(m, p - stage) forwards, then a backward before every further
    # forward, then the remaining backwards: at most p - stage micro-batches in flight.
    warmup = min(m, p - stage)
    order = forwards[:warmup]
    for i in range(m - warmup):
        order += [backwards[i], forwards[warmup + i]]
    return order + backwards[m - warmup:]


class ReplayStuck(RuntimeError):
    """No rank can run its next action: the orders wait on each other forever."""


def replay(lay: Layout, duration: Callable[[int, Action], float]) -> list[list[tuple[float, float, Action]]]:
    """(start, end, action) of every action of every rank: each rank runs its order, an
    action starting when the rank is free and its input is there; `duration(rank, action)`."""
    last = lay.stages - 1
    end: dict[tuple[int, str, int], float] = {}
    free = [0.0] * lay.ranks
    pos = [0] * lay.ranks
    out: list[list[tuple[float, float, Action]]] = [[] for _ in range(lay.ranks)]

    def ready_at(action: Action) -> float | None:
        stage, kind, mb = action
        if kind == "F":
            needs = [(stage - 1, "F", mb)] if stage > 0 else []
        elif kind in ("B", "I"):
            # The gradient of this stage's output: the next stage's backward of the micro-batch.
            needs = [(stage + 1, k, mb) for k in ("B", "I")] if stage < last else [(stage, "F", mb)]
        else:  # W follows its own I on this rank
            needs = [(stage, "I", mb)]
        times = [end[n] for n in needs if n in end]
        return (times[0] if times else None) if needs else 0.0

    remaining = sum(len(o) for o in lay.orders)
    while remaining:
        moved = False
        for r, order in enumerate(lay.orders):
            while pos[r] < len(order):
                action = order[pos[r]]
                at = ready_at(action)
                if at is None:
                    break
                start = max(free[r], at)
                free[r] = start + duration(r, action)
                end[action] = free[r]
                out[r].append((start, free[r], action))
                pos[r] += 1
                remaining -= 1
                moved = True
        if not moved:
            waiting = ", ".join(
                f"rank {r} at {label(o[pos[r]])}" for r, o in enumerate(lay.orders) if pos[r] < len(o)
            )
            raise ReplayStuck(f"no rank can move: {waiting}")
    return out


def idle_share(timeline: list[list[tuple[float, float, Action]]]) -> list[float]:
    """Each rank's idle share of the step: 1 - its busy time / the step's span (all ranks
    start together; the step ends with the last action anywhere)."""
    span = max(t[-1][1] for t in timeline if t)
    return [1 - sum(e - s for s, e, _ in t) / span for t in timeline]


def in_flight(lay: Layout) -> dict[int, int]:
    """Per stage, the most micro-batches it has run forward and not yet finished backward
    (B, or W after I) at once: whose activations the schedule makes it hold."""
    most: dict[int, int] = {}
    for order in lay.orders:
        begun: dict[int, set[int]] = {}
        for stage, kind, mb in order:
            held = begun.setdefault(stage, set())
            if kind == "F":
                held.add(mb)
            elif kind in ("B", "W"):
                held.discard(mb)
            most[stage] = max(most.get(stage, 0), len(held))
    return dict(sorted(most.items()))


def unit_timeline(lay: Layout) -> list[list[tuple[float, float, Action]]]:
    return replay(lay, lambda rank, action: UNIT_TIME[action[1]])


def schedule_bubble(lay: Layout) -> float:
    """The schedule's own bubble: the mean idle share with equal stages and unit times."""
    shares = idle_share(unit_timeline(lay))
    return sum(shares) / len(shares)


def grid(lay: Layout, row_names: list[str] | None = None) -> str:
    """The unit-time replay as a rank x time table; an action spans its units, "." is idle.
    row_names: what to call each rank's row (default "rank r")."""
    timeline = unit_timeline(lay)
    steps = int(max(t[-1][1] for t in timeline if t))
    rows = [["time", *map(str, range(steps))]]
    for r, t in enumerate(timeline):
        cells = ["."] * steps
        for start, end, action in t:
            for u in range(int(start), int(end)):
                cells[u] = label(action)
        rows.append([row_names[r] if row_names else f"rank {r}", *cells])
    width = max(len(cell) for row in rows for cell in row[1:])
    head = max(len(row[0]) for row in rows)
    return "\n".join(
        " ".join([row[0].ljust(head), *(cell.ljust(width) for cell in row[1:])]).rstrip()
        for row in rows
    )


def closed_form(lay: Layout) -> tuple[str, int, int] | None:
    """The textbook bubble of the layout, (expression, numerator, denominator), where one
    exists: (p-1)/(m+p-1) for GPipe and 1F1B; Megatron's (p-1)/(v*m+p-1) for interleaved
    1F1B with m >= p (fewer micro-batches than ranks leave torch's interleaved schedule
    more idle than that). schedule_bubble equals it (tests check)."""
    p, m, v = lay.ranks, lay.micro_batches, lay.stages_per_rank
    if v == 1:
        return "(p-1)/(m+p-1)", p - 1, m + p - 1
    if lay.name == "interleaved-1f1b" and m >= p:
        return "(p-1)/(v*m+p-1)", p - 1, v * m + p - 1
    return None
