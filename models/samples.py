"""What every data format returns: :class:`Dataset`, its rows read on demand, and the seeded splits.

A data set's samples are a numpy array, or for data too large to hold (a CSV, a folder of
images) an object that reads the rows asked for: :class:`SampleRows`. Both answer ``shape``,
``dtype``, ``len()`` and indexing by an int, a slice or an index array, which is all a run
(``x_train[batch]``) and an evaluation (``x_test[i:j]``) ask of them. Labels are always an
int64 array in memory (8 bytes a sample).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from edgert.models.errors import DatasetError


class SampleRows(Protocol):
    """Rows of samples read on demand: ``rows[indices]`` is an ndarray of those rows."""

    shape: tuple[int, ...]
    dtype: np.dtype

    def __len__(self) -> int: ...

    def __getitem__(self, index: int | slice | np.ndarray) -> np.ndarray: ...


Samples = np.ndarray | SampleRows


@dataclass(frozen=True, eq=False)
class Dataset:
    """Train and test samples of one classification task; labels are int64 class indices.

    ``classes`` names each class index where the data gives names (an image folder's class
    folders, a CSV's label strings, an .npz's ``classes``); ``None`` where labels are bare numbers.
    """

    name: str
    x_train: Samples
    y_train: np.ndarray
    x_test: Samples
    y_test: np.ndarray
    num_classes: int
    classes: tuple[str, ...] | None = None

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """The shape of one sample (the batch dimension left out)."""
        return tuple(self.x_train.shape[1:])


class RowSubset:
    """The rows ``indices`` of ``rows`` (a memory-mapped array, say), read only when asked for."""

    def __init__(self, rows: Samples, indices: np.ndarray):
        self._rows = rows
        self._indices = np.asarray(indices, dtype=np.int64)
        self.shape = (len(self._indices), *rows.shape[1:])
        self.dtype = np.dtype(rows.dtype)

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, index: int | slice | np.ndarray) -> np.ndarray:
        chosen = self._indices[index]
        if np.ndim(chosen) == 0:
            return np.asarray(self._rows[int(chosen)])
        order = np.argsort(chosen, kind="stable")  # rows in file order: a memory map reads forward
        rows = np.asarray(self._rows[chosen[order]])
        out = np.empty_like(rows)
        out[order] = rows
        return out


def seeded_split(samples: int, test_fraction: float, seed: int, what: str = "data") -> tuple[np.ndarray, np.ndarray]:
    """A seeded ``test_fraction`` of ``samples`` rows for testing (at least one, never all): (train, test)."""
    if samples < 2:
        raise DatasetError(f"{what}: cannot split a test set off {samples} sample(s)")
    order = np.random.default_rng(seed).permutation(samples)
    n_test = min(max(1, round(samples * test_fraction)), samples - 1)
    return order[n_test:], order[:n_test]


def stratified_split(y: np.ndarray, test_fraction: float, seed: int, what: str = "data"
                     ) -> tuple[np.ndarray, np.ndarray]:
    """``test_fraction`` of each class's rows for testing (at least one of a class of two or more), seeded."""
    if np.bincount(y).max(initial=0) < 2:
        raise DatasetError(f"{what}: no class has two samples, so no test set can be split off")
    rng = np.random.default_rng(seed)
    train, test = [], []
    for label in np.unique(y):
        members = rng.permutation(np.flatnonzero(y == label))
        n_test = min(max(1, round(len(members) * test_fraction)), len(members) - 1)
        test.append(members[:n_test])
        train.append(members[n_test:])
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))


def check_seed(seed: int) -> None:
    """A data seed is a non-negative integer."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise DatasetError(f"seed must be a non-negative integer, got {seed!r}")


def check_fraction(test_fraction: float) -> None:
    """A test fraction lies strictly between 0 and 1."""
    if not isinstance(test_fraction, (int, float)) or not 0.0 < test_fraction < 1.0:
        raise DatasetError(
            f"test_fraction must be between 0 and 1 (exclusive), got {test_fraction!r}"
        )
