"""Recurrent layers (ONNX ``RNN``, ``GRU``, ``LSTM``) unrolled into standard operators.

The training build differentiates these into ``GRUTraining``/``GRUGrad``,
``LSTMTraining``/``LSTMGrad`` and ``ConcatTraining``, which stock onnxruntime lacks and which
have no compact standard form. Unrolled before gradients are built, a recurrence over a
fixed sequence length is plain MatMul, Sigmoid, Tanh, Mul and Add, which every build
differentiates into portable graphs. The input projection of every time step is one
MatMul; the recurrent one is a MatMul per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from edgert.exporter.errors import ModelLoadError
from edgert.exporter.graph_writer import GraphWriter

RECURRENT_OPS = ("RNN", "GRU", "LSTM")
_GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
_DEFAULT_ACTIVATIONS = {"RNN": ["Tanh"], "GRU": ["Sigmoid", "Tanh"], "LSTM": ["Sigmoid", "Tanh", "Tanh"]}
_ACTIVATIONS = {"Sigmoid", "Tanh", "Relu"}


@dataclass
class _Layer:
    """One recurrent node, read: its attributes and inputs by role."""

    node: onnx.NodeProto
    op: str
    hidden: int
    steps: int
    directions: list[str]
    activations: list[str]
    clip: float | None
    linear_before_reset: bool
    batch_first: bool

    def input(self, index: int) -> str | None:
        return self.node.input[index] if index < len(self.node.input) and self.node.input[index] else None

    def output(self, index: int) -> str | None:
        return self.node.output[index] if index < len(self.node.output) and self.node.output[index] else None


def unroll_recurrent(model: onnx.ModelProto) -> list[str]:
    """Replace every RNN/GRU/LSTM node of ``model`` (in place); returns a note per node unrolled."""
    graph = model.graph
    if not any(node.op_type in RECURRENT_OPS and node.domain in ("", "ai.onnx") for node in graph.node):
        return []
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    shapes = _shapes(model)
    nodes, notes = [], []
    for node in graph.node:
        if node.op_type not in RECURRENT_OPS or node.domain not in ("", "ai.onnx"):
            nodes.append(node)
            continue
        layer = _read(node, shapes)
        writer = GraphWriter(f"{node.name}/unrolled", opset)
        _unroll(layer, writer)
        nodes.extend(writer.nodes)
        graph.initializer.extend(writer.initializers)
        notes.append(f"unrolled {node.op_type} {node.name!r} over {layer.steps} steps "
                     f"({len(layer.directions)} direction(s)) into standard operators")
    del graph.node[:]
    graph.node.extend(nodes)
    return notes


def _shapes(model: onnx.ModelProto) -> dict[str, list]:
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    shapes = {}
    for value in [*inferred.graph.input, *inferred.graph.value_info]:
        dims = value.type.tensor_type.shape.dim
        shapes[value.name] = [d.dim_value if d.HasField("dim_value") else None for d in dims]
    for init in inferred.graph.initializer:
        shapes[init.name] = list(init.dims)
    return shapes


def _read(node: onnx.NodeProto, shapes: dict[str, list]) -> _Layer:
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}

    def refuse(reason: str) -> ModelLoadError:
        return ModelLoadError(f"node {node.name!r} ({node.op_type}): {reason}; edgert unrolls recurrent layers "
                              f"into standard operators and cannot unroll this one")

    if node.op_type == "LSTM" and attributes.get("input_forget", 0):
        raise refuse("input_forget=1 is not supported")
    if len(node.input) > 4 and node.input[4]:
        raise refuse("sequence_lens (packed, variable-length sequences) is not supported")
    batch_first = bool(attributes.get("layout", 0))
    x_shape = shapes.get(node.input[0])
    steps = x_shape[1 if batch_first else 0] if x_shape and len(x_shape) == 3 else None
    if not isinstance(steps, int) or steps < 1:
        raise refuse(f"the sequence length must be fixed (input {node.input[0]!r} has shape {x_shape})")
    direction = attributes.get("direction", b"forward")
    direction = direction.decode() if isinstance(direction, bytes) else direction
    directions = ["forward", "reverse"] if direction == "bidirectional" else [direction]
    activations = [a.decode() if isinstance(a, bytes) else a for a in attributes.get("activations", [])]
    activations = activations or _DEFAULT_ACTIVATIONS[node.op_type] * len(directions)
    unknown = sorted(set(activations) - _ACTIVATIONS)
    if unknown:
        raise refuse(f"activation(s) {', '.join(unknown)} are not supported (only {', '.join(sorted(_ACTIVATIONS))})")
    hidden = attributes.get("hidden_size") or shapes.get(node.input[2], [None, None, None])[2]
    if not hidden:
        raise refuse("hidden_size is unknown")
    return _Layer(node, node.op_type, int(hidden), steps, directions, activations,
                  attributes.get("clip"), bool(attributes.get("linear_before_reset", 0)), batch_first)


def _unroll(layer: _Layer, w: GraphWriter) -> None:
    x = layer.input(0)
    if layer.batch_first:
        x = w.op("Transpose", [x], perm=[1, 0, 2])
    batch = w.op("Slice", [w.op("Shape", [x]), w.ints([1]), w.ints([2])])
    zeros = w.zeros(w.op("Concat", [batch, w.ints([layer.hidden])], axis=0), onnx.TensorProto.FLOAT)
    per_direction = len(_DEFAULT_ACTIVATIONS[layer.op])
    outputs, finals, cells = [], [], []
    for d, direction in enumerate(layer.directions):
        acts = layer.activations[d * per_direction:(d + 1) * per_direction]
        ys, h, c = _direction(layer, w, x, d, direction, acts, zeros)
        outputs.append(w.unsqueeze(w.op("Concat", [w.unsqueeze(y, [0]) for y in ys], axis=0), [1]))
        finals.append(w.unsqueeze(h, [0]))
        cells.append(w.unsqueeze(c, [0]) if c else None)
    _write(layer, w, outputs, finals, cells)


def _direction(layer: _Layer, w: GraphWriter, x: str, d: int, direction: str, acts: list[str], zeros: str
               ) -> tuple[list[str], str, str | None]:
    """One direction's recurrence; returns the hidden state of every step (in sequence order), the last h and c."""
    gates, size = _GATES[layer.op], layer.hidden
    weight = w.op("Transpose", [_pick(w, layer.input(1), d)], perm=[1, 0])  # (input, gates*H)
    recurrent = w.op("Transpose", [_pick(w, layer.input(2), d)], perm=[1, 0])  # (H, gates*H)
    projected = w.op("MatMul", [x, weight])  # (T, B, gates*H): every step's input projection at once
    bias = layer.input(3)
    input_bias = recurrent_bias = None
    if bias:
        both = _pick(w, bias, d)
        input_bias = w.op("Slice", [both, w.ints([0]), w.ints([gates * size])])
        recurrent_bias = w.op("Slice", [both, w.ints([gates * size]), w.ints([2 * gates * size])])
        projected = w.op("Add", [projected, input_bias])
    h = _pick(w, layer.input(5), d) if layer.input(5) else zeros
    c = (_pick(w, layer.input(6), d) if layer.input(6) else zeros) if layer.op == "LSTM" else None
    peepholes = (w.multi("Split", [_pick(w, layer.input(7), d), w.ints([size] * 3)], 3, axis=0)
                 if layer.op == "LSTM" and layer.input(7) else None)  # P = [Pi, Po, Pf]
    order = range(layer.steps) if direction == "forward" else reversed(range(layer.steps))
    states: dict[int, str] = {}
    for t in order:
        x_t = w.squeeze(w.op("Slice", [projected, w.ints([t]), w.ints([t + 1])]), [0])
        if layer.op == "LSTM":
            h, c = _lstm_step(layer, w, x_t, h, c, recurrent, recurrent_bias, peepholes, acts)
        elif layer.op == "GRU":
            h = _gru_step(layer, w, x_t, h, recurrent, recurrent_bias, acts)
        else:
            pre = w.op("Add", [x_t, w.op("MatMul", [h, recurrent])])
            h = w.op(acts[0], [_clip(layer, w, w.op("Add", [pre, recurrent_bias]) if recurrent_bias else pre)])
        states[t] = h
    return [states[t] for t in range(layer.steps)], h, c


