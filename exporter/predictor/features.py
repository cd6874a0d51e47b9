"""Op features of blocks and stages, the inputs of the latency predictor.

A :class:`Features` describes one stage (a range of blocks run as one forward call and one
backward call) per sample: FLOPs split by op category, activation bytes moved, parameter
bytes, node count and the bytes of its boundary. A single block is featurised as a
one-block stage; :func:`join_features` joins adjacent blocks into their stage, so that
``join_features(block_features(a)[i:j]) == stage_features(a, i, j)``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from edgert.exporter.errors import PredictorError

if TYPE_CHECKING:  # featurising needs onnx; predicting and learning online do not (the coordinator)
    import onnx

    from edgert.exporter.analyse import ModelAnalysis
    from edgert.exporter.flops import ShapeOf


CATEGORIES = ("conv", "dwconv", "matmul", "elementwise", "norm", "pool", "reduce", "gather", "movement")
_CATEGORY_OF = {
    "Conv": "conv", "ConvTranspose": "conv",
    "MatMul": "matmul", "Gemm": "matmul",
    "BatchNormalization": "norm", "LayerNormalization": "norm", "InstanceNormalization": "norm",
    "MaxPool": "pool", "AveragePool": "pool", "GlobalAveragePool": "pool", "GlobalMaxPool": "pool",
    "Softmax": "reduce", "LogSoftmax": "reduce", "ReduceMean": "reduce", "ReduceSum": "reduce",
    "ReduceMax": "reduce", "ReduceMin": "reduce", "ReduceProd": "reduce", "ArgMax": "reduce",
    "Gather": "gather", "GatherElements": "gather", "Transpose": "movement", "Concat": "movement",
    "Slice": "movement", "Split": "movement", "Expand": "movement", "Tile": "movement", "Pad": "movement",
    "Resize": "movement", "ScatterElements": "movement",
}
SHAPE_TERMS = ("conv_weights", "conv_padding", "im2col", "gemm_calls")
GEMM_PANEL = 16  # MLAS packs the pixel dimension of a convolution's GEMM in panels of 16
# Ops that only relabel a buffer: they cost a node's overhead and nothing per element.
_VIEWS = {"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Shape", "Constant", "Size"}


@dataclass(frozen=True)
class Features:
    """One stage's cost drivers; FLOPs and bytes are per sample, the rest per call."""

    nodes: int = 0
    tensors: int = 0  # parameters and running statistics: each is fed, and a parameter's gradient returned
    param_bytes: int = 0
    conv: float = 0.0  # dense convolution FLOPs
    dwconv: float = 0.0  # grouped / depthwise convolution FLOPs
    matmul: float = 0.0
    elementwise: float = 0.0
    norm: float = 0.0
    pool: float = 0.0
    reduce: float = 0.0  # softmax and reductions
    gather: float = 0.0  # elements gathered (embeddings; their gradient is a scatter-add)
    movement: float = 0.0  # elements transposed, concatenated, sliced, padded
    conv_weights: float = 0.0  # convolution weight elements: packed again for every image
    conv_padding: float = 0.0  # FLOPs wasted on output pixels padded to a multiple of 16
    im2col: float = 0.0  # elements of the unfolded convolution inputs
    gemm_calls: float = 0.0  # matrix products per sample (conv groups, batched MatMul batches)
    activation_bytes: int = 0  # every node's activation inputs + outputs
    grad_in_bytes: int = 0  # stage inputs whose gradient the backward returns
    out_bytes: int = 0  # stage outputs (the VJP loss, or the real loss on the last stage)

    @property
    def flops(self) -> float:
        return sum(getattr(self, c) for c in CATEGORIES)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Features:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PredictorError(f"features have unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**data)


_ADDITIVE = tuple(f.name for f in fields(Features) if f.name not in ("grad_in_bytes", "out_bytes"))


def join_features(parts: list[Features]) -> Features:
    """The features of adjacent blocks run as one stage: sums, with the outer boundary only."""
    if not parts:
        raise PredictorError("join_features needs at least one block's features (got none)")
    sums = {name: sum(getattr(p, name) for p in parts) for name in _ADDITIVE}
    return Features(**sums, grad_in_bytes=parts[0].grad_in_bytes, out_bytes=parts[-1].out_bytes)


def block_features(analysis: ModelAnalysis) -> list[Features]:
    """Every block's features, each block featurised as a one-block stage."""
    return [stage_features(analysis, index, index + 1) for index in range(len(analysis.blocks))]


def stage_features(analysis: ModelAnalysis, first: int, end: int) -> Features:
    """The features of the stage made of blocks ``[first, end)``."""
    count = len(analysis.blocks)
    if not 0 <= first < end <= count:
        raise PredictorError(f"block range [{first}, {end}) is empty or outside 0..{count}")
    parts = [_block_body(analysis, index) for index in range(first, end)]
    sums = {name: sum(getattr(p, name) for p in parts) for name in _ADDITIVE}
    inputs = () if first == 0 else analysis.cut_before(first).tensors
    outputs = (analysis.output,) if end == count else analysis.cut_before(end).tensors
    return Features(
        **sums,
        grad_in_bytes=sum(t.bytes_per_sample for t in inputs if t.differentiable),
        out_bytes=sum(t.bytes_per_sample for t in outputs),
    )


def _block_body(analysis: ModelAnalysis, index: int) -> Features:
    """A block's nodes, FLOPs by category and bytes moved, without its boundary."""
    from edgert.exporter.flops import node_flops

    block = analysis.blocks[index]
    graph = analysis.trainable.graph
    members = set(block.nodes)
    initializers = {i.name for i in graph.initializer}
    state = set(analysis.trainable.parameters) | set(analysis.trainable.buffers)
    known = analysis.tensors

    def shape_of(name: str) -> tuple[int, ...] | None:
        tensor = known.get(name)
        return tensor.shape_for(1) if tensor is not None else None

    def bytes_of(name: str) -> int:
        tensor = known.get(name)
        return tensor.bytes_per_sample if tensor is not None and name not in initializers else 0

    totals = dict.fromkeys((*CATEGORIES, *SHAPE_TERMS), 0.0)
    moved = 0
    fed: set[str] = set()
    for node in graph.node:
        if node.name not in members:
            continue
        fed.update(name for name in node.input if name in state)
        category = _category(node)
        if category is not None:
            totals[category] += node_flops(node, shape_of)
        for name, value in _shape_terms(node, shape_of).items():
            totals[name] += value
        moved += sum(bytes_of(n) for n in (*node.input, *node.output) if n)
    return Features(nodes=len(block.nodes), tensors=len(fed), param_bytes=block.param_bytes, activation_bytes=moved,
                    **totals)



def _shape_terms(node: onnx.NodeProto, shape_of: ShapeOf) -> dict[str, float]:
    """Per-sample costs that FLOPs miss: small matrix products and their packing."""
    if node.op_type == "Conv":
        weight, out = shape_of(node.input[1]), shape_of(node.output[0])
        if weight is None or out is None or len(weight) < 3:
            return {}
        groups = _group(node)
        pixels = int(np.prod(out[2:]))
        unfolded = int(np.prod(weight[1:])) * groups * pixels if int(np.prod(weight[2:])) > 1 else 0
        padding = 2 * int(np.prod(weight)) * (-pixels % GEMM_PANEL)
        return {"conv_weights": float(np.prod(weight)), "conv_padding": float(padding), "im2col": float(unfolded),
                "gemm_calls": float(groups)}
    if node.op_type == "MatMul":
        b = shape_of(node.input[1])
        if b is None or len(b) < 3:
            return {}  # a 2-D weight: one product over the whole micro-batch
        return {"gemm_calls": float(np.prod(b[1:-2]) if len(b) > 3 else 1)}
    return {}


def _category(node: onnx.NodeProto) -> str | None:
    if node.op_type in _VIEWS:
        return None
    if node.op_type == "Conv" and _group(node) > 1:
        return "dwconv"
    return _CATEGORY_OF.get(node.op_type, "elementwise")


def _group(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "group"), 1)


def feature_matrix(features: list[Features], micro_batches: list[int] | np.ndarray) -> np.ndarray:
    """Design rows of the linear cost model: per-call terms, then per-sample terms x micro-batch."""
    return np.array([design_row(f, int(m)) for f, m in zip(features, micro_batches)], dtype=float)


COLUMNS = ("call", "nodes", "tensors", "param_bytes", *CATEGORIES, *SHAPE_TERMS, "activation_bytes", "boundary_bytes")
# Units of the columns, so every coefficient is a few ms per unit: MFLOP and MB.
_MEGA = 1e6


def design_row(f: Features, micro_batch: int) -> np.ndarray:
    """One stage's design row for one micro-batch, in the order of :data:`COLUMNS`."""
    if micro_batch < 1:
        raise PredictorError(f"micro-batch must be >= 1 (got {micro_batch})")
    per_sample = [getattr(f, c) for c in (*CATEGORIES, *SHAPE_TERMS)]
    per_sample += [f.activation_bytes, f.grad_in_bytes + f.out_bytes]
    return np.array([1.0, f.nodes, f.tensors, f.param_bytes / _MEGA, *(micro_batch * v / _MEGA for v in per_sample)])
