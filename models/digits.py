"""scikit-learn's bundled 8x8 handwritten digits: a named data set (host only: it needs scikit-learn).

``load_dataset`` imports this module by name when the digits are asked for, as the zoo imports a
model's builder, so a board that reads its own files never loads scikit-learn.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from edgert.errors import MissingDependencyError
from edgert.models.errors import DatasetError
from edgert.models.samples import Dataset, check_fraction, check_seed, stratified_split

if TYPE_CHECKING:
    from edgert.models import ModelSpec

DIGITS_LAYOUTS = ("flat", "image")


def load(name: str, model_spec: ModelSpec | None, seed: int, sample_shape: tuple[int, ...] | None) -> Dataset:
    """``digits-flat``, ``digits-image``, or ``digits`` in the model's layout (the zoo model's data set, else
    flat for one-dimensional samples and image otherwise; flat without a model)."""
    if name == "digits":
        if model_spec is not None and model_spec.dataset.startswith("digits-"):
            name = model_spec.dataset
        elif sample_shape is not None and len(sample_shape) > 1:
            name = "digits-image"
    return digits(layout="image" if name == "digits-image" else "flat", seed=seed)


def digits(layout: str = "flat", seed: int = 0, test_fraction: float = 0.2) -> Dataset:
    """The 8x8 digits as float32 in [0, 1], flat [N, 64] or image [N, 1, 8, 8]."""
    if layout not in DIGITS_LAYOUTS:
        raise DatasetError(f"digits layout must be one of {DIGITS_LAYOUTS}, got {layout!r}")
    check_seed(seed)
    check_fraction(test_fraction)
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise MissingDependencyError(
            f"the digits data set needs scikit-learn ({error}): pip install 'edgert[host]'"
        ) from None
    bunch = load_digits()
    x = (bunch.data / 16.0).astype(np.float32)
    if layout == "image":
        x = x.reshape(-1, 1, 8, 8)
    y = bunch.target.astype(np.int64)
    train, test = stratified_split(y, test_fraction, seed)
    return Dataset(f"digits-{layout}", x[train], y[train], x[test], y[test], 10)
