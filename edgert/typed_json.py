"""Strict loading of JSON files into (nested) dataclasses: the routine behind devices.json and checkpoint.json.

Every field is checked against its type hint (``int`` takes no ``"16"``, no ``true``;
``float`` takes ints and finite floats; ``tuple[X, ...]`` a list; ``X | None``; nested
dataclasses), unknown and missing fields are named, and a field may carry a bound in its
metadata (:func:`at_least`, :func:`above`, :func:`one_of`, :func:`not_empty`). A problem raises
:class:`~edgert.errors.FileFormatError` naming the path inside the file, e.g.
``devices[0].blocks[2].forward_ms: expected a number, got 'fast'``; :func:`load_json_file`
reads the file and puts its name in front.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from edgert.errors import FileFormatError

T = TypeVar("T")
CHECK = "edgert.check"  # the metadata key of a field's bound: (predicate, what it requires)


def at_least(bound: float) -> dict[str, Any]:
    """Field metadata: the value must be >= ``bound``."""
    return {CHECK: (lambda value: value >= bound, f"must be >= {bound}")}


def above(bound: float) -> dict[str, Any]:
    """Field metadata: the value must be > ``bound``."""
    return {CHECK: (lambda value: value > bound, f"must be > {bound}")}


def one_of(choices: Iterable[str]) -> dict[str, Any]:
    """Field metadata: the value must be one of ``choices``."""
    allowed = tuple(choices)
    return {CHECK: (lambda value: value in allowed, f"must be one of {', '.join(allowed)}")}


def not_empty() -> dict[str, Any]:
    """Field metadata: the string (or list) must not be empty."""
    return {CHECK: (bool, "must not be empty")}


def load_dataclass(cls: type[T], data: Any, where: str = "") -> T:
    """``cls`` built from parsed JSON ``data``, every field checked; ``where`` prefixes error paths."""
    if not isinstance(data, dict):
        raise FileFormatError(f"{where or 'the file'} must be an object, got {_shown(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise FileFormatError(f"{where + ': ' if where else ''}unknown field {unknown[0]!r} "
                              f"(known: {', '.join(fields)})")
    hints = typing.get_type_hints(cls)
    values = {}
    for name, spec in fields.items():
        path = f"{where}.{name}" if where else name
        if name not in data:
            if spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
                raise FileFormatError(f"{path}: missing")
            continue
        value = _load(hints[name], data[name], path)
        check: tuple[Callable[[Any], bool], str] | None = spec.metadata.get(CHECK)
        if check is not None and value is not None and not check[0](value):
            raise FileFormatError(f"{path} {check[1]}, got {_shown(value)}")
        values[name] = value
    return cls(**values)


def load_json_file(path: Path, parse: Callable[[Any], T]) -> T:
    """``parse`` applied to ``path``'s JSON; bad JSON, or a FileFormatError ``parse`` raises, names the file."""
    try:
        return parse(json.loads(path.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise FileFormatError(f"{path}: not valid JSON ({error})") from None
    except FileFormatError as error:
        raise FileFormatError(f"{path}: {error}") from None


def _load(hint: Any, value: Any, path: str) -> Any:
    """``value`` checked against the type ``hint`` (and converted: lists to tuples, ints to floats)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _load(inner, value, path)
    if origin is tuple:
        if not isinstance(value, list):
            raise FileFormatError(f"{path}: expected a list, got {_shown(value)}")
        return tuple(_load(args[0], item, f"{path}[{k}]") for k, item in enumerate(value))
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise FileFormatError(f"{path}: expected an object, got {_shown(value)}")
        return dict(value)
    if dataclasses.is_dataclass(hint):
        return load_dataclass(hint, value, path)
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise FileFormatError(f"{path}: expected true or false, got {_shown(value)}")
        return value
    if hint is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise FileFormatError(f"{path}: expected an integer, got {_shown(value)}")
        return value
    if hint is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise FileFormatError(f"{path}: expected a number, got {_shown(value)}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise FileFormatError(f"{path}: expected a string, got {_shown(value)}")
        return value
    raise TypeError(f"load_dataclass does not handle the type {hint!r} (at {path})")  # a bug, not bad input


def _shown(value: Any) -> str:
    """``value`` as an error shows it: JSON's spelling of null and booleans, cut short."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
