"""Nested dataclasses <-> plain maps (JSON files, CBOR ``meta``): the one routine behind the manifest,
devices.json, checkpoint.json and every runtime message's ``meta`` on the wire (:mod:`edgert.protocol`).

:func:`to_data` writes every field (nested dataclasses as maps, tuples as lists).
:func:`load_dataclass` reads one back strictly: every field is checked against its type hint
(``int`` takes no ``"16"``, no ``true``; ``float`` takes ints and finite floats, NaN and infinities
too where the field's metadata says :func:`non_finite`; ``tuple[X, ...]``, ``tuple[X, Y]`` and ``list[X]``
a list; ``dict[K, V]`` a map; ``X | Y``; nested dataclasses), unknown and
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
NON_FINITE = "edgert.non_finite"  # the metadata key of a float field that may be NaN or infinite


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


def non_finite() -> dict[str, Any]:
    """Field metadata: the float (or the floats inside the field) may also be NaN or infinite."""
    return {NON_FINITE: True}


def satisfies(predicate: Callable[[Any], bool], requirement: str) -> dict[str, Any]:
    """Field metadata: ``predicate(value)`` must hold (one that raises ValueError fails, its
    message shown)."""
    return {CHECK: (predicate, requirement)}


def to_data(value: Any) -> Any:
    """``value`` as plain data: a dataclass as a map of its fields, tuples as lists, recursively."""
    if type(value) in _PLAIN:
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {name: to_data(getattr(value, name)) for name in _init_fields(type(value))}
    if isinstance(value, (list, tuple)):
        return [to_data(item) for item in value]
    if isinstance(value, dict):
        return {key: to_data(item) for key, item in value.items()}
    return value


_PLAIN = {int, float, str, bool, type(None)}


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
    """One load: the error class every problem raises. Each class's fields and each type hint are turned into
    a reader once (cached), and a path is spelled out only for an error: a message read every step costs
    little more per field than its type check."""

    def __init__(self, error: type[EdgertError]) -> None:
        self.error = error

    def dataclass(self, cls: type[T], data: Any, where: str) -> T:
        if not isinstance(data, dict):
            raise self.error(f"{where or 'the file'} must be an object, got {_shown(data)}")
        plan = _plan(cls)
        if not data.keys() <= plan.names.keys():
            unknown = sorted(map(str, data.keys() - plan.names))
            raise self.error(f"{where + ': ' if where else ''}unknown field {unknown[0]!r} "
                             f"(known: {', '.join(plan.names)})")
        values = {}
        for name, read, fast, finite, required, check in plan.fields:
            if name not in data:
                if required:
                    raise self.error(f"{_path(where, name)}: missing")
                continue
            value = data[name]
            if type(value) is not fast or (finite and not math.isfinite(value)):
                value = read(self, value, where, name)
            if check is not None and value is not None:
                self._check(check, value, where, name)
            values[name] = value
        return cls(**values)

    def _check(self, check: tuple[Callable[[Any], bool], str], value: Any, where: str, name: str) -> None:
        predicate, requirement = check
        try:
            if predicate(value):
                return
            reason = ""
        except ValueError as error:  # a parser as the predicate: its reason is worth showing
            reason = f" ({error})"
        raise self.error(f"{_path(where, name)} {requirement}, got {_shown(value)}{reason}")


Reader = Callable[[_Loader, Any, str, "str | int"], Any]
"""Reads a value at ``where`` + ``key`` (a field's name, a list's index, or a suffix such as ``"[3]"``)."""


def _path(where: str, key: str | int) -> str:
    """The path an error names: ``where.key``, ``where[key]``, or ``where`` + a suffix."""
    if isinstance(key, int):
        return f"{where}[{key}]"
    if key[:1] in ("[", " "):
        return where + key
    return f"{where}.{key}" if where else key


class _Plan(typing.NamedTuple):
    names: dict[str, None]  # the init fields, in order
    fields: tuple[tuple[str, Reader, Any, bool, bool, Any], ...]  # name, reader, fast, finite, required, check


@functools.cache
def _init_fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.init)


@functools.cache
def _plan(cls: type) -> _Plan:
    """How ``cls`` is read: per field its reader, the type a value may have to skip the reader (``fast``, with
    ``finite`` for a float that must be finite), whether it is required, and its bound."""
    hints = typing.get_type_hints(cls)
    specs = [f for f in dataclasses.fields(cls) if f.init]
    fields = []
    for f in specs:
        finite = not f.metadata.get(NON_FINITE, False)
        hint = hints[f.name]
        fast = hint if hint in _SCALARS else None
        fields.append((f.name, _reader(hint, finite), fast, fast is float and finite,
                       f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
                       f.metadata.get(CHECK)))
    return _Plan(dict.fromkeys(f.name for f in specs), tuple(fields))


@functools.cache
def _reader(hint: Any, finite: bool = True) -> Reader:
    """How a value of type ``hint`` is read (``finite``: a float must be finite)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return _union_reader(args, finite)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return _sequence_reader(_reader(args[0], finite), tuple)
    if origin is tuple:
        return _fixed_reader(tuple(_reader(arg, finite) for arg in args))
    if origin is list:
        return _sequence_reader(_reader(args[0], finite), list)
    if origin is dict or hint is dict:
        return _map_reader(tuple(_reader(arg, finite) for arg in args))
    if dataclasses.is_dataclass(hint):
        return lambda loader, value, where, key: loader.dataclass(hint, value, _path(where, key))
    if hint is Any:
        return lambda loader, value, where, key: value
    if hint in _SCALARS:
        return _SCALARS[hint] if finite or hint is not float else _any_number
    raise TypeError(f"load_dataclass does not handle the type {hint!r}")  # a bug, not bad input


