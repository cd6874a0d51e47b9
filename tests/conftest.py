"""Shared fixtures: small hand-built ONNX models with known structure, and plan folders."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


def make_skip_model(seed: int = 0, opset: int = 17, ir_version: int = 8):
    """input[N,4] -> /a/Gemm -> /b/Relu -> /c/Gemm + skip(a) -> /d/Gemm -> logits[N,3].

    Blocks a, b, c, d; the cuts before b and before c are crossed by the skip tensor too.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)

    def weight(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.5).astype(np.float32), name)

    nodes = [
        helper.make_node("Gemm", ["input", "a.weight", "a.bias"], ["a_out"], name="/a/Gemm"),
        helper.make_node("Relu", ["a_out"], ["b_out"], name="/b/Relu"),
        helper.make_node("Gemm", ["b_out", "c.weight", "c.bias"], ["c_lin"], name="/c/Gemm"),
        helper.make_node("Add", ["c_lin", "a_out"], ["c_out"], name="/c/Add"),
        helper.make_node("Gemm", ["c_out", "d.weight", "d.bias"], ["logits"], name="/d/Gemm"),
    ]
    initializers = [weight("a.weight", 4, 6), weight("a.bias", 6), weight("c.weight", 6, 6), weight("c.bias", 6),
                    weight("d.weight", 6, 3), weight("d.bias", 3)]
    graph = helper.make_graph(nodes, "skip", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 3])], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir_version)
    onnx.checker.check_model(model)
    return model


@pytest.fixture
def skip_model_path(tmp_path):
    import onnx

    path = tmp_path / "skip.onnx"
    onnx.save(make_skip_model(), str(path))
    return path
