"""Errors of the cluster's security: refused graphs and stages, and the keystore's."""

from __future__ import annotations

from edgert.errors import EdgertError


class GraphRefused(EdgertError):
    """An ONNX file uses an operator domain or a feature the runtime does not accept."""


class AdmissionRefused(GraphRefused):
    """A stage is not signed by the cluster, or its signature or revocation list does not verify."""


class KeystoreError(EdgertError):
    """The keystore is missing, already exists, or cannot do what was asked."""
