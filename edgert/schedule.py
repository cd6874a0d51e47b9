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

Actions print compactly as in torch's pipelining (``F0``, ``B3``, ``S``; ``2F0`` on stage 2)
for logs and tests, and parse back (:meth:`Action.parse`).
:func:`steps_ahead` bounds how far ahead the coordinator feeds a pipeline.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum

import numpy as np

from edgert.errors import EdgertError

Key = tuple[int, int]  # (step, micro-batch index within the step)


class Schedule(str, Enum):
    """A pipeline schedule. Its value is its name on the command line, on the wire and in run.json."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    ASYNC = "async"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def named(cls, name: str) -> Schedule:
        """The schedule called ``name``; raises with the names there are."""
        try:
            return cls(name)
        except ValueError:
            raise EdgertError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}") from None


SCHEDULES = tuple(s.value for s in Schedule)  # the names, for click.Choice and the protocol's check


class Computation(str, Enum):
    """What an action computes; the value is the letter the action prints with."""

    FORWARD = "F"
    BACKWARD = "B"
    STEP = "S"


_ACTION = re.compile(rf"(\d*)([{''.join(c.value for c in Computation)}])(\d*)")  # stage, kind, micro-batch


@dataclass(frozen=True)
class Action:
    """One thing a stage does: forward or backward of a micro-batch, or an optimizer step.

    ``stage`` is None in a stage's own action list; set, it prints first (``2F0``).
    """

    kind: Computation
    microbatch: int | None = None  # None for a step
    stage: int | None = None

    def __str__(self) -> str:
        stage = "" if self.stage is None else str(self.stage)
        return f"{stage}{self.kind.value}{'' if self.microbatch is None else self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """The action ``text`` prints: ``F0``, ``B3``, ``S``, or any of them after a stage (``2F0``)."""
        match = _ACTION.fullmatch(text)
        if match is None or (match[2] == Computation.STEP.value) != (match[3] == ""):
            raise EdgertError(f"action {text!r}: expected F<micro-batch>, B<micro-batch> or S, "
                              f"optionally after a stage (2F0)")
        stage, kind, microbatch = match.groups()
        return cls(Computation(kind), int(microbatch) if microbatch else None, int(stage) if stage else None)

    def on(self, stage: int) -> Action:
        """This action as stage ``stage`` runs it."""
        return replace(self, stage=stage)


def forward(m: int) -> Action:
    return Action(Computation.FORWARD, m)


def backward(m: int) -> Action:
    return Action(Computation.BACKWARD, m)


STEP = Action(Computation.STEP)


def stage_actions(kind: str, stage: int, stages: int, microbatches: int) -> list[Action]:
    """The ordered actions of ``stage`` (0-based) for ``microbatches`` micro-batches."""
    schedule = _check(kind, stage, stages, microbatches)
    if schedule is Schedule.GPIPE:
        return [forward(m) for m in range(microbatches)] + [backward(m) for m in range(microbatches)] + [STEP]
    if schedule is Schedule.ASYNC or stage == stages - 1:
        warmup = min(stages - stage - 1, microbatches)
    else:
        warmup = min(stages - stage, microbatches)
    after_backward = [STEP] if schedule is Schedule.ASYNC else []
    actions = [forward(m) for m in range(warmup)]
    for m in range(microbatches - warmup):
        actions += [forward(warmup + m), backward(m), *after_backward]
    for m in range(microbatches - warmup, microbatches):
        actions += [backward(m), *after_backward]
    return actions if schedule is Schedule.ASYNC else actions + [STEP]


def microbatches_per_step(kind: str, microbatches: int) -> int:
    """A step's micro-batches: ``microbatches``, or one under ``async`` (each micro-batch is its own step)."""
    return 1 if Schedule.named(kind) is Schedule.ASYNC else microbatches


def steps_ahead(kind: str, stages: int, microbatches: int, lookahead: int, capacity: int) -> int:
    """How many steps the coordinator may have sent and not yet seen completed.

    ``lookahead`` (plus ``stages`` under ``async``, whose pipeline never drains), but no more
    than the first and last stages' inboxes (``capacity`` messages each) hold: every step sent
    leaves its micro-batches' inputs on the first stage and their labels on the last (both on
    a single stage), beside what the neighbouring stage sends meanwhile (one step's
    micro-batches; under ``async``, one per stage). At least 1.
    """
    asynchronous = _check(kind, 0, stages, microbatches) is Schedule.ASYNC
    per_step = microbatches_per_step(kind, microbatches)
    wanted = lookahead + (stages if asynchronous else 0)
    if stages == 1:
        fits = capacity // (2 * per_step)
    else:
        fits = (capacity - (stages if asynchronous else per_step)) // per_step
    return max(1, min(wanted, fits))


def schedule_table(kind: str, stages: int, microbatches: int) -> list[list[str]]:
    """Every stage's actions as strings: the literal tables the tests compare against."""
    return [[str(a) for a in stage_actions(kind, s, stages, microbatches)] for s in range(stages)]


def max_in_flight(actions: list[Action]) -> int:
    """The most micro-batches a stage holds (forwarded, not yet backwarded) at once."""
    held = peak = 0
    for action in actions:
        held += {Computation.FORWARD: 1, Computation.BACKWARD: -1}.get(action.kind, 0)
        peak = max(peak, held)
    return peak


