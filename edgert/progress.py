"""A one-line progress display for long work (a run: step, loss, accuracy, throughput; an evaluation).

On a terminal the line is redrawn in place; otherwise (CI logs, pipes) a line is printed
every few seconds, so logs stay readable.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``update()`` after each step; ``close()`` at the end."""

    def __init__(self, total: int, label: str = "train", stream: TextIO | None = None, enabled: bool = True,
                 interval: float = 2.0, delay: float = 0.0):
        """``delay``: show nothing of work that ends sooner (a quick evaluation prints its result alone)."""
        self.total = total
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.interval = interval
        self._tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last = 0.0
        self._line = ""
        self._quiet_until = time.monotonic() + delay

    def update(self, done: int, **values: float | str | None) -> None:
        if not self.enabled or time.monotonic() < self._quiet_until:
            return
        width = 24
        filled = int(width * done / max(self.total, 1))
        fields = "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                           for k, v in values.items() if v is not None)
        self._line = f"{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total}  {fields}"
        now = time.monotonic()
        if self._tty:
            self.stream.write("\r\x1b[2K" + self._line)
            self.stream.flush()
        elif now - self._last >= self.interval or done == self.total:
            self.stream.write(self._line + "\n")
            self.stream.flush()
            self._last = now

    def follow(self, done: int, total: int) -> None:
        """``update`` for work whose total a callback reports as it goes (``progress(done, total)``)."""
        self.total = total
        self.update(done)

    def message(self, text: str) -> None:
        """Print a line above the progress line."""
        if not self.enabled:
            return
        if self._tty:
            self.stream.write("\r\x1b[2K" + text + "\n" + self._line)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._tty and self._line:
            self.stream.write("\n")
            self.stream.flush()
