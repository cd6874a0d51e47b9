"""What every benchmark shares: its options, its result (rows and ratios), its targets, its tables.

A benchmark module holds a frozen ``BenchConfig`` dataclass whose fields are declared with
:func:`option` (default and help written once; ``edgert bench <name>`` builds its command
line from them), a ``run(config)`` returning :func:`result`, and a ``format_table(result)``
for the terminal; ``--json`` prints the result itself.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

OPTION = "edgert.bench.option"  # the dataclass field metadata key of an option


@dataclass(frozen=True)
class Option:
    """How a config field appears on the command line (``--field-name`` unless ``flag`` says otherwise)."""

    help: str
    flag: str | None = None
    choices: tuple[str, ...] | None = None
    parse: Callable[[str], Any] | None = None  # text -> value, raising ValueError (``type`` otherwise)
    show: Callable[[Any], str] | None = None  # value -> text, for the default shown in --help
    type: type | None = None  # when the default does not say it (None for a path)


def option(default: Any, help: str, **how: Any) -> Any:
    """A benchmark config field that is also an ``edgert bench`` option; ``how``: :class:`Option`'s fields."""
    return field(default=default, metadata={OPTION: Option(help, **how)})


def quiet(_: str) -> None:
    """The default progress callback: say nothing."""


def to_stderr(text: str) -> None:
    """Progress on stderr: stdout is the result alone (``--json``) or its table."""
    print(text, file=sys.stderr, flush=True)


Progress = Callable[[str], None]


def progress_field() -> Any:
    """A config's ``progress`` field: where lines about the run go (not an option)."""
    return field(default=quiet, compare=False)


# -- results -------------------------------------------------------------------------------------


def result(rows: list[dict[str, Any]], ratios: dict[str, Any], **about: Any) -> dict[str, Any]:
    """A benchmark's result, as ``--json`` prints it: ``{"rows": [...], "ratios": {...}, **about}``."""
    return {"rows": rows, "ratios": ratios, **about}


def ratio(numerator: float | None, denominator: float | None, digits: int | None = None) -> float | None:
    """``numerator / denominator`` (rounded to ``digits``), or None where either is missing or zero."""
    if numerator is None or not denominator:
        return None
    value = numerator / denominator
    return value if digits is None else round(value, digits)


def geomean(values: Iterable[float]) -> float:
    """The geometric mean: the typical ratio of many same-run ratios."""
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


# -- targets -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """A figure of the ``ratios`` against its goal: ``figure op bound`` (``<=``, ``>=`` or ``==``)."""

    figure: str
    op: str
    bound: Any
    text: str

    def met(self, value: Any) -> bool:
        if self.op == "==":
            return value == self.bound
        return value >= self.bound if self.op == ">=" else value <= self.bound

    def line(self, figures: dict[str, Any], missing: str = "") -> str:
        """``PASS``/``FAIL``, the text, the value and the goal; a figure not measured says so (``missing``)."""
        value = figures.get(self.figure)
        if value is None:
            return f"  {missing + '  ' if missing else ''}{self.text}: not measured"
        return f"  {'PASS' if self.met(value) else 'FAIL'}  {self.text}: {_shown(value)} (target {self.op} " \
               f"{_shown(self.bound, '{:g}')})"


def target_lines(targets: Sequence[Target], figures: dict[str, Any], missing: str = "") -> list[str]:
    """The ``Targets`` section of a report (``missing``: the verdict of a figure not measured)."""
    return ["Targets", *(target.line(figures, missing) for target in targets)]


def _shown(value: Any, pattern: str = "{:.4g}") -> str:
    return str(value) if isinstance(value, (bool, str)) else pattern.format(value)


# -- tables --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    """A fixed-width column: ``header``, the row's ``key`` (or a function of the row) and the cell's format."""

    header: str
    width: int
    key: str | Callable[[dict[str, Any]], Any]
    pattern: str = "{}"
    left: bool = False

    def cell(self, row: dict[str, Any]) -> str:
        value = self.key(row) if callable(self.key) else row.get(self.key)
        text = cell(value, self.pattern)
        return f"{text:<{self.width}}" if self.left else f"{text:>{self.width}}"

    def head(self) -> str:
        return f"{self.header:<{self.width}}" if self.left else f"{self.header:>{self.width}}"


def heading(columns: Sequence[Column]) -> str:
    """The columns' headers, as one line."""
    return "".join(column.head() for column in columns)


def line(columns: Sequence[Column], row: dict[str, Any]) -> str:
    """One row's cells, as one line."""
    return "".join(column.cell(row) for column in columns)


def table(columns: Sequence[Column], rows: Iterable[dict[str, Any]]) -> list[str]:
    """The heading, then a line per row."""
    return [heading(columns), *(line(columns, row) for row in rows)]


def cell(value: Any, pattern: str = "{:.3f}") -> str:
    """A value as a table shows it; ``-`` for a figure not measured."""
    return "-" if value is None else pattern.format(value)


def key_value_lines(result: dict[str, Any]) -> str:
    """Every row as ``key=value`` pairs, then the ratios: the report of a benchmark without a table of its own."""
    lines = ["  ".join(f"{k}={v}" for k, v in row.items()) for row in result["rows"]]
    lines.append("ratios: " + "  ".join(f"{k}={v}" for k, v in result["ratios"].items()))
    return "\n".join(lines)
