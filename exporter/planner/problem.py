"""What the planner is given: units, per-device costs, links, schedule; checked up front.

The lead maps the exporter's analysis and ``devices.json`` onto these dataclasses; the
planner itself never reads files (docs/PLANNER.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from edgert.exporter.errors import PlanError
from edgert.schedule import SCHEDULES, Schedule

DEFAULT_CODECS = {"none": 1.0, "fp16": 2.0, "int8": 4.0}


@dataclass(frozen=True)
class Unit:
    """A contiguous group of blocks between two legal cuts: the planner's atom."""

    name: str
    param_bytes: int  # trainable parameter bytes
    input_bytes: int  # bytes per sample entering this unit (for unit 0: the model input)
    saved_bytes: int = 0  # bytes per sample a stashing stage keeps for this unit's backward (an upper bound)


@dataclass(frozen=True)
class DeviceCosts:
    """One device's measured (or predicted) cost of every unit, for one micro-batch."""

    name: str
    forward_ms: tuple[float, ...]  # per unit
    backward_ms: tuple[float, ...]  # per unit: the backward call, which recomputes the forward
    peak_bytes: tuple[int, ...]  # per unit: transient memory of its backward
    memory_bytes: int = 0  # 0 = unknown, unlimited
    cores: int = 1
    call_ms: float = 0.0  # per stage and micro-batch, whatever its units: session calls, boundary I/O
    last_call_ms: float | None = None  # the same as the last stage, which makes no forward call (None: call_ms)
    # Amdahl's parallel fraction of each direction's time with ORT threads (threads.py; 0: unmeasured, no gain)
    forward_parallel: float = 0.0
    backward_parallel: float = 0.0
    # per unit: the part of backward_ms a split backward computes once a step (empty or 0: unmeasured, costed whole)
    weight_ms: tuple[float, ...] = ()

    @property
    def last_call(self) -> float:
        """The fixed cost per micro-batch of being the last stage."""
        return self.call_ms if self.last_call_ms is None else self.last_call_ms


@dataclass(frozen=True)
class PlanProblem:
    """Everything :func:`edgert.exporter.planner.solver.plan` needs; devices and links by position."""

    units: tuple[Unit, ...]
    devices: tuple[DeviceCosts, ...]
    bandwidth: tuple[tuple[float, ...], ...]  # bytes/s from device i to device j
    rtt_ms: tuple[tuple[float, ...], ...]
    micro_batch: int
    micro_batches: int
    schedule: str = "1f1b"  # gpipe | 1f1b | async
    optimizer_slots: int = 2  # buffers per parameter: AdamW 2, SGD+momentum 1, SGD 0
    allow_groups: bool = False  # a stage may run on several devices splitting each micro-batch
    stash: bool = False  # activation stashing: a stage's backward does not recompute its forward
    side_by_side: bool = False  # a stage's forwards may run beside its backwards (see side_by_side_on)
    split_backward: bool = False  # stages after the first compute their weight gradients once a step (defers_weights)
    codecs: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_CODECS), hash=False)

    def codec_ladder(self) -> tuple[tuple[str, float], ...]:
        """Allowed codecs from the weakest (``none``, always allowed) to the strongest compression."""
        ladder = {"none": 1.0, **self.codecs}
        return tuple(sorted(ladder.items(), key=lambda item: (item[1], item[0] != "none")))

    def steps_per_microbatch(self) -> float:
        """Optimizer steps per micro-batch: one per batch when synchronous, one each under ``async``."""
        return 1.0 if self.schedule == Schedule.ASYNC else 1.0 / self.micro_batches


def in_flight(schedule: str, rank: int, micro_batches: int) -> int:
    """Micro-batches a stage holds at once; ``rank`` counts stages after it (0 = the last stage).

    Matches ``max_in_flight(stage_actions(...))`` in edgert.schedule; under ``async`` batches
    flow without a flush, so the count is not capped by ``micro_batches``.
    """
    if schedule == Schedule.GPIPE:
        return micro_batches
    if schedule == Schedule.ASYNC:
        return rank + 1
    return 1 if rank == 0 else min(rank + 2, micro_batches)


def side_by_side_on(problem: PlanProblem, device: int) -> bool:
    """Whether a stage that is not the last runs its forwards beside its backwards on ``device``: asked for,
    under 1F1B (GPipe has nothing to overlap; ``async`` keeps one thread), and with a core for each."""
    return problem.side_by_side and problem.schedule == Schedule.ONE_F_ONE_B and problem.devices[device].cores >= 2


def defers_weights(problem: PlanProblem, first: int) -> bool:
    """Whether a stage starting at unit ``first`` leaves its weight gradients to once a step: split backward asked
    for, not the first stage (nothing waits for its backward), and a synchronous schedule (``async`` computes them
    right after each backward, with the weights its forward read)."""
    return problem.split_backward and first > 0 and problem.schedule != Schedule.ASYNC


# What a stage that defers its weight gradients keeps of every micro-batch of the step until its weight call, per row
# and unit: a layer's input and its output's gradient, each bounded as a stashing stage's saved tensors (saved_bytes).
DEFERRED_TENSORS = 2


def held_on(problem: PlanProblem, rank: int, device: int) -> int:
    """Micro-batches a stage holds at once on ``device``: :func:`in_flight`, and side by side the forward
    handed to the lane before the backward it follows."""
    held = in_flight(problem.schedule, rank, problem.micro_batches)
    return min(held + 1, problem.micro_batches) if rank > 0 and side_by_side_on(problem, device) else held


