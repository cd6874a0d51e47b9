"""``edgert evaluate``: a trained model's loss and accuracy on a data set, split and prepared as its run did.

The data comes from ``--data`` (with the seed and label column given), else from a run
folder's ``data.json`` (``--run``), else from the settings the merge recorded in the model
(``edgert.data``): the same source, seed and split the run evaluated on, read through the same
data formats (edgert.models), so a merged model scores what the run's last evaluation scored.
Samples are scored batch by batch (edgert/scoring.py): a test set of any size takes the memory
of one batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from edgert.inference.errors import InferenceError
from edgert.inference.model import TrainedModel
from edgert.models import UnknownModelError, get_model_spec
from edgert.models.data_settings import DataSettings, read_data_record
from edgert.models.samples import Dataset
from edgert.scoring import Score

SPLITS = ("test", "train", "all")
DEFAULT_BATCH = 256


@dataclass(frozen=True)
class Evaluation:
    """A model's score on one split of a data set."""

    data: str
    split: str
    samples: int
    loss_name: str
    loss: float
    accuracy: float | None

    def to_json(self) -> dict:
        return asdict(self)


def data_settings_for(model: TrainedModel, data: str | None, run_dir: Path | None, seed: int | None,
                      label_column: str | None) -> DataSettings:
    """The data to evaluate on: ``data`` given, else the run's record, else the model's; seed and label column
    as recorded unless given."""
    recorded = read_data_record(run_dir).settings if run_dir is not None else model.data_settings
    if data is None and recorded is None:
        raise InferenceError(f"{model.path} records no data set (merged before edgert recorded one, or not merged "
                             "by edgert): give --data, or --run with the run folder")
    base = recorded or DataSettings("")
    source = base.source if data is None else DataSettings.given(data).source
    return DataSettings(source, base.seed if seed is None else seed,
                        base.label_column if label_column is None else label_column, base.test_fraction)


def load_data(model: TrainedModel, settings: DataSettings,
              progress: Callable[[int, int], None] | None = None) -> Dataset:
    """The data set ``settings`` pick, prepared for the model's input (images sized to it, the zoo's layout)."""
    spec = None
    if model.zoo_model:
        try:
            spec = get_model_spec(model.zoo_model)
        except UnknownModelError:
            spec = None  # a model named by a zoo this edgert does not have: read the data for its input
    if spec is not None and tuple(spec.input_shape) != tuple(model.input.sample_shape):
        spec = None  # a zoo model re-exported with another input
    dataset = settings.load(spec, model.input.sample_shape, progress)
    model.check_samples(dataset.sample_shape, f"data {settings.source!r}")
    return dataset


def evaluate(model: TrainedModel, dataset: Dataset, split: str = "test", batch_size: int = DEFAULT_BATCH,
             loss: str | None = None, progress: Callable[[int, int, Score], None] | None = None) -> Evaluation:
    """Score ``model`` on ``split`` of ``dataset``, batch by batch; ``progress(done, total, score)`` after each."""
    if split not in SPLITS:
        raise InferenceError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    if batch_size < 1:
        raise InferenceError(f"--batch-size must be at least 1 (got {batch_size})")
    parts = _parts(dataset, split)
    total = sum(len(y) for _, y in parts)
    score = Score(loss or model.loss)
    done = 0
    for x, y in _batches(parts, batch_size):
        prediction = model.run(x, f"data {dataset.name!r}")
        _check_labels(score.loss, prediction, y, dataset.name)
        score.add(prediction, y)
        done += len(y)
        if progress is not None:
            progress(done, total, score)
    if score.samples == 0:
        raise InferenceError(f"data {dataset.name!r} has no {split} samples")
    return Evaluation(dataset.name, split, done, score.loss, score.mean_loss, score.accuracy)


def _parts(dataset: Dataset, split: str) -> list[tuple]:
    train, test = (dataset.x_train, dataset.y_train), (dataset.x_test, dataset.y_test)
    return {"test": [test], "train": [train], "all": [train, test]}[split]


def _batches(parts: list[tuple], batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    for x, y in parts:
        for start in range(0, len(y), batch_size):
            yield np.asarray(x[start:start + batch_size]), y[start:start + batch_size]


def _check_labels(loss: str, prediction: np.ndarray, labels: np.ndarray, name: str) -> None:
    if loss != "cross_entropy":
        if prediction.shape != labels.shape:
            raise InferenceError(f"data {name!r}: targets of shape {list(labels.shape[1:])} per sample, the model "
                                 f"predicts {list(prediction.shape[1:])}")
        return
    classes = prediction.shape[-1]
    if labels.size and int(labels.max()) >= classes:
        raise InferenceError(f"data {name!r} has label {int(labels.max())}, but the model predicts {classes} classes")
