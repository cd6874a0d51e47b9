"""Errors the runtime raises; each carries one line a user can act on.

The CLI prints ``str(error)`` of any :class:`EdgertError` as one ``error:`` line instead of a
traceback (edgert/cli/__init__.py says which other exceptions it treats so, and the exit codes).
"""


class EdgertError(Exception):
    """Base of every error edgert reports to a user."""


class ManifestError(EdgertError):
    """A plan folder or its manifest is missing, malformed, or does not match its files."""


class StageError(EdgertError):
    """A stage was given inputs it cannot run on (wrong names, shapes or dtypes)."""


class TrainingError(EdgertError):
    """A training run could not start or could not go on."""


class MissingDependencyError(EdgertError):
    """An optional dependency (the ``host`` extra, torch) is needed but not installed."""


class FileFormatError(EdgertError):
    """A file edgert reads (devices.json, checkpoint.json, a saved stage state) is missing or malformed."""
