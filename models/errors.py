"""Errors of the model zoo and the datasets; each message names the bad value and the fix."""

from __future__ import annotations

from edgert.errors import EdgertError


class UnknownModelError(EdgertError):
    """A model name that is not in the zoo; the message lists the names that are."""


class ModelBuildError(EdgertError):
    """A zoo builder was given arguments it cannot build from (e.g. a negative seed)."""


class DatasetError(EdgertError):
    """A data set is missing, malformed, or does not fit the model it is meant for."""
