"""What an ONNX file would make the runtime execute, read straight from its protobuf bytes.

A board has no ``onnx`` package, yet must refuse a graph handed to it over the network
that uses an operator domain outside the runtime's (a custom-op library) or that points
at external data files (which would read arbitrary files of the board). This walks the
protobuf wire format of ``ModelProto`` (field numbers from onnx.proto3) without decoding
tensor data: the main graph, subgraphs in attributes, training-info graphs and
model-local functions.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from edgert.security.errors import GraphRefused

#: Operator domains a stage may use: ONNX, ONNX-ML, ORT's contrib and training ops.
ALLOWED_DOMAINS = frozenset({
    "", "ai.onnx", "ai.onnx.ml", "ai.onnx.training", "ai.onnx.preview.training",
    "com.microsoft", "com.microsoft.nchwc", "com.microsoft.experimental",
})

_MAX_DEPTH = 32

# field numbers (onnx.proto3)
_MODEL_GRAPH, _MODEL_TRAINING_INFO, _MODEL_FUNCTIONS = 7, 20, 25
_TRAINING_GRAPHS = (1, 2)  # TrainingInfoProto.initialization, .algorithm
_GRAPH_NODE, _GRAPH_INITIALIZER, _GRAPH_SPARSE_INITIALIZER = 1, 5, 15
_NODE_OP_TYPE, _NODE_ATTRIBUTE, _NODE_DOMAIN = 4, 5, 7
_ATTR_TENSOR, _ATTR_GRAPH, _ATTR_TENSORS, _ATTR_GRAPHS, _ATTR_SPARSE, _ATTR_SPARSES = 5, 6, 10, 11, 22, 23
_TENSOR_NAME, _TENSOR_EXTERNAL_DATA, _TENSOR_DATA_LOCATION = 8, 13, 14
_SPARSE_VALUES, _SPARSE_INDICES = 1, 2
_FUNCTION_NODE = 7


@dataclass
class GraphScan:
    """Operator domains (with an example op type each) and external-data tensors found in a model."""

    domains: dict[str, str] = field(default_factory=dict)
    external: list[str] = field(default_factory=list)

    def check(self, what: str, allowed: frozenset[str] = ALLOWED_DOMAINS) -> None:
        """Raise :class:`GraphRefused` naming the first forbidden domain or external tensor."""
        forbidden = sorted(set(self.domains) - allowed)
        if forbidden:
            examples = ", ".join(f"{d!r} (op {self.domains[d]})" for d in forbidden)
            raise GraphRefused(f"{what}: operator domain(s) {examples} are not allowed on this runtime "
                               f"(allowed: {', '.join(repr(d) for d in sorted(allowed))})")
        if self.external:
            raise GraphRefused(f"{what}: tensor(s) {', '.join(self.external[:5])} use external data files, "
                               f"which a stage may not reference")


def scan_model(data: bytes | bytearray | memoryview) -> GraphScan:
    """Scan a serialized ``ModelProto``; malformed bytes raise :class:`GraphRefused`."""
    scan = GraphScan()
    view = memoryview(data).cast("B")
    try:
        for number, value in _fields(view):
            if number == _MODEL_GRAPH:
                _graph(value, scan, 0)
            elif number == _MODEL_TRAINING_INFO:
                for inner, graph in _fields(value):
                    if inner in _TRAINING_GRAPHS:
                        _graph(graph, scan, 0)
            elif number == _MODEL_FUNCTIONS:
                for inner, node in _fields(value):
                    if inner == _FUNCTION_NODE:
                        _node(node, scan, 0)
    except (IndexError, ValueError) as error:
        raise GraphRefused(f"not a valid ONNX model: {error}") from None
    return scan


def _graph(view: memoryview, scan: GraphScan, depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise ValueError(f"subgraphs nested deeper than {_MAX_DEPTH}")
    for number, value in _fields(view):
        if number == _GRAPH_NODE:
            _node(value, scan, depth)
        elif number == _GRAPH_INITIALIZER:
            _tensor(value, scan)
        elif number == _GRAPH_SPARSE_INITIALIZER:
            _sparse(value, scan)


def _node(view: memoryview, scan: GraphScan, depth: int) -> None:
    domain, op_type = "", "?"
    for number, value in _fields(view):
        if number == _NODE_DOMAIN:
            domain = bytes(value).decode("utf-8", "replace")
        elif number == _NODE_OP_TYPE:
            op_type = bytes(value).decode("utf-8", "replace")
        elif number == _NODE_ATTRIBUTE:
            for inner, item in _fields(value):
                if inner in (_ATTR_GRAPH, _ATTR_GRAPHS):
                    _graph(item, scan, depth + 1)
                elif inner in (_ATTR_TENSOR, _ATTR_TENSORS):
                    _tensor(item, scan)
                elif inner in (_ATTR_SPARSE, _ATTR_SPARSES):
                    _sparse(item, scan)
    scan.domains.setdefault(domain, op_type)


def _tensor(view: memoryview, scan: GraphScan) -> None:
    name, external = "?", False
    for number, value in _fields(view):
        if number == _TENSOR_NAME:
            name = bytes(value).decode("utf-8", "replace")
        elif number == _TENSOR_EXTERNAL_DATA or (number == _TENSOR_DATA_LOCATION and value == 1):
            external = True
    if external:
        scan.external.append(name)


def _sparse(view: memoryview, scan: GraphScan) -> None:
    for number, value in _fields(view):
        if number in (_SPARSE_VALUES, _SPARSE_INDICES):
            _tensor(value, scan)


def _fields(view: memoryview) -> Iterator[tuple[int, memoryview | int]]:
    """(field number, value) of each field: a memoryview for length-delimited, an int otherwise."""
    at, end = 0, len(view)
    while at < end:
        key, at = _varint(view, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _varint(view, at)
            yield number, value
        elif wire == 2:
            length, at = _varint(view, at)
            if at + length > end:
                raise ValueError(f"field {number} runs past the end of its message")
            yield number, view[at:at + length]
            at += length
        elif wire == 1:
            at += 8
        elif wire == 5:
            at += 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire} (field {number})")
        if at > end:
            raise ValueError(f"field {number} runs past the end of its message")


def _varint(view: memoryview, at: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = view[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")
