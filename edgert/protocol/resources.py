"""The runtime's resource names, message kinds and limits, and how a handler reads a request (4.00 when malformed)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from edgert.errors import ProtocolError
from edgert.transport import BadRequest
from edgert.transport.urls import parse_url
from edgert.typed_data import load_dataclass, satisfies

HEALTH, STAGE, RUN, STOP, WEIGHTS, REPORT, BATCH = "health", "stage", "run", "stop", "weights", "report", "batch"


MIGRATE, PROFILE, PROBE, ECHO, REPLICA, JOIN = "migrate", "profile", "probe", "echo", "replica", "join"


ACT, GRAD, LABELS = "act", "grad", "labels"


DATA_KINDS = {ACT: "activations", GRAD: "gradients"}


GROUP_GRAD, GROUP_GRAD_KIND = "groupgrad", "group_gradients"  # a group member's gradients for its peers


SELF = "self"  # a migration source meaning "the state this worker held itself"


SIGNATURE, CRL = "signature", "crl"  # a stage's meta fields set by its signer (edgert.security.admission)


MAX_REASON_BYTES = 1024  # a /stop reason


INBOX_CAPACITY = 256  # messages a worker's inbox holds; the coordinator feeds no further ahead than fits


MAX_STAGE_BYTES = 64 << 30  # a stage assignment (its files) received in pieces: written to disk as it arrives
MAX_SEGMENT_STEPS = 100_000  # steps of one /run segment (a worker queues one window per step)


T = TypeVar("T")


def read_request(parse: Callable[[Any], T], body: Any) -> T:
    """``parse(body)`` (a ``from_envelope``, or a reader of a request's payload) in a handler: a malformed
    message is answered 4.00."""
    try:
        return parse(body)
    except ProtocolError as error:
        raise BadRequest(str(error)) from None


def is_url(value: str) -> bool:
    """A worker or coordinator URL (raises ValueError with the reason otherwise)."""
    parse_url(value)
    return True


URL = satisfies(is_url, "must be a worker URL (coap+tcp://, coaps+tcp:// or coap:// host:port)")


OPTIONAL_URL = satisfies(lambda value: value == "" or is_url(value), "must be a worker URL or \"\"")


PARAMETER_NAMES = satisfies(all, "must be parameter names (non-empty text)")


def load_meta(cls: type[T], meta: dict, what: str, **envelope_fields: Any) -> T:
    """``cls`` read from a message's ``meta`` by :func:`~edgert.typed_data.load_dataclass`, with the fields
    the envelope itself carries (``envelope_fields``, which ``meta`` must not repeat); a problem is a
    ProtocolError "``what`` is malformed: ``meta.<path>``: ..." (a 4.00)."""
    for name in envelope_fields:
        if name in meta:
            raise ProtocolError(f"{what} is malformed: unknown field {name!r} (the envelope's {name} says it)")
    try:
        return load_dataclass(cls, {**meta, **envelope_fields} if envelope_fields else meta, "meta", ProtocolError)
    except ProtocolError as error:
        raise ProtocolError(f"{what} is malformed: {error}") from None


MAX_PROFILE_MICRO_BATCH, MAX_PROFILE_REPEATS = 4096, 100
