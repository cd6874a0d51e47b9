"""Gradient rules of Conv and ConvTranspose, and AveragePool's (docs/EXPORTER.md).

Where speed is won or lost: a
convolution's dX is a Conv (stride 1, not widening) or a ConvTranspose; its dW one GEMM
per kernel offset (wide layers), one product and sum per offset (depthwise), or one Conv
with batch and channels swapped (narrow and grouped layers), each as :data:`FORMS` chooses,
never a materialised im2col matrix; and each layout is chosen for what ORT copies fast
(a transpose it can do as a matrix's, slices of long contiguous runs). Spatial sizes known only at
run time take the forms that need none: dX a ConvTranspose fitted to the input's run-time shape, dW
the swapped Conv.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from edgert.exporter.gradients.normalization import channel_sum
from edgert.exporter.gradients.registry import GradientContext, NodeContext, gradient


@dataclass(frozen=True)
class Window:
    """A sliding window's geometry along the spatial axes of one node."""

    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    begin: tuple[int, ...]
    end: tuple[int, ...]

    def span(self, axis: int) -> int:
        return (self.kernel[axis] - 1) * self.dilations[axis] + 1

    def out_size(self, size: int, axis: int, ceil: bool = False) -> int:
        extent = size + self.begin[axis] + self.end[axis] - self.span(axis)
        steps = -(-extent // self.strides[axis]) if ceil else extent // self.strides[axis]
        return steps + 1

    def transposed(self, inputs: tuple[int, ...], outputs: tuple[int, ...]) -> dict:
        """ConvTranspose attributes mapping ``outputs`` positions back onto exactly ``inputs`` positions."""
        pads_end, extra = [], []
        for axis, (size, out) in enumerate(zip(inputs, outputs)):
            total = (out - 1) * self.strides[axis] + self.span(axis) - self.begin[axis]
            pads_end.append(max(total - size, 0))
            extra.append(max(size - total, 0))
        return {"strides": list(self.strides), "dilations": list(self.dilations),
                "pads": [*self.begin, *pads_end], "output_padding": extra}


def window_of(c: NodeContext, spatial: tuple[int, ...] | None, kernel: tuple[int, ...]) -> Window:
    """The window of a Conv, ConvTranspose or pool node over inputs of ``spatial`` sizes (None: known at run time,
    which only ``auto_pad`` SAME needs)."""
    d = len(kernel)
    strides = tuple(c.attr("strides", [1] * d))
    dilations = tuple(c.attr("dilations", [1] * d))
    pads = list(c.attr("pads", [0] * 2 * d))
    auto_pad = c.attr("auto_pad", "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        if spatial is None:
            raise c.refuse(f"auto_pad {auto_pad} needs the spatial sizes, which are known only at run time")
        pads = [0] * 2 * d
        for axis in range(d):
            out = -(-spatial[axis] // strides[axis])
            total = max((out - 1) * strides[axis] + (kernel[axis] - 1) * dilations[axis] + 1 - spatial[axis], 0)
            small, large = total // 2, total - total // 2
            pads[axis], pads[axis + d] = (small, large) if auto_pad == "SAME_UPPER" else (large, small)
    elif auto_pad == "VALID":
        pads = [0] * 2 * d
    elif auto_pad != "NOTSET":
        raise c.refuse(f"auto_pad {auto_pad!r} is not supported")
    return Window(kernel, strides, dilations, tuple(pads[:d]), tuple(pads[d:]))


@dataclass(frozen=True)
class ConvForms:
    """Which standard-operator form a convolution's gradients take, by the layer's shape (figures:
    docs/EXPORTER.md; ``tools/conv_forms.py`` times each against the others, layer by layer)."""

    narrow_channels: int = 6  # below this many input channels per group, dW is one swapped Conv
    short_rows: int = 16  # output rows at most this wide: dW's windows come from a spatial-first copy
    depthwise_products: bool = True  # depthwise dW as products and column sums (else the swapped Conv)
    widening_transposed: bool = True  # a widening layer's stride-1 dX (kernel > 1x1) as ConvTranspose


FORMS = ConvForms()


def _weight_gradient(c: NodeContext, source: str, gradient: str, window: Window, groups: int,
                     out_spatial: tuple[int, ...] | None, weight_shape: tuple[int, ...]) -> str:
    """dW[m, c, k] = sum over n, p of gradient[n, m, p] * source_padded[n, c, p * stride + k * dilation].

    A layer with ``FORMS.narrow_channels`` or more input channels takes one strided Slice of a
    transposed source per kernel offset k and one matrix product with the gradient for dW[:, :, k]
    (:func:`_matrix_weight_gradient`); a depthwise one, one product and one sum per offset
    (:func:`_depthwise_weight_gradient`); a narrower or grouped one is one Conv
    (:func:`_swapped_weight_gradient`). Each is the work of ORT's ConvGrad (im2col and GEMM)
    in standard operators.
    """
    offsets = list(itertools.product(*(range(k) for k in window.kernel)))
    source_spatial = c.type_of(source).static_dims(2)
    depthwise = weight_shape[0] == groups and weight_shape[1] == 1
    if out_spatial is None or source_spatial is None:  # sizes known at run time only: the form that needs none
        return _swapped_weight_gradient(c, source, gradient, window, groups, weight_shape)
    if depthwise and FORMS.depthwise_products and len(offsets) > 1:
        return _depthwise_weight_gradient(c, source, gradient, window, offsets, source_spatial, out_spatial,
                                          weight_shape)
    if groups > 1 or weight_shape[1] < FORMS.narrow_channels:
        return _swapped_weight_gradient(c, source, gradient, window, groups, weight_shape)
    return _matrix_weight_gradient(c, source, gradient, window, offsets, source_spatial, out_spatial, weight_shape)


def _spatial_first(c: NodeContext, x: str) -> str:
    """(N, C, spatial...) as (P, N, C), P the spatial positions: transposed as (N, C, P), which ORT does as a
    matrix, where it moves (N, C, spatial...) element by element."""
    return c.writer.op("Transpose", [c.writer.reshape(x, [0, 0, -1])], perm=[2, 0, 1])


def _windows(c: NodeContext, source: str, window: Window, offsets: list[tuple[int, ...]], axes: list[int],
             pads: list[int], out_spatial: tuple[int, ...]) -> list[str]:
    """The padded ``source``'s values under each kernel offset, one strided Slice along ``axes`` per offset."""
    w = c.writer
    if any(pads):
        source = w.op("Pad", [source, w.ints(pads)])
    taken = []
    for offset in offsets:
        starts = [o * dil for o, dil in zip(offset, window.dilations)]
        ends = [s + (n - 1) * stride + 1 for s, n, stride in zip(starts, out_spatial, window.strides)]
        taken.append(w.op("Slice", [source, w.ints(starts), w.ints(ends), w.ints(axes), w.ints(window.strides)]))
    return taken


def _spatial_first_windows(c: NodeContext, source: str, source_spatial: tuple[int, ...], channels: int,
                           window: Window, offsets: list[tuple[int, ...]], out_spatial: tuple[int, ...]) -> list[str]:
    """The source's windows taken from a spatial-first (spatial..., N, C) copy, each as (P*N, C)."""
    w = c.writer
    source_t = w.reshape(_spatial_first(c, source), [*source_spatial, -1, channels])
    pads = [*window.begin, 0, 0, *window.end, 0, 0]
    return [w.reshape(taken, [-1, channels])
            for taken in _windows(c, source_t, window, offsets, list(range(len(window.kernel))), pads, out_spatial)]


def _matrix_weight_gradient(c: NodeContext, source: str, gradient: str, window: Window,
                            offsets: list[tuple[int, ...]], source_spatial: tuple[int, ...] | None,
                            out_spatial: tuple[int, ...] | None, weight_shape: tuple[int, ...]) -> str:
    """dW[:, :, k] = gradient (M, N*P) x window_k (N*P, C), one Gemm per kernel offset k.

    The source goes channels first, (C, N, spatial...), where a window's rows are long; where
    they are short, spatial first, (spatial..., N, C), so that each row of a window is one run
    of columns x N x C values rather than N x C runs of a few (docs/EXPORTER.md has the figures).
    """
    w = c.writer
    in_channels, out_channels = weight_shape[1], weight_shape[0]
    spatial = list(range(2, 2 + len(window.kernel)))
    if len(offsets) > 1 and out_spatial[-1] <= FORMS.short_rows:
        windows = _spatial_first_windows(c, source, source_spatial, in_channels, window, offsets, out_spatial)
        rows = w.reshape(w.op("Transpose", [gradient], perm=[1, *spatial, 0]), [out_channels, -1])  # (M, P*N)
        transposed = 0
    else:
        source_t = w.op("Transpose", [source], perm=[1, 0, *spatial])  # (C, N, spatial...)
        pads = [0, 0, *window.begin, 0, 0, *window.end]
        windows = [w.reshape(taken, [in_channels, -1])  # (C, N*P)
                   for taken in _windows(c, source_t, window, offsets, spatial, pads, out_spatial)]
        rows = w.reshape(w.op("Transpose", [gradient], perm=[1, 0, *spatial]), [out_channels, -1])  # (M, N*P)
        transposed = 1
    products = [w.op("Gemm", [rows, taken], transB=transposed) for taken in windows]  # (M, C) each
    if len(products) == 1:
        return w.reshape(products[0], list(weight_shape))
    stacked = w.reshape(w.op("Concat", products, axis=0), [len(offsets), out_channels, in_channels])  # (K, M, C)
    return w.reshape(w.op("Transpose", [stacked], perm=[1, 2, 0]), list(weight_shape))


def _depthwise_weight_gradient(c: NodeContext, source: str, gradient: str, window: Window,
                               offsets: list[tuple[int, ...]], source_spatial: tuple[int, ...],
                               out_spatial: tuple[int, ...] | None, weight_shape: tuple[int, ...]) -> str:
    """dW[c, 0, k] = the sum over rows of gradient (P*N, C) * window_k (P*N, C), both spatial first.

    The swapped Conv's one group per channel, each with a kernel as large as an image, is
    several times slower in ORT than these whole-tensor products and column sums.
    """
    w = c.writer
    channels = weight_shape[0]
    rows = w.reshape(_spatial_first(c, gradient), [-1, channels])  # (P*N, C)
    sums = [w.reduce("ReduceSum", w.op("Mul", [rows, taken]), [0])  # (1, C)
            for taken in _spatial_first_windows(c, source, source_spatial, channels, window, offsets, out_spatial)]
    return w.reshape(w.op("Transpose", [w.op("Concat", sums, axis=0)], perm=[1, 0]), list(weight_shape))


def _swapped_weight_gradient(c: NodeContext, source: str, gradient: str, window: Window, groups: int,
                             weight_shape: tuple[int, ...]) -> str:
    """dW as one Conv: the source with its batch and channels-in-group axes swapped is the input, the gradient
    (batch and channels swapped) the kernels, one group per convolution group; stride and dilation trade places."""
    w = c.writer
    d = len(window.kernel)
    in_per_group = weight_shape[1]
    source_spatial = w.op("Slice", [w.op("Shape", [source]), w.ints([2]), w.ints([2 + d])])
    split = w.op("Reshape", [source, w.op("Concat", [w.ints([0, groups, in_per_group]), source_spatial], axis=0)])
    swapped = w.op("Transpose", [split], perm=[2, 1, 0, *range(3, 3 + d)])  # (C/G, G, N, spatial...)
    swapped = w.op("Reshape", [swapped, w.op("Concat", [w.ints([in_per_group, -1]), source_spatial], axis=0)])
    kernels = w.op("Transpose", [gradient], perm=[1, 0, *range(2, 2 + d)])  # (M, N, out...)
    full = w.op("Conv", [swapped, kernels], group=groups, strides=list(window.dilations),
                dilations=list(window.strides), pads=[*window.begin, *window.end])  # (C/G, M, >= kernel)
    cropped = w.op("Slice", [full, w.ints([0] * d), w.ints(list(window.kernel)), w.ints(list(range(2, 2 + d)))])
    return w.op("Transpose", [cropped], perm=[1, 0, *range(2, 2 + d)])


def _input_gradient(c: NodeContext, dy: str, weight: str, window: Window, groups: int,
                    weight_shape: tuple[int, ...], x: str, x_spatial: tuple[int, ...] | None,
                    out_spatial: tuple[int, ...] | None) -> str:
    """A convolution's dX: ConvTranspose(dY, W); with stride 1, unless the layer widens its channels with a
    kernel larger than 1x1, the equal and faster "full" Conv of dY with W's kernels flipped and its input and
    output channels swapped within each group (a widening layer's dX is faster as ConvTranspose: the flipped
    Conv's im2col would be of the wider side; a 1x1 kernel has no im2col)."""
    w = c.writer
    d = len(window.kernel)
    pads = [window.span(a) - 1 - window.begin[a] for a in range(d)] + \
           [window.span(a) - 1 - window.end[a] for a in range(d)]
    widens = (FORMS.widening_transposed and weight_shape[0] // groups > weight_shape[1]
              and any(k > 1 for k in window.kernel))
    if any(s != 1 for s in window.strides) or min(pads) < 0 or widens:
        if x_spatial is None or out_spatial is None:
            return fitted_transposed(c, dy, weight, window, groups, x)
        return w.op("ConvTranspose", [dy, weight], group=groups, **window.transposed(x_spatial, out_spatial))
    out_channels, in_per_group = weight_shape[0], weight_shape[1]
    per_group = w.reshape(weight, [groups, out_channels // groups, in_per_group, *weight_shape[2:]])
    swapped = w.op("Transpose", [per_group], perm=[0, 2, 1, *range(3, 3 + d)])
    swapped = w.reshape(swapped, [groups * in_per_group, out_channels // groups, *weight_shape[2:]])
    axes = list(range(2, 2 + d))
    flipped = w.op("Slice", [swapped, w.ints([-1] * d), w.ints([-(2 ** 62)] * d), w.ints(axes), w.ints([-1] * d)])
    return w.op("Conv", [dy, flipped], group=groups, dilations=list(window.dilations), pads=pads)


def fitted_transposed(c: NodeContext, dy: str, weight: str, window: Window, groups: int, x: str) -> str:
    """ConvTranspose(dY, W) without the end padding, then cut or padded at the end to ``x``'s run-time size:
    a strided layer's dX where the sizes are known only at run time."""
    w = c.writer
    d = len(window.kernel)
    spread = w.op("ConvTranspose", [dy, weight], group=groups, strides=list(window.strides),
                  dilations=list(window.dilations), pads=[*window.begin, *([0] * d)])
    axes = w.ints(list(range(2, 2 + d)))
    target = w.op("Slice", [w.op("Shape", [x]), w.ints([2]), w.ints([2 + d])])
    cut = w.op("Slice", [spread, w.ints([0] * d), target, axes])
    missing = w.op("Sub", [target, w.op("Slice", [w.op("Shape", [cut]), w.ints([2]), w.ints([2 + d])])])
    return w.op("Pad", [cut, w.op("Concat", [w.ints([0] * (d + 4)), missing], axis=0)])


@gradient("Conv", inputs=(0, 1, 2))
def conv(c: GradientContext) -> dict[int, str]:
    """dX by a (transposed) convolution of dY; dW by matrix products per kernel offset; dB = sum of dY."""
    x, weight, y = c.input(0), c.input(1), c.output(0)
    dy = c.dy()
    weight_shape = c.static(weight, what="the shape")
    x_spatial, out_spatial = c.type_of(x).static_dims(2), c.type_of(y).static_dims(2)
    window = window_of(c, x_spatial, tuple(c.attr("kernel_shape", weight_shape[2:])))
    groups = c.attr("group", 1)
    result = {}
    if c.wants(0):
        result[0] = _input_gradient(c, dy, weight, window, groups, weight_shape, x, x_spatial, out_spatial)
    if c.wants(1):
        result[1] = _weight_gradient(c, x, dy, window, groups, out_spatial, weight_shape)
    if c.wants(2):
        result[2] = channel_sum(c, dy, y)
    return result


@gradient("ConvTranspose", inputs=(0, 1, 2))
def conv_transpose(c: GradientContext) -> dict[int, str]:
    """dX = Conv(dY, W); dW as a convolution's with dY and X in swapped roles."""
    x, weight, y = c.input(0), c.input(1), c.output(0)
    dy = c.dy()
    if c.attr("output_shape") or c.attr("auto_pad", "NOTSET") != "NOTSET":
        raise c.refuse("only explicit pads are supported (no output_shape, no auto_pad)")
    weight_shape = c.static(weight, what="the shape")
    x_spatial = c.type_of(x).static_dims(2)
    window = window_of(c, x_spatial, tuple(c.attr("kernel_shape", weight_shape[2:])))
    groups = c.attr("group", 1)
    result = {}
    if c.wants(0):
        result[0] = c.writer.op("Conv", [dy, weight], group=groups, strides=list(window.strides),
                                dilations=list(window.dilations), pads=[*window.begin, *window.end])
    if c.wants(1):
        c.types.setdefault(dy, c.type_of(y))
        result[1] = _weight_gradient(c, dy, x, window, groups, x_spatial, weight_shape)
    if c.wants(2):
        result[2] = channel_sum(c, dy, y)
    return result
