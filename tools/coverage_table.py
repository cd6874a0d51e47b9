#!/usr/bin/env python3
"""The torch coverage matrix as a table: every model of tests/exporter/torch_zoo.py, exported by both of torch's
exporters in training and eval mode, cut into 1, 2 and 4 stages, its one batch's loss and gradients against torch
autograd in float64 (the judgement of tests/exporter/torch_coverage.py, the same as the tests').

Writes a markdown table (model, exporter, mode, stages, worst group's error and noise floor, pass/fail, and for a
case that cannot go through the one line edgert gives), rewritten after every model so that a long run shows its
progress; prints one line per case. Needs the ``torch`` extra. The full matrix takes hours on 2 cores.

Usage: python tools/coverage_table.py [--models resnet18,bert_small] [--exporters torchscript] [--modes training]
                                      [--stages 1,2,4] [--out coverage.md] [--exports DIR]

``--exports DIR`` keeps the ONNX exports there and re-uses them on the next run (the dynamo exporter takes minutes
per model on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before onnxruntime and torch load

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's tests/ package

from tests.exporter.torch_coverage import (  # noqa: E402
    CHAOTIC,
    ERROR_FLOOR,
    EXACT_TOLERANCE,
    NOISE_FACTOR,
    CaseResult,
    export_once,
    one_line,
    run_case,
)
from tests.exporter.torch_zoo import EXPORTERS, MODELS, MODES  # noqa: E402

HEADER = ["| model | exporter | mode | stages | largest error | noise floor | float64 error | chaotic groups | result "
          "| worst group / why not |",
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]


def row(result: CaseResult) -> str:
    """One table row."""
    def figure(value: float | None) -> str:
        return "" if value is None else f"{value:.1e}"

    if result.passed:
        verdict, detail = "pass", f"{result.worst_group} ({result.compared}/{result.trained} parameters)"
    elif result.largest_error is None:
        verdict, detail = "fail", result.reason
    else:
        verdict = "fail"
        detail = result.reason or (f"{result.worst_group}: above tolerance {result.tolerance:.1e}"
                                   if result.largest_error > result.tolerance else "float64 error above tolerance")
    detail = detail.replace("|", "\\|")
    return (f"| {result.model} | {result.exporter} | {result.mode} | {result.stages} | {figure(result.largest_error)} "
            f"| {figure(result.noise_floor)} | {figure(result.exact_error)} | {result.chaotic} | {verdict} "
            f"| {detail} |")


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for package in ("torch", "torchvision", "timm", "transformers", "onnxscript", "onnxruntime-training-cpu",
                    "onnxruntime"):
        try:
            found.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            continue
    return ", ".join(found)


def _export(name: str, exporter: str, mode: str, folder: Path) -> Path:
    kept = folder / f"{name}-{exporter}-{mode}.onnx"
    if kept.exists():
        return kept
    folder.mkdir(parents=True, exist_ok=True)
    return export_once(MODELS[name], exporter, mode, folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--exporters", default=",".join(EXPORTERS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--stages", default="1,2,4")
    parser.add_argument("--out", type=Path, default=Path("coverage.md"))
    parser.add_argument("--exports", type=Path, help="a folder to keep the ONNX exports in and re-use them from")
    args = parser.parse_args()
    stages = [int(s) for s in args.stages.split(",")]
    intro = [f"Written by `python tools/coverage_table.py` ({_versions()}). One batch of 8; errors are relative to "
             "the largest float64 gradient of the worst group (the torch module whose error is the largest fraction "
             f"of its tolerance, max({NOISE_FACTOR:g} x noise floor, {ERROR_FLOOR:g})); the noise floor is torch "
             "float32's own error against float64 in that group; the float64 error is the plan's own graphs run in "
             f"float64 against torch in float64 (tolerance {EXACT_TOLERANCE:g}); where torch float32 is more than "
             f"{CHAOTIC:g} off float64 in some group (chaotic groups), every group may be as far off as torch "
             "float32's worst (tests/exporter/torch_coverage.py says why).", ""]
    rows: list[str] = []
    passed = total = 0
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="coverage-") as scratch:
        for name in args.models.split(","):
            for exporter in args.exporters.split(","):
                for mode in args.modes.split(","):
                    folder = Path(scratch) / f"{name}-{exporter}-{mode}"
                    folder.mkdir()
                    try:
                        path = _export(name, exporter, mode, args.exports or folder)
                    except Exception as error:  # noqa: BLE001 - a failed export is a row of the table
                        results = [CaseResult(name, exporter, mode, n, reason=f"torch export: {one_line(error)}")
                                   for n in stages]
                    else:
                        results = []
                        for n in stages:
                            (folder / f"case-{n}").mkdir()
                            results.append(run_case(name, exporter, mode, n, path, folder / f"case-{n}"))
                    for result in results:
                        rows.append(row(result))
                        passed += result.passed
                        total += 1
                        print(f"{name} {exporter} {mode} {result.stages}: {result.verdict()} "
                              f"[{result.seconds:.0f} s]", flush=True)
            summary = [f"{passed} of {total} cases pass ({(time.monotonic() - started) / 60:.0f} min so far).", ""]
            args.out.write_text("\n".join(intro + summary + HEADER + rows) + "\n")
    print(f"{passed} of {total} cases pass; wrote {args.out}")


if __name__ == "__main__":
    main()
