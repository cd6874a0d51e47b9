"""The planner's cost model for one concrete stage or link (docs/PLANNER.md, "Cost model").

Scalar and direct: the reference the DP tables (exporter/planner/tables.py) must agree with, and what
:func:`brute_force` and the placement builder use. A stage is ``(first, end, devices)``:
units ``[first, end)`` on device positions ``devices`` (one, or a data-parallel group).
"""

from __future__ import annotations

from collections.abc import Sequence

from edgert.exporter.planner.problem import (
    DEFERRED_TENSORS,
    PlanProblem,
    defers_weights,
    held_on,
    side_by_side_on,
    stashes_activations,
    stashes_weights,
)
from edgert.exporter.planner.threads import split_cores

Stage = tuple[int, int, tuple[int, ...]]
TINY_MS = 1e-12  # a stage measured at 0 ms still gets a finite share of a group's work
RELATIVE_TOLERANCE = 1e-9


def at_most(value: float, limit: float) -> bool:
    """``value <= limit`` up to rounding (costs are sums of floats in different orders)."""
    return value <= limit + RELATIVE_TOLERANCE * abs(limit) + 1e-12


def device_times(problem: PlanProblem, first: int, end: int, device: int) -> tuple[float, float]:
    """Forward and backward time (ms) of units ``[first, end)`` on one device, whole micro-batch; a stage that
    splits its backward (``defers_weights``) without the weight gradients it computes once a step."""
    costs = problem.devices[device]
    return (sum(costs.forward_ms[first:end]),
            sum(costs.backward_ms[first:end]) - deferred_ms(problem, first, end, device))


def deferred_ms(problem: PlanProblem, first: int, end: int, device: int) -> float:
    """The weight gradients (ms per micro-batch) a stage of units ``[first, end)`` leaves to once a step."""
    weights = problem.devices[device].weight_ms
    return sum(weights[first:end]) if weights and defers_weights(problem, first) else 0.0


def device_work(problem: PlanProblem, first: int, end: int, device: int, last: bool) -> float:
    """A device's time per micro-batch on the stage: forward + backward, backward only if last; side by side
    the longer of the two (stashing: of the forward and the backward less the forward it does not redo)."""
    forward, backward = device_times(problem, first, end, device)
    if not last and side_by_side_on(problem, device):
        own = side_by_side_split(problem, first, end, device)[2]
    else:
        own = backward if last or problem.stash else forward + backward
    costs = problem.devices[device]
    return max(own + (costs.last_call if last else costs.call_ms), TINY_MS)


def side_by_side_split(problem: PlanProblem, first: int, end: int, device: int) -> tuple[int, int, float]:
    """(forward threads, backward threads, ms) of a non-last stage running side by side on ``device``: its cores
    split so that the longer of the forward and the backward (less the forward under stash) is shortest."""
    forward, backward = device_times(problem, first, end, device)
    costs = problem.devices[device]
    return split_cores(forward, backward - forward if problem.stash else backward, costs.cores,
                       costs.forward_parallel, costs.backward_parallel)


def shares(problem: PlanProblem, stage: Stage, last: bool) -> tuple[float, ...]:
    """Each group member's share of a micro-batch, in proportion to its speed on this stage."""
    first, end, devices = stage
    speeds = [1.0 / device_work(problem, first, end, d, last) for d in devices]
    return tuple(speed / sum(speeds) for speed in speeds)


def allreduce_ms(problem: PlanProblem, stage: Stage) -> float:
    """A group's gradient all-reduce per micro-batch: ``2 * params / min bandwidth``, per optimizer step."""
    first, end, devices = stage
    if len(devices) < 2:
        return 0.0
    params = sum(unit.param_bytes for unit in problem.units[first:end])
    slowest = min(problem.bandwidth[a][b] for a in devices for b in devices if a != b)
    return 2.0 * params / slowest * 1000.0 * problem.steps_per_microbatch()


def compute_ms(problem: PlanProblem, stage: Stage, last: bool) -> float:
    """Stage time per micro-batch: ``1 / sum(1 / t_d)`` over the group, plus its all-reduce."""
    first, end, devices = stage
    speed = sum(1.0 / device_work(problem, first, end, d, last) for d in devices)
    return 1.0 / speed + allreduce_ms(problem, stage)


