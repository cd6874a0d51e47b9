"""A CSV of features with a label column, read in one streamed pass into a memory-mapped float32 table.

The format (docs/MODELS.md, "a CSV of features"): comma-separated, a header row naming the
columns; one column holds the label (``label`` unless told otherwise), every other column is a
numeric feature, in header order. Labels are whole numbers >= 0 (class indices) or names (any
other text: the class indices then follow the names' sorted order, and the names are kept).

The file is never held whole in memory: it is parsed in chunks of rows into a float32 file in
the temporary folder (``$TMPDIR``, 4 bytes a feature), which the data set memory-maps; the
file is unlinked at once, so its space returns when the data set is dropped or the process
ends, however it ends. Labels (8 bytes a row) stay in memory.
"""

from __future__ import annotations

import csv
import os
import re
import tempfile
from collections.abc import Callable
from itertools import islice
from pathlib import Path

import numpy as np

from edgert.models.errors import DatasetError
from edgert.models.samples import Dataset, RowSubset, check_fraction, check_seed, stratified_split

DEFAULT_LABEL_COLUMN = "label"
CHUNK_ROWS = 16384  # rows parsed at a time
_WHOLE_NUMBER = re.compile(r"\s*\+?\d+\s*")


def load_csv(path: str | Path, label_column: str = DEFAULT_LABEL_COLUMN, seed: int = 0, test_fraction: float = 0.2,
             progress: Callable[[int, int], None] | None = None) -> Dataset:
    """The CSV at ``path``: float32 features, the label column's class indices, a seeded stratified test split.

    ``progress(bytes_read, file_bytes)`` is called after each chunk.
    """
    path = Path(path)
    check_seed(seed)
    check_fraction(test_fraction)
    if not path.is_file():
        raise DatasetError(f"data file not found: {path}")
    with path.open(newline="", encoding="utf-8-sig", errors="replace") as handle:
        header = _header(path, handle, label_column)
        label = header.index(label_column)
        features = [k for k in range(len(header)) if k != label]
        table = _FeatureTable(path, len(features))
        labels = _LabelCodes()
        try:
            _read_rows(path, handle, header, label, features, table, labels, progress)
        finally:
            x = table.finish()
    if len(x) < 2:
        raise DatasetError(f"{path}: {len(x)} data row(s); a test set needs at least 2")
    y, classes = labels.finish(path, label_column)
    train, test = stratified_split(y, test_fraction, seed, str(path))
    num_classes = len(classes) if classes is not None else int(y.max()) + 1
    return Dataset(path.stem, RowSubset(x, train), y[train], RowSubset(x, test), y[test], num_classes, classes)


def _read_rows(path: Path, handle, header: list[str], label: int, features: list[int], table: _FeatureTable,
               labels: _LabelCodes, progress: Callable[[int, int], None] | None) -> None:
    line = 2  # the first data row's line number
    while chunk := list(islice(handle, CHUNK_ROWS)):
        rows = [text for text in chunk if text.strip()]
        if rows:
            values, names = _parse(path, rows, chunk, line, header, features, label)
            table.append(values)
            labels.add(names)
        line += len(chunk)
        if progress is not None:
            progress(min(handle.buffer.tell(), table.file_bytes), table.file_bytes)


def _header(path: Path, handle, label_column: str) -> list[str]:
    first = next(csv.reader([handle.readline()]), None)
    if not first or not any(name.strip() for name in first):
        raise DatasetError(f"{path} is empty: a CSV needs a header row naming its columns")
    header = [name.strip() for name in first]
    if label_column not in header:
        shown = ", ".join(header[:10]) + (", ..." if len(header) > 10 else "")
        raise DatasetError(f"{path} has no column {label_column!r} (its columns: {shown}); name the label column "
                           "with --label-column")
    if len(header) < 2:
        raise DatasetError(f"{path}: only the label column {label_column!r}, no feature columns")
    return header