def _lstm_step(layer: _Layer, w: GraphWriter, x_t: str, h: str, c: str, recurrent: str, bias: str | None,
               peepholes: list[str] | None, acts: list[str]) -> tuple[str, str]:
    f, g, activation = acts
    pre = w.op("Add", [x_t, w.op("MatMul", [h, recurrent])])
    if bias:
        pre = w.op("Add", [pre, bias])
    i_pre, o_pre, f_pre, c_pre = w.multi("Split", [pre, w.ints([layer.hidden] * 4)], 4, axis=1)
    if peepholes:
        i_pre = w.op("Add", [i_pre, w.op("Mul", [peepholes[0], c])])
        f_pre = w.op("Add", [f_pre, w.op("Mul", [peepholes[2], c])])
    i = w.op(f, [_clip(layer, w, i_pre)])
    forget = w.op(f, [_clip(layer, w, f_pre)])
    candidate = w.op(g, [_clip(layer, w, c_pre)])
    c = w.op("Add", [w.op("Mul", [forget, c]), w.op("Mul", [i, candidate])])
    if peepholes:
        o_pre = w.op("Add", [o_pre, w.op("Mul", [peepholes[1], c])])
    o = w.op(f, [_clip(layer, w, o_pre)])
    return w.op("Mul", [o, w.op(activation, [c])]), c


