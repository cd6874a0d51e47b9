"""Running a graph in float64: the reference that float32 results are judged against (``edgert check``).

onnxruntime has no float64 kernels for Conv, pools and several activations, so the float64
run is onnx's reference evaluator (numpy), with edgert's own Conv and ConvTranspose (the
evaluator's mishandle grouped convolutions and ``auto_pad`` SAME, and are slow; here each is an
im2col of strided window views and one einsum per group), Erf and Gelu (the evaluator's Erf
rounds through float32 in onnx >= 1.18, and Gelu's function body reaches it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from numpy.lib.stride_tricks import sliding_window_view
from onnx import TensorProto, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun


def as_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` computing in float64: every float32 input, output, initializer, cast and constant."""
    wide = onnx.ModelProto()
    wide.CopyFrom(model)
    graph = wide.graph
    for value in [*graph.input, *graph.output]:
        if value.type.tensor_type.elem_type == TensorProto.FLOAT:
            value.type.tensor_type.elem_type = TensorProto.DOUBLE
    for index, init in enumerate(graph.initializer):
        if init.data_type == TensorProto.FLOAT:
            graph.initializer[index].CopyFrom(
                numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float64), init.name))
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.name == "to" and attribute.i == TensorProto.FLOAT:
                attribute.i = TensorProto.DOUBLE
            elif attribute.type == onnx.AttributeProto.TENSOR and attribute.t.data_type == TensorProto.FLOAT:
                attribute.t.CopyFrom(numpy_helper.from_array(
                    numpy_helper.to_array(attribute.t).astype(np.float64), attribute.t.name))
    del graph.value_info[:]
    return wide


class Float64Evaluator:
    """onnx's reference evaluator with edgert's Conv and ConvTranspose kernels."""

    def __init__(self, model: onnx.ModelProto):
        self._evaluator = ReferenceEvaluator(model, new_ops=[Conv, ConvTranspose, Erf, Gelu])
        self.input_names = list(self._evaluator.input_names)
        self.output_names = list(self._evaluator.output_names)

    def run(self, feeds: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        names = list(outputs or self.output_names)
        wanted = set(self.input_names)
        return dict(zip(names, self._evaluator.run(names, {k: v for k, v in feeds.items() if k in wanted})))


def _geometry(x_spatial: Sequence[int], kernel: Sequence[int], auto_pad: str | None, dilations, pads, strides):
    d = len(kernel)
    strides = list(strides or [1] * d)
    dilations = list(dilations or [1] * d)
    pads = list(pads or [0] * 2 * d)
    mode = auto_pad.decode() if isinstance(auto_pad, bytes) else (auto_pad or "NOTSET")
    if mode in ("SAME_UPPER", "SAME_LOWER"):
        for axis in range(d):
            out = -(-x_spatial[axis] // strides[axis])
            total = max((out - 1) * strides[axis] + (kernel[axis] - 1) * dilations[axis] + 1 - x_spatial[axis], 0)
            small, large = total // 2, total - total // 2
            pads[axis], pads[axis + d] = (small, large) if mode == "SAME_UPPER" else (large, small)
    elif mode == "VALID":
        pads = [0] * 2 * d
    return strides, dilations, pads


def convolve(x: np.ndarray, w: np.ndarray, strides, dilations, pads, group: int) -> np.ndarray:
    """The ONNX Conv of ``x`` (N, C, spatial...) with ``w`` (M, C/group, kernel...), explicit pads."""
    d = w.ndim - 2
    kernel = w.shape[2:]
    padded = np.pad(x, [(0, 0), (0, 0)] + [(pads[a], pads[a + d]) for a in range(d)])
    spans = [(kernel[a] - 1) * dilations[a] + 1 for a in range(d)]
    windows = sliding_window_view(padded, spans, axis=tuple(range(2, 2 + d)))  # (N, C, out_full..., span...)
    index = (slice(None), slice(None), *(slice(None, None, s) for s in strides),
             *(slice(None, None, dl) for dl in dilations))
    windows = windows[index]  # (N, C, out..., kernel...)
    n, c = x.shape[:2]
    m = w.shape[0]
    out = windows.shape[2:2 + d]
    grouped = windows.reshape(n, group, c // group, *out, *kernel)
    weights = w.reshape(group, m // group, c // group, *kernel)
    out_l, ker_l = "hijk"[:d], "uvwx"[:d]  # n, g, c, m name the batch, group, input and output channels
    result = np.einsum(f"ngc{out_l}{ker_l},gmc{ker_l}->ngm{out_l}", grouped, weights, optimize=True)
    return result.reshape(n, m, *out)


class Conv(OpRun):
    op_domain = ""

    def _run(self, X, W, B=None, auto_pad=None, dilations=None, group=None, kernel_shape=None, pads=None,
             strides=None):
        strides, dilations, pads = _geometry(X.shape[2:], W.shape[2:], auto_pad, dilations, pads, strides)
        result = convolve(X, W, strides, dilations, pads, group or 1)
        if B is not None:
            result = result + B.reshape(1, -1, *([1] * (result.ndim - 2)))
        return (result.astype(X.dtype),)


class ConvTranspose(OpRun):
    op_domain = ""

    def _run(self, X, W, B=None, auto_pad=None, dilations=None, group=None, kernel_shape=None, output_padding=None,
             output_shape=None, pads=None, strides=None):
        if output_shape is not None or auto_pad not in (None, "NOTSET", b"NOTSET"):
            raise NotImplementedError("ConvTranspose with output_shape or auto_pad")
        group = group or 1
        d = W.ndim - 2
        kernel = W.shape[2:]
        strides = list(strides or [1] * d)
        dilations = list(dilations or [1] * d)
        pads = list(pads or [0] * 2 * d)
        extra = list(output_padding or [0] * d)
        n, c = X.shape[:2]
        spread = np.zeros((n, c, *[(X.shape[2 + a] - 1) * strides[a] + 1 for a in range(d)]), X.dtype)
        spread[(slice(None), slice(None), *(slice(None, None, s) for s in strides))] = X
        full = [(kernel[a] - 1) * dilations[a] for a in range(d)]
        padding = [full[a] - pads[a] for a in range(d)] + [full[a] - pads[a + d] + extra[a] for a in range(d)]
        # the transposed convolution is the convolution of the spread input with the flipped, swapped kernels
        m_per_group = W.shape[1]
        swapped = W.reshape(group, c // group, m_per_group, *kernel).transpose(0, 2, 1, *range(3, 3 + d))
        swapped = swapped.reshape(group * m_per_group, c // group, *kernel)[(slice(None), slice(None),
                                                                             *(slice(None, None, -1),) * d)]
        cropped = spread
        if any(p < 0 for p in padding):
            cut = tuple(slice(max(-padding[a], 0), spread.shape[2 + a] - max(-padding[a + d], 0)) for a in range(d))
            cropped = spread[(slice(None), slice(None), *cut)]
            padding = [max(p, 0) for p in padding]
        result = convolve(cropped, swapped, [1] * d, dilations, padding, group)
        if B is not None:
            result = result + B.reshape(1, -1, *([1] * d))
        return (result.astype(X.dtype),)




class Erf(OpRun):
    op_domain = ""

    def _run(self, x):
        return (np.vectorize(math.erf, otypes=[x.dtype])(x),)


class Gelu(OpRun):
    op_domain = ""

    def _run(self, x, approximate="none"):
        if approximate == "tanh":
            inner = math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)
            return ((0.5 * x * (1 + np.tanh(inner))).astype(x.dtype),)
        return ((0.5 * x * (1 + Erf._run(self, x / math.sqrt(2))[0])).astype(x.dtype),)
