"""Shapes known only at run time: no gradient rule needs a fixed spatial size, and a channel shuffle's computed
Reshape trains at any batch size.

A CNN's gradient graph built where its image size is unknown (the rules then take their sizes from ``Shape``)
computes, on images of two sizes, what the graph built for each known size computes (other, faster forms); and a
plan of a Reshape whose shape is computed from ``Shape`` (ShuffleNet's channel shuffle) trains like its float64
self at any batch size.
"""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgert.chain import StageChain
from edgert.exporter.export import ExportOptions, export_plan
from edgert.exporter.float64_model import Float64Chain
from edgert.manifest import load_manifest

TOLERANCE = 1e-4  # float32 against float64, relative to each parameter's largest gradient


def _image_net(height, width) -> onnx.ModelProto:
    """input[N, 3, H, W] -> strided Conv -> BatchNorm (training mode) -> Relu -> MaxPool -> AveragePool (pads) ->
    Conv (same) -> Slice of the channels -> GlobalAveragePool -> Flatten -> Gemm -> logits[N, 4]."""
    rng = np.random.default_rng(0)

    def weight(name, *shape, scale=0.5):
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    inits = [weight("c1.weight", 6, 3, 3, 3), weight("c1.bias", 6), weight("bn.scale", 6, scale=1.0),
             weight("bn.bias", 6), numpy_helper.from_array(np.zeros(6, np.float32), "bn.mean"),
             numpy_helper.from_array(np.ones(6, np.float32), "bn.var"), weight("c2.weight", 8, 6, 3, 3),
             numpy_helper.from_array(np.array([1], np.int64), "start"),
             numpy_helper.from_array(np.array([7], np.int64), "end"),
             numpy_helper.from_array(np.array([1], np.int64), "axis"),
             weight("fc.weight", 4, 6), weight("fc.bias", 4)]
    nodes = [
        helper.make_node("Conv", ["input", "c1.weight", "c1.bias"], ["c1"], name="/c1/Conv", strides=[2, 2],
                         pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c1", "bn.scale", "bn.bias", "bn.mean", "bn.var"],
                         ["bn", "bn.mean.moved", "bn.var.moved"], name="/bn/BatchNormalization", training_mode=1),
        helper.make_node("Relu", ["bn"], ["relu"], name="/bn/Relu"),
        helper.make_node("MaxPool", ["relu"], ["pool"], name="/pool/MaxPool", kernel_shape=[2, 2], strides=[1, 1]),
        helper.make_node("AveragePool", ["pool"], ["avg"], name="/avg/AveragePool", kernel_shape=[3, 3],
                         strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["avg", "c2.weight"], ["c2"], name="/c2/Conv", pads=[1, 1, 1, 1]),
        helper.make_node("Slice", ["c2", "start", "end", "axis"], ["sliced"], name="/c2/Slice"),
        helper.make_node("GlobalAveragePool", ["sliced"], ["gap"], name="/head/GlobalAveragePool"),
        helper.make_node("Flatten", ["gap"], ["flat"], name="/head/Flatten"),
        helper.make_node("Gemm", ["flat", "fc.weight", "fc.bias"], ["logits"], name="/head/Gemm", transB=1),
    ]
    graph = helper.make_graph(nodes, "images",
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, height, width])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 4])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _shuffle_net() -> onnx.ModelProto:
    """input[N, 8] -> Gemm -> (N, 2, 4) by a Reshape of Shape arithmetic -> Transpose -> back to (N, 8) the same
    way -> Relu -> Gemm -> logits[N, 3]: a channel shuffle as torch exports ``x.view(x.size(0), g, -1)``."""
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "a.weight"),
             numpy_helper.from_array(rng.standard_normal((8, 3)).astype(np.float32), "b.weight"),
             numpy_helper.from_array(np.array([0], np.int64), "zero"),
             numpy_helper.from_array(np.array([2, -1], np.int64), "groups"),
             numpy_helper.from_array(np.array([-1], np.int64), "flat")]
    nodes = [
        helper.make_node("MatMul", ["input", "a.weight"], ["a"], name="/a/MatMul"),
        helper.make_node("Shape", ["a"], ["shape"], name="/shuffle/Shape"),
        helper.make_node("Gather", ["shape", "zero"], ["batch"], name="/shuffle/Gather", axis=0),
        helper.make_node("Concat", ["batch", "groups"], ["split_shape"], name="/shuffle/Concat", axis=0),
        helper.make_node("Reshape", ["a", "split_shape"], ["split"], name="/shuffle/Reshape"),
        helper.make_node("Transpose", ["split"], ["swapped"], name="/shuffle/Transpose", perm=[0, 2, 1]),
        helper.make_node("Concat", ["batch", "flat"], ["flat_shape"], name="/shuffle/Concat_1", axis=0),
        helper.make_node("Reshape", ["swapped", "flat_shape"], ["shuffled"], name="/shuffle/Reshape_1"),
        helper.make_node("Relu", ["shuffled"], ["relu"], name="/b/Relu"),
        helper.make_node("MatMul", ["relu", "b.weight"], ["logits"], name="/b/MatMul"),
    ]
    graph = helper.make_graph(nodes, "shuffle", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 8])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 3])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _compare(plan, inputs: dict[str, np.ndarray], labels: dict[str, np.ndarray]) -> float:
    """The largest difference of the plan's float32 gradients from its own graphs' in float64, per parameter."""
    manifest = load_manifest(plan)
    chain, wide = StageChain(plan, manifest), Float64Chain(plan, manifest)
    chain.train_batch(inputs, labels)
    wide.train_batch(inputs, labels)
    got, exact = chain.gradients(), wide.gradients()
    return max(float(np.max(np.abs(got[k] - exact[k]))) / max(float(np.max(np.abs(exact[k]))), 1e-12)
               for k in exact)


