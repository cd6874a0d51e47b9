"""A stage's state as one message: parameters, running statistics and optimizer state.

The same envelope serves the ``/weights`` resource of a worker, replication between
workers, and the checkpoint files the coordinator keeps on disk (``stage<k>.cbor``), so
there is one format for all of them (docs/PROTOCOL.md, docs/RUNS.md). Optimizer state is
stored as tensors named ``<parameter>#<buffer>`` (``conv.weight#exp_avg``,
``conv.weight#step``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edgert.errors import EdgertError, FileFormatError
from edgert.optimizer import StateDict
from edgert.transport import Envelope, ResponseError, decode_envelope, encode_envelope
from edgert.transport.limits import Limits

KIND = "weights"
SEPARATOR = "#"
# Checkpoints hold whole stages; they may be much larger than one activation message.
FILE_LIMITS = Limits(max_payload_bytes=1 << 34, max_tensor_bytes=1 << 33, max_decoded_bytes=1 << 34)


@dataclass
class StageState:
    """Parameters (and running statistics) and optimizer state of one stage, by name."""

    parameters: dict[str, np.ndarray]
    optimizer: StateDict = field(default_factory=dict)
    step: int = 0
    stage: int = 0

    def to_envelope(self, run_id: str = "") -> Envelope:
        tensors = dict(self.parameters)
        for name, buffers in self.optimizer.items():
            for buffer, value in buffers.items():
                tensors[f"{name}{SEPARATOR}{buffer}"] = np.asarray(value)
        return Envelope(kind=KIND, run_id=run_id, step=self.step, stage=self.stage, tensors=tensors)

    @classmethod
    def from_envelope(cls, envelope: Envelope) -> StageState:
        if envelope.kind != KIND:
            raise EdgertError(f"expected a {KIND!r} message, got {envelope.kind!r}")
        parameters: dict[str, np.ndarray] = {}
        optimizer: StateDict = {}
        for name, value in envelope.tensors.items():
            if SEPARATOR in name:
                parameter, buffer = name.rsplit(SEPARATOR, 1)
                optimizer.setdefault(parameter, {})[buffer] = value
            else:
                parameters[name] = value
        return cls(parameters=parameters, optimizer=optimizer, step=envelope.step, stage=envelope.stage)

    @property
    def bytes(self) -> int:
        return sum(v.nbytes for v in self.parameters.values()) + sum(
            np.asarray(b).nbytes for buffers in self.optimizer.values() for b in buffers.values())


def save_state(state: StageState, path: Path, run_id: str = "") -> int:
    """Write ``state`` as one CBOR envelope; returns the bytes written. Atomic (rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = encode_envelope(state.to_envelope(run_id))
    partial = path.with_suffix(path.suffix + ".partial")
    partial.write_bytes(data)
    partial.replace(path)
    return len(data)


def load_state(path: Path) -> StageState:
    """Read a stage state written by :func:`save_state`; a damaged file is a FileFormatError naming it."""
    if not path.is_file():
        raise FileFormatError(f"{path}: no such checkpoint file")
    try:
        return StageState.from_envelope(decode_envelope(path.read_bytes(), FILE_LIMITS))
    except ResponseError as error:  # what the decoder says of a bad message, without its CoAP code
        raise FileFormatError(f"{path}: damaged stage state: {error.diagnostic}") from None
    except EdgertError as error:
        raise FileFormatError(f"{path}: {error}") from None
