"""Plan folders the security tests train."""

from __future__ import annotations

from pathlib import Path


def mlp_plan(folder: Path, stages: int) -> Path:
    """The zoo's mlp exported into ``folder/plan`` with ``stages`` stages."""
    from edgert.exporter.export import ExportOptions, export_plan
    from edgert.manifest import TrainingConfig
    from edgert.models import build_model, save_model

    save_model(build_model("mlp"), folder / "mlp.onnx")
    export_plan(folder / "mlp.onnx", folder / "plan", ExportOptions(stages=stages, training=TrainingConfig()))
    return folder / "plan"
