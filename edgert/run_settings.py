"""What every stage of a run is told: the one definition of the run's settings and their defaults.

The coordinator builds a :class:`RunSettings` from ``edgert train``'s options (whose defaults are
these), every ``PUT /stage`` and ``POST /profile`` carries it as ``meta.settings``
(:class:`edgert.protocol.StageAssignment`, docs/PROTOCOL.md), and the worker reads its stage's
codecs, threads (and whether its forwards run beside its backwards), timeout, memory mode and copy
intervals from it. The codecs here are the run-wide ones: a link the plan gives its own codec says
so in the assignment's ``peers`` (``next_codec``, ``previous_codec``), which take precedence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edgert.errors import EdgertError
from edgert.manifest import MEMORY_MODES, TrainingConfig
from edgert.transport import get_codec
from edgert.typed_data import above, at_least, one_of, satisfies


def is_codec_spec(spec: str) -> bool:
    """A codec spec the worker can build (raises ValueError with the parser's reason otherwise)."""
    try:
        get_codec(spec)
    except (TypeError, EdgertError) as error:
        raise ValueError(str(error)) from None
    return True


CODEC = satisfies(is_codec_spec, "must be a codec spec (none, fp16, int8, int4, topk:RATIO...)")


@dataclass(frozen=True)
class RunSettings:
    """The settings every stage of one run shares, each default stated here only."""

    training: TrainingConfig  # loss, optimizer and its hyper-parameters (the plan's, --lr applied)
    forward_codec: str = field(default="none", metadata=CODEC)  # activations sent on a link with no codec of its own
    backward_codec: str = field(default="none", metadata=CODEC)  # gradients sent on a link with no codec of its own
    forward_threads: int = field(default=1, metadata=at_least(1))  # ORT intra-op threads, forward session
    backward_threads: int = field(default=1, metadata=at_least(1))  # ... and backward session
    side_by_side: bool = False  # a stage's forwards on a thread of their own, beside its backwards
    split_backward: bool = False  # parameter gradients once a step, after the micro-batches' input gradients
    wait_timeout: float = field(default=120.0, metadata=above(0))  # seconds a stage waits for a tensor
    memory_mode: str = field(default="recompute", metadata=one_of(MEMORY_MODES))
    replicate_every: int = field(default=20, metadata=at_least(0))  # steps between copies to the next workers (0: off)
    central_every: int = field(default=100, metadata=at_least(0))  # steps between copies to the coordinator (0: off)
