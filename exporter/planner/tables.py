"""The cost model of exporter/planner/costs.py as numpy tables over every unit range ``[j, k)``.

Index ``j`` is a stage's first unit, ``k`` its end (``0 <= j < k <= units``); entries
with ``k <= j`` are ``inf``. Built once per problem, shared by every device order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgert.exporter.planner.costs import TINY_MS
from edgert.exporter.planner.problem import (
    DEFERRED_TENSORS,
    PlanProblem,
    defers_weights,
    held_on,
    side_by_side_on,
    stashes_activations,
    stashes_weights,
)
from edgert.exporter.planner.threads import scaled


@dataclass(frozen=True)
class Tables:
    units: int
    devices: int
    work: np.ndarray  # (devices, U+1, U+1): forward + backward ms of a non-last stage (side by side: the longer)
    speed: np.ndarray  # 1 / work: micro-batches per ms, summed over a group's members
    last_work: np.ndarray  # (devices, U+1): backward ms of the last stage [j, U)
    unit_work: np.ndarray  # (devices, U): forward + backward ms of each unit (side by side: a lower bound)
    unit_backward: np.ndarray  # (devices, U)
    max_rank: np.ndarray  # (devices, U+1, U+1): most stages that may follow [j, k) on the device (-1: never fits)
    params: np.ndarray  # (U+1, U+1): parameter bytes of [j, k)
    state_factor: int  # parameters, gradients and optimizer slots: bytes of state per parameter byte
    memory: np.ndarray  # (devices,): bytes, inf when unlimited
    links: np.ndarray  # (codecs, devices, devices, U+1): link ms at the cut before unit k, weakest codec first
    bandwidth: np.ndarray  # (devices, devices), inf on the diagonal
    allreduce_factor: float  # all-reduce ms per micro-batch = parameter bytes x this / slowest bandwidth

    def allreduce(self, members: list[int]) -> float:
        """The all-reduce factor of a group over its slowest internal link (0 for one device)."""
        if len(members) < 2:
            return 0.0
        return self.allreduce_factor / self.bandwidth[np.ix_(members, members)].min()


def build_tables(problem: PlanProblem) -> Tables:
    units, devices = len(problem.units), len(problem.devices)
    forward = _prefix([d.forward_ms for d in problem.devices])
    backward = _prefix([d.backward_ms for d in problem.devices])
    deferred, unit_deferred = _deferred(problem)
    upper = np.triu(np.ones((units + 1, units + 1), dtype=bool), k=1)
    # stashing: the forward (F) plus a backward without the recomputed forward (B - F) is B
    per_range = (_ranges(backward) if problem.stash else _ranges(forward) + _ranges(backward)) - deferred
    per_range, unit_work = _side_by_side(problem, forward, backward, deferred, unit_deferred, per_range,
                                         np.diff(backward if problem.stash else forward + backward, axis=1)
                                         - unit_deferred)
    calls = np.array([d.call_ms for d in problem.devices], dtype=float)
    work = np.where(upper, np.maximum(per_range + calls[:, None, None], TINY_MS), np.inf)
    last_calls = np.array([d.last_call for d in problem.devices], dtype=float)
    last_work = np.maximum(backward[:, -1:] - backward - deferred[:, :, -1] + last_calls[:, None], TINY_MS)
    last_work[:, -1] = np.inf
    params = _ranges(_prefix([[u.param_bytes for u in problem.units]]))[0]
    bandwidth = np.array(problem.bandwidth, dtype=float)
    np.fill_diagonal(bandwidth, np.inf)
    return Tables(units=units, devices=devices, work=work, speed=1.0 / work, last_work=last_work,
                  unit_work=unit_work,
                  unit_backward=np.diff(backward, axis=1) - unit_deferred,
                  max_rank=_max_rank(problem, params, upper), params=params,
                  state_factor=2 + problem.optimizer_slots, memory=_memory(problem),
                  links=_links(problem, bandwidth), bandwidth=bandwidth,
                  allreduce_factor=2.0 * 1000.0 * problem.steps_per_microbatch())


def _deferred(problem: PlanProblem) -> tuple[np.ndarray, np.ndarray]:
    """``(devices, U+1, U+1)``: the weight gradients range ``[j, k)`` leaves to once a step (costs.deferred_ms: 0 for
    ``j = 0``, the first stage); and ``(devices, U)``: each unit's, the most any stage holding it defers."""
    units, devices = len(problem.units), len(problem.devices)
    weights = np.array([d.weight_ms or (0.0,) * units for d in problem.devices], dtype=float)
    if not defers_weights(problem, 1):
        return np.zeros((devices, units + 1, units + 1)), np.zeros((devices, units))
    deferred = _ranges(_prefix(weights))
    deferred[:, 0, :] = 0.0
    return deferred, weights


