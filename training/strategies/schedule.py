"""Pipeline schedules as plain action lists, and a dry-run that finds deadlocks before anything runs.

A stage's schedule is the order of its actions for one batch: ("F", i) is the
forward of micro-batch i, ("B", i) its backward. The executor (pipeline.py) runs
exactly these lists; `run_actions` replays them with the executor's communication
semantics, so what the dry-run shows (and refuses) is what the ranks would do.
Pure Python: the driver checks and prints a schedule without torch.
"""

from __future__ import annotations

Action = tuple[str, int]
# timeline[stage][time step]: the action that stage runs in that step, None when idle.
Timeline = list[list[Action | None]]


class DeadlockError(RuntimeError):
    """Some stage would block forever on a message no other stage will send."""


def actions(schedule: str, stages: int, micro_batches: int, stage: int) -> list[Action]:
    """The order in which `stage` runs its forwards and backwards for one batch.

    Backwards run in micro-batch order in both schedules: the gradient of every
    parameter is then summed in the same order, so GPipe and 1F1B give bit-equal
    weights (reverse order would change only the rounding, not the timeline).
    """
    m = micro_batches
    forwards = [("F", i) for i in range(m)]
    backwards = [("B", i) for i in range(m)]
    if schedule == "gpipe":
        return forwards + backwards
    if schedule == "1f1b":
        # Warm-up fills the pipeline below this stage; from then on every forward is
        # followed by the oldest pending backward, so at most stages - stage
        # micro-batches' activations are held at once.
        warmup = min(stages - stage - 1, m)
        steady = [a for i in range(warmup, m) for a in (forwards[i], backwards[i - warmup])]
        return forwards[:warmup] + steady + backwards[m - warmup:]
    raise ValueError(f"unknown pipeline schedule {schedule!r} (valid: gpipe, 1f1b)")


def _needs(stage: int, action: Action, stages: int) -> tuple[int, Action] | None:
    """The other stage's action whose message `action` receives; None if it receives none."""
    kind, i = action
    if kind == "F" and stage > 0:
        return stage - 1, action  # the activation of micro-batch i
    if kind == "B" and stage < stages - 1:
        return stage + 1, action  # the gradient of micro-batch i
    return None


def _check_lists(lists: list[list[Action]]) -> None:
    m = sum(1 for kind, _ in lists[0] if kind == "F")
    for stage, acts in enumerate(lists):
        complete = sorted(acts) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
        if not complete or any(acts.index(("B", i)) < acts.index(("F", i)) for i in range(m)):
            raise ValueError(
                f"stage {stage}'s actions must hold F0..F{m - 1} and B0..B{m - 1} once each, "
                "each B after its F"
            )


def run_actions(lists: list[list[Action]]) -> Timeline:
    """Replay one action list per stage, one time unit per action.

    Sends are buffered (the executor's isend never waits for the receiver);
    a receive blocks until the matching message has been sent, in an earlier
    step. A step in which no stage can move means none ever will: DeadlockError.
    """
    _check_lists(lists)
    stages = len(lists)
    ran_at: dict[tuple[int, Action], int] = {}
    pos = [0] * stages
    timeline: Timeline = [[] for _ in range(stages)]
    t = 0
    while any(pos[s] < len(lists[s]) for s in range(stages)):
        moved = []
        for s in range(stages):
            action = lists[s][pos[s]] if pos[s] < len(lists[s]) else None
            need = action and _needs(s, action, stages)
            ready = action is not None and (need is None or ran_at.get(need, t) < t)
            timeline[s].append(action if ready else None)
            if ready:
                moved.append((s, action))
        if not moved:
            raise DeadlockError("; ".join(
                _waiting(s, lists[s][pos[s]], stages) for s in range(stages) if pos[s] < len(lists[s])
            ))
        for s, action in moved:
            ran_at[s, action] = t
            pos[s] += 1
        t += 1
    return timeline


def _waiting(stage: int, action: Action, stages: int) -> str:
    source, _ = _needs(stage, action, stages)
    message = "activation" if action[0] == "F" else "gradient"
    return (
        f"stage {stage} waits forever at {_label(action)} for the {message} of "
        f"micro-batch {action[1]} from stage {source}"
    )


def dry_run(schedule: str, stages: int, micro_batches: int) -> Timeline:
    """The timeline of `schedule` on `stages` stages, or DeadlockError."""
    return run_actions([actions(schedule, stages, micro_batches, s) for s in range(stages)])


def _label(action: Action | None) -> str:
    return "." if action is None else f"{action[0]}{action[1]}"


def grid(timeline: Timeline) -> str:
    """The timeline as a stage x time-step table: F0, B3 ..., "." where the stage idles."""
    steps = len(timeline[0])
    rows = [["step", *map(str, range(steps))]]
    rows += [[f"stage {s}", *map(_label, row)] for s, row in enumerate(timeline)]
    width = max(len(cell) for row in rows for cell in row[1:])
    head = max(len(row[0]) for row in rows)
    return "\n".join(
        " ".join([row[0].ljust(head), *(cell.ljust(width) for cell in row[1:])]).rstrip()
        for row in rows
    )


def bubble_formula(p: int, m: int) -> float:
    """Idle share of each stage with unit-time actions: (p-1)/(m+p-1), both schedules."""
    return (p - 1) / (m + p - 1)
