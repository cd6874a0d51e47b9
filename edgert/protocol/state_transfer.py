"""State moving between workers: ``FETCH /weights`` queries, ``POST /migrate`` sources."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edgert import meta_fields as fields
from edgert.errors import ProtocolError
from edgert.protocol.resources import SELF
from edgert.transport import Envelope


@dataclass(frozen=True)
class WeightsQuery:
    """``FETCH /weights``: these parameters, from the copy after ``copy_step``, or from the stage held before
    the latest assignment (``previous``), else from the current stage."""

    names: tuple[str, ...]
    copy_step: int | None = None
    previous: bool = False

    def to_envelope(self, run_id: str) -> Envelope:
        meta: dict[str, Any] = {"names": list(self.names), "previous": self.previous}
        if self.copy_step is not None:
            meta["copy_step"] = self.copy_step
        return Envelope(kind="control", run_id=run_id, meta=meta)

    @classmethod
    def from_envelope(cls, envelope: Envelope) -> WeightsQuery:
        meta = envelope.meta
        if envelope.kind != "control":
            raise ProtocolError(f"FETCH /weights takes a 'control' envelope, got {envelope.kind!r}")
        try:
            return cls(names=fields.names(meta), copy_step=fields.integer(meta, "copy_step", None),
                       previous=fields.flag(meta, "previous", False))
        except fields.MALFORMED as error:
            raise ProtocolError(f"FETCH /weights needs meta.names, a list of parameter names, and optionally "
                                f"copy_step (a step) or previous (a bool): {fields.why(error)}") from None


@dataclass(frozen=True)
class MigrationSource:
    """Where part of a stage's state comes from: a worker URL (or :data:`SELF`) and the names it gives."""

    url: str
    names: tuple[str, ...]
    previous: bool = True
    copy_step: int | None = None

    def query(self) -> WeightsQuery:
        return WeightsQuery(self.names, self.copy_step, self.previous)


@dataclass(frozen=True)
class MigrateRequest:
    """``POST /migrate``: fetch these sources' state into the stage."""

    sources: tuple[MigrationSource, ...]

    @classmethod
    def from_envelope(cls, envelope: Envelope) -> MigrateRequest:
        try:
            sources = []
            for item in fields.listed(envelope.meta, "sources"):
                if not isinstance(item, dict):
                    raise TypeError(f"a source must be a map, got {type(item).__name__}")
                where = item["url"] if item.get("url") == SELF else fields.url(item.get("url"), "url")
                sources.append(MigrationSource(where, fields.names(item), fields.flag(item, "previous", True),
                                               fields.integer(item, "copy_step", None)))
        except fields.MALFORMED as error:
            raise ProtocolError(f"POST /migrate needs meta.sources, a list of {{url, names, previous?, "
                                f"copy_step?}}: {fields.why(error)}") from None
        return cls(tuple(sources))
