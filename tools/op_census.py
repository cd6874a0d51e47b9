#!/usr/bin/env python3
"""Which ONNX operators the torch coverage models use, as each of torch's exporters writes them.

For every model of the coverage matrix (tests/exporter/torch_zoo.py), exported with the TorchScript
exporter (``dynamo=False``, opset 17) and torch's default (``dynamo=True``), in training and eval mode,
this lists each graph's operators (domain, op_type, count) with their notable attributes (every
attribute's distinct values) and how many of a shape-taking operator's shape inputs are computed at run
time (not an initializer or a Constant): what a gradient builder must cover. Needs the ``torch`` extra.

Usage: python tools/op_census.py [--models resnet18,gpt2_small] [--out op_census.md]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import onnx
from onnx import helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's tests/ package

from tests.exporter.torch_zoo import EXPORTERS, MODELS, MODES, export_onnx  # noqa: E402

# Operators whose listed input positions give a shape, sizes, indices or bounds: computed ones matter to a builder.
SHAPE_INPUTS = {"Reshape": (1,), "Expand": (1,), "Tile": (1,), "ConstantOfShape": (0,), "Slice": (1, 2, 3, 4),
                "Resize": (1, 2, 3), "Pad": (1,), "Range": (0, 1, 2), "Squeeze": (1,), "Unsqueeze": (1,),
                "ReduceMean": (1,), "ReduceSum": (1,), "ReduceMax": (1,), "Split": (1,), "Gather": (1,),
                "TopK": (1,), "CumSum": (1,)}
LONG_LIST = 8  # attribute lists longer than this are shown by their length


class OpUse:
    """One operator's uses in one graph: count, distinct attribute values, computed shape inputs."""

    def __init__(self) -> None:
        self.count = 0
        self.attributes: dict[str, set[str]] = defaultdict(set)
        self.computed = 0  # uses with a computed shape input

    def describe(self) -> str:
        parts = [f"{name}={'/'.join(sorted(values))}" for name, values in sorted(self.attributes.items())]
        if self.computed:
            parts.append(f"computed shape input in {self.computed} of {self.count}")
        return "; ".join(parts)


def census(model: onnx.ModelProto) -> dict[tuple[str, str], OpUse]:
    """(domain, op_type) -> its uses, over the main graph and every local function."""
    static = {i.name for i in model.graph.initializer}
    uses: dict[tuple[str, str], OpUse] = defaultdict(OpUse)
    nodes = list(model.graph.node) + [n for f in model.functions for n in f.node]
    static |= {o for n in nodes if n.op_type == "Constant" for o in n.output}
    for node in nodes:
        use = uses[node.domain or "ai.onnx", node.op_type]
        use.count += 1
        for attribute in node.attribute:
            use.attributes[attribute.name].add(_attribute_text(attribute))
        positions = SHAPE_INPUTS.get(node.op_type, ())
        if any(p < len(node.input) and node.input[p] and node.input[p] not in static for p in positions):
            use.computed += 1
    return uses


def _attribute_text(attribute: onnx.AttributeProto) -> str:
    value = helper.get_attribute_value(attribute)
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, list) and len(value) > LONG_LIST:
        return f"[{len(value)} values]"
    if isinstance(value, list):
        return "[" + ",".join(v.decode() if isinstance(v, bytes) else f"{v:g}" if isinstance(v, float) else str(v)
                              for v in value) + "]"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, int | str):
        return str(value)
    return type(value).__name__  # a tensor or a graph


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated names (default: all)")
    parser.add_argument("--out", type=Path, default=Path("op_census.md"))
    args = parser.parse_args()
    names = args.models.split(",")
    lines = ["# Operator census of the torch coverage models", "",
             "Written by `python tools/op_census.py` (torch " + _version("torch") + ", torchvision "
             + _version("torchvision") + ", timm " + _version("timm") + ", transformers " + _version("transformers")
             + "). Per model, per export: each operator with its count and its attributes' distinct values; "
             "'computed shape input' counts the uses whose shape/index/bounds input is neither an initializer nor "
             "a Constant (it is computed at run time, e.g. from `Shape`).", ""]
    union: dict[tuple[str, str], set[str]] = defaultdict(set)
    with tempfile.TemporaryDirectory(prefix="op-census-") as scratch:
        for name in names:
            model = MODELS[name]
            lines += [f"## {name}", ""]
            for exporter in EXPORTERS:
                for mode in MODES:
                    started = time.monotonic()
                    label = f"{exporter}, {mode}"
                    try:
                        path = export_onnx(model.module(), model, exporter, mode, Path(scratch) / f"{name}.onnx")
                        exported = onnx.load(str(path))
                    except Exception as error:  # noqa: BLE001 - an export that fails is a census fact
                        lines += [f"### {label}: export failed", "", f"`{_one_line(error)}`", ""]
                        print(f"{name} {label}: export failed: {_one_line(error)}", flush=True)
                        continue
                    uses = census(exported)
                    opsets = ", ".join(f"{o.domain or 'ai.onnx'} {o.version}" for o in exported.opset_import)
                    lines += [f"### {label} (opset {opsets}; {len(exported.graph.node)} nodes, "
                              f"{len(exported.graph.initializer)} initializers, {len(exported.functions)} functions)",
                              "", "| domain | op | count | notable |", "| --- | --- | --- | --- |"]
                    for (domain, op), use in sorted(uses.items()):
                        lines.append(f"| {domain} | {op} | {use.count} | {use.describe()} |")
                        union[domain, op].add(f"{name} ({exporter[0]}{mode[0]})")
                    lines.append("")
                    print(f"{name} {label}: {len(uses)} operators, {time.monotonic() - started:.1f} s", flush=True)
            args.out.write_text("\n".join(lines + _union_lines(union)) + "\n")
    print(f"wrote {args.out}")


def _union_lines(union: dict[tuple[str, str], set[str]]) -> list[str]:
    lines = ["## Every operator, with the exports that use it", "",
             "t/d = TorchScript/dynamo exporter, t/e = training/eval mode.", "",
             "| domain | op | used by |", "| --- | --- | --- |"]
    return lines + [f"| {d} | {op} | {', '.join(sorted(users))} |" for (d, op), users in sorted(union.items())]


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "absent"


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


if __name__ == "__main__":
    main()
