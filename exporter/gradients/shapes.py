"""The element type and shape of every tensor of a forward graph, for the gradient rules.

onnx's shape inference loses dimensions behind shapes computed at run time (a channel
shuffle's ``Reshape`` of ``Shape`` arithmetic, a torch model's ``view(x.size(0), -1)``). Where
it does, the graph is also run, on random data at two batch sizes, with stock onnxruntime: a dim
equal in both runs is fixed; one that grows with the batch is named after it (``N``, ``N*8``);
rules then take constant shapes where they can and ``Shape`` where they cannot.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

from edgert.exporter.graph_writer import TensorType
from edgert.manifest import BATCH
from edgert.ort_import import onnxruntime

PROBE_ROWS = (2, 3)  # the sizes every symbolic input dim takes in the two runs


def forward_types(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray] | None = None) -> dict[str, TensorType]:
    """Types of ``model``'s tensors: onnx's inference, completed by two runs where the graph's inputs allow it.

    ``feeds`` gives values for inputs that random data must not replace (parameters, say).
    """
    types = inferred_types(model)
    if _complete(model, types):
        return types
    probed = _probe(model, feeds or {})
    for name, kind in probed.items():
        known = types.get(name)
        if known is None or known.shape is None or _less_known(known.shape, kind.shape):
            types[name] = kind
    return types


def _complete(model: onnx.ModelProto, types: Mapping[str, TensorType]) -> bool:
    """Whether inference typed every node output, each dim a number or named (a run would add nothing)."""
    for node in model.graph.node:
        for name in node.output:
            kind = types.get(name) if name else None
            if name and (kind is None or kind.shape is None or any(d is None for d in kind.shape)):
                return False
    return True


def inferred_types(model: onnx.ModelProto) -> dict[str, TensorType]:
    """What onnx's shape inference (with data propagation) knows of ``model``'s tensors."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception:  # noqa: BLE001 - inference refuses some valid graphs; the run below still types them
        inferred = model
    graph = inferred.graph
    types: dict[str, TensorType] = {}
    for value in [*graph.input, *graph.value_info, *graph.output]:
        found = type_of_value(value)
        if found is not None:
            types.setdefault(value.name, found)
    for init in graph.initializer:
        types[init.name] = TensorType(init.data_type, tuple(init.dims))
    return types


def type_of_value(value: onnx.ValueInfoProto) -> TensorType | None:
    """The :class:`TensorType` a value info declares, or None when it declares no element type."""
    tensor = value.type.tensor_type
    if not tensor.elem_type:
        return None
    if not tensor.HasField("shape"):
        return TensorType(tensor.elem_type, None)
    dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim)
    return TensorType(tensor.elem_type, dims)


def _less_known(known: tuple, probed: tuple | None) -> bool:
    if probed is None or len(known) != len(probed):
        return False
    return any(not isinstance(a, int) and isinstance(b, int) for a, b in zip(known, probed)) or \
        any(a is None and b is not None for a, b in zip(known, probed))


def _probe(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> dict[str, TensorType]:
    """Types from running ``model`` at each of :data:`PROBE_ROWS`; empty where it cannot run on random data."""
    graph = model.graph
    initializers = {init.name for init in graph.initializer}
    inputs = [i for i in graph.input if i.name not in initializers]
    names = list(dict.fromkeys(name for node in graph.node for name in node.output if name))
    wide = onnx.ModelProto()
    wide.CopyFrom(model)
    del wide.graph.output[:]
    wide.graph.output.extend(helper.make_empty_tensor_value_info(name) for name in names)
    rng = np.random.default_rng(0)
    runs = []
    try:
        options = onnxruntime().SessionOptions()
        options.log_severity_level = 3
        options.graph_optimization_level = onnxruntime().GraphOptimizationLevel.ORT_DISABLE_ALL
        session = onnxruntime().InferenceSession(wide.SerializeToString(), options,
                                                 providers=["CPUExecutionProvider"])
        for rows in PROBE_ROWS:
            values = {i.name: feeds[i.name] if i.name in feeds else _random(i, rows, rng) for i in inputs}
            runs.append(dict(zip(names, session.run(names, values))))
    except Exception:  # noqa: BLE001 - a graph random data cannot run keeps onnx's inferred types
        return {}
    types = {}
    for name in names:
        first, second = runs[0][name], runs[1][name]
        if not isinstance(first, np.ndarray) or first.ndim != second.ndim:
            continue
        dims = tuple(_dim(a, b) for a, b in zip(first.shape, second.shape))
        types[name] = TensorType(helper.np_dtype_to_tensor_dtype(first.dtype), dims)
    return types


def _dim(first: int, second: int) -> int | str | None:
    """A dim seen at both probe sizes: fixed, a multiple of the batch (named so), or unknown."""
    if first == second:
        return int(first)
    rows, more = PROBE_ROWS
    if first % rows == 0 and second == first // rows * more:
        factor = first // rows
        return BATCH if factor == 1 else f"{BATCH}*{factor}"
    return None


def _random(value: onnx.ValueInfoProto, rows: int, rng: np.random.Generator) -> np.ndarray:
    """Random data for a graph input, its symbolic axes ``rows`` long: zeros for integers (valid indices and
    labels), normal values otherwise."""
    tensor = value.type.tensor_type
    shape = [d.dim_value if d.HasField("dim_value") else rows for d in tensor.shape.dim]
    dtype = helper.tensor_dtype_to_np_dtype(tensor.elem_type)
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(size=shape).astype(dtype)
    if dtype == np.bool_:
        return np.ones(shape, dtype=bool)
    return np.zeros(shape, dtype=dtype)


def initial_values(model: onnx.ModelProto, names: set[str]) -> dict[str, np.ndarray]:
    """The values of ``model``'s initializers ``names``, to feed them where they became inputs."""
    return {init.name: numpy_helper.to_array(init) for init in model.graph.initializer if init.name in names}
