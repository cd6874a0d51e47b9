"""Nested dataclasses <-> plain maps (JSON files, CBOR ``meta``): the one routine behind the manifest,
devices.json, checkpoint.json and the stage assignment on the wire.

:func:`to_data` writes every field (nested dataclasses as maps, tuples as lists).
:func:`load_dataclass` reads one back strictly: every field is checked against its type hint
(``int`` takes no ``"16"``, no ``true``; ``float`` takes ints and finite floats; ``tuple[X, ...]``
and ``tuple[X, Y]`` a list; ``dict[K, V]`` a map; ``X | Y``; nested dataclasses), unknown and
missing fields are named, absent ones take the dataclass's default, and a field may carry a
bound in its metadata (:func:`at_least`, :func:`above`, :func:`one_of`, :func:`not_empty`,
:func:`satisfies`). A problem raises ``error`` (:class:`~edgert.errors.FileFormatError` unless
told) naming the path, e.g. ``devices[0].blocks[2].forward_ms: expected a number, got 'fast'``;
:func:`load_json_file` reads a file and puts its name in front.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from edgert.errors import EdgertError, FileFormatError

T = TypeVar("T")
CHECK = "edgert.check"  # the metadata key of a field's bound: (predicate, what it requires)


def at_least(bound: float) -> dict[str, Any]:
    """Field metadata: the value must be >= ``bound``."""
    return satisfies(lambda value: value >= bound, f"must be >= {bound}")


def above(bound: float) -> dict[str, Any]:
    """Field metadata: the value must be > ``bound``."""
    return satisfies(lambda value: value > bound, f"must be > {bound}")


def one_of(choices: Iterable[str]) -> dict[str, Any]:
    """Field metadata: the value must be one of ``choices``."""
    allowed = tuple(choices)
    return satisfies(lambda value: value in allowed, f"must be one of {', '.join(allowed)}")


def not_empty() -> dict[str, Any]:
    """Field metadata: the string (or list) must not be empty."""
    return satisfies(bool, "must not be empty")


def satisfies(predicate: Callable[[Any], bool], requirement: str) -> dict[str, Any]:
    """Field metadata: ``predicate(value)`` must hold (one that raises ValueError fails, its
    message shown)."""
    return {CHECK: (predicate, requirement)}


def to_data(value: Any) -> Any:
    """``value`` as plain data: a dataclass as a map of its fields, tuples as lists, recursively."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_data(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    if isinstance(value, (list, tuple)):
        return [to_data(item) for item in value]
    if isinstance(value, dict):
        return {key: to_data(item) for key, item in value.items()}
    return value


def load_dataclass(cls: type[T], data: Any, where: str = "", error: type[EdgertError] = FileFormatError) -> T:
    """``cls`` built from plain ``data``, every field checked; ``where`` prefixes error paths, ``error`` is
    what a problem raises."""
    return _Loader(error).dataclass(cls, data, where)


def load_json_file(path: Path, parse: Callable[[Any], T]) -> T:
    """``parse`` applied to ``path``'s JSON; bad JSON, or a FileFormatError ``parse`` raises, names the file."""
    try:
        return parse(json.loads(path.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise FileFormatError(f"{path}: not valid JSON ({error})") from None
    except FileFormatError as error:
        raise FileFormatError(f"{path}: {error}") from None


class _Loader:
    """One load: the error class every problem raises."""

    def __init__(self, error: type[EdgertError]) -> None:
        self.error = error

    def dataclass(self, cls: type[T], data: Any, where: str) -> T:
        if not isinstance(data, dict):
            raise self.error(f"{where or 'the file'} must be an object, got {_shown(data)}")
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(map(str, set(data) - set(fields)))
        if unknown:
            raise self.error(f"{where + ': ' if where else ''}unknown field {unknown[0]!r} "
                             f"(known: {', '.join(fields)})")
        hints = _hints(cls)
        values = {}
        for name, spec in fields.items():
            path = f"{where}.{name}" if where else name
            if name not in data:
                if spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
                    raise self.error(f"{path}: missing")
                continue
            value = self.value(hints[name], data[name], path)
            check: tuple[Callable[[Any], bool], str] | None = spec.metadata.get(CHECK)
            if check is not None and value is not None:
                self._check(check, value, path)
            values[name] = value
        return cls(**values)

    def _check(self, check: tuple[Callable[[Any], bool], str], value: Any, path: str) -> None:
        predicate, requirement = check
        try:
            if predicate(value):
                return
            reason = ""
        except ValueError as error:  # a parser as the predicate: its reason is worth showing
            reason = f" ({error})"
        raise self.error(f"{path} {requirement}, got {_shown(value)}{reason}")

    def value(self, hint: Any, value: Any, path: str) -> Any:
        """``value`` checked against the type ``hint`` (and converted: lists to tuples, ints to floats)."""
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if origin in (typing.Union, types.UnionType):
            return self._union(args, value, path)
        if origin is tuple:
            if not isinstance(value, list):
                raise self.error(f"{path}: expected a list, got {_shown(value)}")
            if len(args) == 2 and args[1] is Ellipsis:
                return tuple(self.value(args[0], item, f"{path}[{k}]") for k, item in enumerate(value))
            if len(value) != len(args):
                raise self.error(f"{path}: expected a list of {len(args)}, got {len(value)} item(s)")
            return tuple(self.value(arg, item, f"{path}[{k}]") for k, (arg, item) in enumerate(zip(args, value)))
        if origin is dict or hint is dict:
            if not isinstance(value, dict):
                raise self.error(f"{path}: expected an object, got {_shown(value)}")
            if not args:
                return dict(value)
            return {self.value(args[0], key, f"{path} key"): self.value(args[1], item, f"{path}[{key!r}]")
                    for key, item in value.items()}
        if dataclasses.is_dataclass(hint):
            return self.dataclass(hint, value, path)
        if hint is Any:
            return value
        return self._scalar(hint, value, path)

    def _union(self, args: tuple, value: Any, path: str) -> Any:
        if value is None and type(None) in args:
            return None
        choices = [a for a in args if a is not type(None)]
        for choice in choices[:-1]:  # the last one's complaint is the one reported
            try:
                return self.value(choice, value, path)
            except self.error:
                pass
        return self.value(choices[-1], value, path)

    def _scalar(self, hint: Any, value: Any, path: str) -> Any:
        if hint is bool:
            if not isinstance(value, bool):
                raise self.error(f"{path}: expected true or false, got {_shown(value)}")
            return value
        if hint is int:
            if not isinstance(value, int) or isinstance(value, bool):
                raise self.error(f"{path}: expected an integer, got {_shown(value)}")
            return value
        if hint is float:
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise self.error(f"{path}: expected a number, got {_shown(value)}")
            return float(value)
        if hint is str:
            if not isinstance(value, str):
                raise self.error(f"{path}: expected a string, got {_shown(value)}")
            return value
        raise TypeError(f"load_dataclass does not handle the type {hint!r} (at {path})")  # a bug, not bad input


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _shown(value: Any) -> str:
    """``value`` as an error shows it: JSON's spelling of null and booleans, cut short."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
