"""State moving between workers: ``FETCH /weights`` queries, ``POST /migrate`` sources."""

from __future__ import annotations

from dataclasses import dataclass, field

from edgert.errors import ProtocolError
from edgert.protocol.resources import PARAMETER_NAMES, SELF, is_url, load_meta
from edgert.transport import Envelope
from edgert.typed_data import at_least, satisfies, to_data


@dataclass(frozen=True)
class WeightsQuery:
    """``FETCH /weights``: these parameters, from the copy after ``copy_step``, or from the stage held before
    the latest assignment (``previous``), else from the current stage."""

    names: tuple[str, ...] = field(metadata=PARAMETER_NAMES)
    copy_step: int | None = field(default=None, metadata=at_least(0))  # None (absent): not from a copy
    previous: bool = False

    def to_envelope(self, run_id: str) -> Envelope:
        meta = {key: value for key, value in to_data(self).items() if value is not None}
        return Envelope(kind="control", run_id=run_id, meta=meta)

    @classmethod
    def from_envelope(cls, envelope: Envelope) -> WeightsQuery:
        if envelope.kind != "control":
            raise ProtocolError(f"FETCH /weights takes a 'control' envelope, got {envelope.kind!r}")
        return load_meta(cls, envelope.meta, "FETCH /weights")


@dataclass(frozen=True)
class MigrationSource:
    """Where part of a stage's state comes from: a worker URL (or :data:`SELF`) and the names it gives."""

    url: str = field(metadata=satisfies(lambda url: url == SELF or is_url(url), f"must be a worker URL or {SELF!r}"))
    names: tuple[str, ...] = field(metadata=PARAMETER_NAMES)
    previous: bool = True
    copy_step: int | None = field(default=None, metadata=at_least(0))

    def query(self) -> WeightsQuery:
        return WeightsQuery(self.names, self.copy_step, self.previous)


@dataclass(frozen=True)
class MigrateRequest:
    """``POST /migrate``: fetch these sources' state into the stage."""

    sources: tuple[MigrationSource, ...]

    def to_envelope(self, run_id: str) -> Envelope:
        sources = [{key: value for key, value in to_data(source).items() if value is not None}
                   for source in self.sources]  # a null copy_step is left out, as WeightsQuery leaves it
        return Envelope(kind="control", run_id=run_id, meta={"sources": sources})

    @classmethod
    def from_envelope(cls, envelope: Envelope) -> MigrateRequest:
        return load_meta(cls, envelope.meta, "POST /migrate")
