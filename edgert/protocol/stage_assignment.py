"""``PUT /stage`` and ``POST /profile``: which stage a worker takes, under the run's settings; /probe's target."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from edgert.errors import ProtocolError
from edgert.groups import StageGroup, StageRouting, single
from edgert.manifest import ArtifactFile, StageEntry, needed_roles
from edgert.protocol.resources import (
    CRL,
    MAX_PROFILE_MICRO_BATCH,
    MAX_PROFILE_REPEATS,
    OPTIONAL_URL,
    SIGNATURE,
    URL,
    is_url,
    load_meta,
)
from edgert.run_settings import CODEC, RunSettings
from edgert.transport import Envelope, PieceOptions
from edgert.typed_data import at_least, satisfies, to_data

ASSIGNMENT_PIECES = PieceOptions(max_body=0)
"""How ``PUT /stage`` and ``POST /profile`` go: the assignment (its files, the parameters among them) in pieces
when it is larger than one (docs/PROTOCOL.md §12); the answer is one small message."""


@dataclass(frozen=True)
class Peers:
    """Where a stage sends activations, gradients and reports, and in which codecs; over TLS the neighbours'
    credential names are the only senders of its activations (``previous_name``) and gradients (``next_name``)."""

    previous: str | None = field(metadata=OPTIONAL_URL)  # None (or ""): the first stage
    next: str | None = field(metadata=OPTIONAL_URL)  # None (or ""): the last stage
    coordinator: str = field(metadata=OPTIONAL_URL)  # "": none (a stage sent to be profiled)
    previous_name: str | None = None
    next_name: str | None = None
    next_codec: str | None = field(default=None, metadata=CODEC)  # activations to ``next``; None: the run's
    previous_codec: str | None = field(default=None, metadata=CODEC)  # gradients to ``previous``; None: the run's
    previous_group: StageGroup | None = None  # the previous stage's members and shares; None: ``previous`` alone
    next_group: StageGroup | None = None  # the next stage's members and shares; None: ``next`` alone


@dataclass(frozen=True)
class StageAssignment:
    """``PUT /stage`` (and ``POST /profile``): which stage a worker trains, under the run's settings.

    ``meta`` is every field but ``run_id`` (the envelope's), written and read by
    :mod:`edgert.typed_data` (docs/PROTOCOL.md, "The stage assignment"); the artifact files
    travel as uint8 tensors named by role.
    """

    run_id: str
    entry: StageEntry
    stages: int = field(metadata=at_least(1))
    peers: Peers
    settings: RunSettings
    replica_targets: tuple[str, ...] = field(default=(), metadata=satisfies(
        lambda urls: all(is_url(u) for u in urls), "must be worker URLs"))
    group: StageGroup | None = None  # the workers holding this stage with their shares; None: this one alone
    member: int = field(default=0, metadata=at_least(0))  # this worker's index in ``group``

    @property
    def routing(self) -> StageRouting:
        """Which rows of each micro-batch this worker owns, receives and sends (edgert/groups.py)."""
        peers = self.peers
        return StageRouting(self.group, self.member, peers.previous_group or single(peers.previous),
                            peers.next_group or single(peers.next))

    @property
    def holder(self) -> bool:
        """Whether this worker is its stage's holder of record (its group's first member): the one whose
        state is replicated and copied to the coordinator."""
        return self.member == 0

    @property
    def forward_codec(self) -> str:
        """The codec of the activations this stage sends: its outgoing link's, else the run's."""
        return self.peers.next_codec or self.settings.forward_codec

    @property
    def backward_codec(self) -> str:
        """The codec of the gradients this stage sends: its incoming link's, else the run's."""
        return self.peers.previous_codec or self.settings.backward_codec

    @property
    def group_codec(self) -> str:
        """The codec of the gradients this member sends the other members of its group: the run's gradient
        codec (``--grad-codec``; the planner costs a group's exchange uncompressed and plans no codec for it)."""
        return self.settings.backward_codec

    @property
    def roles(self) -> tuple[str, ...]:
        """The artifact roles this stage needs (its memory mode decides the stash files)."""
        return needed_roles(self.entry, self.settings.memory_mode, self.settings.split_backward)

    @property
    def artifacts(self) -> tuple[ArtifactFile, ...]:
        """The entry's artifact files the worker gets: those of :attr:`roles`."""
        return tuple(a for a in self.entry.artifacts if a.role in self.roles)

    def read_files(self, plan_dir: Path) -> dict[str, bytes]:
        """The files to send with this assignment, by role, read from the plan folder."""
        return {a.role: (plan_dir / a.path).read_bytes() for a in self.artifacts}

    def to_envelope(self, files: dict[str, bytes]) -> Envelope:
        meta = to_data(self)
        del meta["run_id"]
        tensors = {role: np.frombuffer(data, dtype=np.uint8) for role, data in files.items()}
        return Envelope(kind="stage", run_id=self.run_id, stage=self.entry.index, tensors=tensors, meta=meta)

    @classmethod
    def from_envelope(cls, envelope: Envelope,
                      beside: tuple[str, ...] = ()) -> tuple[StageAssignment, dict[str, bytes]]:
        """The assignment and its files; ``meta`` may hold nothing else but the signature fields and
        ``beside`` (another message's fields sharing the meta: ``POST /profile``'s options)."""
        meta = {key: value for key, value in envelope.meta.items() if key not in (SIGNATURE, CRL, *beside)}
        assignment = load_meta(cls, meta, "stage assignment", run_id=envelope.run_id)
        entry = assignment.entry
        if not assignment.run_id:
            raise ProtocolError("stage assignment has no run_id")
        if envelope.stage != entry.index or entry.index >= assignment.stages:
            raise ProtocolError(f"stage assignment: envelope stage {envelope.stage}, entry index {entry.index} and "
                                f"{assignment.stages} stages do not agree")
        check_groups(assignment)
        files = {}
        for role, array in envelope.tensors.items():
            if array.dtype != np.uint8 or array.ndim != 1:
                raise ProtocolError(f"stage assignment: file {role!r} must be a 1-D uint8 tensor")
            files[role] = array.tobytes()
        return assignment, files


def check_groups(assignment: StageAssignment) -> None:
    """The groups must agree with the peers: ``member`` indexes ``group``, and a neighbour's group holds the
    neighbour ``peers`` names (its holder of record) and exists only where that neighbour does."""
    group, peers = assignment.group, assignment.peers
    size = 1 if group is None else group.size
    if assignment.member >= size:
        raise ProtocolError(f"stage assignment: member {assignment.member} of a group of {size}")
    for link in ("previous", "next"):
        url, neighbours = getattr(peers, link), getattr(peers, f"{link}_group")
        if neighbours is not None and (not url or url != neighbours.members[0]):
            raise ProtocolError(f"stage assignment: peers.{link} {url!r} must be peers.{link}_group's first member")


@dataclass(frozen=True)
class ProfileOptions:
    """``POST /profile``'s own fields (beside the stage assignment): micro-batch size and repetitions.

    The defaults are also ``edgert profile``'s and :func:`edgert.coordinator.profiling.profile_devices`'.
    """

    micro_batch: int = field(default=16, metadata=satisfies(lambda n: 1 <= n <= MAX_PROFILE_MICRO_BATCH,
                                                            f"must be 1 to {MAX_PROFILE_MICRO_BATCH}"))
    repeats: int = field(default=5, metadata=satisfies(lambda n: 1 <= n <= MAX_PROFILE_REPEATS,
                                                       f"must be 1 to {MAX_PROFILE_REPEATS}"))

    @classmethod
    def from_envelope(cls, envelope: Envelope) -> ProfileOptions:
        """The options among the stage assignment's fields (see :meth:`StageAssignment.from_envelope`'s ``beside``)."""
        mine = {key: value for key, value in envelope.meta.items() if key in {f.name for f in fields(cls)}}
        return load_meta(cls, mine, "POST /profile")


@dataclass(frozen=True)
class ProbeRequest:
    """``POST /probe``: time the link to the worker at ``target``."""

    target: str = field(metadata=URL)


def probe_target(envelope: Envelope) -> str:
    """``POST /probe``'s ``meta.target``: the worker URL to time the link to."""
    return load_meta(ProbeRequest, envelope.meta, "POST /probe").target
