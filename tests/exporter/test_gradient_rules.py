"""Every gradient rule of edgert's builder against central differences, on single-operator models.

Each case is one forward operator (tests/exporter/gradient_cases.py): its gradient graph built
from the float64 model must equal central differences of the float64 forward (the formula), and
the one built from the float32 model, run by onnxruntime as a board runs it, must equal that
float64 gradient to float32 rounding.
"""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from edgert.exporter.errors import GradientError
from edgert.exporter.gradients.registry import RULES
from tests.exporter.gradient_cases import F, check, gradient_model, single_op

FORMULA_TOLERANCE = 1e-6  # float64 gradients against float64 central differences (step 1e-6)
ROUNDING_TOLERANCE = 2e-5  # float32 gradients run by onnxruntime against the float64 ones
rng = np.random.default_rng(7)
I64 = TensorProto.INT64


def p(*shape, positive=False):
    value = rng.standard_normal(shape).astype(np.float32)
    return np.abs(value) + 0.5 if positive else value


def ints(*values):
    return np.array(values, np.int64)


def bn(channels, rank=4, size=5, **attrs):
    shape = ["N", channels] + [size] * (rank - 2)
    return single_op("BatchNormalization", {"x": (F, shape)},
                     {"s": p(channels), "b": p(channels), "m": p(channels), "v": p(channels, positive=True)},
                     extra_outputs=2, training_mode=1, **attrs), {"x", "s", "b"}


def conv(x_shape, w_shape, op="Conv", bias=True, **attrs):
    params = {"W": p(*w_shape)}
    if bias:
        params["B"] = p(w_shape[0] if op == "Conv" else w_shape[1] * attrs.get("group", 1))
    return single_op(op, {"x": (F, ["N", *x_shape])}, params, **attrs), {"x", *params}


def unary(op, shape=("N", 3, 4), **attrs):
    return single_op(op, {"x": (F, list(shape))}, **attrs), {"x"}


def binary(op, a, b, **attrs):
    return single_op(op, {"x": (F, list(a)), "z": (F, list(b))}, **attrs), {"x", "z"}


