"""Cutting one stage out of an analysed model as a self-contained forward sub-graph.

A stage owns a contiguous range of blocks. Its inputs are exactly the tensors crossing the
cut before it, its outputs exactly those crossing the cut after it (or the prediction, for
the last stage). A tensor that crosses both cuts is passed straight through. Constants are
copied into every stage that uses them; a trainable parameter used on both sides of a cut
is an error, never silently duplicated.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from edgert.exporter.analyse import ModelAnalysis
from edgert.exporter.errors import SliceError
from edgert.manifest import BATCH, BoundaryTensor


@dataclass
class StageGraph:
    """A stage's forward graph and what it exchanges with its neighbours."""

    index: int
    first_block: int
    end_block: int
    model: onnx.ModelProto
    inputs: tuple[BoundaryTensor, ...]
    outputs: tuple[BoundaryTensor, ...]
    parameters: tuple[str, ...]
    buffers: tuple[str, ...]
    buffer_updates: dict[str, str]
    is_first: bool
    is_last: bool


def stage_ranges(cut_blocks: list[int], block_count: int) -> list[tuple[int, int]]:
    """Block ranges ``[first, end)`` of the stages made by cutting before each of ``cut_blocks``."""
    bounds = [0, *cut_blocks, block_count]
    return list(zip(bounds[:-1], bounds[1:]))


def slice_stage(analysis: ModelAnalysis, index: int, first: int, end: int) -> StageGraph:
    """Cut blocks ``[first, end)`` out of the analysed model as stage ``index``."""
    block_count = len(analysis.blocks)
    if not 0 <= first < end <= block_count:
        raise SliceError(f"stage {index}: block range [{first}, {end}) is empty or outside 0..{block_count}")
    graph = analysis.trainable.graph
    members = {name for block in analysis.blocks[first:end] for name in block.nodes}
    nodes = [node for node in graph.node if node.name in members]
    inputs = analysis.inputs if first == 0 else analysis.cut_before(first).tensors
    outputs = (analysis.output,) if end == block_count else analysis.cut_before(end).tensors
    _check_shared_parameters(analysis, index, first, end)
    initializers = _initializers_used(graph, nodes)
    trainable = analysis.trainable
    parameters = tuple(p for p in trainable.parameters if p in initializers)
    buffers = tuple(b for b in trainable.buffers if b in initializers)
    produced = {o for node in nodes for o in node.output}
    updates = {out: stat for out, stat in trainable.buffer_updates.items() if out in produced}
    model = _make_model(analysis, f"stage{index}", nodes, inputs, outputs, initializers)
    return StageGraph(
        index=index,
        first_block=first,
        end_block=end,
        model=model,
        inputs=tuple(inputs),
        outputs=tuple(outputs),
        parameters=parameters,
        buffers=buffers,
        buffer_updates=updates,
        is_first=first == 0,
        is_last=end == block_count,
    )


def _check_shared_parameters(analysis: ModelAnalysis, index: int, first: int, end: int) -> None:
    for cut_index in (first, end):
        if 0 < cut_index < len(analysis.blocks):
            cut = analysis.cut_before(cut_index)
            if cut.shared_params:
                raise SliceError(
                    f"stage {index}: the cut before block {cut.before_block!r} splits parameter(s) "
                    f"{', '.join(cut.shared_params)} used on both sides; choose a cut outside their users"
                )


def _initializers_used(graph: onnx.GraphProto, nodes: list[onnx.NodeProto]) -> dict[str, onnx.TensorProto]:
    by_name = {init.name: init for init in graph.initializer}
    used = {}
    for node in nodes:
        for name in node.input:
            if name in by_name:
                used[name] = by_name[name]
    return used


def _make_model(
    analysis: ModelAnalysis,
    name: str,
    nodes: list[onnx.NodeProto],
    inputs: tuple[BoundaryTensor, ...],
    outputs: tuple[BoundaryTensor, ...],
    initializers: dict[str, onnx.TensorProto],
) -> onnx.ModelProto:
    source = analysis.trainable.model
    tensor_names = {n for node in nodes for n in (*node.input, *node.output)}
    boundary = {t.name for t in (*inputs, *outputs)}
    value_info = [v for v in source.graph.value_info if v.name in tensor_names and v.name not in boundary]
    graph = helper.make_graph(
        nodes=list(nodes),
        name=name,
        inputs=[value_info_of(t) for t in inputs],
        outputs=[value_info_of(t) for t in outputs],
        initializer=list(initializers.values()),
        value_info=value_info,
    )
    model = helper.make_model(graph, opset_imports=list(source.opset_import), ir_version=source.ir_version)
    model.producer_name = "edgert"
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as error:
        first_line = str(error).strip().splitlines()[0]
        raise SliceError(f"{name}: the sliced graph is invalid: {first_line}") from None
    return model


def value_info_of(tensor: BoundaryTensor) -> onnx.ValueInfoProto:
    """An ONNX value-info for a boundary tensor, batch dimension symbolic."""
    elem_type = helper.np_dtype_to_tensor_dtype(np.dtype(tensor.dtype))
    dims = [BATCH if d == BATCH else int(d) for d in tensor.shape]
    return helper.make_tensor_value_info(tensor.name, elem_type, dims)
