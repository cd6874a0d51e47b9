"""How a run read its data, so that evaluating its model reads the same split: a run folder's ``data.json``.

``edgert train`` writes it (docs/RUNS.md); ``edgert merge`` copies it into the merged model's
metadata (``edgert.data``); ``edgert evaluate --run`` and ``edgert predict --run`` read it.
A data file or folder is recorded by its absolute path, so the record holds from any folder.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgert.models.datasets import DEFAULT_LABEL_COLUMN, NAMED_DATASETS, load_dataset
from edgert.models.errors import DatasetError
from edgert.models.samples import Dataset

if TYPE_CHECKING:
    from edgert.models import ModelSpec

DATA_FILE = "data.json"


@dataclass(frozen=True)
class DataSettings:
    """What picks a data set and its split: the source (a named set or a path), the seed, the label column."""

    source: str
    seed: int = 0
    label_column: str = DEFAULT_LABEL_COLUMN
    test_fraction: float = 0.2

    @classmethod
    def given(cls, data: str | Path, seed: int = 0, label_column: str = DEFAULT_LABEL_COLUMN) -> DataSettings:
        """Settings from a command line's ``--data``: a path that exists is made absolute."""
        text = str(data)
        if text not in NAMED_DATASETS and Path(text).exists():
            text = str(Path(text).resolve())
        return cls(text, seed, label_column)

    def load(self, model_spec: ModelSpec | None = None, sample_shape: Sequence[int] | None = None,
             progress: Callable[[int, int], None] | None = None) -> Dataset:
        """The data set these settings pick (:func:`edgert.models.datasets.load_dataset`)."""
        return load_dataset(self.source, model_spec, self.seed, sample_shape, self.label_column, self.test_fraction,
                            progress)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any, what: str) -> DataSettings:
        """Settings read back from a record, refused with ``what`` named unless they are well formed."""
        types = {"source": str, "seed": int, "label_column": str, "test_fraction": (int, float)}
        if not isinstance(data, dict) or not isinstance(data.get("source"), str):
            raise DatasetError(f"{what}: no data settings (a \"source\" naming the data)")
        for name, kind in types.items():
            if name in data and (not isinstance(data[name], kind) or isinstance(data[name], bool)):
                raise DatasetError(f"{what}: data setting {name!r} is {data[name]!r}")
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


@dataclass(frozen=True)
class DataRecord:
    """A run's ``data.json``: its data settings and what they gave (class names, sizes)."""

    settings: DataSettings
    name: str
    num_classes: int
    classes: tuple[str, ...] | None
    train_samples: int
    test_samples: int

    @classmethod
    def of(cls, settings: DataSettings, dataset: Dataset) -> DataRecord:
        return cls(settings, dataset.name, dataset.num_classes, dataset.classes, len(dataset.x_train),
                   len(dataset.x_test))

    def to_json(self) -> dict[str, Any]:
        return {**self.settings.to_json(), "name": self.name, "num_classes": self.num_classes,
                "classes": None if self.classes is None else list(self.classes),
                "train_samples": self.train_samples, "test_samples": self.test_samples}


def write_data_record(run_dir: Path, record: DataRecord) -> Path:
    """``run_dir/data.json``."""
    path = Path(run_dir) / DATA_FILE
    path.write_text(json.dumps(record.to_json(), indent=2) + "\n")
    return path


def read_data_record(run_dir: str | Path) -> DataRecord:
    """A run folder's ``data.json``, refused with one line if it is missing or malformed."""
    path = Path(run_dir) / DATA_FILE
    if not Path(run_dir).is_dir():
        raise DatasetError(f"run folder not found: {run_dir}")
    if not path.is_file():
        raise DatasetError(f"{path}: missing; a run records its data there (runs before it did: give --data)")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DatasetError(f"{path}: not readable JSON ({error})") from None
    settings = DataSettings.from_json(data, str(path))
    classes = data.get("classes")
    if classes is not None and (not isinstance(classes, list) or not all(isinstance(c, str) for c in classes)):
        raise DatasetError(f"{path}: classes must be a list of names")
    try:
        return DataRecord(settings, str(data.get("name", "")), int(data.get("num_classes", 0)),
                          None if classes is None else tuple(classes), int(data.get("train_samples", 0)),
                          int(data.get("test_samples", 0)))
    except (TypeError, ValueError) as error:
        raise DatasetError(f"{path}: malformed ({error})") from None
