"""What a pipeline rank measures on torch's executor: each action's time, and the
micro-batches whose activations each stage holds.

`TimedStage` is torch's `PipelineStage` with its three compute calls timed
(`forward_one_chunk`, `backward_one_chunk`, `backward_weight_one_chunk`: what the
schedules call for F, B or I, and W); the sends, receives and waits around them are not
inside, so a rank's busy time is its compute and the rest of the step is idle. In the
forward, a saved-tensor hook tags every tensor autograd keeps for the backward (but the
parameters themselves) with its micro-batch; the tag dies when autograd frees the tensor
(normally in that micro-batch's backward), so the live tags count the micro-batches whose
activations the stage holds.

`step_bubbles` turns the ranks' logs into each step's bubble, measured and predicted:
every rank of a pipeline enters a step together (the strategy waits on a barrier of the
pipeline's group first), so a step's span is the longest rank's time in it, and
- measured: 1 - a rank's busy time / the span it took,
- predicted: 1 - the same busy time / the span of schedule.replay with these very
  action times (communication taking none).
The two differ by what the replay leaves out: sends and receives, the executor's own
work between actions, the barrier's skew, and time a rank was ready to run but waited
for a core. That last one is measured too (Linux's per-thread run-queue wait, outside the
rank's actions: inside them it is part of the action's time): `cpu_wait`.
"""

from __future__ import annotations

import os
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

from .schedule import Action, Layout, idle_share, replay


@dataclass
class StepLog:
    """One rank's record of one step: (action, start, end) in seconds from the step's start;
    the step's length; the most micro-batches whose activations it held at once, per stage
    and in all (a rank with several stages); whether it was the schedule's first step (which
    also measures shapes and connects the stages)."""

    actions: list[tuple[Action, float, float]] = field(default_factory=list)
    length: float = 0.0
    held: dict[int, int] = field(default_factory=dict)
    held_in_all: int = 0
    first: bool = False
    cpu_wait: float = 0.0  # seconds ready to run but waiting for a core, outside the actions


class _RunQueueWait:
    """Seconds the calling thread has waited, ready to run, for a core (the second field of
    Linux's /proc/thread-self/schedstat); always 0.0 where that is unreadable."""

    def __init__(self) -> None:
        try:
            self._fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None
            return
        weakref.finalize(self, os.close, self._fd)

    def __call__(self) -> float:
        return int(os.pread(self._fd, 128, 0).split()[1]) / 1e9 if self._fd is not None else 0.0


class RankClock:
    """The steps of one rank, shared by its stages."""

    def __init__(self, device: torch.device) -> None:
        # On a GPU an action's time is its kernels': wait for the compute stream at each edge
        # (the p2p streams are not waited on). Never ran on a GPU: none was available.
        self._sync = (
            torch.cuda.current_stream(device).synchronize if device.type == "cuda" else lambda: None
        )
        self.steps: list[StepLog] = []
        self._start = 0.0
        self.live: dict[tuple[int, int], int] = defaultdict(int)  # (stage, mb) -> saved tensors
        self._run_queue = _RunQueueWait()  # made on the thread that runs the steps
        self._waited = self._waited_in_actions = 0.0

    def begin(self, first: bool) -> None:
        self.steps.append(StepLog(first=first))
        self._waited, self._waited_in_actions = self._run_queue(), 0.0
        self._start = time.perf_counter()

    def end(self) -> None:
        log = self.steps[-1]
        log.length = time.perf_counter() - self._start
        log.cpu_wait = max(0.0, self._run_queue() - self._waited - self._waited_in_actions)

    def now(self) -> float:
        return time.perf_counter() - self._start

    def start_action(self) -> tuple[float, float]:
        self._sync()
        return self.now(), self._run_queue()

    def record(self, action: Action, started: tuple[float, float]) -> None:
        self._sync()
        start, waited = started
        self._waited_in_actions += self._run_queue() - waited
        self.steps[-1].actions.append((action, start, self.now()))

    def extend_last_forward(self) -> None:
        """The loss is computed right after the last stage's forward: part of that F.
        (Before the first forward, torch's shape inference computes one: not an action.)"""
        actions = self.steps[-1].actions
        if actions and actions[-1][0][1] == "F":
            self._sync()
            action, start, _ = actions[-1]
            actions[-1] = (action, start, self.now())

    def note_held(self, stage: int) -> None:
        holding = [s for (s, _), n in self.live.items() if n > 0]
        log = self.steps[-1]
        log.held[stage] = max(log.held.get(stage, 0), holding.count(stage))
        log.held_in_all = max(log.held_in_all, len(holding))

    def take(self) -> list[StepLog]:
        steps, self.steps = self.steps, []
        return steps


class _Saved:
    """A tensor autograd saved in (stage, mb)'s forward; counted live until autograd drops it.
    Parameters are not wrapped: they are no micro-batch's (a bf16 copy of one is).

    It keeps the tensor detached, as autograd keeps what it saves itself: a saved output
    that kept its grad_fn would hold the very node that holds it, a cycle through C++ that
    Python's collector cannot see. After a plain backward autograd frees saved tensors
    anyway; a zero-bubble schedule's input-only backward (I) retains its graph, and those
    cycles leaked every micro-batch's activations (seen: ZBV's RSS grew ~17 MB a step)."""

    __slots__ = ("tensor", "key", "live")

    def __init__(self, tensor: torch.Tensor, key: tuple[int, int], live: dict) -> None:
        self.tensor, self.key, self.live = tensor.detach(), key, live
        live[key] += 1

    def __del__(self) -> None:
        self.live[self.key] -= 1


class TimedStage(PipelineStage):
    """torch's PipelineStage, its compute calls timed into `clock` (see the module doc)."""

    def __init__(self, *args, clock: RankClock, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.clock = clock

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
        key, live = (self.stage_index, fwd_chunk_id), self.clock.live
        start = self.clock.start_action()
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: t if isinstance(t, nn.Parameter) else _Saved(t, key, live),
            lambda s: s.tensor if isinstance(s, _Saved) else s,
        ):
            out = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        self.clock.record((self.stage_index, "F", fwd_chunk_id), start)
        self.clock.note_held(self.stage_index)
        return out

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        start = self.clock.start_action()
        super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        self.clock.record((self.stage_index, "B" if full_backward else "I", bwd_chunk_id), start)

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        start = self.clock.start_action()
        super().backward_weight_one_chunk(bwd_chunk_id, last_backward)
        self.clock.record((self.stage_index, "W", bwd_chunk_id), start)


@dataclass(frozen=True)
class StepBubble:
    measured: list[float]  # per rank of the pipeline
    predicted: list[float]
    cpu_wait: list[float]  # share of the span a rank waited for a core outside its actions


def step_bubbles(lay: Layout, logs: list[list[StepLog]]) -> list[StepBubble]:
    """Each step's bubble per rank, measured and predicted; logs[rank][step] (see the module doc)."""
    out = []
    for steps in zip(*logs):
        times = {action: end - start for log in steps for action, start, end in log.actions}
        busy = [sum(end - start for _, start, end in log.actions) for log in steps]
        span = max(log.length for log in steps)
        predicted = idle_share(replay(lay, lambda rank, action: times[action]))
        out.append(StepBubble([1 - b / span for b in busy], predicted, [log.cpu_wait / span for log in steps]))
    return out