def _with_loss(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with a cross-entropy loss on its logits (labels an input) and its parameters as inputs."""
    graph = model.graph
    graph.input.append(helper.make_tensor_value_info("labels", TensorProto.INT64, ["N"]))
    graph.node.append(helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"], name="/loss"))
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info("loss", TensorProto.FLOAT, []))
    return model


def _gradient_graph(height, width):
    from edgert.exporter.gradients.builder import build_gradient_graph
    from edgert.exporter.gradients.shapes import inferred_types

    model = _with_loss(_image_net(height, width))
    types = inferred_types(model)  # onnx's inference alone: no run fills in what it leaves unknown
    parameters = [i.name for i in model.graph.initializer if i.name.endswith(("weight", "bias", "scale"))]
    model.graph.initializer.append(numpy_helper.from_array(np.array(1.0, np.float32), "loss_grad"))
    return build_gradient_graph(model, {"loss": "loss_grad"}, ["input", *parameters], types, "test").model, parameters


@pytest.mark.parametrize(("height", "width"), [(9, 12), (16, 16)])
def test_no_rule_needs_a_fixed_image_size(height, width):
    from tests.exporter.gradient_cases import run_ort

    unknown, parameters = _gradient_graph("H", "W")
    known, _ = _gradient_graph(height, width)
    assert any(n.op_type == "Shape" for n in unknown.graph.node)  # sizes from the tensors themselves
    rng = np.random.default_rng(2)
    feeds = {"input": rng.standard_normal((4, 3, height, width)).astype(np.float32),
             "labels": rng.integers(0, 4, 4)}
    got, expected = run_ort(unknown, feeds), run_ort(known, feeds)
    for name in ["input", *parameters]:
        value = expected[f"{name}_grad"]
        assert float(np.max(np.abs(got[f"{name}_grad"] - value))) <= 1e-5 * max(float(np.max(np.abs(value))), 1e-12)


@pytest.mark.parametrize("batch", [3, 7])
def test_a_reshape_computed_from_shape_trains_at_any_batch(tmp_path, batch):
    path = tmp_path / "shuffle.onnx"
    onnx.save(_shuffle_net(), str(path))
    export_plan(path, tmp_path / "plan", ExportOptions())
    rng = np.random.default_rng(4)
    inputs = {"input": rng.standard_normal((batch, 8)).astype(np.float32)}
    assert _compare(tmp_path / "plan", inputs, {"labels": rng.integers(0, 3, batch)}) <= TOLERANCE
