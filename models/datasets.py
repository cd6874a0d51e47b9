"""The data a run trains on and ``edgert evaluate`` reads: one resolver over every data format.

Each format is defined in one module of its own (docs/MODELS.md, "Datasets"):

- named data sets, each imported by name when asked for (as the zoo imports a model's
  builder), so a board reading its own files never loads what they need: ``digits``
  (digits.py, needs scikit-learn) and ``tokens`` (tokens.py);
- files and folders: an ``.npz`` archive (npz_data.py), a CSV of features with a label column
  (csv_data.py), a folder of images in class subfolders (image_folder.py).

``load_dataset`` picks the format from the name or the path and, given the model, checks the
data fits it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from edgert.models.csv_data import DEFAULT_LABEL_COLUMN, load_csv
from edgert.models.errors import DatasetError
from edgert.models.image_folder import load_image_folder
from edgert.models.npz_data import load_npz
from edgert.models.samples import Dataset

if TYPE_CHECKING:
    from edgert.models import ModelSpec

__all__ = ["DEFAULT_LABEL_COLUMN", "NAMED_DATASETS", "Dataset", "data_kind", "load_dataset", "load_npz"]

# name -> the module of edgert.models that makes it (its ``load(name, model_spec, seed, sample_shape)``)
NAMED_DATASETS = {"digits": "digits", "digits-flat": "digits", "digits-image": "digits", "tokens": "tokens"}
FILE_SUFFIXES = {".npz": "npz", ".csv": "csv"}


def data_kind(source: str | Path) -> str:
    """``named``, ``npz``, ``csv`` or ``images`` (a folder): what ``source`` is, by its name or what is there."""
    text = str(source)
    if not isinstance(source, Path) and text in NAMED_DATASETS:
        return "named"
    path = Path(source)
    if path.suffix.lower() in FILE_SUFFIXES:
        return FILE_SUFFIXES[path.suffix.lower()]
    if path.is_dir():
        return "images"
    if not path.exists() and (isinstance(source, Path) or "/" in text or path.suffix):
        raise DatasetError(f"data file or folder not found: {path}")
    if path.exists():
        raise DatasetError(f"{path}: not a data set edgert reads (an .npz, a .csv, or a folder of images in class "
                           "subfolders)")
    raise DatasetError(f"unknown data set {text!r}; use one of {', '.join(NAMED_DATASETS)}, a .npz or .csv path, "
                       "or a folder of images")


def load_dataset(
    spec_or_name: str | Path,
    model_spec: ModelSpec | None = None,
    seed: int = 0,
    sample_shape: Sequence[int] | None = None,
    label_column: str = DEFAULT_LABEL_COLUMN,
    test_fraction: float = 0.2,
    progress: Callable[[int, int], None] | None = None,
) -> Dataset:
    """The data set named ``digits``/``digits-flat``/``digits-image``/``tokens``, or an .npz, a .csv or an image folder.

    ``sample_shape`` (one sample of the model's input, no batch dimension; the zoo model's when
    ``model_spec`` is given) sizes images and picks the digits' layout. With ``model_spec``,
    ``digits`` takes the model's layout, ``tokens`` its sequence length, vocabulary and classes,
    and the result is checked to fit the model's input. ``progress(done, total)`` follows a long read.
    """
    if sample_shape is None and model_spec is not None:
        sample_shape = model_spec.input_shape
    kind = data_kind(spec_or_name)
    if kind == "named":
        name = str(spec_or_name)
        maker = importlib.import_module(f"{__package__}.{NAMED_DATASETS[name]}")
        dataset = maker.load(name, model_spec, seed, None if sample_shape is None else tuple(sample_shape))
    elif kind == "npz":
        dataset = load_npz(spec_or_name, seed=seed, test_fraction=test_fraction)
    elif kind == "csv":
        dataset = load_csv(spec_or_name, label_column, seed=seed, test_fraction=test_fraction, progress=progress)
    else:
        dataset = load_image_folder(spec_or_name, sample_shape, seed=seed, test_fraction=test_fraction)
    if model_spec is not None:
        _check_fits(dataset, model_spec)
    return dataset


def _check_fits(dataset: Dataset, model_spec: ModelSpec) -> None:
    if dataset.sample_shape != model_spec.input_shape:
        raise DatasetError(
            f"data set {dataset.name!r} has samples of shape {dataset.sample_shape}, but model "
            f"{model_spec.name!r} takes {model_spec.input_shape}"
        )
    wants_ints = np.dtype(model_spec.input_dtype).kind in "iu"
    if wants_ints != (dataset.x_train.dtype.kind in "iu"):
        raise DatasetError(
            f"data set {dataset.name!r} has {dataset.x_train.dtype} samples, but model "
            f"{model_spec.name!r} takes {model_spec.input_dtype}"
        )
    if model_spec.vocab_size and isinstance(dataset.x_train, np.ndarray):
        low = min(dataset.x_train.min(), dataset.x_test.min())
        high = max(dataset.x_train.max(), dataset.x_test.max())
        if low < 0 or high >= model_spec.vocab_size:
            raise DatasetError(
                f"data set {dataset.name!r} has token ids {low}..{high}, but model "
                f"{model_spec.name!r} knows ids 0..{model_spec.vocab_size - 1}"
            )
    if dataset.num_classes > model_spec.num_classes:
        raise DatasetError(
            f"data set {dataset.name!r} has {dataset.num_classes} classes, but model "
            f"{model_spec.name!r} predicts {model_spec.num_classes}"
        )