def stashes_weights(problem: PlanProblem, rank: int) -> bool:
    """Whether a stage keeps a weight copy per in-flight micro-batch: under ``async``, all but the last."""
    return problem.schedule == Schedule.ASYNC and rank > 0


def stashes_activations(problem: PlanProblem, rank: int) -> bool:
    """Whether a stage keeps its saved tensors per in-flight micro-batch: when stashing, all but the
    last, whose forward is folded into its backward."""
    return problem.stash and rank > 0


def check_problem(problem: PlanProblem) -> None:
    """Raise :class:`PlanError` naming the first malformed field, with its bad value."""
    _check_units(problem.units)
    _check_devices(problem.devices, len(problem.units))
    _check_links(problem.bandwidth, problem.rtt_ms, len(problem.devices))
    if not isinstance(problem.micro_batch, int) or problem.micro_batch < 1:
        raise PlanError(f"micro_batch must be a positive integer (got {problem.micro_batch!r})")
    if not isinstance(problem.micro_batches, int) or problem.micro_batches < 1:
        raise PlanError(f"micro_batches must be a positive integer (got {problem.micro_batches!r})")
    if problem.schedule not in SCHEDULES:
        raise PlanError(f"unknown schedule {problem.schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if not isinstance(problem.optimizer_slots, int) or problem.optimizer_slots < 0:
        raise PlanError(f"optimizer_slots must be a non-negative integer (got {problem.optimizer_slots!r})")
    _check_codecs(problem.codecs)


def _check_units(units: Sequence[Unit]) -> None:
    if len(units) == 0:
        raise PlanError("the problem has no units: nothing to place")
    names = [unit.name for unit in units]
    if len(set(names)) != len(names):
        raise PlanError(f"unit names repeat: {', '.join(sorted({n for n in names if names.count(n) > 1}))}")
    for unit in units:
        if unit.param_bytes < 0 or unit.input_bytes < 0 or unit.saved_bytes < 0:
            raise PlanError(f"unit {unit.name!r}: param_bytes {unit.param_bytes}, input_bytes {unit.input_bytes} "
                            f"and saved_bytes {unit.saved_bytes} must be >= 0")


def _check_devices(devices: Sequence[DeviceCosts], units: int) -> None:
    if len(devices) == 0:
        raise PlanError("the problem has no devices")
    names = [device.name for device in devices]
    if len(set(names)) != len(names):
        raise PlanError(f"device names repeat: {', '.join(sorted({n for n in names if names.count(n) > 1}))}")
    for device in devices:
        for label in ("forward_ms", "backward_ms", "peak_bytes"):
            values = getattr(device, label)
            if len(values) != units:
                raise PlanError(f"device {device.name!r}: {label} has {len(values)} entries for {units} units")
            bad = [v for v in values if not (math.isfinite(v) and v >= 0)]
            if bad:
                raise PlanError(f"device {device.name!r}: {label} must be finite and >= 0 (got {bad[0]!r})")
        if device.weight_ms and len(device.weight_ms) != units:
            raise PlanError(f"device {device.name!r}: weight_ms has {len(device.weight_ms)} entries for {units} units "
                            f"(or none: unmeasured)")
        over = [(u, w) for u, w in enumerate(device.weight_ms)
                if not (math.isfinite(w) and 0 <= w <= device.backward_ms[u])]
        if over:
            raise PlanError(f"device {device.name!r}: weight_ms of unit {over[0][0]} must be finite, >= 0 and at most "
                            f"its backward_ms (got {over[0][1]!r})")
        if device.memory_bytes < 0:
            raise PlanError(f"device {device.name!r}: memory_bytes must be >= 0, 0 = unlimited "
                            f"(got {device.memory_bytes})")
        if not isinstance(device.cores, int) or device.cores < 1:
            raise PlanError(f"device {device.name!r}: cores must be a positive integer (got {device.cores!r})")
        for name in ("forward_parallel", "backward_parallel"):
            value = getattr(device, name)
            if not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise PlanError(f"device {device.name!r}: {name} must be a fraction in [0, 1] (got {value!r})")


def _check_links(bandwidth: Sequence[Sequence[float]], rtt_ms: Sequence[Sequence[float]], devices: int) -> None:
    for label, matrix in (("bandwidth", bandwidth), ("rtt_ms", rtt_ms)):
        shape = [len(row) for row in matrix]
        if len(matrix) != devices or any(n != devices for n in shape):
            raise PlanError(f"{label} must be a {devices}x{devices} matrix (one row and column per device); "
                            f"got {len(matrix)} rows of lengths {shape}")
    for i in range(devices):
        for j in range(devices):
            if i == j:
                continue
            if not bandwidth[i][j] > 0:
                raise PlanError(f"bandwidth[{i}][{j}] must be > 0 bytes/s (got {bandwidth[i][j]!r})")
            if not (math.isfinite(rtt_ms[i][j]) and rtt_ms[i][j] >= 0):
                raise PlanError(f"rtt_ms[{i}][{j}] must be finite and >= 0 (got {rtt_ms[i][j]!r})")


def _check_codecs(codecs: dict[str, float]) -> None:
    for name, ratio in codecs.items():
        if not (math.isfinite(ratio) and ratio >= 1):
            raise PlanError(f"codec {name!r}: compression ratio must be finite and >= 1 (got {ratio!r})")
    if codecs.get("none", 1.0) != 1.0:
        raise PlanError(f"codec 'none' must have ratio 1.0 (got {codecs['none']!r})")
