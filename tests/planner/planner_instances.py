"""Synthetic planning problems: equal units on devices with given slowdowns, and seeded random ones."""

from __future__ import annotations

import random

from edgert.exporter.planner.solver import DeviceCosts, PlanProblem, Unit

MIB = 2**20


def uniform_problem(slowdowns: list[float], units: int = 8, forward_ms: float = 1.0, backward_ms: float = 2.0,
                    param_bytes: int = MIB, input_bytes: int = 1024, peak_bytes: int = MIB, saved_bytes: int = 0,
                    memory_bytes: int | list[int] = 0, bandwidth: float = 1e9, rtt_ms: float = 0.0,
                    weight_ms: float = 0.0, **options) -> PlanProblem:
    """``units`` equal units; device ``d`` takes ``slowdowns[d]`` times the base forward/backward (and, of the
    backward, weight-gradient) times."""
    memories = memory_bytes if isinstance(memory_bytes, list) else [memory_bytes] * len(slowdowns)
    devices = tuple(DeviceCosts(name=f"dev{d}", forward_ms=(forward_ms * slow,) * units,
                                backward_ms=(backward_ms * slow,) * units, peak_bytes=(peak_bytes,) * units,
                                memory_bytes=memories[d], cores=2,
                                weight_ms=(weight_ms * slow,) * units if weight_ms else ())
                    for d, slow in enumerate(slowdowns))
    n = len(slowdowns)
    return PlanProblem(units=tuple(Unit(f"u{u}", param_bytes, input_bytes, saved_bytes) for u in range(units)),
                       devices=devices,
                       bandwidth=full_matrix(n, bandwidth), rtt_ms=full_matrix(n, rtt_ms),
                       micro_batch=options.pop("micro_batch", 8), micro_batches=options.pop("micro_batches", 4),
                       **options)


def full_matrix(n: int, value: float) -> tuple[tuple[float, ...], ...]:
    return tuple(tuple(value for _ in range(n)) for _ in range(n))


def random_problem(seed: int, devices: int, units: int, memory: bool = True, **options) -> PlanProblem:
    """Random unit times, sizes, device speeds, memories and links; memory is tight enough to matter.

    Saved activations (what a stashing stage keeps) and the weight gradients' share of each backward
    (what a split backward defers) come from generators of their own, so adding them left every other
    random figure of a seed as it was.
    """
    rng = random.Random(seed)
    saved = [random.Random(seed * 7919 + u).randint(0, 128) * 1024 for u in range(units)]
    base_forward = [rng.uniform(0.5, 5.0) for _ in range(units)]
    params = [rng.choice([0, rng.randint(1, 8) * MIB]) for _ in range(units)]
    inputs = [rng.randint(1, 64) * 1024 for _ in range(units)]
    costs = []
    for d in range(devices):
        slow = rng.choice([1.0, 1.5, 2.0, 4.0, 10.0])
        forward = tuple(f * slow * rng.uniform(0.8, 1.25) for f in base_forward)
        backward = tuple(f * rng.uniform(1.5, 2.5) for f in forward)
        peak = tuple(rng.randint(1, 16) * MIB for _ in range(units))
        memory = rng.choice([0, 24 * MIB, 48 * MIB, 96 * MIB]) if memory else 0
        call = rng.choice([0.0, rng.uniform(0.1, 2.0) * slow])
        shares = random.Random(seed * 104729 + d)
        costs.append(DeviceCosts(f"d{d}", forward, backward, peak, memory, cores=rng.choice([1, 2, 4]),
                                 call_ms=call, last_call_ms=rng.choice([None, call * rng.uniform(0.3, 1.0)]),
                                 weight_ms=tuple(b * shares.uniform(0.1, 0.45) for b in backward)))
    bandwidth = tuple(tuple(rng.choice([2e6, 1e7, 5e7, 1e8]) for _ in range(devices)) for _ in range(devices))
    rtt = tuple(tuple(rng.uniform(0.1, 3.0) for _ in range(devices)) for _ in range(devices))
    return PlanProblem(units=tuple(Unit(f"u{u}", params[u], inputs[u], saved[u]) for u in range(units)),
                       devices=tuple(costs),
                       bandwidth=bandwidth, rtt_ms=rtt, micro_batch=options.pop("micro_batch", 8),
                       micro_batches=options.pop("micro_batches", rng.choice([1, 2, 4, 8])), **options)
