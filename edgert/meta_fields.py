"""Reading typed fields out of a message's ``meta`` map: one strict rule per kind of field.

Each reader raises KeyError (missing), TypeError or ValueError (wrong type or range) naming the
field; :func:`why` turns that into one line. :mod:`edgert.protocol` builds its flat messages with them
(the nested stage assignment is read by :mod:`edgert.typed_data`).
"""

from __future__ import annotations

import math
from typing import Any

from edgert.errors import EdgertError
from edgert.transport.urls import parse_url

MALFORMED = (KeyError, TypeError, ValueError, AttributeError, IndexError, EdgertError)
"""What a reader (or a constructor fed from meta) raises for a malformed field."""

REQUIRED: Any = object()


def integer(meta: dict, key: str, default: Any = REQUIRED, minimum: int = 0) -> Any:
    """``meta[key]`` as an int >= ``minimum`` (not a bool, not a float); ``default`` when absent."""
    if key not in meta and default is not REQUIRED:
        return default
    value = meta[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{key} must be an integer >= {minimum}, got {value!r}")
    return value


def real(meta: dict, key: str, default: Any = REQUIRED, finite: bool = True) -> float:
    """``meta[key]`` as a real number (an int or a float, not a bool), finite unless ``finite`` is False;
    ``default`` when absent."""
    if key not in meta and default is not REQUIRED:
        return default
    value = meta[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (finite and not math.isfinite(value)):
        raise ValueError(f"{key} must be a {'finite ' if finite else ''}number, got {value!r}")
    return float(value)


def text(meta: dict, key: str, default: Any = REQUIRED) -> str:
    value = meta[key] if default is REQUIRED else meta.get(key, default)
    if not isinstance(value, str):
        raise TypeError(f"{key} must be text, got {value!r}")
    return value


def flag(meta: dict, key: str, default: bool) -> bool:
    value = meta.get(key, default)
    if not isinstance(value, bool):
        raise TypeError(f"{key} must be true or false, got {value!r}")
    return value


def listed(meta: dict, key: str, default: Any = REQUIRED) -> list:
    value = meta[key] if default is REQUIRED else meta.get(key, default)
    if not isinstance(value, list):
        raise TypeError(f"{key} must be a list, got {type(value).__name__}")
    return value


def names(meta: dict) -> tuple[str, ...]:
    names = listed(meta, "names")
    if not all(isinstance(n, str) and n for n in names):
        raise TypeError("names must be parameter names (non-empty text)")
    return tuple(names)


def url(value: Any, what: str) -> str:
    """A worker or coordinator URL (``coap+tcp://``, ``coaps+tcp://`` or ``coap://`` host:port)."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a URL, got {value!r}")
    try:
        parse_url(value)
    except ValueError as error:
        raise ValueError(f"{what}: {error}") from None
    return value


def why(error: Exception) -> str:
    """A one-line reason from a parsing error (a KeyError names the missing field)."""
    if isinstance(error, KeyError):
        return f"missing field {error.args[0]!r}" if error.args else "a field is missing"
    return f"{type(error).__name__}: {error}" if not isinstance(error, EdgertError) else str(error)