def _side_by_side(problem: PlanProblem, forward: np.ndarray, backward: np.ndarray, deferred: np.ndarray,
                  unit_deferred: np.ndarray, per_range: np.ndarray,
                  unit_work: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """On a device whose stages run side by side, a range costs the longer of its forward and backward at the
    best split of the cores (costs.side_by_side_split): not a sum over units, so each unit's share of the
    search's lower bound is its backward at the most threads the backward can get, which no split beats."""
    per_range, unit_work = per_range.copy(), unit_work.copy()
    gradients = backward - forward if problem.stash else backward
    for d, costs in enumerate(problem.devices):
        if not side_by_side_on(problem, d):
            continue
        forwards, backwards = _ranges(forward[d:d + 1])[0], _ranges(gradients[d:d + 1])[0] - deferred[d]
        splits = [np.maximum(forwards * scaled(1.0, costs.forward_parallel, f),
                             backwards * scaled(1.0, costs.backward_parallel, costs.cores - f))
                  for f in range(1, costs.cores)]
        per_range[d] = np.minimum.reduce(splits)
        unit_work[d] = (np.diff(gradients[d]) - unit_deferred[d]) * scaled(1.0, costs.backward_parallel,
                                                                         costs.cores - 1)
    return per_range, unit_work


def _prefix(rows: list) -> np.ndarray:
    values = np.asarray(rows, dtype=float)
    return np.concatenate([np.zeros((values.shape[0], 1)), np.cumsum(values, axis=1)], axis=1)


def _ranges(prefix: np.ndarray) -> np.ndarray:
    """``out[d, j, k] = prefix[d, k] - prefix[d, j]``."""
    return prefix[:, None, :] - prefix[:, :, None]


def _peak_max(problem: PlanProblem) -> np.ndarray:
    """``out[d, j, k]`` = the largest backward peak among units ``[j, k)`` on device ``d``."""
    peaks = np.array([d.peak_bytes for d in problem.devices], dtype=float)
    devices, units = peaks.shape
    out = np.zeros((devices, units + 1, units + 1))
    rows = np.arange(units)
    for length in range(1, units + 1):
        starts = rows[: units - length + 1]
        out[:, starts, starts + length] = np.maximum(out[:, starts, starts + length - 1], peaks[:, starts + length - 1])
    return out


def _max_rank(problem: PlanProblem, params: np.ndarray, upper: np.ndarray) -> np.ndarray:
    """Memory need grows with the rank (stages after), so a fit is one threshold per range and device."""
    devices, units = len(problem.devices), len(problem.units)
    peak = _peak_max(problem)
    inputs = np.array([u.input_bytes for u in problem.units] + [0], dtype=float) * problem.micro_batch
    saved = _ranges(_prefix([[u.saved_bytes for u in problem.units]]))[0] * problem.micro_batch
    limits = _memory(problem)
    state = params * (2 + problem.optimizer_slots)
    deferred = saved * (DEFERRED_TENSORS * problem.micro_batches if defers_weights(problem, 1) else 0.0)
    deferred[0, :] = 0.0  # costs.deferred_bytes: not the first stage
    max_rank = np.full((devices, units + 1, units + 1), -1, dtype=np.int64)
    for rank in range(devices):
        held = np.array([held_on(problem, rank, d) for d in range(devices)], dtype=float)[:, None, None]
        stash = held if stashes_weights(problem, rank) else 0
        kept = inputs[:, None] + (saved if stashes_activations(problem, rank) else 0.0)
        need = state + stash * params + held * kept + peak + deferred
        max_rank[(need <= limits[:, None, None]) & upper] = rank
    return max_rank


def _memory(problem: PlanProblem) -> np.ndarray:
    return np.array([d.memory_bytes if d.memory_bytes > 0 else np.inf for d in problem.devices])


def _links(problem: PlanProblem, bandwidth: np.ndarray) -> np.ndarray:
    """Link ms per codec, device pair and cut: the slower of the two directions (full duplex)."""
    ratios = np.array([ratio for _, ratio in problem.codec_ladder()])
    payload = np.array([u.input_bytes for u in problem.units], dtype=float) * problem.micro_batch
    half_rtt = np.array(problem.rtt_ms, dtype=float) / 2.0
    one_way = half_rtt[None, :, :, None] + (payload[None, None, None, :] / ratios[:, None, None, None]
                                             / bandwidth[None, :, :, None] * 1000.0)
    both = np.maximum(one_way, one_way.transpose(0, 2, 1, 3))
    links = np.full(both.shape[:3] + (len(problem.units) + 1,), np.inf)
    links[..., 1:-1] = both[..., 1:]  # no link before unit 0 or after the last unit
    return links