def _gru_step(layer: _Layer, w: GraphWriter, x_t: str, h: str, recurrent: str, bias: str | None,
              acts: list[str]) -> str:
    f, g = acts
    size = layer.hidden
    x_z, x_r, x_h = w.multi("Split", [x_t, w.ints([size] * 3)], 3, axis=1)
    r_zr = w.op("Slice", [recurrent, w.ints([0]), w.ints([2 * size]), w.ints([1])])
    r_h = w.op("Slice", [recurrent, w.ints([2 * size]), w.ints([3 * size]), w.ints([1])])
    b_zr = b_h = None
    if bias:
        b_zr = w.op("Slice", [bias, w.ints([0]), w.ints([2 * size])])
        b_h = w.op("Slice", [bias, w.ints([2 * size]), w.ints([3 * size])])
    zr = w.op("MatMul", [h, r_zr])
    if b_zr:
        zr = w.op("Add", [zr, b_zr])
    h_z, h_r = w.multi("Split", [zr, w.ints([size, size])], 2, axis=1)
    z = w.op(f, [_clip(layer, w, w.op("Add", [x_z, h_z]))])
    r = w.op(f, [_clip(layer, w, w.op("Add", [x_r, h_r]))])
    if layer.linear_before_reset:
        hidden = w.op("MatMul", [h, r_h])
        if b_h:
            hidden = w.op("Add", [hidden, b_h])
        hidden = w.op("Mul", [r, hidden])
    else:
        hidden = w.op("MatMul", [w.op("Mul", [r, h]), r_h])
        if b_h:
            hidden = w.op("Add", [hidden, b_h])
    candidate = w.op(g, [_clip(layer, w, w.op("Add", [x_h, hidden]))])
    keep = w.op("Mul", [z, h])
    return w.op("Add", [w.op("Sub", [candidate, w.op("Mul", [z, candidate])]), keep])


def _pick(w: GraphWriter, tensor: str, direction: int) -> str:
    """``tensor[direction]``: the weights or states of one direction."""
    return w.squeeze(w.op("Slice", [tensor, w.ints([direction]), w.ints([direction + 1])]), [0])


def _clip(layer: _Layer, w: GraphWriter, value: str) -> str:
    if layer.clip is None:
        return value
    return w.op("Clip", [value, w.const(-layer.clip, np.float32), w.const(layer.clip, np.float32)])


def _write(layer: _Layer, w: GraphWriter, outputs: list[str], finals: list[str], cells: list[str | None]) -> None:
    """Y (T, directions, B, H), Y_h and Y_c (directions, B, H), or batch first under layout=1."""
    def stack(values: list[str], axis: int) -> str:
        return values[0] if len(values) == 1 else w.op("Concat", values, axis=axis)

    results = [(0, stack(outputs, 1), [2, 0, 1, 3]), (1, stack(finals, 0), [1, 0, 2])]
    if layer.op == "LSTM":
        results.append((2, stack([c for c in cells if c], 0), [1, 0, 2]))
    for index, value, batch_first_perm in results:
        name = layer.output(index)
        if not name:
            continue
        if layer.batch_first:
            w.op("Transpose", [value], outputs=[name], perm=batch_first_perm)
        else:
            w.identity(value, name)
