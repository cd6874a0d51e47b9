"""Pipeline schedules: pure functions giving each stage its ordered F / B / step actions.

- ``gpipe``  all forwards, then all backwards, then one optimizer step (flush per batch).
- ``1f1b``   after ``stages - stage`` warm-up forwards, alternate one forward and one
  backward, then one optimizer step (flush per batch). Same maths as ``gpipe``, at most
  ``stages - stage + 1`` micro-batches held. One warm-up forward more than the textbook
  ``stages - stage - 1`` gives each stage a forward to run while its gradient is in flight,
  which hides the link latency (about 6% of a step in ``simulate`` with 1 ms links). The
  last stage needs no warm-up: its forward is folded into its backward.
- ``async``  PipeDream's 1F1B with weight stashing, as FTPipeHD uses: an optimizer step after
  every backward and no flush, so stage ``s`` has at most ``stages - s`` micro-batches in
  flight and a micro-batch's backward sees weights at most that many steps old.

Actions print compactly as in torch's pipelining (``F0``, ``B3``, ``S``) for logs and tests.
:func:`steps_ahead` bounds how far ahead the coordinator feeds a pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgert.errors import EdgertError

SCHEDULES = ("gpipe", "1f1b", "async")
SYNCHRONOUS = ("gpipe", "1f1b")
Key = tuple[int, int]  # (step, micro-batch index within the step)


@dataclass(frozen=True)
class Action:
    """One thing a stage does: forward or backward of a micro-batch, or an optimizer step."""

    kind: str  # "F", "B" or "S"
    microbatch: int = -1

    def __str__(self) -> str:
        return self.kind if self.kind == "S" else f"{self.kind}{self.microbatch}"


def forward(m: int) -> Action:
    return Action("F", m)


def backward(m: int) -> Action:
    return Action("B", m)


STEP = Action("S")


def stage_actions(kind: str, stage: int, stages: int, microbatches: int) -> list[Action]:
    """The ordered actions of ``stage`` (0-based) for ``microbatches`` micro-batches."""
    _check(kind, stage, stages, microbatches)
    if kind == "gpipe":
        return [forward(m) for m in range(microbatches)] + [backward(m) for m in range(microbatches)] + [STEP]
    if kind == "async" or stage == stages - 1:
        warmup = min(stages - stage - 1, microbatches)
    else:
        warmup = min(stages - stage, microbatches)
    after_backward = [STEP] if kind == "async" else []
    actions = [forward(m) for m in range(warmup)]
    for m in range(microbatches - warmup):
        actions += [forward(warmup + m), backward(m), *after_backward]
    for m in range(microbatches - warmup, microbatches):
        actions += [backward(m), *after_backward]
    return actions if kind == "async" else actions + [STEP]


def steps_ahead(kind: str, stages: int, microbatches: int, lookahead: int, capacity: int) -> int:
    """How many steps the coordinator may have sent and not yet seen completed.

    ``lookahead`` (plus ``stages`` under ``async``, whose pipeline never drains), but no more
    than the first and last stages' inboxes (``capacity`` messages each) hold: every step sent
    leaves its micro-batches' inputs on the first stage and their labels on the last (both on
    a single stage), beside what the neighbouring stage sends meanwhile (one step's
    micro-batches; under ``async``, one per stage). At least 1.
    """
    _check(kind, 0, stages, microbatches)
    per_step = 1 if kind == "async" else microbatches
    wanted = lookahead + (stages if kind == "async" else 0)
    if stages == 1:
        fits = capacity // (2 * per_step)
    else:
        fits = (capacity - (stages if kind == "async" else per_step)) // per_step
    return max(1, min(wanted, fits))


def schedule_table(kind: str, stages: int, microbatches: int) -> list[list[str]]:
    """Every stage's actions as strings: the literal tables the tests compare against."""
    return [[str(a) for a in stage_actions(kind, s, stages, microbatches)] for s in range(stages)]


