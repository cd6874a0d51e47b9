"""``devices.json``: what each device measured about itself and its links (docs/DEVICES.md).

Written by ``edgert profile``, read by the planner and the latency predictor, updated by
the coordinator as training reports real times. The one definition of the format.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edgert.errors import EdgertError, FileFormatError
from edgert.manifest import MEMORY_MODES
from edgert.typed_data import above, at_least, load_dataclass, load_json_file, not_empty, one_of

FORMAT = "edgert-devices"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class BlockTiming:
    """One block's measured cost on one device, for one micro-batch of ``DevicesFile.micro_batch``."""

    block: str
    forward_ms: float = field(metadata=at_least(0))
    backward_ms: float = field(metadata=at_least(0))  # the backward call: recomputed forward + gradients
    peak_bytes: int = field(default=0, metadata=at_least(0))  # memory the backward needed beyond the resident state
    optimizer_ms: float = field(default=0.0, metadata=at_least(0))  # one optimizer step over the block's parameters
    # of backward_ms, the weight gradients a split backward computes once a step (0: not split, or not measured)
    weight_ms: float = field(default=0.0, metadata=at_least(0))


@dataclass(frozen=True)
class ThreadScaling:
    """The whole model's forward and backward on one device with ``threads`` ORT threads per session: how
    each direction's time scales with threads (the planner splits a device's cores between the two by it)."""

    threads: int = field(metadata=at_least(2))
    forward_ms: float = field(metadata=at_least(0))
    backward_ms: float = field(metadata=at_least(0))


@dataclass(frozen=True)
class DeviceProfile:
    """A device: its measured block times, memory and cores."""

    name: str = field(metadata=not_empty())
    url: str = ""
    memory_bytes: int = field(default=0, metadata=at_least(0))  # available for training (0 = unknown, unlimited)
    cores: int = field(default=1, metadata=at_least(1))
    slowdown: str = "0:1"  # emulated slowdown, when the device is an emulation
    blocks: tuple[BlockTiming, ...] = ()
    whole: BlockTiming | None = None  # the whole model as one stage: with the units, a stage's fixed cost
    scaling: tuple[ThreadScaling, ...] = ()  # the whole model again at more threads (cores > 1; `whole` is at 1)

    def timing(self, block: str) -> BlockTiming | None:
        for timing in self.blocks:
            if timing.block == block:
                return timing
        return None


@dataclass(frozen=True)
class LinkProfile:
    """A measured link from one device to another (direction matters on Wi-Fi)."""

    source: str = field(metadata=not_empty())
    target: str = field(metadata=not_empty())
    bandwidth_bytes_per_s: float = field(metadata=above(0))
    rtt_ms: float = field(metadata=at_least(0))


@dataclass(frozen=True)
class DevicesFile:
    """Every device and link measured for one model at one micro-batch size."""

    model_sha256: str
    blocks: tuple[str, ...]
    micro_batch: int = field(metadata=at_least(1))
    devices: tuple[DeviceProfile, ...]
    links: tuple[LinkProfile, ...] = ()
    notes: dict[str, Any] = field(default_factory=dict)
    memory_mode: str = field(default="recompute", metadata=one_of(MEMORY_MODES))  # stash: backward includes forward

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
        """The file's content, every field checked (docs/DEVICES.md); FileFormatError names a bad one."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise FileFormatError(f"not an edgert devices file (expected format {FORMAT!r})")
        if data.get("format_version") != FORMAT_VERSION:
            raise FileFormatError(f"devices file version {data.get('format_version')!r} is not supported")
        fields = {key: value for key, value in data.items() if key not in ("format", "format_version")}
        return load_dataclass(cls, fields)


def save_devices(devices: DevicesFile, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(devices.to_json(), indent=2) + "\n")
    return path


def load_devices(path: str | Path) -> DevicesFile:
    """Read and check a devices file; every problem is one FileFormatError naming the file and the field."""
    path = Path(path)
    if not path.is_file():
        raise FileFormatError(f"{path}: no such devices file (write one with `edgert profile`)")
    return load_json_file(path, DevicesFile.from_json)
