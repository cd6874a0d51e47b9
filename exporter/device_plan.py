"""``edgert plan``: cut a model for the devices a profile measured, and export that plan.

The planner (edgert.exporter.planner.solver) chooses the cuts, the device order, the codecs of
slow links and the threads; this module maps ``devices.json`` onto its problem (through
the same :class:`Replanner` live re-planning uses), exports the plan folder, and writes
``placement.json`` beside the manifest: which device runs which stage, with the predicted
times (docs/PLANNER.md). ``edgert train`` reads it back (:func:`load_placement`) for each link's codec.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from edgert.devices import load_devices
from edgert.exporter.errors import ExportError
from edgert.manifest import Manifest, TrainingConfig
from edgert.run_settings import is_codec_spec
from edgert.typed_data import load_dataclass, load_json_file, satisfies

if TYPE_CHECKING:  # the planner (onnx) is loaded only to plan: `edgert train` reads placement.json without it
    from edgert.exporter.planner.replanner import Replanner

PLACEMENT_NAME = "placement.json"


@dataclass(frozen=True)
class PlannedStage:
    """One stage of an exported placement."""

    index: int
    blocks: tuple[str, ...]
    device: str
    url: str
    compute_ms: float
    forward_threads: int
    backward_threads: int
    # a group (docs/PLANNER.md, "Groups"): every member's device, URL and share, `device` first; empty: `device` alone
    devices: tuple[str, ...] = ()
    urls: tuple[str, ...] = ()
    shares: tuple[float, ...] = ()

    @property
    def member_urls(self) -> tuple[str, ...]:
        """The URLs of the workers holding this stage, its holder of record first."""
        return self.urls or (self.url,)

    @property
    def member_shares(self) -> tuple[float, ...]:
        """Each member's share of every micro-batch."""
        return self.shares or (1.0,)


@dataclass(frozen=True)
class PlannedPlacement:
    """What ``placement.json`` holds."""

    stages: tuple[PlannedStage, ...]
    link_codecs: tuple[str, ...] = field(metadata=satisfies(lambda specs: all(map(is_codec_spec, specs)),
                                                            "must be codec specs"))  # link k: stage k -> k + 1
    link_ms: tuple[float, ...]
    bottleneck_ms: float
    predicted_step_ms: float
    unused_devices: tuple[str, ...]
    schedule: str
    batch_size: int
    micro_batches: int
    memory_mode: str
    side_by_side: bool = False  # planned for forwards beside backwards: edgert train runs so, with each stage's threads
    split_backward: bool = False  # planned for weight gradients once a step: edgert train runs so

    @property
    def workers(self) -> list[str]:
        """The ``--workers`` list for ``edgert train``: every stage's members, in stage order."""
        return [url for stage in self.stages for url in stage.member_urls]

    def threads(self) -> dict[str, tuple[int, int]]:
        """Each planned worker's (forward, backward) ORT threads, by URL (a group's members share its split)."""
        return {url: (stage.forward_threads, stage.backward_threads) for stage in self.stages
                for url in stage.member_urls if url}


def load_placement(plan_dir: Path) -> PlannedPlacement | None:
    """The plan folder's ``placement.json`` (None: the plan was not made by ``edgert plan``)."""
    path = Path(plan_dir) / PLACEMENT_NAME
    if not path.is_file():
        return None
    return load_json_file(path, lambda data: load_dataclass(PlannedPlacement, data))


def plan_for_devices(model_path: Path, devices_path: Path, out_dir: Path, training: TrainingConfig,
                     batch_size: int = 64, micro_batches: int = 4, schedule: str = "1f1b",
                     memory_mode: str = "recompute", allow_groups: bool = False,
                     side_by_side: bool = False, split_backward: bool = False) -> tuple[Manifest, PlannedPlacement]:
    """Plan ``model_path`` for the devices of ``devices_path`` and export the plan into ``out_dir`` (``side_by_side``:
    for stages that run their forwards beside their backwards; ``split_backward``: for stages that compute their
    weight gradients once a step; docs/PLANNER.md)."""
    from edgert.exporter.planner.replanner import Replanner

    devices = load_devices(devices_path)
    with tempfile.TemporaryDirectory(prefix="edgert-plan-") as scratch_name:
        scratch = Path(scratch_name)
        whole = _whole_model_plan(model_path, scratch / "whole", training)
        replanner = Replanner(scratch / "whole", whole, scratch / "cache", devices=devices_path,
                              batch_size=batch_size, micro_batches=micro_batches, schedule=schedule,
                              memory_mode=memory_mode, side_by_side=side_by_side, split_backward=split_backward)
        return _plan_and_export(replanner, devices, devices_path, out_dir, allow_groups, schedule, batch_size,
                                micro_batches, memory_mode)


def _plan_and_export(replanner: Replanner, devices, devices_path: Path, out_dir: Path, allow_groups: bool,
                     schedule: str, batch_size: int, micro_batches: int,
                     memory_mode: str) -> tuple[Manifest, PlannedPlacement]:
    from edgert.exporter.planner.solver import plan

    if replanner.source.sha256 != devices.model_sha256:
        raise ExportError(f"{devices_path} was measured on another model (sha256 {devices.model_sha256[:12]}...)")
    problem = replanner.problem([d.name for d in devices.devices], allow_groups)
    placement = plan(problem)
    cuts = [replanner.unit_first_block(u) for u in placement.cut_units()]
    manifest = replanner.build(cuts, out_dir)
    urls = {d.name: d.url for d in devices.devices}
    stages = tuple(_planned_stage(k, entry.blocks, s, urls) for k, (entry, s) in enumerate(zip(manifest.stages,
                                                                                              placement.stages)))
    result = PlannedPlacement(stages=stages, link_codecs=tuple(placement.link_codecs),
                              link_ms=tuple(round(v, 3) for v in placement.link_ms),
                              bottleneck_ms=round(placement.bottleneck_ms, 3),
                              predicted_step_ms=round(placement.predicted_step_ms, 3),
                              unused_devices=tuple(placement.unused_devices), schedule=schedule,
                              batch_size=batch_size, micro_batches=micro_batches, memory_mode=memory_mode,
                              side_by_side=replanner.side_by_side, split_backward=replanner.split_backward)
    (out_dir / PLACEMENT_NAME).write_text(json.dumps(asdict(result), indent=2) + "\n")
    return manifest, result


def _planned_stage(index: int, blocks: tuple[str, ...], stage, urls: dict[str, str]) -> PlannedStage:
    """One stage of the planner's placement as placement.json holds it; a group lists every member."""
    first = stage.devices[0]
    group = {} if len(stage.devices) == 1 else {
        "devices": tuple(stage.devices), "urls": tuple(urls.get(d, "") for d in stage.devices),
        "shares": tuple(round(float(share), 6) for share in stage.shares)}
    return PlannedStage(index, blocks, first, urls.get(first, ""), round(stage.compute_ms, 3),
                        stage.forward_threads[0], stage.backward_threads[0], **group)


def _whole_model_plan(model_path: Path, folder: Path, training: TrainingConfig) -> Manifest:
    from edgert.exporter.export import ExportOptions, prepare_analysis, write_plan
    from edgert.exporter.source import load_source_model

    source = load_source_model(model_path)
    return write_plan(source, prepare_analysis(source, ExportOptions()), [], folder, training)
