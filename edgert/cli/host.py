"""What every host-only command needs first: the ``host`` extra."""

from __future__ import annotations

from edgert.errors import MissingDependencyError


def require_host_extra(command: str) -> None:
    """Fail with one line if ``onnx`` (the ``host`` extra) is not installed."""
    try:
        import onnx  # noqa: F401
    except ImportError:
        raise MissingDependencyError(
            f"`edgert {command}` runs on the host and needs the host extra: pip install 'edgert[host]'"
        ) from None