def _parse(path: Path, rows: list[str], chunk: list[str], first_line: int, header: list[str], features: list[int],
           label: int) -> tuple[np.ndarray, np.ndarray]:
    """One chunk's feature values and label texts; a bad cell is named by its line and column."""
    try:
        values = np.loadtxt(rows, delimiter=",", dtype=np.float32, usecols=features, quotechar='"', ndmin=2)
        names = np.loadtxt(rows, delimiter=",", dtype=str, usecols=[label], quotechar='"', ndmin=1)
    except ValueError as error:
        raise DatasetError(_bad_cell(path, chunk, first_line, header, label) or
                           f"{path}, lines {first_line}-{first_line + len(chunk) - 1}: unreadable ({error})") from None
    names = np.char.strip(names)
    if (names == "").any():
        line = first_line + next(k for k, text in enumerate(chunk) if text.strip() and
                                 not next(csv.reader([text]))[label].strip())
        raise DatasetError(f"{path}, line {line}: the label column {header[label]!r} is empty")
    return values, names


def _bad_cell(path: Path, chunk: list[str], first_line: int, header: list[str], label: int) -> str | None:
    """Where a chunk numpy could not read goes wrong: a row of another width, or a feature that is no number."""
    for offset, fields in enumerate(csv.reader(chunk)):
        if not fields or not any(field.strip() for field in fields):
            continue
        line = first_line + offset
        if len(fields) != len(header):
            return f"{path}, line {line}: {len(fields)} fields, the header has {len(header)}"
        for column, field in enumerate(fields):
            if column == label:
                continue
            try:
                float(field)
            except ValueError:
                return f"{path}, line {line}: column {header[column]!r} holds {field.strip()[:40]!r}, not a number"
    return None


class _FeatureTable:
    """The features, appended chunk by chunk to a float32 file in the temporary folder, then memory-mapped."""

    def __init__(self, path: Path, width: int):
        self.file_bytes = path.stat().st_size
        self._width = width
        handle, name = tempfile.mkstemp(prefix=f"edgert-{path.stem[:40]}-", suffix=".f32")
        self._file = os.fdopen(handle, "wb")
        self._name = name
        self._rows = 0

    def append(self, values: np.ndarray) -> None:
        self._file.write(np.ascontiguousarray(values, dtype=np.float32).tobytes())
        self._rows += len(values)

    def finish(self) -> np.ndarray:
        """The table as a read-only memory map; its file is unlinked (the map keeps it until closed)."""
        self._file.close()
        try:
            if self._rows == 0:
                return np.empty((0, self._width), np.float32)
            return np.memmap(self._name, dtype=np.float32, mode="r", shape=(self._rows, self._width))
        finally:
            os.unlink(self._name)


class _LabelCodes:
    """Label texts as codes in order of first sight; at the end, class indices (and names, for texts)."""

    def __init__(self):
        self._codes: list[np.ndarray] = []
        self._names: dict[str, int] = {}

    def add(self, names: np.ndarray) -> None:
        unique, inverse = np.unique(names, return_inverse=True)
        lookup = np.array([self._names.setdefault(str(name), len(self._names)) for name in unique], np.int64)
        self._codes.append(lookup[inverse.reshape(-1)])

    def finish(self, path: Path, label_column: str) -> tuple[np.ndarray, tuple[str, ...] | None]:
        codes = np.concatenate(self._codes) if self._codes else np.empty(0, np.int64)
        names = list(self._names)
        if all(_WHOLE_NUMBER.fullmatch(name) for name in names):
            return np.array([int(name) for name in names], np.int64)[codes], None
        if all(_is_number(name) for name in names):
            odd = next(name for name in names if not _WHOLE_NUMBER.fullmatch(name))
            raise DatasetError(f"{path}: label column {label_column!r} holds {odd.strip()!r}; labels are whole "
                               "numbers >= 0 (class indices) or class names")
        order = sorted(names)
        position = {name: k for k, name in enumerate(order)}
        rank = np.array([position[name] for name in names], np.int64)
        return rank[codes], tuple(order)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