def max_in_flight(actions: list[Action]) -> int:
    """The most micro-batches a stage holds (forwarded, not yet backwarded) at once."""
    held = peak = 0
    for action in actions:
        held += {"F": 1, "B": -1}.get(action.kind, 0)
        peak = max(peak, held)
    return peak


def simulate(kind: str, forward_ms: list[float], backward_ms: list[float], microbatches: int,
             link_ms: list[float] | None = None) -> float:
    """Makespan (ms) of one window of the schedule, from per-stage forward/backward times.

    ``link_ms[s]`` is the transfer time between stage ``s`` and ``s + 1``. The last stage's
    forward is folded into its backward, as the runtime does. Raises if the schedule would
    deadlock, which the tests use to prove every schedule is executable.
    """
    stages = len(forward_ms)
    links = link_ms or [0.0] * (stages - 1)
    plans = [stage_actions(kind, s, stages, microbatches) for s in range(stages)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, microbatch) -> finish time
    clock = [0.0] * stages
    cursor = [0] * stages
    progressed = True
    while progressed:
        progressed = False
        for s in range(stages):
            while cursor[s] < len(plans[s]):
                action = plans[s][cursor[s]]
                ready = _ready_time(action, s, stages, done, links)
                if ready is None:
                    break
                cost = {"F": 0.0 if s == stages - 1 else forward_ms[s], "B": backward_ms[s], "S": 0.0}[action.kind]
                clock[s] = max(clock[s], ready) + cost
                done[(action.kind, s, action.microbatch)] = clock[s]
                cursor[s] += 1
                progressed = True
    if any(cursor[s] < len(plans[s]) for s in range(stages)):
        stuck = {s: str(plans[s][cursor[s]]) for s in range(stages) if cursor[s] < len(plans[s])}
        raise EdgertError(f"schedule {kind} deadlocks: stages waiting at {stuck}")
    return max(clock)


def _ready_time(action: Action, s: int, stages: int, done: dict, links: list[float]) -> float | None:
    if action.kind == "F":
        if s == 0:
            return 0.0
        upstream = done.get(("F", s - 1, action.microbatch))
        return None if upstream is None else upstream + links[s - 1]
    if action.kind == "B":
        own_forward = done.get(("F", s, action.microbatch))
        if own_forward is None:
            return None
        if s == stages - 1:
            return own_forward
        downstream = done.get(("B", s + 1, action.microbatch))
        return None if downstream is None else max(own_forward, downstream + links[s])
    return 0.0


def _check(kind: str, stage: int, stages: int, microbatches: int) -> None:
    if kind not in SCHEDULES:
        raise EdgertError(f"unknown schedule {kind!r}; choose one of {', '.join(SCHEDULES)}")
    if stages < 1 or not 0 <= stage < stages:
        raise EdgertError(f"stage {stage} is not in 0..{stages - 1}")
    if microbatches < 1:
        raise EdgertError(f"micro-batches must be at least 1 (got {microbatches})")


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of a window: which step it belongs to, its size and loss scale."""

    step: int
    index: int
    size: int
    loss_scale: float

    @property
    def key(self) -> Key:
        return (self.step, self.index)


@dataclass(frozen=True)
class Window:
    """Work the coordinator hands a stage: micro-batches under one schedule.

    Synchronous schedules: one step (all micro-batches share ``step``). ``async``: each
    micro-batch is its own step, and the pipeline drains only at the end of the window.
    """

    schedule: str
    stages: int
    microbatches: tuple[MicroBatch, ...]

    @property
    def steps(self) -> list[int]:
        return sorted({m.step for m in self.microbatches})




def split_batch(step: int, batch_size: int, microbatches: int) -> list[MicroBatch]:
    """Micro-batches of one synchronous step; sizes differ by at most one sample."""
    bounds = np.linspace(0, batch_size, min(microbatches, batch_size) + 1).astype(int)
    return [MicroBatch(step, i, int(b - a), float(b - a) / batch_size)
            for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]
