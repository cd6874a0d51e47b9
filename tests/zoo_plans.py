"""Plan folders the runtime, security and CLI tests train: a zoo model, exported into stages; groups written
into a plan's placement.json."""

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


def write_groups(plan_dir: Path, members: list[tuple[str, ...]], shares: list[tuple[float, ...]]) -> None:
    """A placement.json for the plan in ``plan_dir``: stage ``k`` on ``members[k]`` workers with ``shares[k]``."""
    import json
    from dataclasses import asdict

    from edgert.exporter.device_plan import PLACEMENT_NAME, PlannedPlacement, PlannedStage
    from edgert.manifest import load_manifest

    stages = []
    for entry, urls, parts in zip(load_manifest(plan_dir).stages, members, shares):
        names = tuple(f"w{entry.index}.{j}" for j in range(len(urls)))
        group = {} if len(urls) == 1 else {"devices": names, "urls": tuple(urls), "shares": tuple(parts)}
        stages.append(PlannedStage(entry.index, entry.blocks, names[0], urls[0], 1.0, 1, 1, **group))
    placement = PlannedPlacement(stages=tuple(stages), link_codecs=("none",) * (len(stages) - 1),
                                 link_ms=(1.0,) * (len(stages) - 1), bottleneck_ms=1.0, predicted_step_ms=10.0,
                                 unused_devices=(), schedule="gpipe", batch_size=64, micro_batches=4,
                                 memory_mode="recompute")
    (plan_dir / PLACEMENT_NAME).write_text(json.dumps(asdict(placement)))
