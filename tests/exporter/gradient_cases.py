"""Single-operator models and the harness that checks edgert's gradient rules on them.

``loss = sum_k ReduceSum(out_k * g_k)`` over one operator node, so the gradient of every
output is the random ``g_k``. The rule's gradient graph is written by edgert's builder and
checked two ways: built from the float64 model and run by onnx's reference evaluator, against
central differences of the float64 forward (the formulas); built from the float32 model and
run by onnxruntime, against that float64 gradient (what a board runs).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgert.exporter.float64 import Float64Evaluator, as_float64
from edgert.exporter.gradients.builder import build_gradient_graph
from edgert.exporter.gradients.shapes import forward_types

F = TensorProto.FLOAT
ELEMENTWISE_LIMIT = 256  # up to this many elements a tensor's gradient is checked element by element
DIRECTIONS = 4  # random directions for a larger tensor


def single_op(op_type: str, inputs: dict[str, tuple[int, list]], params: dict[str, np.ndarray] | None = None,
              outputs: int = 1, opset: int = 17, extra_outputs: int = 0, order: list[str] | None = None,
              **attributes) -> onnx.ModelProto:
    """``loss = sum_k ReduceSum(out_k * g_k)`` over one ``op_type`` node.

    ``extra_outputs`` more outputs of the node (running statistics...) take no part in the loss;
    ``order`` gives the node's input order when it is not graph inputs, then parameters.
    """
    params = params or {}
    out_names = [f"y{k}" for k in range(outputs)]
    extra = [f"extra{k}" for k in range(extra_outputs)]
    node = helper.make_node(op_type, order or [*inputs, *params], out_names + extra, name=f"/{op_type}", **attributes)
    nodes, terms = [node], []
    for k, out in enumerate(out_names):
        nodes += [helper.make_node("Mul", [out, f"g{k}"], [f"prod{k}"]),
                  helper.make_node("ReduceSum", [f"prod{k}"], [f"term{k}"], keepdims=0)]
        terms.append(f"term{k}")
    total = terms[0]
    for k, term in enumerate(terms[1:]):
        nodes.append(helper.make_node("Add", [total, term], [f"total{k}"]))
        total = f"total{k}"
    nodes.append(helper.make_node("Identity", [total], ["loss"]))
    graph_inputs = [helper.make_tensor_value_info(name, dtype, shape) for name, (dtype, shape) in inputs.items()]
    graph = helper.make_graph(nodes, op_type, graph_inputs, [helper.make_tensor_value_info("loss", F, [])],
                              [numpy_helper.from_array(v, k) for k, v in params.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    for k, out in enumerate(out_names):
        value = next(v for v in inferred.graph.value_info if v.name == out)
        model.graph.input.append(helper.make_tensor_value_info(f"g{k}", value.type.tensor_type.elem_type,
                                                               [d.dim_value or d.dim_param for d in
                                                                value.type.tensor_type.shape.dim]))
    return model


def params_as_inputs(forward: onnx.ModelProto, params: set[str]) -> onnx.ModelProto:
    """A copy of ``forward`` whose initializers ``params`` are graph inputs, as a stage's parameters are."""
    model = onnx.ModelProto()
    model.CopyFrom(forward)
    moved = [init for init in model.graph.initializer if init.name in params]
    kept = [init for init in model.graph.initializer if init.name not in params]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    model.graph.input.extend(helper.make_tensor_value_info(i.name, i.data_type, i.dims) for i in moved)
    return model


def gradient_model(forward: onnx.ModelProto, wanted: set[str], params: set[str]) -> onnx.ModelProto:
    """edgert's gradient graph of ``loss`` for ``wanted`` (graph inputs, or initializers in ``params``)."""
    types = forward_types(forward)
    model = params_as_inputs(forward, params)
    dtype = next(o.type.tensor_type.elem_type for o in model.graph.output if o.name == "loss")
    model.graph.initializer.append(numpy_helper.from_array(
        np.array(1.0, helper.tensor_dtype_to_np_dtype(dtype)), "loss_grad"))
    built = build_gradient_graph(model, {"loss": "loss_grad"}, sorted(wanted), types, "test")
    return built.model


