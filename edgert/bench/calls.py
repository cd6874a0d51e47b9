"""A stage call's own cost: :class:`~edgert.stage.StageSession` against bare ``InferenceSession.run``.

On one stage of a plan, in this process: the runtime's forward and backward of a micro-batch
(checks, parameter feeds, gradient accumulation) against the same sessions run with the same
feeds prepared once, and a 1-row backward: the fixed cost every micro-batch pays, whatever its
size (why ``planned_vs_ideal`` falls short on small layers, docs/PLANNER.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from edgert.manifest import load_manifest
from edgert.stage import StageSession

CALLS = 400  # timed calls of each kind, after 40 untimed ones


def _ms_per_call(call: Callable[[], object], calls: int = CALLS) -> float:
    for _ in range(calls // 10):
        call()
    best = float("inf")
    for _ in range(3):  # the fastest of 3 rounds: load only ever slows a call down
        started = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - started) / calls * 1000)
    return best


def call_costs(plan: Path, stage: int, rows: int) -> dict[str, float]:
    """ms per call of ``plan``'s stage ``stage`` (not the last) on ``rows`` rows: the runtime's forward and backward,
    the bare sessions', the runtime's backward on 1 row, and its gradient accumulation alone."""
    manifest = load_manifest(plan)
    entry = manifest.stages[stage]
    session = StageSession(entry, plan, manifest.training)
    rng = np.random.default_rng(0)

    def tensors(specs, count):
        return {t.name: rng.standard_normal(t.shape_for(count)).astype(np.float32) for t in specs}

    inputs, gradients = tensors(entry.inputs, rows), tensors(entry.outputs, rows)
    state = session.parameters()
    forward_feeds = {name: value for name, value in {**inputs, **state}.items()
                     if name in {i.name for i in session._forward.get_inputs()}}
    backward_feeds = {**inputs, **{entry.output_gradients[n]: v for n, v in gradients.items()
                                   if n in entry.output_gradients}, **state}
    backward_feeds = {n: v for n, v in backward_feeds.items() if n in {i.name for i in session._backward.get_inputs()}}
    one_input, one_gradient = tensors(entry.inputs, 1), tensors(entry.outputs, 1)

    outputs = session._backward_outputs
    named = dict(zip(outputs, session._backward.run(outputs, backward_feeds)))
    session._add_gradients(named)  # the calls timed below add, as every call after a step's first does

    def backward():
        session.backward(inputs, output_gradients=gradients)
        session.zero_grad()

    def backward_one_row():
        session.backward(one_input, output_gradients=one_gradient)
        session.zero_grad()

    return {"forward_ms": _ms_per_call(lambda: session.forward(inputs)),
            "bare_forward_ms": _ms_per_call(lambda: session._forward.run(None, forward_feeds)),
            "backward_ms": _ms_per_call(backward),
            "bare_backward_ms": _ms_per_call(lambda: session._backward.run(None, backward_feeds)),
            "backward_1row_ms": _ms_per_call(backward_one_row),
            "accumulate_ms": _ms_per_call(lambda: session._add_gradients(named))}
