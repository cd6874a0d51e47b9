"""Every gradient operator the training build emits, rewritten for stock onnxruntime, gives the same numbers.

Each case is one forward operator; the training build differentiates it, and its gradient
graph is compared with the portable form of that graph on random inputs (both run here).
"""

import numpy as np
import pytest
from onnx import TensorProto

from edgert.exporter.errors import PortabilityError
from tests.exporter.portable_cases import F, both_forms, compare, gradient_graph, numeric_reference, single_op

TOLERANCE = 1e-5
rng = np.random.default_rng(7)


def p(*shape, positive=False):
    value = rng.standard_normal(shape).astype(np.float32)
    return np.abs(value) + 0.5 if positive else value


def bn(channels, rank=4, size=5, **attrs):
    shape = ["N", channels] + [size] * (rank - 2)
    return single_op("BatchNormalization", {"x": (F, shape)},
                     {"s": p(channels), "b": p(channels), "m": p(channels), "v": p(channels, positive=True)},
                     extra_outputs=2, training_mode=1, **attrs), {"x", "s", "b"}, ("extra0", "extra1")


def conv(x_shape, w_shape, op="Conv", bias=True, **attrs):
    params = {"W": p(*w_shape)}
    if bias:
        params["B"] = p(w_shape[0] if op == "Conv" else w_shape[1] * attrs.get("group", 1))
    return single_op(op, {"x": (F, ["N", *x_shape])}, params, **attrs), {"x", *params}, ()


def unary(op, shape=("N", 3, 4), **attrs):
    return single_op(op, {"x": (F, list(shape))}, **attrs), {"x"}, ()