def simulate(kind: str, forward_ms: list[float], backward_ms: list[float], microbatches: int,
             link_ms: list[float] | None = None, side_by_side: Sequence[bool] = (),
             weights_ms: Sequence[float] = (), steps: int = 1) -> float:
    """Makespan (ms) of one window of the schedule (of ``steps`` windows), from per-stage forward/backward times.

    ``link_ms[s]`` is the transfer time between stage ``s`` and ``s + 1``. The last stage's
    forward is folded into its backward, as the runtime does. A stage flagged in ``side_by_side``
    (not the last; not under ``async``) runs its forwards on a lane of their own, as the runtime's
    forward lane does: a forward is handed over when the stage reaches it, or when it reaches the
    backward the forward follows; a backward waits for its forward, the step for the lane.
    ``weights_ms[s]`` is what stage ``s`` computes before each optimizer step (a split backward's
    weight gradients of the step's micro-batches). ``steps`` windows run back to back, as the
    runtime runs them: a stage starts the next step's actions once its own step is done. Raises
    if the schedule would deadlock, which the tests use to prove every schedule is executable.
    """
    stages = len(forward_ms)
    links = link_ms or [0.0] * (stages - 1)
    plans = [_back_to_back(stage_actions(kind, s, stages, microbatches), microbatches, steps) for s in range(stages)]
    lanes = {s for s, on in enumerate(side_by_side) if on and s < stages - 1 and Schedule.named(kind) != Schedule.ASYNC}
    done: dict[Action, float] = {}  # action on its stage -> finish time
    clock = [0.0] * stages  # each stage's compute thread
    lane = [0.0] * stages  # each stage's forward lane
    handed: list[collections.deque[tuple[Action, float]]] = [collections.deque() for _ in range(stages)]
    handed_to = [0] * stages  # positions before this are handed over already
    cursor = [0] * stages
    progressed = True
    while progressed:
        progressed = False
        for s in range(stages):
            while handed[s]:  # the lane: the forwards handed over, in order
                action, at = handed[s][0]
                ready = _ready_time(action, s, stages, done, links)
                if ready is None:
                    break
                lane[s] = max(lane[s], at, ready) + forward_ms[s]
                done[action.on(s)] = lane[s]
                handed[s].popleft()
                progressed = True
            while cursor[s] < len(plans[s]):
                action = plans[s][cursor[s]]
                if s in lanes and action.kind is Computation.FORWARD:
                    if cursor[s] >= handed_to[s]:
                        handed[s].append((action, clock[s]))
                        handed_to[s] = cursor[s] + 1
                    cursor[s] += 1
                    progressed = True
                    continue
                if s in lanes and action.kind is Computation.BACKWARD and handed_to[s] <= cursor[s]:
                    # the forwards after this backward go to the lane when the stage reaches it
                    end = cursor[s] + 1
                    while end < len(plans[s]) and plans[s][end].kind is Computation.FORWARD:
                        handed[s].append((plans[s][end], clock[s]))
                        end += 1
                    handed_to[s] = end
                    progressed = True
                ready = _ready_time(action, s, stages, done, links)
                if s in lanes and action.kind is Computation.STEP and ready is not None:
                    ready = None if handed[s] else max(ready, lane[s])  # the step waits for an idle lane
                if ready is None:
                    break
                cost = {Computation.FORWARD: 0.0 if s == stages - 1 else forward_ms[s],
                        Computation.BACKWARD: backward_ms[s],
                        Computation.STEP: weights_ms[s] if weights_ms else 0.0}[action.kind]
                clock[s] = max(clock[s], ready) + cost
                done[action.on(s)] = clock[s]
                cursor[s] += 1
                progressed = True
    if any(cursor[s] < len(plans[s]) or handed[s] for s in range(stages)):
        stuck = {s: str(plans[s][cursor[s]]) for s in range(stages) if cursor[s] < len(plans[s])}
        raise EdgertError(f"schedule {kind} deadlocks: stages waiting at {stuck}")
    return max(max(clock), max(lane))


def _back_to_back(actions: list[Action], microbatches: int, steps: int) -> list[Action]:
    """``steps`` copies of one step's ``actions``, each copy's micro-batches numbered after the last copy's."""
    return [replace(a, microbatch=None if a.microbatch is None else a.microbatch + step * microbatches)
            for step in range(steps) for a in actions]


def _ready_time(action: Action, s: int, stages: int, done: dict[Action, float], links: list[float]) -> float | None:
    if action.kind is Computation.FORWARD:
        if s == 0:
            return 0.0
        upstream = done.get(action.on(s - 1))
        return None if upstream is None else upstream + links[s - 1]
    if action.kind is Computation.BACKWARD:
        own_forward = done.get(forward(action.microbatch).on(s))
        if own_forward is None:
            return None
        if s == stages - 1:
            return own_forward
        downstream = done.get(action.on(s + 1))
        return None if downstream is None else max(own_forward, downstream + links[s])
    return 0.0


def _check(kind: str, stage: int, stages: int, microbatches: int) -> Schedule:
    schedule = Schedule.named(kind)
    if stages < 1 or not 0 <= stage < stages:
        raise EdgertError(f"stage {stage} is not in 0..{stages - 1}")
    if microbatches < 1:
        raise EdgertError(f"micro-batches must be at least 1 (got {microbatches})")
    return schedule


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
