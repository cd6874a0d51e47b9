"""Combining a group's gradients before every optimizer step (``POST /groupgrad``; docs/RUNTIME.md, "Groups").

Each member of a stage's group computes the gradients of its rows only. Its last stage scales a
share's loss by the share's rows over the batch (``loss_scale``), so every member's accumulated
gradient is already its share-weighted part of the batch's mean-loss gradient, and the combination
is their plain sum: ``sum_i (rows_i / batch) x mean-over-share gradient_i``, which equals the one
device's gradient. Every member adds the parts in member order, so all of them step bitwise the same
weights. The buffers the forward updates (BatchNorm's running statistics, each member's from its
own rows) are replaced by their mean weighted by each member's rows of the step.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import numpy as np

from edgert.groups import StageRouting
from edgert.protocol import GROUP_GRAD
from edgert.stage import StageSession
from edgert.transport import DEFAULT_LIMITS, Codec
from edgert.transport.codec import NoCodec, round_trip

GRADIENT = "gradient"  # the tensor of a /groupgrad message holding the flat parameter gradients
Take = Callable[[Hashable], dict[str, np.ndarray]]
Send = Callable[[int, dict[str, np.ndarray], dict[str, Codec]], None]  # (step, tensors, codec by tensor name)


class GroupExchange:
    """One member's side of its group's gradient exchange: send its part to the others, sum everyone's.

    The flat gradient goes in ``codec`` (the run's gradient codec); a lossy one is applied to the
    member's own part too (it adds what the others decode, top-k's residual kept for its next step),
    so every member still sums the same parts and steps the same weights.
    """

    def __init__(self, session: StageSession, routing: StageRouting, take: Take, send: Send,
                 codec: Codec | None = None):
        self._session = session
        self._routing = routing
        self._take = take
        self._send = send
        self._codec = codec or NoCodec()

    def combine(self, step: int, rows: list[int]) -> None:
        """Replace the accumulated gradients (and running statistics) by the group's combination for
        ``step``; ``rows[i]``: member ``i``'s rows of the step's micro-batches."""
        routing = self._routing
        flat = self._session.gradient_flat()
        sent, codec = round_trip(self._codec, GRADIENT, flat, DEFAULT_LIMITS)
        statistics = self._session.running_statistics()
        self._send(step, {GRADIENT: flat, **statistics}, {GRADIENT: codec})
        own = {GRADIENT: sent, **statistics}
        parts = [own if j == routing.member else self._take((GROUP_GRAD, step, j))
                 for j in range(routing.group.size)]
        total = parts[0][GRADIENT].copy()
        for part in parts[1:]:
            total += part[GRADIENT]
        self._session.replace_gradient(total)
        statistics = [name for name in own if name != GRADIENT]
        if statistics:
            weights = np.asarray(rows, dtype=np.float64) / sum(rows)
            self._session.load_parameters({name: sum(w * part[name].astype(np.float64)
                                                     for w, part in zip(weights, parts)).astype(np.float32)
                                           for name in statistics})


def expected_tensors(session: StageSession) -> dict[str, tuple[int, ...]]:
    """The tensors a member's /groupgrad message holds, with their shapes: the flat gradient, the running statistics."""
    return {GRADIENT: session.gradient_flat().shape,
            **{name: value.shape for name, value in session.running_statistics().items()}}