def pad_to_a_multiple():
    """``loss = sum(Pad(x, pads)^2)`` with pads computed from x's shape (a window attention pads to a multiple of the
    window so): the last axis grows from 4 to 6."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Slice", ["shape", "two", "three"], ["width"]),
        helper.make_node("Sub", ["six", "width"], ["missing"]),
        helper.make_node("Concat", ["zeros5", "missing"], ["pads"], axis=0),
        helper.make_node("Pad", ["x", "pads"], ["y"], name="/Pad"),
        helper.make_node("Mul", ["y", "y"], ["square"]),
        helper.make_node("ReduceSum", ["square"], ["loss"], keepdims=0),
    ]
    constants = [onnx.numpy_helper.from_array(value, name) for name, value in
                 {"two": ints(2), "three": ints(3), "six": ints(6), "zeros5": ints(0, 0, 0, 0, 0)}.items()]
    graph = helper.make_graph(nodes, "pad", [helper.make_tensor_value_info("x", F, ["N", 3, 4])],
                              [helper.make_tensor_value_info("loss", F, [])], constants)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


CASES = {
    # activations and other elementwise maps
    "relu": unary("Relu"),
    "leaky_relu": unary("LeakyRelu", alpha=0.2),
    "prelu": (single_op("PRelu", {"x": (F, ["N", 3, 4])}, {"slope": p(3, 1)}), {"x", "slope"}),
    "elu": unary("Elu", alpha=0.7),
    "selu": unary("Selu"),
    "celu": unary("Celu", alpha=1.3),
    "sigmoid": unary("Sigmoid"),
    "hard_sigmoid": unary("HardSigmoid", alpha=0.3, beta=0.4),
    "hard_swish": unary("HardSwish", shape=("N", 40)),
    "tanh": unary("Tanh"),
    "softplus": unary("Softplus"),
    "softsign": unary("Softsign"),
    "mish": (single_op("Mish", {"x": (F, ["N", 3, 4])}, opset=18), {"x"}),
    "gelu_exact": (single_op("Gelu", {"x": (F, ["N", 6])}, opset=20), {"x"}),
    "gelu_tanh": (single_op("Gelu", {"x": (F, ["N", 6])}, opset=20, approximate="tanh"), {"x"}),
    "erf": unary("Erf"),
    "exp": unary("Exp"),
    "log": (single_op("Log", {"x": (F, ["N", 3])}, {"c": p(3, positive=True)}, order=["c"]), {"c"}),
    "sqrt": (single_op("Sqrt", {"x": (F, ["N", 3])}, {"c": p(3, positive=True)}, order=["c"]), {"c"}),
    "reciprocal": (single_op("Reciprocal", {"x": (F, ["N", 3])}, {"c": p(3, positive=True)}, order=["c"]), {"c"}),
    "abs": unary("Abs"),
    "neg": unary("Neg"),
    "sin": unary("Sin"),
    "cos": unary("Cos"),
    "identity": unary("Identity"),
    "cast_same": unary("Cast", to=F),
    "cast_like": (single_op("CastLike", {"x": (F, ["N", 3])}, {"like": p(1)}), {"x"}),
    "clip": (single_op("Clip", {"x": (F, ["N", 5])}, {"lo": np.float32(-0.3), "hi": np.float32(0.4)}), {"x"}),
    "clip_min_only": (single_op("Clip", {"x": (F, ["N", 5])}, {"lo": np.float32(0.1)}), {"x"}),
    # arithmetic, broadcasting both ways
    "add_broadcast": binary("Add", ["N", 3, 4], ["N", 1, 4]),
    "sub_rank_broadcast": binary("Sub", ["N", 3, 4], [4]),
    "mul_broadcast": binary("Mul", ["N", 1, 4], [3, 1]),
    "mul_same": (single_op("Mul", {"x": (F, ["N", 3])}, order=["x", "x"]), {"x"}),
    "divide": binary("Div", ["N", 3, 4], ["N", 3, 4]),
    "divide_broadcast": binary("Div", ["N", 3, 4], ["N", 1, 4]),
    "divide_by_parameter": (single_op("Div", {"x": (F, ["N", 3, 4])}, {"z": p(4, positive=True)}), {"x", "z"}),
    "pow_constant": (single_op("Pow", {"x": (F, ["N", 3])}, {"c": p(3, positive=True), "e": np.float32(2.5)},
                               order=["c", "e"]), {"c"}),
    "pow_both": (single_op("Pow", {"e": (F, ["N", 3])}, {"c": p(3, positive=True)}, order=["c", "e"]), {"c", "e"}),
    "sum_three": (single_op("Sum", {"x": (F, ["N", 3]), "z": (F, [3])}, {"c": p(1, 3)}, order=["x", "z", "c"]),
                  {"x", "z", "c"}),
    "mean_two": binary("Mean", ["N", 3], ["N", 3]),
    "max_two": binary("Max", ["N", 3], ["N", 3]),
    "min_broadcast": binary("Min", ["N", 3], [3]),
    "where": (single_op("Where", {"m": (TensorProto.BOOL, ["N", 4]), "x": (F, ["N", 4]), "z": (F, [4])}),
              {"x", "z"}),
    # products
    "matmul_2d": binary("MatMul", ["N", 3], [3, 5]),
    "matmul_linear": binary("MatMul", ["N", 4, 3], [3, 5]),
    "matmul_batched": binary("MatMul", ["N", 2, 4, 3], ["N", 2, 3, 5]),
    "matmul_broadcast_left": binary("MatMul", [4, 3], ["N", 3, 5]),
    "matmul_broadcast_batch": binary("MatMul", ["N", 1, 4, 3], [2, 3, 5]),
    "matmul_vector_right": binary("MatMul", ["N", 4, 3], [3]),
    "matmul_vector_left": binary("MatMul", [3], ["N", 3, 5]),
    "gemm": (single_op("Gemm", {"x": (F, ["N", 3])}, {"W": p(5, 3), "B": p(5)}, transB=1), {"x", "W", "B"}),
    "gemm_transposes": (single_op("Gemm", {"x": (F, [5, 4])}, {"W": p(5, 3), "B": p(1, 4)}, order=["W", "x", "B"],
                                  transA=1, transB=0, alpha=0.5, beta=2.0), {"x", "W", "B"}),
    "gemm_both_transposed": (single_op("Gemm", {"x": (F, [3, 4])}, {"W": p(5, 3)}, order=["x", "W"], transA=1,
                                       transB=1), {"x", "W"}),
    "einsum_attention": (single_op("Einsum", {"q": (F, ["N", 2, 4, 3]), "k": (F, ["N", 2, 5, 3])},
                                   equation="bhqd,bhkd->bhqk"), {"q", "k"}),
    "einsum_summed_away": (single_op("Einsum", {"a": (F, ["N", 3, 4]), "b": (F, [4, 5])}, equation="nij,jk->nk"),
                           {"a", "b"}),
    # reductions and normalising maps
    "reduce_sum_axes_input": (single_op("ReduceSum", {"x": (F, ["N", 3, 4])}, {"ax": ints(1)}, keepdims=0), {"x"}),
    "reduce_mean_opset17": unary("ReduceMean", axes=[-1]),
    "reduce_mean_all": unary("ReduceMean", keepdims=0),
    "reduce_mean_opset18": (single_op("ReduceMean", {"x": (F, ["N", 3, 4])}, {"ax": ints(1, 2)}, opset=18),
                            {"x"}),
    "reduce_max": unary("ReduceMax", axes=[1], keepdims=0),
    "reduce_min": unary("ReduceMin", axes=[2]),
    "reduce_sum_square": unary("ReduceSumSquare", axes=[1]),
    "reduce_l2": unary("ReduceL2", axes=[2], keepdims=0),
    "reduce_log_sum_exp": unary("ReduceLogSumExp", axes=[1]),
    "softmax_last": unary("Softmax", axis=-1),
    "softmax_axis1": unary("Softmax", shape=("N", 3, 4, 2), axis=1),
    "log_softmax": unary("LogSoftmax", axis=-1),
    "cumsum": (single_op("CumSum", {"x": (F, ["N", 5])}, {"ax": np.array(1, np.int64)}), {"x"}),
    "cumsum_reverse_exclusive": (single_op("CumSum", {"x": (F, ["N", 5])}, {"ax": np.array(1, np.int64)}, reverse=1,
                                           exclusive=1), {"x"}),
    "global_average_pool": unary("GlobalAveragePool", shape=("N", 3, 4, 4)),
    "global_max_pool": unary("GlobalMaxPool", shape=("N", 3, 4, 4)),
    "batchnorm_2d": bn(4),
    "batchnorm_small_channels": bn(3),
    "batchnorm_small_image": bn(4, size=3),  # per-channel sums over the batch first
    "batchnorm_1d": bn(5, rank=3),
    "batchnorm_momentum": bn(4, momentum=0.7, epsilon=1e-3),
    "layernorm_last": (single_op("LayerNormalization", {"x": (F, ["N", 3, 8])}, {"s": p(8), "b": p(8)},
                                 extra_outputs=2, axis=-1), {"x", "s", "b"}),
    "layernorm_no_stat_outputs": (single_op("LayerNormalization", {"x": (F, ["N", 3, 8])}, {"s": p(8)}, axis=-1),
                                  {"x", "s"}),
    "layernorm_two_axes": (single_op("LayerNormalization", {"x": (F, ["N", 3, 4])}, {"s": p(3, 4), "b": p(3, 4)},
                                     extra_outputs=2, axis=1), {"x", "s", "b"}),
    "instance_norm": (single_op("InstanceNormalization", {"x": (F, ["N", 3, 4, 4])}, {"s": p(3), "b": p(3)}),
                      {"x", "s", "b"}),
    # convolutions and pools
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
    "conv_same_upper": conv((2, 7, 7), (3, 2, 3, 3), auto_pad="SAME_UPPER", strides=[2, 2]),
    "conv_same_lower": conv((2, 6, 6), (3, 2, 2, 2), auto_pad="SAME_LOWER"),
    "conv_transpose_grouped": conv((4, 3, 3), (4, 2, 2, 2), op="ConvTranspose", group=2, strides=[2, 2]),
    "conv_transpose": conv((2, 4, 4), (2, 3, 3, 3), op="ConvTranspose", strides=[2, 2], pads=[1, 1, 1, 1],
                           output_padding=[1, 1]),
    "max_pool_overlap": unary("MaxPool", shape=("N", 2, 7, 7), kernel_shape=[3, 3], strides=[2, 2],
                              pads=[1, 1, 1, 1]),
    "max_pool": unary("MaxPool", shape=("N", 2, 6, 6), kernel_shape=[2, 2], strides=[2, 2]),
    "average_pool": unary("AveragePool", shape=("N", 2, 6, 6), kernel_shape=[2, 2], strides=[2, 2]),
    "average_pool_pads": unary("AveragePool", shape=("N", 2, 7, 7), kernel_shape=[3, 3], strides=[2, 2],
                               pads=[1, 1, 1, 1]),
    "average_pool_count_pads": unary("AveragePool", shape=("N", 2, 7, 7), kernel_shape=[3, 3], strides=[2, 2],
                                     pads=[1, 1, 1, 1], count_include_pad=1),
    "average_pool_ceil": unary("AveragePool", shape=("N", 2, 6, 6), kernel_shape=[3, 3], strides=[2, 2],
                               ceil_mode=1),
    # moving values
    "reshape": (single_op("Reshape", {"x": (F, ["N", 6])}, {"shape": ints(-1, 2, 3)}), {"x"}),
    "flatten": unary("Flatten", shape=("N", 2, 3, 2), axis=1),
    "squeeze": (single_op("Squeeze", {"x": (F, ["N", 1, 4])}, {"ax": ints(1)}), {"x"}),
    "unsqueeze": (single_op("Unsqueeze", {"x": (F, ["N", 4])}, {"ax": ints(1, 3)}), {"x"}),
    "transpose": unary("Transpose", perm=[2, 0, 1]),
    "expand": (single_op("Expand", {"x": (F, ["N", 1, 4])}, {"shape": ints(1, 3, 1)}), {"x"}),
    "tile": (single_op("Tile", {"x": (F, ["N", 2, 3])}, {"r": ints(1, 3, 2)}), {"x"}),
    "concat": (single_op("Concat", {"x": (F, ["N", 3]), "z": (F, ["N", 2])}, axis=-1), {"x", "z"}),
    "split": (single_op("Split", {"x": (F, ["N", 6])}, {"parts": ints(2, 4)}, outputs=2, axis=1), {"x"}),
    "split_one_output_used": (single_op("Split", {"x": (F, ["N", 6])}, {"parts": ints(2, 4)}, outputs=1,
                                        extra_outputs=1, axis=1), {"x"}),
    "slice_pad_back": (single_op("Slice", {"x": (F, ["N", 9, 4])}, {"st": ints(1, -3), "en": ints(8, 100),
                                                                    "ax": ints(1, 2)}), {"x"}),
    "slice_to_the_end": (single_op("Slice", {"x": (F, ["N", 9])}, {"st": ints(2), "en": ints(2 ** 63 - 1),
                                                                   "ax": ints(1)}), {"x"}),
    "slice_steps": (single_op("Slice", {"x": (F, ["N", 9, 4])},
                              {"st": ints(1, -3), "en": ints(8, 100), "ax": ints(1, 2), "sp": ints(3, 1)}), {"x"}),
    "slice_negative_steps": (single_op("Slice", {"x": (F, ["N", 9, 4])},
                                       {"st": ints(1, -1), "en": ints(8, -5), "ax": ints(1, 2), "sp": ints(3, -1)}),
                             {"x"}),
    "pad_constant": (single_op("Pad", {"x": (F, ["N", 3, 4])}, {"pads": ints(0, 1, 2, 0, 0, 1)}), {"x"}),
    "pad_axes": (single_op("Pad", {"x": (F, ["N", 3, 4])}, {"pads": ints(1, 2, 0, 3), "v": np.float32(0.5),
                                                              "ax": ints(-1, 1)}, opset=18), {"x"}),
    "pad_computed": (pad_to_a_multiple(), {"x"}),
    "gather_rows": (single_op("Gather", {"i": (I64, ["N", 3])}, {"table": p(5, 4)}, order=["table", "i"]), {"table"}),
    "gather_axis1": (single_op("Gather", {"i": (I64, [2])}, {"table": p(3, 5, 2)}, axis=1, order=["table", "i"]),
                     {"table"}),
    "gather_scalar_index": (single_op("Gather", {"x": (F, ["N", 4, 3])}, {"i": np.array(-1, np.int64)}, axis=1),
                            {"x"}),
    "gather_elements": (single_op("GatherElements", {"i": (I64, [4, 3])}, {"x": p(4, 5)}, order=["x", "i"],
                                  axis=1), {"x"}),
    "gather_nd": (single_op("GatherND", {"x": (F, [4, 5])}, {"i": ints(1, 1, 3, 0).reshape(2, 2)}), {"x"}),
    "scatter_nd": (single_op("ScatterND", {"x": (F, [4, 3]), "u": (F, [2, 3])}, {"i": ints(1, 3).reshape(2, 1)},
                             order=["x", "i", "u"]), {"x", "u"}),
    "scatter_elements": (single_op("ScatterElements", {"x": (F, [3, 4]), "u": (F, [3, 2])},
                                   {"i": ints(0, 2, 1, 3, 3, 0).reshape(3, 2)}, order=["x", "i", "u"], axis=1),
                         {"x", "u"}),
    "trilu": (single_op("Trilu", {"x": (F, ["N", 4, 4])}, upper=0), {"x"}),
    # the loss a last stage ends with
    "softmax_cross_entropy": (single_op("SoftmaxCrossEntropyLoss", {"x": (F, ["N", 5]), "t": (I64, ["N"])}),
                              {"x"}),
    "softmax_cross_entropy_weighted": (single_op("SoftmaxCrossEntropyLoss", {"x": (F, ["N", 5]), "t": (I64, ["N"])},
                                                 {"cw": p(5, positive=True)}, ignore_index=1), {"x"}),
    "softmax_cross_entropy_sum": (single_op("SoftmaxCrossEntropyLoss", {"x": (F, ["N", 5]), "t": (I64, ["N"])},
                                            reduction="sum"), {"x"}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_rules_gradient_equals_central_differences_and_runs_on_onnxruntime(case):
    model, wanted = CASES[case]
    formula, rounding = check(model, wanted)
    assert formula <= FORMULA_TOLERANCE, f"{case}: float64 gradient against central differences {formula:.3g}"
    assert rounding <= ROUNDING_TOLERANCE, f"{case}: float32 on onnxruntime against float64 {rounding:.3g}"


def test_every_rule_has_a_case():
    """A rule no case reaches is a rule nothing checks."""
    used = {node.op_type for model, _ in CASES.values() for node in model.graph.node if node.name.startswith("/")}
    assert {op for domain, op in RULES if domain == ""} - used == set()


@pytest.mark.parametrize("case, layout", [("conv_wide_short_rows", [2, 0, 1]), ("conv_wide_3d", [2, 0, 1]),
                                          ("conv_wide_long_rows", [1, 0, 2, 3]), ("conv_wide_pointwise", [1, 0, 2, 3])])
def test_a_wide_convolutions_weight_gradient_transposes_its_input_for_its_rows(case, layout):
    """Short output rows (and several kernel offsets): the input as (N, C, P) -> (P, N, C); the rest channels first."""
    model, wanted = CASES[case]
    graph = gradient_model(model, wanted, {"W", "B"} & wanted)
    reshaped = {n.output[0] for n in graph.graph.node if n.op_type == "Reshape" and n.input[0] == "x"}
    transposed = [list(n.attribute[0].ints) for n in graph.graph.node
                  if n.op_type == "Transpose" and n.input[0] in {"x", *reshaped}]
    assert transposed == [layout]


@pytest.mark.parametrize("case, form", [("conv_wide_long_rows", "Conv"), ("conv_grouped_wide", "Conv"),
                                        ("conv_pointwise_widening", "Conv"),
                                        ("conv_3d", "ConvTranspose"), ("conv_grouped", "ConvTranspose"),
                                        ("conv_stride_dilation", "ConvTranspose")])
def test_a_convolutions_input_gradient_is_a_flipped_conv_unless_strided_or_widening(case, form):
    """Stride 1, unless the layer widens its channels with a kernel over 1x1: a Conv of dY; else ConvTranspose."""
    model, wanted = CASES[case]
    graph = gradient_model(model, wanted, {"W", "B"} & wanted)
    assert [n.op_type for n in graph.graph.node if "x_grad" in n.output] == [form]


def test_only_standard_operators_are_written():
    """No com.microsoft operator, no fusion: every node of every case's gradient graph is ai.onnx."""
    for case, (model, wanted) in CASES.items():
        graph = gradient_model(model, wanted, {i.name for i in model.graph.initializer} & wanted)
        assert {n.domain for n in graph.graph.node} <= {"", "ai.onnx"}, case


def test_an_operator_without_a_rule_is_named_with_its_node_and_stage():
    """An operator on the gradient's path with no rule fails in one line naming the operator, the node, the graph."""
    model = single_op("Relu", {"x": (F, ["N", 3])})
    model.graph.node[0].CopyFrom(helper.make_node("Shrink", ["x"], ["y0"], name="/odd/node"))
    with pytest.raises(GradientError) as error:
        gradient_model(model, {"x"}, set())
    message = str(error.value)
    assert "\n" not in message
    assert "test" in message and "Shrink" in message and "/odd/node" in message
