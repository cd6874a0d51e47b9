"""GraphBuilder: block-path names, unique tensors, contiguous blocks, seeded initializers."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from edgert.models.graph import GraphBuilder


def _tiny(seed: int) -> onnx.ModelProto:
    b = GraphBuilder("tiny", seed)
    x = b.input("input", "float32", ["N", 4])
    with b.block("fc"):
        weight = b.normal("linear", "weight", (4, 4), std=0.5)
        x = b.op("MatMul", [x, weight], "linear")
        x = b.op("Relu", [x])
        x = b.op("Relu", [x], output="logits")
    return b.model(x, "float32", ["N", 4], {"edgert.model": "tiny"})


def test_names_follow_block_paths_and_repeats_get_a_suffix() -> None:
    model = _tiny(0)
    assert [node.name for node in model.graph.node] == [
        "/fc/linear/MatMul",
        "/fc/Relu",
        "/fc/Relu_1",
    ]
    assert model.graph.node[0].output == ["/fc/linear/MatMul_output_0"]
    assert [init.name for init in model.graph.initializer] == ["fc.linear.weight"]
    onnx.checker.check_model(model, full_check=True)


def test_initializers_are_seeded_by_seed_and_name() -> None:
    assert _tiny(5).SerializeToString() == _tiny(5).SerializeToString()
    assert _tiny(5).SerializeToString() != _tiny(6).SerializeToString()


def test_frozen_initializers_are_listed_in_metadata() -> None:
    b = GraphBuilder("m", 0)
    x = b.input("input", "float32", ["N", 2])
    with b.block("act"):
        low = b.constant("clip", "clip_min", np.array(0.0, np.float32))
        high = b.constant("clip", "clip_max", np.array(6.0, np.float32))
        y = b.op("Clip", [x, low, high], "clip")
    props = {p.key: p.value for p in b.model(y, "float32", ["N", 2], {}).metadata_props}
    assert props["edgert.frozen"] == "act.clip.clip_min,act.clip.clip_max"
    assert props["edgert.blocks"] == "act"


def test_nodes_outside_a_block_are_refused() -> None:
    b = GraphBuilder("m", 0)
    x = b.input("input", "float32", ["N", 2])
    with pytest.raises(ValueError, match="inside a block"):
        b.op("Relu", [x])


def test_a_block_cannot_reopen_or_nest() -> None:
    b = GraphBuilder("m", 0)
    with b.block("a"), pytest.raises(ValueError, match="inside block 'a'"), b.block("b"):
        pass
    with pytest.raises(ValueError, match="contiguous"), b.block("a"):
        pass
    with pytest.raises(ValueError, match="'x.y'"), b.block("x.y"):
        pass


def test_duplicate_tensor_names_and_unknown_outputs_are_refused() -> None:
    b = GraphBuilder("m", 0)
    x = b.input("input", "float32", ["N", 2])
    with b.block("a"):
        b.param("p", "weight", np.zeros(2, np.float32))
        with pytest.raises(ValueError, match="a.p.weight"):
            b.param("p", "weight", np.ones(2, np.float32))
        b.op("Relu", [x], output="y")
        with pytest.raises(ValueError, match="'y'"):
            b.op("Relu", [x], output="y")
    with pytest.raises(ValueError, match="'nope'"):
        b.model("nope", "float32", ["N", 2], {})