CASES = {
    "relu": unary("Relu"),
    "leaky_relu": unary("LeakyRelu", alpha=0.2),
    "sigmoid": unary("Sigmoid"),
    "tanh": unary("Tanh"),
    "softmax_last": unary("Softmax", axis=-1),
    "softmax_axis1": unary("Softmax", shape=("N", 3, 4, 2), axis=1),
    "log_softmax": unary("LogSoftmax", axis=-1),
    "softmax_opset11": (single_op("Softmax", {"x": (F, ["N", 3, 4])}, opset=11, axis=1), {"x"}, ()),
    "gelu_exact": (single_op("Div", {"x": (F, ["N", 6])}, {"c": np.float32(2 ** 0.5)}), {"x"}, ()),
    "batchnorm_2d": bn(4),
    "batchnorm_small_channels": bn(3),
    "batchnorm_small_image": bn(4, size=3),  # per-channel sums over the batch first
    "batchnorm_1d": bn(5, rank=3),
    "batchnorm_momentum": bn(4, momentum=0.7, epsilon=1e-3),
    "layernorm_last": (single_op("LayerNormalization", {"x": (F, ["N", 3, 8])}, {"s": p(8), "b": p(8)},
                                 extra_outputs=2, axis=-1), {"x", "s", "b"}, ()),
    "layernorm_two_axes": (single_op("LayerNormalization", {"x": (F, ["N", 3, 4])}, {"s": p(3, 4), "b": p(3, 4)},
                                     extra_outputs=2, axis=1), {"x", "s", "b"}, ()),
    "conv": conv((2, 6, 6), (4, 2, 3, 3), pads=[1, 1, 1, 1]),
    "conv_stride_dilation": conv((3, 9, 8), (4, 3, 3, 2), strides=[2, 3], dilations=[2, 1], pads=[1, 0, 2, 1]),
    "conv_grouped": conv((4, 6, 6), (6, 2, 3, 3), group=2, pads=[1, 1, 1, 1]),
    "conv_grouped_wide": conv((32, 5, 5), (8, 16, 3, 3), group=2, pads=[1, 1, 1, 1]),
    "conv_wide": conv((20, 5, 5), (6, 20, 3, 3), strides=[2, 2]),
    # Wide layers' dW: rows of at most 16 outputs are sliced spatial first, longer ones channels first.
    "conv_wide_short_rows": conv((16, 7, 6), (3, 16, 3, 2), strides=[2, 1], dilations=[1, 2], pads=[1, 0, 2, 1]),
    "conv_wide_long_rows": conv((16, 18, 18), (4, 16, 3, 3), pads=[1, 1, 1, 1]),
    "conv_wide_pointwise": conv((16, 4, 4), (3, 16, 1, 1), strides=[2, 2], bias=False),
    "conv_wide_3d": conv((16, 3, 4, 4), (2, 16, 2, 2, 2), pads=[0, 1, 0, 1, 0, 1]),
    "conv_six_channels": conv((6, 5, 5), (4, 6, 3, 3), pads=[1, 1, 1, 1]),  # the narrowest with a Gemm per offset
    "conv_depthwise_strided": conv((4, 7, 7), (4, 1, 3, 3), group=4, strides=[2, 2], pads=[1, 1, 1, 1]),
    "conv_depthwise_dilated": conv((3, 6, 5), (3, 1, 2, 3), group=3, dilations=[2, 1], pads=[1, 0, 0, 2]),
    "conv_depthwise_multiplier": conv((3, 5, 5), (6, 1, 3, 3), group=3, pads=[1, 1, 1, 1]),  # the swapped Conv
    "conv_pointwise": conv((5, 4, 4), (3, 5, 1, 1), bias=False),
    "conv_pointwise_widening": conv((3, 4, 4), (6, 3, 1, 1)),
    "conv_1d": conv((3, 10), (4, 3, 3), strides=[2]),
    "conv_3d": conv((2, 4, 4, 4), (3, 2, 2, 2, 2)),
}
# The training build gets these gradients wrong or cannot run them (ORT 1.19.2: ConvGrad ignores auto_pad SAME,
# SliceGrad fails on negative steps, a session loading a bare AveragePoolGrad or MaxPoolGrad crashes, and there
# is no CPU ConvTransposeGrad): checked against central differences of the forward instead.
NUMERIC_CASES = {
    "conv_same_upper": conv((2, 7, 7), (3, 2, 3, 3), auto_pad="SAME_UPPER", strides=[2, 2]),
    "conv_same_lower": conv((2, 6, 6), (3, 2, 2, 2), auto_pad="SAME_LOWER"),
    "slice_negative_steps": (single_op("Slice", {"x": (F, ["N", 9, 4])},
                                       {"st": np.array([1, -1], np.int64), "en": np.array([8, -5], np.int64),
                                        "ax": np.array([1, 2], np.int64), "sp": np.array([3, -1], np.int64)}),
                             {"x"}, ()),
    "max_pool_overlap": unary("MaxPool", shape=("N", 2, 7, 7), kernel_shape=[3, 3], strides=[2, 2],
                              pads=[1, 1, 1, 1]),
    "max_pool": unary("MaxPool", shape=("N", 2, 6, 6), kernel_shape=[2, 2], strides=[2, 2]),
    "conv_transpose_grouped": conv((4, 3, 3), (4, 2, 2, 2), op="ConvTranspose", group=2, strides=[2, 2]),
    "conv_transpose": conv((2, 4, 4), (2, 3, 3, 3), op="ConvTranspose", strides=[2, 2], pads=[1, 1, 1, 1],
                           output_padding=[1, 1]),
    "average_pool": unary("AveragePool", shape=("N", 2, 6, 6), kernel_shape=[2, 2], strides=[2, 2]),
    "average_pool_pads": unary("AveragePool", shape=("N", 2, 7, 7), kernel_shape=[3, 3], strides=[2, 2],
                               pads=[1, 1, 1, 1]),
    "average_pool_count_pads": unary("AveragePool", shape=("N", 2, 7, 7), kernel_shape=[3, 3], strides=[2, 2],
                                     pads=[1, 1, 1, 1], count_include_pad=1),
    "average_pool_ceil": unary("AveragePool", shape=("N", 2, 6, 6), kernel_shape=[3, 3], strides=[2, 2],
                               ceil_mode=1),
}
CASES |= {
    "global_average_pool": unary("GlobalAveragePool", shape=("N", 3, 4, 4)),
    "gather_rows": (single_op("Gather", {"i": (TensorProto.INT64, ["N", 3])}, {"table": p(5, 4)}, order=["table", "i"]),
                    {"table"}, ()),
    "gather_axis1": (single_op("Gather", {"i": (TensorProto.INT64, [2])}, {"table": p(3, 5, 2)}, axis=1,
                               order=["table", "i"]),
                     {"table"}, ()),
    "concat": (single_op("Concat", {"x": (F, ["N", 3]), "z": (F, ["N", 2])}, axis=-1), {"x", "z"}, ()),
    "split": (single_op("Split", {"x": (F, ["N", 6])}, {"parts": np.array([2, 4], np.int64)}, outputs=2, axis=1),
              {"x"}, ()),
    "slice_steps": (single_op("Slice", {"x": (F, ["N", 9, 4])},
                              {"st": np.array([1, -3], np.int64), "en": np.array([8, 100], np.int64),
                               "ax": np.array([1, 2], np.int64), "sp": np.array([3, 1], np.int64)}), {"x"}, ()),
    "transpose": unary("Transpose", perm=[2, 0, 1]),
    "reshape": (single_op("Reshape", {"x": (F, ["N", 6])}, {"shape": np.array([-1, 2, 3], np.int64)}), {"x"}, ()),
    "broadcast_add": (single_op("Add", {"x": (F, ["N", 3, 4]), "z": (F, ["N", 1, 4])}), {"x", "z"}, ()),
    "broadcast_mul": (single_op("Mul", {"x": (F, ["N", 1, 4]), "z": (F, [3, 1])}), {"x", "z"}, ()),
    "divide": (single_op("Div", {"x": (F, ["N", 3, 4]), "z": (F, ["N", 3, 4])}), {"x", "z"}, ()),
    "divide_broadcast": (single_op("Div", {"x": (F, ["N", 3, 4]), "z": (F, ["N", 1, 4])}), {"x", "z"}, ()),
    "divide_by_parameter": (single_op("Div", {"x": (F, ["N", 3, 4])}, {"z": p(4, positive=True)}), {"x", "z"}, ()),
    "expand": (single_op("Expand", {"x": (F, ["N", 1, 4])}, {"shape": np.array([1, 3, 1], np.int64)}), {"x"}, ()),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_portable_gradient_equals_training_build(case):
    model, requires_grad, also = CASES[case]
    difference, original = compare(model, requires_grad, also=also)
    assert difference <= TOLERANCE, f"{case}: {difference:.3g}"


@pytest.mark.parametrize("case", sorted(NUMERIC_CASES))
def test_portable_gradient_equals_central_differences(case):
    model, requires_grad, _ = NUMERIC_CASES[case]
    linear = any(n.op_type in ("AveragePool", "Conv", "ConvTranspose") for n in model.graph.node)
    assert numeric_reference(model, requires_grad, batch=2, linear=linear) <= TOLERANCE


def test_cases_exercise_the_rewrites():
    """Guard against cases that no longer reach a rule (an ORT change could fuse them away)."""
    from edgert.exporter.portable import runs_on_stock

    reached = set()
    for model, requires_grad, _ in [*CASES.values(), *NUMERIC_CASES.values()]:
        graph = gradient_graph(model, requires_grad)
        opset = next(o.version for o in graph.opset_import if o.domain in ("", "ai.onnx"))
        reached |= {n.op_type for n in graph.graph.node if not runs_on_stock(n, opset)}
    assert {"ReluGrad", "LeakyReluGrad", "SigmoidGrad", "TanhGrad", "SoftmaxGrad_13", "LogSoftmaxGrad_13",
            "BatchNormInternal", "BatchNormalizationGrad", "LayerNormalizationGrad", "ConvGrad",
            "ConvTransposeGrad", "MaxPoolGrad", "AveragePoolGrad", "Scale", "GatherGrad", "ConcatTraining",
            "SplitTraining", "SliceGrad", "BroadcastGradientArgs", "DivGrad"} <= reached


@pytest.mark.parametrize("case, layout", [("conv_wide_short_rows", [2, 0, 1]), ("conv_wide_3d", [2, 0, 1]),
                                          ("conv_wide_long_rows", [1, 0, 2, 3]), ("conv_wide_pointwise", [1, 0, 2, 3])])
def test_a_wide_convolutions_weight_gradient_transposes_its_input_for_its_rows(case, layout):
    """Short output rows (and several kernel offsets): the input as (N, C, P) -> (P, N, C); the rest channels first."""
    model, requires_grad, also = CASES[case]
    _, portable = both_forms(model, requires_grad, also)
    reshaped = {n.output[0] for n in portable.graph.node if n.op_type == "Reshape" and n.input[0] == "x"}
    transposed = [list(n.attribute[0].ints) for n in portable.graph.node
                  if n.op_type == "Transpose" and n.input[0] in {"x", *reshaped}]
    assert transposed == [layout]


@pytest.mark.parametrize("case, form", [("conv_wide_long_rows", "Conv"), ("conv_grouped_wide", "Conv"),
                                        ("conv_pointwise_widening", "Conv"),
                                        ("conv_3d", "ConvTranspose"), ("conv_grouped", "ConvTranspose"),
                                        ("conv_stride_dilation", "ConvTranspose")])
def test_a_convolutions_input_gradient_is_a_flipped_conv_unless_strided_or_widening(case, form):
    """Stride 1, unless the layer widens its channels with a kernel over 1x1: a Conv of dY; else ConvTranspose."""
    model, requires_grad, also = CASES[case]
    _, portable = both_forms(model, requires_grad, also)
    assert [n.op_type for n in portable.graph.node if "x_grad" in n.output] == [form]


def test_an_operator_without_a_portable_form_is_named():
    """A gradient op no rule covers fails with one line naming the operator and the node."""
    from onnx import helper

    from edgert.exporter.portable import make_portable

    model = single_op("Relu", {"x": (F, ["N", 3])})
    graph = gradient_graph(model, {"x"})
    graph.graph.node.append(helper.make_node("MadeUpGrad", ["x_grad"], ["odd"], name="/odd/node",
                                             domain="com.microsoft"))
    with pytest.raises(PortabilityError) as error:
        make_portable(graph, "stage 3 backward")
    message = str(error.value)
    assert "\n" not in message
    assert "stage 3 backward" in message and "com.microsoft.MadeUpGrad" in message and "/odd/node" in message
