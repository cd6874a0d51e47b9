"""A stage's backward split in two: the gradients the pipeline waits for now, the weight gradients once a step.

The B/W split of zero-bubble pipelines (Qi et al., 2023). The *input* half computes what the
pipeline waits for: the gradients sent to the previous stage, the loss and prediction, the
running statistics (and any parameter gradient computed on the way, such as a BatchNorm's);
and the tensors the other half reads, its *feeds* (each weight product's output gradient, say).
The *weight* half computes the parameter gradients from those feeds, the call's own inputs and
the parameters. A weight gradient is a sum over the batch's rows, so
the runtime runs the weight half once per step on all its micro-batches' feeds, concatenated:
one call of M times the rows instead of M calls, and no accumulation between them.

A stage is split only where that holds, which is checked on the graphs themselves: every
tensor the weight half reads is a parameter or has the batch as its first axis (the input half
run at two batch sizes), and the weight half run once on two micro-batches together equals
the sum of its runs on each (onnxruntime, random data). Otherwise :func:`split_backward`
returns None and the stage keeps its one backward.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper

from edgert.exporter.graph_walk import needed_nodes, reads
from edgert.manifest import BATCH
from edgert.ort_import import onnxruntime

PROBE_ROWS = (2, 3)  # the batch sizes the input half is run at (distinct from any fixed leading axis)
TOLERANCE = 1e-4  # the weight half over two micro-batches at once against the sum of its two runs, relative


@dataclass
class SplitBackward:
    """The two halves and what passes between them."""

    input: onnx.ModelProto | None
    """None: nothing the pipeline waits for (a first stage whose statistics the forward updates)."""
    weight: onnx.ModelProto
    feeds: list[str]
    """The input half's outputs the weight half reads."""


def split_backward(backward: onnx.ModelProto, parameters: Collection[str]) -> SplitBackward | None:
    """``backward`` (a stage's portable backward, recompute or stash form) split for the trainable
    ``parameters``; None where the weight half cannot run once a step (module docstring)."""
    graph = backward.graph
    gradients = {f"{name}_grad" for name in parameters}
    for_others = needed_nodes(graph, [o.name for o in graph.output if o.name not in gradients])
    input_nodes = [node for index, node in enumerate(graph.node) if index in for_others]
    produced = {name for node in input_nodes for name in node.output if name}
    # a parameter gradient the input half computes anyway (a BatchNorm's, from the sums its input gradient
    # needs) stays there, per micro-batch
    weight_outputs = [o for o in graph.output if o.name in gradients and o.name not in produced]
    other_outputs = [o for o in graph.output if o.name not in gradients or o.name in produced]
    if not weight_outputs:
        return None
    for_weights = needed_nodes(graph, [o.name for o in weight_outputs]) - for_others
    weight_nodes = [node for index, node in enumerate(graph.node) if index in for_weights]
    read = list(dict.fromkeys(name for node in weight_nodes for name in reads(node)))
    feeds = [name for name in read if name in produced]
    inputs = {i.name: i for i in graph.input}
    initializers = {init.name: init for init in graph.initializer}
    input_read = {name for node in input_nodes for name in reads(node)}
    input_initializers = [init for init in graph.initializer if init.name in input_read]
    probes = _probe_feeds(backward, input_nodes, input_initializers, feeds, parameters)
    if probes is None:
        return None
    input_half = None
    if other_outputs or feeds:
        input_half = _model(backward, f"{graph.name}_input", input_nodes, list(graph.input),
                            [*other_outputs, *(_typed(name, probes[0][name]) for name in feeds)], input_initializers)
    weight_inputs = [*(_typed(name, probes[0][name]) for name in feeds),
                     *(inputs[name] for name in read if name in inputs)]
    weight_half = _model(backward, f"{graph.name}_weight", weight_nodes, weight_inputs, weight_outputs,
                         [initializers[name] for name in read if name in initializers])
    if not _adds_up(weight_half, probes, parameters):
        return None
    return SplitBackward(input=input_half, weight=weight_half, feeds=feeds)


def _typed(name: str, value: np.ndarray) -> onnx.ValueInfoProto:
    """A feed's declaration: its dtype, the batch first, the rest as the probe saw it."""
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype),
                                         [BATCH, *value.shape[1:]])


