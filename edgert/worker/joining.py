"""``edgert worker --join``: offering this worker to a running coordinator until it takes it.

A board may boot before its coordinator, or lose it for a while: like a service, the worker
keeps offering itself, waiting longer after each failed try (0.5 s doubling up to 30 s, with
jitter so a rack of boards that boot together do not knock in step). A coordinator that
answers 5.xx (still starting) or not at all is tried again; one that refuses (4.xx) is not,
and the worker ends with its one-line reason.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable

from edgert.protocol import JOIN, JoinRequest
from edgert.transport import TensorClient, TransportError
from edgert.transport.errors import ResponseError

log = logging.getLogger("edgert.worker.joining")

FIRST_DELAY_S = 0.5  # before the second try
MAX_DELAY_S = 30.0  # the longest wait between tries
JITTER = 0.2  # each wait is drawn from +-20% of its nominal length
TRY_TIMEOUT_S = 15.0  # one try: the coordinator profiles a newcomer before it answers


def join_delays(first: float = FIRST_DELAY_S, longest: float = MAX_DELAY_S, jitter: float = JITTER,
                draw: Callable[[float, float], float] = random.uniform):
    """The waits between tries, forever: ``first`` doubling up to ``longest``, each scaled by 1 +- ``jitter``."""
    delay = first
    while True:
        yield delay * draw(1 - jitter, 1 + jitter)
        delay = min(delay * 2, longest)


class Joining:
    """Offers the worker at ``own_url`` (named ``name``) to ``coordinator`` until it is accepted or refused."""

    def __init__(self, client: TensorClient, coordinator: str, own_url: Callable[[], str], name: str,
                 say: Callable[[str], None]):
        self._client = client
        self._coordinator = coordinator
        self._own_url = own_url
        self._name = name
        self._say = say
        self.accepted = False
        self.refusal: str | None = None  # the coordinator's one-line refusal (4.xx), when it gave one
        self.refused = asyncio.Event()  # set with ``refusal``: the worker has nothing left to wait for
        self.tries = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._offer())

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _offer(self) -> None:
        message = JoinRequest(self._own_url(), self._name).to_envelope()
        for delay in join_delays():
            self.tries += 1
            try:
                await self._client.post(self._coordinator, JOIN, message, timeout=TRY_TIMEOUT_S, retries=0)
            except ResponseError as error:
                if error.code.class_ == 4:
                    self.refusal = f"{self._coordinator} refused to let {self._name} join: {error}"
                    self.refused.set()
                    return
                reason = str(error)
            except (TransportError, OSError) as error:
                reason = str(error) or type(error).__name__
            else:
                self._say(f"joined {self._coordinator}: accepted (try {self.tries}); the coordinator places "
                          f"this worker when the planner predicts a gain")
                self.accepted = True
                return
            self._say(f"could not join {self._coordinator} (try {self.tries}: {reason}); "
                      f"trying again in {delay:.1f} s")
            await asyncio.sleep(delay)
