"""A checkpoint folder's index, ``checkpoint.json``: which step its ``stage<k>.cbor`` files hold.

The coordinator writes one after each epoch's evaluation (``checkpoints/latest/``, docs/RUNS.md);
``edgert merge`` reads it. The stage files themselves are :mod:`edgert.weights` envelopes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from edgert.typed_data import at_least, load_dataclass, load_json_file

CHECKPOINT_NAME = "checkpoint.json"


@dataclass(frozen=True)
class CheckpointInfo:
    """What ``checkpoint.json`` holds."""

    step: int = field(metadata=at_least(0))  # the stages' states are those after this step (0-based)
    epoch: int = field(metadata=at_least(0))  # the epoch that step ended
    stages: int = field(metadata=at_least(1))  # how many stage<k>.cbor files belong to it


def save_checkpoint_info(info: CheckpointInfo, folder: Path) -> Path:
    """Write ``folder``/checkpoint.json."""
    path = folder / CHECKPOINT_NAME
    path.write_text(json.dumps(asdict(info)))
    return path


def load_checkpoint_info(folder: Path) -> CheckpointInfo:
    """Read and check ``folder``/checkpoint.json; a problem is one FileFormatError naming the file."""
    return load_json_file(folder / CHECKPOINT_NAME, lambda data: load_dataclass(CheckpointInfo, data))