def simulated_times(problem: PlanProblem, stage: Stage, last: bool) -> tuple[float, float]:
    """Forward and backward time of the stage for ``edgert.schedule.simulate``: its slowest member's share."""
    first, end, devices = stage
    split = shares(problem, stage, last)
    times = [device_times(problem, first, end, d) for d in devices]
    forward = max(share * f for share, (f, _) in zip(split, times))
    backward = max(share * ((b - f if problem.stash and not last else b)
                            + (problem.devices[d].last_call if last else problem.devices[d].call_ms))
                   for share, (f, b), d in zip(split, times, devices))
    return forward, backward + allreduce_ms(problem, stage)


def weights_step_ms(problem: PlanProblem, stage: Stage, last: bool) -> float:
    """The stage's once-a-step weight call over all the step's micro-batches, before its optimizer step: its
    slowest member's share (0 when it does not split its backward)."""
    first, end, devices = stage
    split = shares(problem, stage, last)
    return max(share * deferred_ms(problem, first, end, d) for share, d in zip(split, devices)) * problem.micro_batches


def memory_bytes(problem: PlanProblem, first: int, end: int, device: int, rank: int) -> int:
    """Bytes one device needs for units ``[first, end)`` when ``rank`` stages follow it.

    Parameters, gradients and optimizer slots; under ``async`` one stashed weight copy per
    in-flight micro-batch (not on the last stage); each in-flight micro-batch's stage inputs
    and, when activations are stashed, its saved tensors (not on the last stage, whose
    forward is folded into its backward); a group member is charged the whole micro-batch;
    the largest backward peak; splitting its backward, what its weight call reads of the step's micro-batches.
    """
    params = sum(unit.param_bytes for unit in problem.units[first:end])
    held = held_on(problem, rank, device)
    stash = held * params if stashes_weights(problem, rank) else 0
    kept = problem.units[first].input_bytes
    if stashes_activations(problem, rank):
        kept += sum(unit.saved_bytes for unit in problem.units[first:end])
    peak = max(problem.devices[device].peak_bytes[first:end])
    return (params * (2 + problem.optimizer_slots) + stash + held * problem.micro_batch * kept + peak
            + deferred_bytes(problem, first, end))


def deferred_bytes(problem: PlanProblem, first: int, end: int) -> int:
    """What a stage that defers its weight gradients keeps for its weight call: every micro-batch of the step."""
    if not defers_weights(problem, first):
        return 0
    saved = sum(unit.saved_bytes for unit in problem.units[first:end])
    return DEFERRED_TENSORS * saved * problem.micro_batch * problem.micro_batches


def fits(problem: PlanProblem, first: int, end: int, device: int, rank: int) -> bool:
    limit = problem.devices[device].memory_bytes
    return limit == 0 or memory_bytes(problem, first, end, device, rank) <= limit


def link_ms(problem: PlanProblem, senders: Sequence[int], receivers: Sequence[int], cut: int, ratio: float) -> float:
    """One micro-batch's activations (and, full duplex, its gradients) across the cut before unit ``cut``.

    ``rtt / 2 + bytes / bandwidth / ratio`` in the slower direction of the slowest
    sender-receiver pair (between groups every pair is charged the whole micro-batch).
    """
    payload = problem.units[cut].input_bytes * problem.micro_batch / ratio

    def one_way(a: int, b: int) -> float:
        return problem.rtt_ms[a][b] / 2.0 + payload / problem.bandwidth[a][b] * 1000.0

    return max(max(one_way(s, r), one_way(r, s)) for s in senders for r in receivers)


def choose_codec(problem: PlanProblem, senders: Sequence[int], receivers: Sequence[int], cut: int,
                 threshold: float) -> tuple[str, float]:
    """The weakest codec whose link time is at most ``threshold``, else the strongest: (name, ms)."""
    ladder = problem.codec_ladder()
    for name, ratio in ladder:
        time = link_ms(problem, senders, receivers, cut, ratio)
        if at_most(time, threshold):
            return name, time
    name, ratio = ladder[-1]
    return name, link_ms(problem, senders, receivers, cut, ratio)


def strongest_link_ms(problem: PlanProblem, senders: Sequence[int], receivers: Sequence[int], cut: int) -> float:
    return link_ms(problem, senders, receivers, cut, problem.codec_ladder()[-1][1])
