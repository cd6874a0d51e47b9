"""A stage's inbox: tensors that arrived from the network, waited for by the compute thread.

The transport thread puts activations, gradients and labels under a key; the compute
thread waits for the key its next action needs. A stop or failure aborts every waiter
instead of leaving it hanging. The number of held entries is capped: a peer that sends
faster than the stage computes is refused, never allowed to exhaust memory.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Hashable
from typing import Any

from edgert.protocol import INBOX_CAPACITY
from edgert.worker.errors import InboxAborted, InboxFull, InboxSkipped, InboxTimeout

DEFAULT_MAX_BYTES = 512 * 1024 * 1024  # tensor bytes held at once
REMEMBERED_KEYS = 4096  # taken keys remembered to drop a retried delivery arriving late


class Inbox:
    """Thread-safe mailbox keyed by ``(kind, step, microbatch)``."""

    def __init__(self, capacity: int = INBOX_CAPACITY, max_bytes: int = DEFAULT_MAX_BYTES):
        self._items: dict[Hashable, Any] = {}
        self._sizes: dict[Hashable, int] = {}
        self._bytes = 0
        self.max_bytes = max_bytes
        self._taken: set[Hashable] = set()
        self._taken_order: deque[Hashable] = deque()
        self._condition = threading.Condition()
        self._aborted: str | None = None
        self._interrupted: Exception | None = None
        self.last_step: int | None = None  # steps after this will not run (truncated segment)
        self.capacity = capacity

    def put(self, key: Hashable, value: Any) -> bool:
        """Deliver ``value``; returns False for a duplicate (a retried delivery), which is dropped.

        A full inbox (by message count or tensor bytes) is refused with :class:`InboxFull`.
        """
        size = _tensor_bytes(value)
        with self._condition:
            if key in self._items or key in self._taken:
                return False
            if len(self._items) >= self.capacity:
                raise InboxFull(f"inbox full ({self.capacity} messages held): peer is too far ahead")
            if self._bytes + size > self.max_bytes:
                raise InboxFull(f"inbox full ({self._bytes} tensor bytes held, {size} more would exceed "
                                f"{self.max_bytes}): peer is too far ahead")
            self._items[key] = value
            self._sizes[key] = size
            self._bytes += size
            self._condition.notify_all()
            return True

    def holds(self, key: Hashable) -> bool:
        """Whether ``key`` has arrived (a :meth:`take` of it would not wait)."""
        with self._condition:
            return key in self._items

    def take(self, key: Hashable, timeout: float | None = None) -> tuple[Any, float]:
        """Wait for ``key``, remove and return it with the seconds spent waiting."""
        start = time.perf_counter()
        deadline = None if timeout is None else start + timeout
        with self._condition:
            while key not in self._items:
                if self._aborted is not None:
                    raise InboxAborted(self._aborted)
                if self._interrupted is not None:
                    raise self._interrupted
                if self.last_step is not None and key[1] > self.last_step:
                    raise InboxSkipped(f"{key} is after the truncation at step {self.last_step}")
                remaining = None if deadline is None else deadline - time.perf_counter()
                if remaining is not None and remaining <= 0:
                    raise InboxTimeout(f"waited {timeout:.1f} s for {key}")
                self._condition.wait(remaining)
            self._remember(key)
            self._bytes -= self._sizes.pop(key, 0)
            return self._items.pop(key), time.perf_counter() - start

    def _remember(self, key: Hashable) -> None:
        self._taken.add(key)
        self._taken_order.append(key)
        if len(self._taken_order) > REMEMBERED_KEYS:
            self._taken.discard(self._taken_order.popleft())

    @property
    def aborted(self) -> str | None:
        """Why the run this inbox served was stopped (None while one runs, or before the first)."""
        return self._aborted

    def abort(self, reason: str) -> None:
        """Wake every waiter with :class:`InboxAborted`; later waits fail at once too."""
        with self._condition:
            self._aborted = reason
            self._condition.notify_all()

    def interrupt(self, error: Exception) -> None:
        """Wake every waiter with ``error`` (the stage failed in another of its threads); later waits raise
        it too, until :meth:`resume`."""
        with self._condition:
            self._interrupted = error
            self._condition.notify_all()

    def resume(self) -> None:
        """Waits wait again (the failure that interrupted them was dealt with)."""
        with self._condition:
            self._interrupted = None

    def truncate(self, last_step: int) -> None:
        """No step after ``last_step`` will run: waiters for later steps give up, their messages go."""
        with self._condition:
            self.last_step = last_step
            for key in [k for k in self._items if k[1] > last_step]:
                self._drop(key)
            self._condition.notify_all()

    def reset(self) -> None:
        """Forget held messages and any abort (a new run starts)."""
        with self._condition:
            self._items.clear()
            self._sizes.clear()
            self._bytes = 0
            self._taken.clear()
            self._taken_order.clear()
            self._aborted = None
            self._interrupted = None
            self.last_step = None

    def _drop(self, key: Hashable) -> None:
        del self._items[key]
        self._bytes -= self._sizes.pop(key, 0)

    def __len__(self) -> int:
        with self._condition:
            return len(self._items)


def _tensor_bytes(value: Any) -> int:
    """Bytes of the arrays in a message (a dict of arrays, or one array)."""
    if isinstance(value, dict):
        return sum(getattr(v, "nbytes", 0) for v in value.values())
    return getattr(value, "nbytes", 0)
