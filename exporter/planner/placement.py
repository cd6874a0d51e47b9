"""The planner's answer: stages on devices, link codecs, predicted times; built from a stage list.

:func:`evaluate` turns any list of stages into a :class:`Placement` with the cost model of
exporter/planner/costs.py, so a plan found by the search, by brute force, or written by hand (the
current plan, when deciding whether to re-partition) is judged the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from edgert.exporter.errors import PlanError
from edgert.exporter.planner import costs
from edgert.exporter.planner.costs import Stage
from edgert.exporter.planner.problem import (
    PlanProblem,
    check_problem,
    held_on,
    side_by_side_on,
    stashes_activations,
    stashes_weights,
)
from edgert.schedule import Schedule, simulate


@dataclass(frozen=True)
class StagePlan:
    """Units ``[first, end)`` on one device or a data-parallel group."""

    first: int
    end: int
    devices: tuple[str, ...]  # one, or a group
    shares: tuple[float, ...]  # per device: its part of each micro-batch; sums to 1
    compute_ms: float  # per micro-batch, all-reduce included
    memory_bytes: int  # per device (the largest member's need in a group)
    forward_threads: tuple[int, ...]  # per device
    backward_threads: tuple[int, ...]  # per device


@dataclass(frozen=True)
class Placement:
    """A pipeline: its stages in order, the links between them and what they should cost."""

    stages: tuple[StagePlan, ...]
    link_codecs: tuple[str, ...]  # per link between consecutive stages
    link_ms: tuple[float, ...]
    bottleneck_ms: float  # max over stages' compute_ms and link_ms
    predicted_step_ms: float  # one synchronous window of micro_batches; async: the steady time per step
    unused_devices: tuple[str, ...]

    def cut_units(self) -> list[int]:
        """The unit index each stage after the first starts at."""
        return [stage.first for stage in self.stages[1:]]

    def latency_ms(self) -> float:
        """One micro-batch through the whole pipeline: the sum of stage and link times (the tie-break)."""
        return sum(stage.compute_ms for stage in self.stages) + sum(self.link_ms)


def evaluate(problem: PlanProblem, stages: Sequence[tuple[int, int, Sequence[str]]]) -> Placement:
    """The placement of explicit stages ``(first, end, device names)``; raises if one does not fit."""
    check_problem(problem)
    index = {device.name: i for i, device in enumerate(problem.devices)}
    unknown = [name for _, _, names in stages for name in names if name not in index]
    if unknown:
        raise PlanError(f"no device {unknown[0]!r}; devices are {', '.join(index)}")
    return build_placement(problem, [(first, end, tuple(index[n] for n in names)) for first, end, names in stages])


def build_placement(problem: PlanProblem, stages: Sequence[Stage]) -> Placement:
    """Check the stages cover the units, fit in memory, then choose codecs and simulate."""
    _check_stages(problem, stages)
    count = len(stages)
    lasts = [s == count - 1 for s in range(count)]
    compute = [costs.compute_ms(problem, stage, last) for stage, last in zip(stages, lasts)]
    pairs = list(zip(stages, stages[1:]))
    strongest = [costs.strongest_link_ms(problem, a[2], b[2], b[0]) for a, b in pairs]
    threshold = max(compute + strongest)
    links = [costs.choose_codec(problem, a[2], b[2], b[0], threshold) for a, b in pairs]
    link_times = [ms for _, ms in links]
    timings = [costs.simulated_times(problem, stage, last) for stage, last in zip(stages, lasts)]
    beside = [all(side_by_side_on(problem, d) for d in devices) for _, _, devices in stages]
    weights = [costs.weights_step_ms(problem, stage, last) for stage, last in zip(stages, lasts)]
    step = step_ms(problem.schedule, [f for f, _ in timings], [b for _, b in timings], problem.micro_batches,
                   link_times, beside, weights)
    used = {d for stage in stages for d in stage[2]}
    return Placement(
        stages=tuple(_stage_plan(problem, stage, count - 1 - s, ms, lasts[s])
                     for s, (stage, ms) in enumerate(zip(stages, compute))),
        link_codecs=tuple(name for name, _ in links), link_ms=tuple(link_times),
        bottleneck_ms=max(compute + link_times), predicted_step_ms=step,
        unused_devices=tuple(d.name for i, d in enumerate(problem.devices) if i not in used))


def step_ms(schedule: str, forward_ms: list[float], backward_ms: list[float], micro_batches: int,
            link_ms: list[float], side_by_side: Sequence[bool] = (), weights_ms: Sequence[float] = ()) -> float:
    """Predicted time per optimizer step: a synchronous schedule's window of ``micro_batches`` (``side_by_side``:
    the stages whose forwards run beside their backwards); with ``weights_ms`` (each stage's weight call before
    its step, a split backward's) the interval between two steps run back to back, since a later stage's weight
    call overlaps the next step's first forwards on the stages before it; under ``async`` (no flush) the steady
    interval between steps, not one batch's trip through the pipeline."""
    if schedule != Schedule.ASYNC and any(weights_ms):
        one, two = (simulate(schedule, forward_ms, backward_ms, micro_batches, link_ms, side_by_side, weights_ms,
                             steps) for steps in (1, 2))
        return two - one
    if schedule != Schedule.ASYNC:
        return simulate(schedule, forward_ms, backward_ms, micro_batches, link_ms, side_by_side)
    warm = 2 * len(forward_ms) + 2  # enough steps for the pipeline to be full
    longer = simulate(schedule, forward_ms, backward_ms, 2 * warm, link_ms)
    return (longer - simulate(schedule, forward_ms, backward_ms, warm, link_ms)) / warm


def _stage_plan(problem: PlanProblem, stage: Stage, rank: int, ms: float, last: bool) -> StagePlan:
    first, end, devices = stage
    threads = [_threads(problem, first, end, d, last) for d in devices]
    return StagePlan(first=first, end=end, devices=tuple(problem.devices[d].name for d in devices),
                     shares=costs.shares(problem, stage, last), compute_ms=ms,
                     memory_bytes=max(costs.memory_bytes(problem, first, end, d, rank) for d in devices),
                     forward_threads=tuple(f for f, _ in threads), backward_threads=tuple(b for _, b in threads))


def _threads(problem: PlanProblem, first: int, end: int, device: int, last: bool) -> tuple[int, int]:
    """(forward, backward) ORT threads: every core for both, one after the other; side by side the split
    of the cores the stage's cost was taken at (costs.side_by_side_split)."""
    if last or not side_by_side_on(problem, device):
        return problem.devices[device].cores, problem.devices[device].cores
    forward_threads, backward_threads, _ = costs.side_by_side_split(problem, first, end, device)
    return forward_threads, backward_threads


def _check_stages(problem: PlanProblem, stages: Sequence[Stage]) -> None:
    if not stages:
        raise PlanError("a placement needs at least one stage")
    bounds = [(first, end) for first, end, _ in stages]
    expected_first = 0
    for first, end in bounds:
        if first != expected_first or end <= first:
            raise PlanError(f"stages {bounds} must cover units 0..{len(problem.units)} contiguously, "
                            f"each with at least one unit")
        expected_first = end
    if expected_first != len(problem.units):
        raise PlanError(f"stages {bounds} end at unit {expected_first}, not at {len(problem.units)}")
    members = [d for _, _, devices in stages for d in devices]
    if len(set(members)) != len(members) or any(not devices for _, _, devices in stages):
        raise PlanError(f"each stage needs its own devices; got {[devices for _, _, devices in stages]}")
    for s, (first, end, devices) in enumerate(stages):
        for d in devices:
            if not costs.fits(problem, first, end, d, len(stages) - 1 - s):
                raise PlanError(_overflow_message(problem, first, end, d, len(stages) - 1 - s))


def _overflow_message(problem: PlanProblem, first: int, end: int, device: int, rank: int) -> str:
    need = costs.memory_bytes(problem, first, end, device, rank)
    names = [unit.name for unit in problem.units[first:end]]
    units = names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
    name = problem.devices[device].name
    return (f"units {units} need {size_text(need)} on {name} ({_breakdown(problem, first, end, device, rank)}); "
            f"{name} has {size_text(problem.devices[device].memory_bytes)}")


def explain_no_fit(problem: PlanProblem) -> str:
    """Why no placement fits: a unit too big for every device, or the model for all of them together."""
    limited = [(d.memory_bytes, i) for i, d in enumerate(problem.devices) if d.memory_bytes > 0]
    if len(limited) < len(problem.devices):
        return "no placement found although a device has unlimited memory (a planner bug; please report it)"
    largest_memory, largest = max(limited)
    last = len(problem.units) - 1
    for u, unit in enumerate(problem.units):
        rank = 0 if u == last else 1  # the fewest in-flight micro-batches this unit can ever have
        if not any(costs.fits(problem, u, u + 1, d, rank) for d in range(len(problem.devices))):
            need = costs.memory_bytes(problem, u, u + 1, largest, rank)
            return (f"unit {unit.name} needs {size_text(need)} ({_breakdown(problem, u, u + 1, largest, rank)}); "
                    f"the largest device ({problem.devices[largest].name}) has {size_text(largest_memory)}")
    state = sum(unit.param_bytes for unit in problem.units) * (2 + problem.optimizer_slots)
    memories = ", ".join(f"{d.name} {size_text(d.memory_bytes)}" for d in problem.devices)
    return (f"no placement of the {len(problem.units)} units fits in memory: parameters, gradients and optimizer "
            f"state alone take {size_text(state)}, plus each stage's in-flight inputs"
            f"{' and saved activations' if problem.stash else ''} under {problem.schedule} "
            f"({problem.micro_batches} micro-batches of {problem.micro_batch}); devices: {memories}. "
            f"Try {', or '.join(_remedies(problem))}")


def _remedies(problem: PlanProblem) -> list[str]:
    remedies = ["more devices", "a smaller micro-batch"]
    if problem.schedule == Schedule.GPIPE:
        remedies.append("the 1f1b schedule")
    if problem.stash:
        remedies.append("recomputing instead of stashing (--memory-mode recompute)")
    if problem.optimizer_slots:
        remedies.append(f"an optimizer with fewer than {problem.optimizer_slots} buffers per parameter")
    return remedies


def _breakdown(problem: PlanProblem, first: int, end: int, device: int, rank: int) -> str:
    params = sum(unit.param_bytes for unit in problem.units[first:end])
    held = held_on(problem, rank, device)
    parts = [f"state {size_text(params * (2 + problem.optimizer_slots))}",
             f"{held} in-flight input(s) {size_text(held * problem.micro_batch * problem.units[first].input_bytes)}",
             f"backward peak {size_text(max(problem.devices[device].peak_bytes[first:end]))}"]
    if stashes_weights(problem, rank):
        parts.insert(1, f"stashed weights {size_text(held * params)}")
    if stashes_activations(problem, rank):
        saved = held * problem.micro_batch * sum(unit.saved_bytes for unit in problem.units[first:end])
        parts.insert(-1, f"{held} micro-batch(es) of saved activations {size_text(saved)}")
    deferred = costs.deferred_bytes(problem, first, end)
    if deferred:
        parts.insert(-1, f"what the weight call reads of {problem.micro_batches} micro-batch(es) {size_text(deferred)}")
    return ", ".join(parts)


def size_text(count: int) -> str:
    """Bytes for people: ``212 MiB``, ``3.5 KiB``, ``900 B``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            value = count / scale
            return f"{value:.0f} {unit}" if value >= 10 else f"{value:.1f} {unit}"
    return f"{count} B"
