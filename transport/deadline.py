"""Bounding an awaited block in time on every Python the board runtime supports (3.10 and newer).

``asyncio.timeout`` (3.11) bounds a block without a task per wait; on 3.10 the
``async-timeout`` package, which it was modelled on, does the same. Both raise
``asyncio.TimeoutError``, which is the builtin ``TimeoutError`` only from 3.11 on: catch
``asyncio.TimeoutError``.
"""

from __future__ import annotations

import sys

if sys.version_info >= (3, 11):
    from asyncio import timeout  # novermin (3.11 and newer only, as the line above checks)
else:  # pragma: no cover - exercised by the board runtime's Python 3.10 run (tests/platforms)
    from async_timeout import timeout

__all__ = ["timeout"]