def _union_reader(args: tuple, finite: bool) -> Reader:
    optional = type(None) in args
    choices = [_reader(a, finite) for a in args if a is not type(None)]

    def read(loader: _Loader, value: Any, where: str, key: str | int) -> Any:
        if value is None and optional:
            return None
        for choice in choices[:-1]:  # the last one's complaint is the one reported
            try:
                return choice(loader, value, where, key)
            except loader.error:
                pass
        return choices[-1](loader, value, where, key)
    return read


def _sequence_reader(item: Reader, kind: type) -> Reader:
    def read(loader: _Loader, value: Any, where: str, key: str | int) -> Any:
        if not isinstance(value, list):
            raise loader.error(f"{_path(where, key)}: expected a list, got {_shown(value)}")
        path = _path(where, key)
        return kind([item(loader, entry, path, k) for k, entry in enumerate(value)])
    return read


def _fixed_reader(items: tuple[Reader, ...]) -> Reader:
    def read(loader: _Loader, value: Any, where: str, key: str | int) -> Any:
        if not isinstance(value, list):
            raise loader.error(f"{_path(where, key)}: expected a list, got {_shown(value)}")
        if len(value) != len(items):
            raise loader.error(f"{_path(where, key)}: expected a list of {len(items)}, got {len(value)} item(s)")
        path = _path(where, key)
        return tuple([item(loader, entry, path, k) for k, (item, entry) in enumerate(zip(items, value))])
    return read


def _map_reader(readers: tuple[Reader, ...]) -> Reader:
    def read(loader: _Loader, value: Any, where: str, key: str | int) -> Any:
        if not isinstance(value, dict):
            raise loader.error(f"{_path(where, key)}: expected an object, got {_shown(value)}")
        if not readers:
            return dict(value)
        path = _path(where, key)
        keys, items = readers
        return {keys(loader, k, path, " key"): items(loader, v, path, f"[{k!r}]") for k, v in value.items()}
    return read


def _boolean(loader: _Loader, value: Any, where: str, key: str | int) -> bool:
    if value is True or value is False:
        return value
    raise loader.error(f"{_path(where, key)}: expected true or false, got {_shown(value)}")


def _integer(loader: _Loader, value: Any, where: str, key: str | int) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise loader.error(f"{_path(where, key)}: expected an integer, got {_shown(value)}")


def _number(loader: _Loader, value: Any, where: str, key: str | int) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    raise loader.error(f"{_path(where, key)}: expected a number, got {_shown(value)}")


def _any_number(loader: _Loader, value: Any, where: str, key: str | int) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise loader.error(f"{_path(where, key)}: expected a number, got {_shown(value)}")


def _text(loader: _Loader, value: Any, where: str, key: str | int) -> str:
    if isinstance(value, str):
        return value
    raise loader.error(f"{_path(where, key)}: expected a string, got {_shown(value)}")


_SCALARS: dict[Any, Reader] = {bool: _boolean, int: _integer, float: _number, str: _text}


def _shown(value: Any) -> str:
    """``value`` as an error shows it: JSON's spelling of null and booleans, cut short."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