def run_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    from edgert.ort_import import onnxruntime as import_onnxruntime

    onnxruntime = import_onnxruntime()
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    wanted = {i.name for i in session.get_inputs()}
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, {k: v for k, v in feeds.items() if k in wanted})))


def run_reference(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return Float64Evaluator(model).run(feeds)


def random_feeds(model: onnx.ModelProto, batch: int, seed: int = 0, int_bound: int = 4) -> dict[str, np.ndarray]:
    """Random values for ``model``'s graph inputs and its initializers (as float64 where float)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in model.graph.input:
        tensor = value.type.tensor_type
        shape = [d.dim_value if d.dim_value else batch for d in tensor.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(tensor.elem_type)
        if np.issubdtype(dtype, np.integer):
            feeds[value.name] = rng.integers(0, int_bound, shape).astype(dtype)
        elif dtype == np.bool_:
            feeds[value.name] = rng.integers(0, 2, shape).astype(bool)
        else:
            feeds[value.name] = rng.standard_normal(shape)
    for init in model.graph.initializer:
        value = numpy_helper.to_array(init)
        feeds[init.name] = value.astype(np.float64) if value.dtype == np.float32 else value
    return feeds


def _narrow(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in feeds.items()}


def central_differences(forward64: onnx.ModelProto, feeds: dict[str, np.ndarray], name: str,
                        gradient: np.ndarray, rng: np.random.Generator, step: float = 1e-6) -> float:
    """The largest difference between ``gradient`` (of ``loss`` w.r.t. ``name``) and central differences of the
    float64 forward: element by element for a small tensor, along random directions for a large one; relative to the
    gradient's largest value (or its norm, along directions)."""
    base = feeds[name]

    def loss_at(value: np.ndarray) -> float:
        return float(run_reference(forward64, {**feeds, name: value})["loss"])

    scale = max(float(np.max(np.abs(gradient))), 1e-12)
    if base.size <= ELEMENTWISE_LIMIT:
        worst = 0.0
        for index in range(base.size):
            delta = np.zeros(base.size)
            delta[index] = step
            delta = delta.reshape(base.shape)
            expected = (loss_at(base + delta) - loss_at(base - delta)) / (2 * step)
            worst = max(worst, abs(float(gradient.reshape(-1)[index]) - expected) / scale)
        return worst
    worst = 0.0
    norm = max(float(np.linalg.norm(gradient)), 1e-12)
    for _ in range(DIRECTIONS):
        direction = rng.standard_normal(base.shape)
        direction /= np.linalg.norm(direction)
        expected = (loss_at(base + step * direction) - loss_at(base - step * direction)) / (2 * step)
        worst = max(worst, abs(float(np.sum(gradient * direction)) - expected) / norm)
    return worst


def check(forward: onnx.ModelProto, wanted: set[str], batch: int = 2, seed: int = 0,
          int_bound: int = 4) -> tuple[float, float]:
    """(the float64 gradients against central differences, the float32 ones run by onnxruntime against the float64
    ones), each the largest relative difference over ``wanted``."""
    params = {i.name for i in forward.graph.initializer} & wanted
    forward64 = as_float64(forward)
    feeds = random_feeds(forward, batch, seed, int_bound)
    exact = run_reference(gradient_model(forward64, wanted, params), feeds)
    rng = np.random.default_rng(seed + 1)
    varied = params_as_inputs(forward64, params)
    formula = max(central_differences(varied, feeds, name, exact[f"{name}_grad"], rng) for name in sorted(wanted))
    board = run_ort(gradient_model(forward, wanted, params), _narrow(feeds))
    rounding = 0.0
    for name in sorted(wanted):
        expected = exact[f"{name}_grad"]
        scale = max(float(np.max(np.abs(expected))), 1e-12)
        rounding = max(rounding, float(np.max(np.abs(board[f"{name}_grad"] - expected))) / scale)
    return formula, rounding
