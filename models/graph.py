"""GraphBuilder: emits ONNX nodes and seeded initializers under the zoo's naming convention.

Nodes are named ``/<block>/<sub>/<OpType>`` (or ``/<block>/<OpType>``), where the first
path component is the *block*: the unit between which the exporter may cut. Their
outputs are named ``<node name>_output_0``. Initializers are named
``<block>.<sub>.<kind>`` (``res2a.conv.weight``). Each block is one contiguous run of
nodes, and every name is unique, by construction.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import numpy as np
import onnx
from onnx import helper, numpy_helper

OPSET = 17
IR_VERSION = 8
PRODUCER = "edgert.models"


class GraphBuilder:
    """Collects the nodes, initializers and block order of one model, then makes the ModelProto."""

    def __init__(self, model_name: str, seed: int) -> None:
        self.model_name = model_name
        self.seed = seed
        self.blocks: list[str] = []
        self._block: str | None = None
        self._nodes: list[onnx.NodeProto] = []
        self._node_names: set[str] = set()
        self._initializers: list[onnx.TensorProto] = []
        self._frozen: list[str] = []
        self._tensor_names: set[str] = set()
        self._inputs: list[onnx.ValueInfoProto] = []

    @contextmanager
    def block(self, name: str) -> Iterator[None]:
        """Emit the nodes and initializers of the ``with`` body into block ``name``."""
        if self._block is not None:
            raise ValueError(f"block {name!r} opened inside block {self._block!r}")
        if not name or "/" in name or "." in name:
            raise ValueError(f"block name must be non-empty without '/' or '.': {name!r}")
        if name in self.blocks:
            raise ValueError(f"block {name!r} already emitted; blocks must be contiguous")
        self.blocks.append(name)
        self._block = name
        try:
            yield
        finally:
            self._block = None

    def input(self, name: str, dtype: str, shape: Sequence[int | str]) -> str:
        """Declare a graph input of numpy dtype ``dtype``; strings in ``shape`` are dim_params."""
        self._claim(name)
        self._inputs.append(helper.make_tensor_value_info(name, _elem_type(dtype), list(shape)))
        return name

    def op(
        self,
        op_type: str,
        inputs: Sequence[str],
        sub: str | None = None,
        *,
        output: str | None = None,
        **attributes: object,
    ) -> str:
        """Emit one single-output node into the current block and return its output's name."""
        node_name = self._unique_node_name(op_type, sub)
        output_name = output or f"{node_name}_output_0"
        self._claim(output_name)
        self._nodes.append(
            helper.make_node(op_type, list(inputs), [output_name], name=node_name, **attributes)
        )
        return output_name

    def param(self, sub: str, kind: str, values: np.ndarray) -> str:
        """Add a trainable initializer ``<block>.<sub>.<kind>`` holding ``values``."""
        return self._initializer(sub, kind, values)

    def constant(self, sub: str, kind: str, values: np.ndarray) -> str:
        """Add a frozen initializer (never trained): shapes, Clip bounds, BN running stats."""
        name = self._initializer(sub, kind, values)
        self._frozen.append(name)
        return name

    def normal(self, sub: str, kind: str, shape: Sequence[int], std: float) -> str:
        """A trainable float32 initializer drawn from N(0, std^2), seeded by model seed and name."""
        values = self._rng(sub, kind).normal(0.0, std, size=tuple(shape))
        return self.param(sub, kind, values.astype(np.float32))

    def uniform(self, sub: str, kind: str, shape: Sequence[int], limit: float) -> str:
        """A trainable float32 initializer drawn from U(-limit, limit), seeded by seed and name."""
        values = self._rng(sub, kind).uniform(-limit, limit, size=tuple(shape))
        return self.param(sub, kind, values.astype(np.float32))

    def model(
        self, output: str, dtype: str, shape: Sequence[int | str], metadata: Mapping[str, str]
    ) -> onnx.ModelProto:
        """The finished model: opset 17, IR 8, ``output`` as the only graph output."""
        if output not in self._tensor_names:
            raise ValueError(f"graph output {output!r} is not produced by any node")
        graph = helper.make_graph(
            self._nodes,
            self.model_name,
            self._inputs,
            [helper.make_tensor_value_info(output, _elem_type(dtype), list(shape))],
            initializer=self._initializers,
        )
        model = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name=PRODUCER
        )
        model.ir_version = IR_VERSION
        props = {
            **metadata,
            "edgert.blocks": ",".join(self.blocks),
            "edgert.frozen": ",".join(self._frozen),
        }
        helper.set_model_props(model, props)
        return model

    def _initializer(self, sub: str, kind: str, values: np.ndarray) -> str:
        name = f"{self._current_block()}.{sub}.{kind}"
        self._claim(name)
        self._initializers.append(numpy_helper.from_array(np.asarray(values), name))
        return name

    def _rng(self, sub: str, kind: str) -> np.random.Generator:
        # One stream per initializer: a weight does not change when another layer is added.
        name = f"{self._current_block()}.{sub}.{kind}"
        return np.random.default_rng([self.seed, zlib.crc32(name.encode())])

    def _unique_node_name(self, op_type: str, sub: str | None) -> str:
        prefix = f"/{self._current_block()}/" + (f"{sub}/" if sub else "")
        name, count = f"{prefix}{op_type}", 0
        while name in self._node_names:
            count += 1
            name = f"{prefix}{op_type}_{count}"
        self._node_names.add(name)
        return name

    def _current_block(self) -> str:
        if self._block is None:
            raise ValueError("nodes and initializers must be emitted inside a block")
        return self._block

    def _claim(self, tensor: str) -> None:
        if tensor in self._tensor_names:
            raise ValueError(f"tensor name {tensor!r} is already used in {self.model_name}")
        self._tensor_names.add(tensor)


def _elem_type(dtype: str) -> int:
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
