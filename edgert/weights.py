"""A stage's state as one envelope: parameters, running statistics and optimizer state.

The same envelope serves the ``/weights`` resource of a worker, replication between
workers, and the checkpoint files the coordinator keeps on disk (``stage<k>.cbor``), so
there is one format for all of them (docs/PROTOCOL.md, docs/RUNS.md). Optimizer state is
stored as tensors named ``<parameter>#<buffer>`` (``conv.weight#exp_avg``,
``conv.weight#step``). Over the network a state larger than a piece travels in pieces
(docs/PROTOCOL.md §12): :func:`state_pieces` says how, bounded by :func:`state_bytes_bound`.
Files are written from the arrays as they are and read back mapped, never as one more copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edgert.errors import EdgertError, FileFormatError
from edgert.manifest import ParameterInfo
from edgert.optimizer import StateDict
from edgert.transport import Envelope, ResponseError, decode_envelope, encode_envelope_parts
from edgert.transport.limits import Limits
from edgert.transport.pieces import FileSink, Sink, map_file
from edgert.transport.transfers import PieceOptions

KIND = "weights"
SEPARATOR = "#"
# Checkpoints hold whole stages; they may be much larger than one activation message.
FILE_LIMITS = Limits(max_payload_bytes=1 << 40, max_tensor_bytes=1 << 40, max_decoded_bytes=1 << 40,
                     max_tensors=65536)
ENCODING_SLACK = 4096  # bytes an envelope adds to its state: its header, and per tensor its name and heads
PER_TENSOR_SLACK = 512


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
    """Write ``state`` as one CBOR envelope, straight from its arrays; returns the bytes written. Atomic
    (rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(path.suffix + ".partial")
    written = 0
    with open(partial, "wb") as file:
        for part in encode_envelope_parts(state.to_envelope(run_id)):
            written += file.write(part)
    partial.replace(path)
    return written


def load_state(path: Path) -> StageState:
    """Read a stage state written by :func:`save_state` (or received into a file in pieces), mapped: its arrays
    are read-only views of the file; a damaged file is a FileFormatError naming it."""
    if not path.is_file():
        raise FileFormatError(f"{path}: no such checkpoint file")
    try:
        return StageState.from_envelope(decode_envelope(map_file(path), FILE_LIMITS))
    except ResponseError as error:  # what the decoder says of a bad message, without its CoAP code
        raise FileFormatError(f"{path}: damaged stage state: {error.diagnostic}") from None
    except EdgertError as error:
        raise FileFormatError(f"{path}: {error}") from None


def state_bytes_bound(parameters: Iterable[ParameterInfo], buffers: Iterable[str]) -> int:
    """The most bytes a stage state of ``parameters`` takes encoded: each parameter, and for each trainable one
    its optimizer ``buffers`` (float32) and step, with room for the envelope's heads and names. What a
    receiver of that stage's state is ready to take, and no more."""
    buffers = tuple(buffers)
    total, tensors = ENCODING_SLACK, 0
    for parameter in parameters:
        total += parameter.bytes
        tensors += 1
        if parameter.trainable:
            total += len(buffers) * parameter.bytes + 8
            tensors += len(buffers) + 1
    return total + tensors * PER_TENSOR_SLACK


def state_pieces(max_body: int, into: Path | None = None) -> PieceOptions:
    """How a request moves a stage state: in pieces, a state answered in pieces taken up to ``max_body``
    bytes, into memory or (``into``) a file written as it arrives."""
    sink: Callable[[int], Sink] | None = None if into is None else (lambda size: FileSink(into))
    return PieceOptions(max_body=max_body, sink=sink)

