#!/usr/bin/env python3
"""Each standard-operator form of a convolution's gradients against the others, one layer at a time.

For every layer shape (by default each distinct convolution of the zoo's models, then three
larger ones) the gradient graph of that one convolution (``loss = sum(conv(x) * g)``) is built
by edgert's gradient builder once with the chosen forms (``FORMS`` in
exporter/gradients/convolution.py), once with each alternative that changes the graph for that
shape, and, where the training build is installed, by it (``ConvGrad``):

- ``channels_first``: a wide layer's dW windows sliced from a channels-first copy of the input
  (``short_rows=0``), the form before short rows went spatial first; ``spatial_first``: from the
  spatial-first copy however long the rows (``short_rows`` unbounded);
- ``swapped``: dW as one Conv of the input with batch and channels swapped (``narrow_channels``
  unbounded, ``depthwise_products=False``); ``per_offset``: one Gemm per kernel offset however
  few the channels (``narrow_channels=1``);
- ``flipped_dx``: a widening layer's stride-1 dX as the flipped Conv (``widening_transposed=False``).

All forms of a shape, and the training build's own graph, run in interleaved rounds (1 thread);
printed per shape: the training build's ms, the chosen form's ms and its ratio to the training
build, and each alternative's ms over the chosen form's (above 1: the chosen form is faster);
every form must compute the same gradients (the training build's, where it runs).
These are the single-layer figures of docs/EXPORTER.md ("Measured").

Usage: python tools/conv_forms.py [--shapes C,H,M,K,S[,G]/...] [--batch 64] [--rounds 30] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before onnxruntime loads

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import (  # noqa: E402
    TensorProto,
    helper,
    numpy_helper,  # noqa: E402
)

from edgert.exporter.gradients import convolution  # noqa: E402
from edgert.exporter.gradients.builder import build_gradient_graph  # noqa: E402
from edgert.exporter.gradients.shapes import forward_types  # noqa: E402
from edgert.models import build_model, list_models  # noqa: E402
from edgert.ort_import import training_folder  # noqa: E402

LARGER = ((16, 28, 32, 3, 1, 1), (32, 32, 32, 3, 1, 1), (64, 16, 64, 3, 1, 1))
ALTERNATIVES = {
    "channels_first": {"short_rows": 0},
    "spatial_first": {"short_rows": 1 << 30},
    "swapped": {"narrow_channels": 1 << 30, "depthwise_products": False},
    "per_offset": {"narrow_channels": 1},
    "flipped_dx": {"widening_transposed": False},
}


@dataclasses.dataclass(frozen=True)
class Layer:
    """One convolution: input channels, square image size, output channels, square kernel, stride, groups."""

    channels: int
    size: int
    out_channels: int
    kernel: int
    stride: int = 1
    groups: int = 1

    def __str__(self) -> str:
        text = f"C{self.channels} {self.size}x{self.size} M{self.out_channels} k{self.kernel} s{self.stride}"
        return text + (f" g{self.groups}" if self.groups > 1 else "")

    @property
    def weight_shape(self) -> tuple[int, int, int, int]:
        return self.out_channels, self.channels // self.groups, self.kernel, self.kernel

    @property
    def out_size(self) -> int:
        """The output's image size ("same" padding)."""
        return (self.size + 2 * (self.kernel // 2) - self.kernel) // self.stride + 1

    def forward(self) -> onnx.ModelProto:
        """``loss = ReduceSum(Conv(x, W) * g)`` with "same" padding, so that dY = g. ``W`` is an input, as a
        stage's parameters are (an initializer would let ORT fold and prepack what depends on it alone)."""
        pad = self.kernel // 2
        nodes = [helper.make_node("Conv", ["x", "W"], ["y"], kernel_shape=[self.kernel] * 2, strides=[self.stride] * 2,
                                  pads=[pad] * 4, group=self.groups),
                 helper.make_node("Mul", ["y", "g"], ["p"]),
                 helper.make_node("ReduceSum", ["p"], ["loss"], keepdims=0)]
        out = self.out_size
        inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", self.channels, self.size, self.size]),
                  helper.make_tensor_value_info("g", TensorProto.FLOAT, ["N", self.out_channels, out, out]),
                  helper.make_tensor_value_info("W", TensorProto.FLOAT, list(self.weight_shape))]
        graph = helper.make_graph(nodes, "conv", inputs, [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def zoo_layers() -> list[Layer]:
    """Each distinct convolution of the zoo's models (square images and kernels, "same" padding)."""
    found: dict[Layer, None] = {}
    for spec in list_models():
        model = onnx.shape_inference.infer_shapes(build_model(spec.name))
        shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
                  for v in [*model.graph.value_info, *model.graph.input]}
        weights = {i.name: list(i.dims) for i in model.graph.initializer}
        for node in model.graph.node:
            if node.op_type != "Conv" or node.input[1] not in weights or len(shapes.get(node.input[0], ())) != 4:
                continue
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            out_channels, _, kernel, _ = weights[node.input[1]]
            _, channels, size, _ = shapes[node.input[0]]
            stride, groups = attrs.get("strides", [1])[0], attrs.get("group", 1)
            found[Layer(channels, size, out_channels, kernel, stride, groups)] = None
    return list(found)


def gradients(forward: onnx.ModelProto, forms: convolution.ConvForms) -> onnx.ModelProto:
    """edgert's gradient graph of ``forward``'s loss for x and W, its convolution written in ``forms``."""
    chosen = convolution.FORMS
    convolution.FORMS = forms
    model = onnx.ModelProto()
    model.CopyFrom(forward)
    model.graph.initializer.append(numpy_helper.from_array(np.array(1.0, np.float32), "loss_grad"))
    try:
        return build_gradient_graph(model, {"loss": "loss_grad"}, ["x", "W"], forward_types(forward),
                                    "conv_forms").model
    finally:
        convolution.FORMS = chosen


def training_build_gradients(forward: onnx.ModelProto) -> onnx.ModelProto:
    """The training build's own gradient graph (ConvGrad), where it is installed."""
    from edgert.exporter.ort_training import gradient_graph

    return gradient_graph(forward, "loss", {"x", "W"})


def session(model: onnx.ModelProto):
    from onnxruntime import InferenceSession, SessionOptions

    options = SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    return InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def measure(layer: Layer, batch: int, rounds: int) -> dict:
    """ms per run of each form of ``layer``'s gradients (interleaved rounds, medians) and the ratios."""
    forward = layer.forward()
    models = {"chosen": gradients(forward, convolution.FORMS)}
    if training_folder() is not None:
        models["training"] = training_build_gradients(forward)
    signature = [n.op_type for n in models["chosen"].graph.node]
    for name, change in ALTERNATIVES.items():
        model = gradients(forward, dataclasses.replace(convolution.FORMS, **change))
        if [n.op_type for n in model.graph.node] != signature:
            models[name] = model
    sessions = {name: session(model) for name, model in models.items()}
    rng = np.random.default_rng(1)
    out = layer.out_size
    feeds = {"x": rng.standard_normal((batch, layer.channels, layer.size, layer.size)).astype(np.float32),
             "g": rng.standard_normal((batch, layer.out_channels, out, out)).astype(np.float32),
             "W": rng.standard_normal(layer.weight_shape).astype(np.float32)}
    results: dict[str, dict[str, np.ndarray]] = {}
    times: dict[str, list[float]] = {name: [] for name in sessions}
    error = 0.0
    for index in range(rounds + 3):
        for name in (list(sessions) if index % 2 else list(reversed(sessions))):
            run = sessions[name]
            feed = {i.name: feeds[i.name] for i in run.get_inputs()}
            names = [o.name for o in run.get_outputs()]
            started = time.perf_counter()
            result = dict(zip(names, run.run(names, feed)))
            if index >= 3:
                times[name].append(time.perf_counter() - started)
            elif index == 0:
                results[name] = result
    reference = results.get("training", results["chosen"])
    for result in results.values():  # every form computes the same gradients (the training build's, where it is)
        for output in ("x_grad", "W_grad"):
            value = reference[output]
            scale = max(float(np.max(np.abs(value))), 1e-12)
            error = max(error, float(np.max(np.abs(result[output] - value))) / scale)
    ms = {name: float(np.median(values)) * 1000 for name, values in times.items()}
    row = {"layer": str(layer), "ms": {k: round(v, 3) for k, v in ms.items()}, "max_relative_error": error,
           **{f"{name}_vs_chosen": round(ms[name] / ms["chosen"], 3) for name in ALTERNATIVES if name in ms}}
    if "training" in ms:
        row["chosen_vs_training"] = round(ms["chosen"] / ms["training"], 3)
    return row


def parse_shapes(text: str) -> list[Layer]:
    return [Layer(*(int(v) for v in item.split(","))) for item in text.split("/") if item]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_shapes, default=None,
                        help="C,H,M,K,S[,G] layers separated by '/' (default: the zoo's, then three larger)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=30, help="timed runs of each form, interleaved")
    parser.add_argument("--json", action="store_true", help="one JSON object per layer")
    args = parser.parse_args()
    layers = args.shapes or [*zoo_layers(), *(Layer(*shape) for shape in LARGER)]
    for layer in layers:
        row = measure(layer, args.batch, args.rounds)
        if args.json:
            print(json.dumps(row), flush=True)
            continue
        others = "  ".join(f"{name} {row['ms'][name]:.3f} ms ({row[name + '_vs_chosen']:.2f}x)"
                           for name in ALTERNATIVES if name in row["ms"])
        training = (f"training {row['ms']['training']:7.3f} ms  " if "training" in row["ms"] else "")
        versus = f"({row['chosen_vs_training']:.2f}x)  " if "chosen_vs_training" in row else ""
        print(f"{row['layer']:28s} {training}chosen {row['ms']['chosen']:7.3f} ms {versus}{others}  "
              f"(error {row['max_relative_error']:.0e})", flush=True)


if __name__ == "__main__":
    main()
