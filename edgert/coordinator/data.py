"""Training data for a plan: the data set its manifest can take, and seeded batches of it.

``--data digits`` (scikit-learn's bundled digits), ``--data tokens`` (the synthetic token
task), ``--data FILE.npz``, ``--data FILE.csv`` (with ``--label-column``) or ``--data FOLDER``
of images in class subfolders: every format is defined in edgert.models (docs/MODELS.md).
Shapes and dtypes are checked against the plan's input and labels before any worker is touched.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from edgert.coordinator.errors import DataError
from edgert.manifest import Manifest
from edgert.models.data_settings import DataSettings
from edgert.progress import Progress


def load_training_data(settings: DataSettings, manifest: Manifest, progress: Progress | None = None):
    """Load the data ``settings`` pick for the plan's model and check it fits the plan's input and labels."""
    from edgert.models import get_model_spec

    spec = None
    model_name = manifest.metadata.get("edgert.model")
    if model_name:
        spec = get_model_spec(model_name)
    on_read = None if progress is None else progress.follow
    dataset = settings.load(spec, tuple(manifest.model_input[0].shape[1:]), on_read)
    check_fits(dataset, manifest)
    return dataset


def check_fits(dataset, manifest: Manifest) -> None:
    """Raise :class:`DataError` naming the mismatch between the data and the plan."""
    if len(manifest.model_input) != 1:
        raise DataError(f"the plan's model takes {len(manifest.model_input)} inputs; edgert feeds one data array")
    spec = manifest.model_input[0]
    wanted = tuple(spec.shape[1:])
    if tuple(dataset.x_train.shape[1:]) != wanted:
        raise DataError(f"data {dataset.name!r} has samples of shape {list(dataset.x_train.shape[1:])}, "
                        f"the plan's input {spec.name!r} takes {list(spec.shape)}")
    if dataset.x_train.dtype != np.dtype(spec.dtype):
        raise DataError(f"data {dataset.name!r} has {dataset.x_train.dtype} samples, "
                        f"the plan's input {spec.name!r} takes {spec.dtype}")
    labels = manifest.labels[0]
    if tuple(dataset.y_train.shape[1:]) != tuple(labels.shape[1:]) or dataset.y_train.dtype != np.dtype(labels.dtype):
        raise DataError(f"data {dataset.name!r} has labels {dataset.y_train.dtype}{list(dataset.y_train.shape[1:])} "
                        f"per sample, the plan's loss takes {labels.dtype}{list(labels.shape[1:])}")
    classes = int(manifest.model_output.shape[-1])
    if manifest.training.loss == "cross_entropy" and int(dataset.y_train.max()) >= classes:
        raise DataError(f"data {dataset.name!r} has label {int(dataset.y_train.max())}, "
                        f"the model predicts {classes} classes")


@dataclass(frozen=True)
class Batch:
    """One batch of the training data: epoch, global step and sample indices."""

    epoch: int
    step: int
    indices: np.ndarray


def batches(samples: int, batch_size: int, epochs: int, seed: int, max_steps: int | None = None) -> Iterator[Batch]:
    """Seeded shuffled batches, epoch after epoch; a last partial batch is dropped."""
    if batch_size < 1 or batch_size > samples:
        raise DataError(f"--batch-size {batch_size} must be between 1 and the {samples} training samples")
    per_epoch = samples // batch_size
    step = 0
    for epoch in range(epochs):
        order = np.random.default_rng((seed, epoch)).permutation(samples)
        for k in range(per_epoch):
            if max_steps is not None and step >= max_steps:
                return
            yield Batch(epoch, step, order[k * batch_size:(k + 1) * batch_size])
            step += 1
