"""Single-operator models and a harness: the training build's gradient graph against its portable form."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgert.exporter.portable import make_portable, runs_on_stock, tensor_types

F = TensorProto.FLOAT


def gradient_graph(forward: onnx.ModelProto, requires_grad: set[str]) -> onnx.ModelProto:
    """The training build's gradient graph of ``loss`` (ORT's optimiser first, as the exporter does)."""
    from edgert.exporter.ort_training import gradient_graph as build

    return build(forward, "loss", requires_grad)


def single_op(op_type: str, inputs: dict[str, tuple[int, list]], params: dict[str, np.ndarray] | None = None,
              outputs: int = 1, opset: int = 17, extra_outputs: int = 0, order: list[str] | None = None,
              **attributes) -> onnx.ModelProto:
    """``loss = sum_k ReduceSum(out_k * g_k)`` over one ``op_type`` node, so every gradient is dY = g.

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


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    from edgert.ort_import import onnxruntime as import_onnxruntime

    onnxruntime = import_onnxruntime()
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    wanted = {i.name for i in session.get_inputs()}
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, {k: v for k, v in feeds.items() if k in wanted})))


def random_feeds(model: onnx.ModelProto, batch: int, seed: int = 0, int_bound: int = 4) -> dict[str, np.ndarray]:
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
            feeds[value.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def both_forms(forward: onnx.ModelProto, requires_grad: set[str], also: tuple[str, ...] = ()
               ) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """The training build's gradient graph (returning the gradients of ``requires_grad`` and ``also``) and its
    portable form, checked to need only stock operators."""
    original = gradient_graph(forward, requires_grad)
    del original.graph.output[:]
    wanted = [f"{name}_grad" for name in sorted(requires_grad)] + list(also)
    original.graph.output.extend(helper.make_empty_tensor_value_info(name) for name in wanted)
    portable = make_portable(original, "test", tensor_types(onnx.shape_inference.infer_shapes(forward)))
    opset = next(o.version for o in portable.opset_import if o.domain in ("", "ai.onnx"))
    assert all(runs_on_stock(n, opset) for n in portable.graph.node)
    return original, portable


def compare(forward: onnx.ModelProto, requires_grad: set[str], batch: int = 3, seed: int = 0,
            int_bound: int = 4, also: tuple[str, ...] = ()) -> tuple[float, onnx.ModelProto]:
    """Largest difference, relative to the largest value, between the two graphs' gradients (and ``also``)."""
    original, portable = both_forms(forward, requires_grad, also)
    feeds = random_feeds(forward, batch, seed, int_bound)
    expected, got = run(original, feeds), run(portable, feeds)
    worst = 0.0
    for name, value in expected.items():
        scale = max(float(np.max(np.abs(value), initial=0.0)), 1e-12)
        worst = max(worst, float(np.max(np.abs(got[name].astype(np.float64) - value), initial=0.0)) / scale)
    return worst, original


def numeric_reference(forward: onnx.ModelProto, requires_grad: set[str], batch: int = 2, seed: int = 0,
                      linear: bool = False) -> float:
    """The portable gradient against central differences of the forward.

    For operators whose training-build gradient cannot run here (ORT 1.19.2 crashes when a
    session loads a bare AveragePoolGrad or MaxPoolGrad, has no CPU ConvTransposeGrad, and
    fails on a Slice with negative steps). The differences are taken in float64 with a tiny
    step, or, for an operator ORT has no float64 kernel of and that is ``linear`` in each
    input, in float32 with a unit step (exact up to rounding).
    """
    step = 1.0 if linear else 1e-6
    _, portable = both_forms(forward, requires_grad)
    feeds = random_feeds(forward, batch, seed)
    got = run(portable, feeds)
    wide = forward if linear else _as_float64(forward)
    real = np.float32 if linear else np.float64
    wide_feeds = {k: v.astype(real) if v.dtype == np.float32 else v for k, v in feeds.items()}
    params = {i.name: numpy_helper.to_array(i) for i in wide.graph.initializer}
    worst = 0.0
    for name in sorted(requires_grad):
        base = wide_feeds[name] if name in wide_feeds else params[name]
        expected = np.zeros(base.size)
        for i in range(base.size):
            losses = []
            for sign in (1, -1):
                moved = base.copy().reshape(-1)
                moved[i] += sign * step
                moved = moved.reshape(base.shape)
                inputs = {**wide_feeds, name: moved} if name in wide_feeds else wide_feeds
                losses.append(float(run(_with(wide, name, moved), inputs)["loss"]))
            expected[i] = (losses[0] - losses[1]) / (2 * step)
        difference = np.abs(got[f"{name}_grad"].ravel().astype(np.float64) - expected)
        worst = max(worst, float(difference.max()) / max(float(np.abs(expected).max()), 1e-12))
    return worst


def _as_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    wide = onnx.ModelProto()
    wide.CopyFrom(model)
    for value in [*wide.graph.input, *wide.graph.output]:
        if value.type.tensor_type.elem_type == F:
            value.type.tensor_type.elem_type = TensorProto.DOUBLE
    for index, init in enumerate(wide.graph.initializer):
        if init.data_type == F:
            wide.graph.initializer[index].CopyFrom(
                numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float64), init.name))
    return wide


def _with(model: onnx.ModelProto, name: str, value: np.ndarray) -> onnx.ModelProto:
    """``model`` with initializer ``name`` set to ``value``; the model itself when ``name`` is a graph input."""
    if not any(i.name == name for i in model.graph.initializer):
        return model
    changed = onnx.ModelProto()
    changed.CopyFrom(model)
    for index, init in enumerate(changed.graph.initializer):
        if init.name == name:
            changed.graph.initializer[index].CopyFrom(numpy_helper.from_array(value, name))
    return changed
