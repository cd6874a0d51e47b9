"""Errors of the contract both roles speak, and :class:`EdgertError`, the base of every edgert error.

Each role and package keeps its own in its ``errors.py`` (edgert/worker, edgert/coordinator,
edgert/security, exporter, transport, models), all derived from :class:`EdgertError`. The CLI
prints ``str(error)`` of any :class:`EdgertError` as one ``error:`` line instead of a traceback
(edgert/cli/__init__.py says which other exceptions it treats so, and the exit codes).
"""


class EdgertError(Exception):
    """Base of every error edgert reports to a user."""


class ManifestError(EdgertError):
    """A plan folder or its manifest is missing, malformed, or does not match its files."""


class StageError(EdgertError):
    """A stage was given inputs it cannot run on (wrong names, shapes or dtypes)."""


class ProtocolError(EdgertError):
    """A message is well-formed CBOR but not what this resource expects."""


class ReplicaStoreFull(EdgertError):
    """Peers sent more replica bytes than this worker keeps."""


class ProviderError(EdgertError):
    """An execution provider was asked for that the installed onnxruntime does not offer."""


class MissingDependencyError(EdgertError):
    """An optional dependency (the ``host`` extra, torch) is needed but not installed."""


class FileFormatError(EdgertError):
    """A file edgert reads (devices.json, checkpoint.json, a saved stage state) is missing or malformed."""
