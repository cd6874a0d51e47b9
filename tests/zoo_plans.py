"""Plan folders the runtime, security and CLI tests train: a zoo model, exported into stages."""

from __future__ import annotations

from pathlib import Path


def zoo_plan(folder: Path, stages: int, model: str = "mlp") -> Path:
    """The zoo's ``model`` saved as ``folder/<model>.onnx`` and exported into ``folder/plan`` with ``stages``
    stages (default training settings)."""
    from edgert.exporter.export import ExportOptions, export_plan
    from edgert.models import build_model, save_model

    source = folder / f"{model}.onnx"
    save_model(build_model(model), source)
    export_plan(source, folder / "plan", ExportOptions(stages=stages))
    return folder / "plan"
