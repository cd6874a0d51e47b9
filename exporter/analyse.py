"""Graph analysis: topological order, blocks, per-block cost, and what crosses each cut.

A *block* is a maximal run of nodes (in topological order) sharing a name scope, e.g.
``/res2/conv_a/Conv`` and ``/res2/add/Add`` are both in block ``res2`` at depth 1. Cuts may
fall only between blocks. A cut's crossing set holds every tensor produced before it and
consumed after it; a skip connection spanning a cut makes it hold several tensors.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

from edgert.exporter.errors import ModelLoadError
from edgert.exporter.flops import node_flops
from edgert.exporter.normalise import TrainableGraph, split_constant_nodes
from edgert.manifest import BATCH, BoundaryTensor

MIN_AUTO_BLOCKS = 8
MAX_BLOCK_DEPTH = 4


@dataclass(frozen=True)
class Block:
    """A unit of cutting: contiguous nodes, their cost, and the parameters they own."""

    index: int
    name: str
    nodes: tuple[str, ...]
    flops: int
    params: tuple[str, ...]
    param_bytes: int
    output_bytes: int
    op_types: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Cut:
    """The boundary before block ``index``: the tensors that cross it, per sample."""

    index: int
    before_block: str
    after_node: str
    tensors: tuple[BoundaryTensor, ...]
    shared_params: tuple[str, ...] = ()
    # crossing tensors computed from constants alone: no stage's backward can produce them as outputs
    constant_tensors: tuple[str, ...] = ()

    @property
    def bytes_per_sample(self) -> int:
        return sum(t.bytes_per_sample for t in self.tensors)

    @property
    def legal(self) -> bool:
        return not self.shared_params and not self.constant_tensors

    @property
    def why_illegal(self) -> str:
        """What an illegal cut would do, for error messages ('' when legal)."""
        if self.shared_params:
            return f"would split parameter(s) {', '.join(self.shared_params)} between two stages"
        if self.constant_tensors:
            return (f"would carry {', '.join(self.constant_tensors[:3])}, computed from constants alone, "
                    "between two stages")
        return ""


@dataclass
class ModelAnalysis:
    """Everything the planner and slicer need to know about a normalised model."""

    trainable: TrainableGraph
    blocks: list[Block]
    cuts: list[Cut]
    node_block: dict[str, int]
    inputs: tuple[BoundaryTensor, ...]
    output: BoundaryTensor
    tensors: dict[str, BoundaryTensor]
    block_depth: int

    @property
    def total_flops(self) -> int:
        return sum(b.flops for b in self.blocks)

    @property
    def param_count(self) -> int:
        sizes = {i.name: int(np.prod(i.dims)) for i in self.trainable.graph.initializer}
        return sum(sizes[p] for p in self.trainable.parameters)

    @property
    def param_bytes(self) -> int:
        return sum(b.param_bytes for b in self.blocks)

    def cut_before(self, block_index: int) -> Cut:
        return self.cuts[block_index - 1]


def analyse(trainable: TrainableGraph, output: str | None = None, block_depth: int | None = None) -> ModelAnalysis:
    """Analyse a normalised model; ``output`` names the prediction (default: first output)."""
    graph = trainable.graph
    _topological_sort(graph)
    shapes = _ShapeTable(trainable.model)
    inputs = tuple(shapes.boundary(i.name) for i in _data_inputs(graph))
    prediction = _prediction_output(graph, output)
    depth = _choose_block_depth(trainable.model, block_depth)
    node_block, names = _assign_blocks(graph, depth)
    crossing = _crossing_tensors(graph, node_block, len(names), prediction)
    shapes.resolve([name for names_ in crossing for name in names_] + [prediction])
    blocks = _describe_blocks(trainable, node_block, names, shapes)
    cuts = _describe_cuts(graph, blocks, crossing, shapes, _constant_tensors(trainable))
    return ModelAnalysis(
        trainable=trainable,
        blocks=blocks,
        cuts=cuts,
        node_block=node_block,
        inputs=inputs,
        output=shapes.boundary(prediction),
        tensors=shapes.known,
        block_depth=depth,
    )


def _topological_sort(graph: onnx.GraphProto) -> None:
    """Order nodes topologically, keeping the file's order wherever it is already valid."""
    available = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    producer = {out: index for index, node in enumerate(graph.node) for out in node.output}
    waiting: dict[int, int] = {}
    consumers = defaultdict(list)
    for index, node in enumerate(graph.node):
        pending = {producer[name] for name in node.input if name not in available and name in producer}
        waiting[index] = len(pending)
        for source in pending:
            consumers[source].append(index)
    ready = [index for index, count in waiting.items() if count == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        index = heapq.heappop(ready)
        order.append(index)
        for consumer in consumers[index]:
            waiting[consumer] -= 1
            if waiting[consumer] == 0:
                heapq.heappush(ready, consumer)
    if len(order) != len(graph.node):
        stuck = [graph.node[i].name for i in range(len(graph.node)) if i not in set(order)][:3]
        raise ModelLoadError(f"the graph has a cycle or an undefined input near nodes {stuck}")
    nodes = [graph.node[i] for i in order]
    del graph.node[:]
    graph.node.extend(nodes)


def _data_inputs(graph: onnx.GraphProto) -> list[onnx.ValueInfoProto]:
    initializers = {i.name for i in graph.initializer}
    return [i for i in graph.input if i.name not in initializers]


def _prediction_output(graph: onnx.GraphProto, output: str | None) -> str:
    names = [o.name for o in graph.output]
    if output is None:
        return names[0]
    if output not in names:
        raise ModelLoadError(f"--output {output!r} is not a graph output; outputs are: {', '.join(names)}")
    return output


def _scope(node_name: str) -> list[str]:
    parts = [p for p in node_name.split("/") if p]
    return parts[:-1]


def _choose_block_depth(model: onnx.ModelProto, requested: int | None) -> int:
    if requested is not None:
        if requested < 1:
            raise ModelLoadError(f"--block-depth must be >= 1 (got {requested})")
        return requested
    metadata = {p.key: p.value for p in model.metadata_props}
    if "edgert.block_depth" in metadata:
        return int(metadata["edgert.block_depth"])
    if "edgert.model" in metadata:
        return 1
    best_depth, best_count = 1, len(_assign_blocks(model.graph, 1)[1])
    for depth in range(2, MAX_BLOCK_DEPTH + 1):
        if best_count >= MIN_AUTO_BLOCKS:
            break
        count = len(_assign_blocks(model.graph, depth)[1])
        if count <= best_count:
            break
        best_depth, best_count = depth, count
    return best_depth


def _assign_blocks(graph: onnx.GraphProto, depth: int) -> tuple[dict[str, int], list[str]]:
    """Group nodes into contiguous runs by scope prefix; unscoped nodes join their neighbour."""
    keys = ["/".join(_scope(node.name)[:depth]) for node in graph.node]
    first_scoped = next((k for k in keys if k), "model")
    names: list[str] = []
    node_block: dict[str, int] = {}
    current = None
    seen: defaultdict[str, int] = defaultdict(int)
    for node, key in zip(graph.node, keys):
        key = key or current or first_scoped
        if key != current:
            seen[key] += 1
            names.append(key if seen[key] == 1 else f"{key}#{seen[key]}")
            current = key
        node_block[node.name] = len(names) - 1
    return node_block, names


def _crossing_tensors(
    graph: onnx.GraphProto, node_block: dict[str, int], block_count: int, prediction: str
) -> list[list[str]]:
    """For each cut c (before block c, 1 <= c < block_count), the tensors crossing it, in order."""
    initializers = {i.name for i in graph.initializer}
    produced_in: dict[str, int] = {i.name: -1 for i in _data_inputs(graph)}
    last_use: dict[str, int] = {}
    order: dict[str, int] = {name: k for k, name in enumerate(produced_in)}
    for node in graph.node:
        block = node_block[node.name]
        for name in node.input:
            if name and name not in initializers:
                last_use[name] = max(last_use.get(name, block), block)
        for name in node.output:
            if name:
                produced_in[name] = block
                order.setdefault(name, len(order))
    last_use[prediction] = block_count
    crossing: list[list[str]] = [[] for _ in range(block_count + 1)]
    for name in sorted(last_use, key=lambda n: order.get(n, -1)):
        start = produced_in.get(name)
        if start is None:
            raise ModelLoadError(f"tensor {name!r} is used but never produced")
        for cut in range(start + 1, min(last_use[name], block_count - 1) + 1):
            crossing[cut].append(name)
    return crossing[1:block_count]


def _describe_blocks(
    trainable: TrainableGraph, node_block: dict[str, int], names: list[str], shapes: _ShapeTable
) -> list[Block]:
    graph = trainable.graph
    parameters = set(trainable.parameters)
    sizes = {i.name: int(np.prod(i.dims)) * helper.tensor_dtype_to_np_dtype(i.data_type).itemsize
             for i in graph.initializer}
    members: list[list[onnx.NodeProto]] = [[] for _ in names]
    for node in graph.node:
        members[node_block[node.name]].append(node)
    blocks = []
    for index, (name, nodes) in enumerate(zip(names, members)):
        params = list(dict.fromkeys(p for n in nodes for p in n.input if p in parameters))
        op_types: dict[str, int] = defaultdict(int)
        for node in nodes:
            op_types[node.op_type] += 1
        blocks.append(Block(
            index=index,
            name=name,
            nodes=tuple(n.name for n in nodes),
            flops=sum(node_flops(n, shapes.per_sample) for n in nodes),
            params=tuple(params),
            param_bytes=sum(sizes[p] for p in params),
            output_bytes=sum(shapes.bytes_per_sample(o) for n in nodes for o in n.output if o),
            op_types=dict(op_types),
        ))
    return blocks


def _constant_tensors(trainable: TrainableGraph) -> set[str]:
    """Node outputs that depend on no model input, parameter or running statistic."""
    constant, _ = split_constant_nodes(trainable.graph, set(trainable.parameters) | set(trainable.buffers))
    return {name for node in constant for name in node.output if name}


def _describe_cuts(
    graph: onnx.GraphProto, blocks: list[Block], crossing: list[list[str]], shapes: _ShapeTable,
    constant: set[str],
) -> list[Cut]:
    users: dict[str, set[int]] = defaultdict(set)
    for block in blocks:
        for param in block.params:
            users[param].add(block.index)
    cuts = []
    for index in range(1, len(blocks)):
        shared = tuple(p for p, b in users.items() if min(b) < index <= max(b))
        cuts.append(Cut(
            index=index,
            before_block=blocks[index].name,
            after_node=blocks[index - 1].nodes[-1],
            tensors=tuple(shapes.boundary(name) for name in crossing[index - 1]),
            shared_params=shared,
            constant_tensors=tuple(name for name in crossing[index - 1] if name in constant),
        ))
    return cuts


class _ShapeTable:
    """Element types and shapes of every tensor, with ``"N"`` for the batch dimension.

    Shapes come from ONNX shape inference; tensors it could not resolve are measured by
    running the model once at two batch sizes (``resolve``).
    """

    def __init__(self, model: onnx.ModelProto):
        self._model = model
        self.known: dict[str, BoundaryTensor] = {}
        self._elem: dict[str, int] = {}
        graph = model.graph
        self.batch_symbol = self._batch_symbol(graph)
        for info in list(graph.input) + list(graph.value_info) + list(graph.output):
            self._add(info)
        for init in graph.initializer:
            self.known[init.name] = BoundaryTensor(init.name, _dtype_name(init.data_type), tuple(init.dims))

    @staticmethod
    def _batch_symbol(graph: onnx.GraphProto) -> str:
        first = _data_inputs(graph)[0]
        dims = first.type.tensor_type.shape.dim
        if not dims:
            raise ModelLoadError(f"input {first.name!r} has no shape; edgert needs a batch dimension")
        if dims[0].HasField("dim_value"):
            raise ModelLoadError(
                f"input {first.name!r} has a fixed batch size {dims[0].dim_value}; export the model with a "
                f"dynamic batch dimension (torch: dynamic_axes={{{first.name!r}: {{0: 'N'}}}})"
            )
        return dims[0].dim_param

    def _add(self, info: onnx.ValueInfoProto) -> None:
        tensor_type = info.type.tensor_type
        if not tensor_type.elem_type:
            return
        self._elem[info.name] = tensor_type.elem_type
        if not tensor_type.HasField("shape"):
            return
        dims: list[int | str] = []
        for dim in tensor_type.shape.dim:
            if dim.HasField("dim_value"):
                dims.append(dim.dim_value)
            elif dim.dim_param == self.batch_symbol:
                dims.append(BATCH)
            else:
                return
        self.known[info.name] = BoundaryTensor(info.name, _dtype_name(tensor_type.elem_type), tuple(dims))

    def resolve(self, names: list[str]) -> None:
        missing = [n for n in dict.fromkeys(names) if n not in self.known]
        if missing:
            self._measure(missing)

    def _measure(self, names: list[str]) -> None:
        import onnxruntime

        model = onnx.ModelProto()
        model.CopyFrom(self._model)
        del model.graph.output[:]
        model.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names)
        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3
        try:
            session = onnxruntime.InferenceSession(
                model.SerializeToString(), options, providers=["CPUExecutionProvider"]
            )
            runs = [session.run(names, self._probe_feeds(batch)) for batch in (2, 3)]
        except Exception as error:  # noqa: BLE001 - ORT raises many types; report them as one
            raise ModelLoadError(f"could not determine the shapes of {names[:3]}: {error}") from None
        for name, small, large in zip(names, runs[0], runs[1]):
            dims = tuple(BATCH if (a, b) == (2, 3) else a for a, b in zip(small.shape, large.shape))
            self.known[name] = BoundaryTensor(name, str(small.dtype), dims)

    def _probe_feeds(self, batch: int) -> dict[str, np.ndarray]:
        feeds = {}
        for info in _data_inputs(self._model.graph):
            tensor = self.known[info.name]
            feeds[info.name] = np.zeros(tensor.shape_for(batch), dtype=tensor.dtype)
        return feeds

    def boundary(self, name: str) -> BoundaryTensor:
        if name not in self.known:
            raise ModelLoadError(f"the shape of tensor {name!r} could not be inferred")
        return self.known[name]

    def per_sample(self, name: str) -> tuple[int, ...] | None:
        tensor = self.known.get(name)
        if tensor is None:
            return None
        return tensor.shape_for(1)

    def bytes_per_sample(self, name: str) -> int:
        tensor = self.known.get(name)
        return tensor.bytes_per_sample if tensor is not None else 0


def _dtype_name(elem_type: int) -> str:
    return str(np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)))
