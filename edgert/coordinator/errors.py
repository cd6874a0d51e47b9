"""Errors of the coordinator: a run that cannot start or go on, refused assignments, failed workers, bad data."""

from __future__ import annotations

from edgert.errors import EdgertError


class TrainingError(EdgertError):
    """A training run could not start or could not go on."""


class AssignmentError(EdgertError):
    """A worker refused its stage, or state could not be moved."""


class WorkerFailure(EdgertError):
    """Workers stopped answering; training must recover without them."""

    def __init__(self, urls: set[str], noticed_at: float):
        super().__init__(f"worker(s) {', '.join(sorted(urls))} failed")
        self.urls = set(urls)
        self.noticed_at = noticed_at


class DataError(EdgertError):
    """The data set does not fit the plan."""
