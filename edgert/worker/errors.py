"""Errors of the board's worker: its inbox's waits and refusals, and the 4.09 of its state resources."""

from __future__ import annotations

from aiocoap.numbers.codes import Code

from edgert.errors import EdgertError
from edgert.transport.errors import ResponseError


class InboxAborted(EdgertError):
    """The run was stopped or failed while the compute thread was waiting."""


class InboxTimeout(EdgertError):
    """What the stage waited for did not arrive in time."""


class InboxSkipped(EdgertError):
    """The awaited micro-batch belongs to a step after the truncation point: it will not come."""


class InboxFull(EdgertError):
    """A peer sent more than the stage may hold (in-flight limit)."""


class Busy(ResponseError):
    """4.09: the request does not fit what the worker is doing now (state written while a segment runs)."""

    code = Code.CONFLICT