def _model(like: onnx.ModelProto, name: str, nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto],
           outputs: list[onnx.ValueInfoProto], initializers: list[onnx.TensorProto]) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs, initializers)
    return helper.make_model(graph, opset_imports=list(like.opset_import), ir_version=like.ir_version)


Probe = dict[str, np.ndarray]


def _probe_feeds(backward: onnx.ModelProto, input_nodes: list[onnx.NodeProto],
                 input_initializers: list[onnx.TensorProto], feeds: list[str],
                 parameters: Collection[str]) -> tuple[Probe, Probe] | None:
    """The weight half's inputs (feeds computed by the input half, the rest random) at each of :data:`PROBE_ROWS`
    rows, the parameters the same in both; None where a feed is not batch-first, or the input half does not run on
    random data whose symbolic axes all take the probe's rows (one of them is not the batch)."""
    graph = backward.graph
    rng = np.random.default_rng(0)
    fixed = {i.name: _random(i, 0, rng) for i in graph.input if i.name in parameters}
    probe = _model(backward, "probe", input_nodes, list(graph.input),
                   [helper.make_empty_tensor_value_info(name) for name in feeds], input_initializers) if feeds else None
    probes = []
    try:
        session = _session(probe) if probe is not None else None
        for rows in PROBE_ROWS:
            values = {**{i.name: _random(i, rows, rng) for i in graph.input if i.name not in parameters}, **fixed}
            if session is not None:
                wanted = {i.name for i in session.get_inputs()}
                values.update(zip(feeds, session.run(feeds, {k: v for k, v in values.items() if k in wanted})))
            probes.append(values)
    except Exception:  # noqa: BLE001 - a graph random data cannot run (its batch not first, say) stays whole
        return None
    for name in feeds:  # the batch first, and only there
        if (any(probe[name].ndim == 0 or probe[name].shape[0] != rows for probe, rows in zip(probes, PROBE_ROWS))
                or probes[0][name].shape[1:] != probes[1][name].shape[1:]):
            return None
    return probes[0], probes[1]


def _session(model: onnx.ModelProto) -> Any:
    return onnxruntime().InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _random(value: onnx.ValueInfoProto, rows: int, rng: np.random.Generator) -> np.ndarray:
    """Random data for a graph input, its symbolic axes ``rows`` long: small non-negative integers for indices,
    positive numbers otherwise (a saved variance or its inverse root must not be negative)."""
    tensor = value.type.tensor_type
    shape = [d.dim_value if d.HasField("dim_value") else rows for d in tensor.shape.dim]
    dtype = helper.tensor_dtype_to_np_dtype(tensor.elem_type)
    if np.issubdtype(dtype, np.integer):
        return rng.integers(0, 2, size=shape).astype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    return rng.uniform(0.1, 1.0, size=shape).astype(dtype)


def _adds_up(weight: onnx.ModelProto, probes: tuple[Probe, Probe], parameters: Collection[str]) -> bool:
    """Whether the weight half on both probes at once gives the sum of its runs on each."""
    names = [i.name for i in weight.graph.input]
    if any(name not in parameters and (probes[0][name].ndim == 0 or probes[0][name].shape[0] != PROBE_ROWS[0])
           for name in names):
        return False  # read per call but not batch-first (a loss scale, a running statistic)
    try:
        session = _session(weight)
        outputs = [o.name for o in session.get_outputs()]
        each = [session.run(outputs, {name: probe[name] for name in names}) for probe in probes]
        both = session.run(outputs, {name: probes[0][name] if name in parameters
                                     else np.concatenate([probes[0][name], probes[1][name]]) for name in names})
    except Exception:  # noqa: BLE001 - any failure on concatenated feeds: the half is not batch-additive
        return False
    summed = [first.astype(np.float64) + second for first, second in zip(*each)]
    if any(together.shape != total.shape for together, total in zip(both, summed)):
        return False
    # relative to the largest gradient of all: one whose exact value is 0 (an attention key's bias) holds noise
    scale = max(max((float(np.max(np.abs(total), initial=0.0)) for total in summed), default=0.0), 1e-6)
    return all(float(np.max(np.abs(together - total), initial=0.0)) <= TOLERANCE * scale
               for together, total in zip(both, summed))
