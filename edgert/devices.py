"""``devices.json``: what each device measured about itself and its links (docs/DEVICES.md).

Written by ``edgert profile``, read by the planner and the latency predictor, updated by
the coordinator as training reports real times. The one definition of the format.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edgert.errors import EdgertError
from edgert.manifest import MEMORY_MODES

FORMAT = "edgert-devices"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class BlockTiming:
    """One block's measured cost on one device, for one micro-batch of ``DevicesFile.micro_batch``."""

    block: str
    forward_ms: float
    backward_ms: float  # the backward call: recomputed forward + gradients
    peak_bytes: int = 0  # memory the block's backward needed beyond the resident state
    optimizer_ms: float = 0.0  # one optimizer step over the block's parameters


@dataclass(frozen=True)
class DeviceProfile:
    """A device: its measured block times, memory and cores."""

    name: str
    url: str = ""
    memory_bytes: int = 0  # available for training (0 = unknown, unlimited)
    cores: int = 1
    slowdown: str = "0:1"  # emulated slowdown, when the device is an emulation
    blocks: tuple[BlockTiming, ...] = ()
    whole: BlockTiming | None = None  # the whole model as one stage: with the units, a stage's fixed cost

    def timing(self, block: str) -> BlockTiming | None:
        for timing in self.blocks:
            if timing.block == block:
                return timing
        return None


@dataclass(frozen=True)
class LinkProfile:
    """A measured link from one device to another (direction matters on Wi-Fi)."""

    source: str
    target: str
    bandwidth_bytes_per_s: float
    rtt_ms: float


@dataclass(frozen=True)
class DevicesFile:
    """Every device and link measured for one model at one micro-batch size."""

    model_sha256: str
    blocks: tuple[str, ...]
    micro_batch: int
    devices: tuple[DeviceProfile, ...]
    links: tuple[LinkProfile, ...] = ()
    notes: dict[str, Any] = field(default_factory=dict)
    memory_mode: str = "recompute"  # how the backward was run (stash: its time includes the forward call)

    def device(self, name: str) -> DeviceProfile:
        for device in self.devices:
            if device.name == name:
                return device
        raise EdgertError(f"devices file has no device {name!r}; it has {', '.join(d.name for d in self.devices)}")

    def link(self, source: str, target: str) -> LinkProfile | None:
        for link in self.links:
            if (link.source, link.target) == (source, target):
                return link
        return None

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "format_version": FORMAT_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DevicesFile:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise EdgertError(f"not an edgert devices file (expected format {FORMAT!r})")
        if data.get("format_version") != FORMAT_VERSION:
            raise EdgertError(f"devices file version {data.get('format_version')!r} is not supported")
        memory_mode = data.get("memory_mode", "recompute")
        if memory_mode not in MEMORY_MODES:
            raise EdgertError(f"devices file is malformed: memory_mode {memory_mode!r} is not one of "
                              f"{', '.join(MEMORY_MODES)}")
        try:
            devices = tuple(
                DeviceProfile(**{**d, "blocks": tuple(BlockTiming(**b) for b in d.get("blocks", [])),
                                 "whole": BlockTiming(**d["whole"]) if d.get("whole") else None})
                for d in data["devices"])
            return cls(model_sha256=data["model_sha256"], blocks=tuple(data["blocks"]),
                       micro_batch=int(data["micro_batch"]), devices=devices,
                       links=tuple(LinkProfile(**link) for link in data.get("links", [])),
                       notes=dict(data.get("notes", {})), memory_mode=memory_mode)
        except (KeyError, TypeError, ValueError) as error:
            raise EdgertError(f"devices file is malformed: {type(error).__name__}: {error}") from None


def save_devices(devices: DevicesFile, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(devices.to_json(), indent=2) + "\n")
    return path


def load_devices(path: str | Path) -> DevicesFile:
    path = Path(path)
    if not path.is_file():
        raise EdgertError(f"{path}: no such devices file (write one with `edgert profile`)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise EdgertError(f"{path}: not valid JSON ({error})") from None
    return DevicesFile.from_json(data)
