"""``edgert predict``: a trained model's top classes for samples in files, read a batch at a time.

Inputs: an ``.npy`` array (one sample, or ``[samples, ...]``; memory-mapped, so any size), an
``.npz`` archive (its ``x``, or its only array), image files or folders of them for a model
of image input (prepared as training prepared them: edgert.models.image_folder.read_image).
Each sample's outputs become probabilities (softmax) for a classifier, or are shown as they
are for a regression (``mse``) model.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgert.inference.errors import InferenceError
from edgert.inference.model import TrainedModel
from edgert.models.errors import DatasetError
from edgert.models.image_folder import IMAGE_SUFFIXES, image_shape, read_image

DEFAULT_TOP = 3


@dataclass(frozen=True)
class Prediction:
    """One sample's result: where it came from and its top classes (index, name, probability) or outputs."""

    source: str
    top: list[tuple[int, str | None, float]]
    outputs: list[float] | None = None  # a regression model's outputs

    def to_json(self) -> dict:
        if self.outputs is not None:
            return {"input": self.source, "outputs": self.outputs}
        return {"input": self.source, "top": [{"class": index, "name": name, "probability": probability}
                                              for index, name, probability in self.top]}

    def line(self) -> str:
        if self.outputs is not None:
            return f"{self.source}: " + ", ".join(f"{v:.6g}" for v in self.outputs)
        return f"{self.source}: " + ", ".join(f"{index if name is None else name} {probability:.4f}"
                                              for index, name, probability in self.top)


def predict(model: TrainedModel, inputs: Sequence[str | Path], top: int = DEFAULT_TOP, batch_size: int = 256,
            classes: Sequence[str] | None = None) -> Iterator[Prediction]:
    """Each sample's prediction, input by input, in batches of ``batch_size``."""
    if top < 1:
        raise InferenceError(f"--top must be at least 1 (got {top})")
    if batch_size < 1:
        raise InferenceError(f"--batch-size must be at least 1 (got {batch_size})")
    names = list(classes) if classes is not None else model.classes
    for sources, samples in _batches(model, inputs, batch_size):
        outputs = model.run(samples, sources[0].split("[")[0])
        for source, row in zip(sources, outputs.reshape(len(sources), -1)):
            yield _prediction(model.loss, source, row, top, names)


def _prediction(loss: str, source: str, row: np.ndarray, top: int, names: list[str] | None) -> Prediction:
    if loss != "cross_entropy":
        return Prediction(source, [], [float(v) for v in row])
    logits = row.astype(np.float64)
    probabilities = np.exp(logits - logits.max())
    probabilities /= probabilities.sum()
    best = np.argsort(-probabilities, kind="stable")[:top]
    return Prediction(source, [(int(k), names[k] if names is not None and k < len(names) else None,
                                float(probabilities[k])) for k in best])


def _batches(model: TrainedModel, inputs: Sequence[str | Path], batch_size: int
             ) -> Iterator[tuple[list[str], np.ndarray]]:
    """(sources, samples) a batch at a time: array files row by row, image files together."""
    images: list[Path] = []
    for given in inputs:
        path = Path(given)
        if path.is_dir() or path.suffix.lower() in IMAGE_SUFFIXES:
            images += _image_files(path)
            continue
        if images:
            yield from _image_batches(model, images, batch_size)
            images = []
        array = _array(path)
        if array.ndim == len(model.input.sample_shape):
            array = array[None]  # one sample
        model.check_samples(tuple(array.shape[1:]), str(path))
        for start in range(0, len(array), batch_size):
            rows = np.asarray(array[start:start + batch_size])
            yield [f"{path}[{k}]" for k in range(start, start + len(rows))], rows
    if images:
        yield from _image_batches(model, images, batch_size)


def _image_batches(model: TrainedModel, files: list[Path], batch_size: int
                   ) -> Iterator[tuple[list[str], np.ndarray]]:
    try:
        shape = image_shape(model.input.sample_shape, f"{files[0]}: {model.path}")
        for start in range(0, len(files), batch_size):
            chosen = files[start:start + batch_size]
            yield [str(f) for f in chosen], np.stack([read_image(f, shape) for f in chosen])
    except DatasetError as error:
        raise InferenceError(str(error)) from None


def _image_files(path: Path) -> list[Path]:
    if path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
        if not found:
            raise InferenceError(f"{path}: no image files ({', '.join(IMAGE_SUFFIXES)})")
        return found
    if not path.is_file():
        raise InferenceError(f"input not found: {path}")
    return [path]


def _array(path: Path) -> np.ndarray:
    """An .npy file memory-mapped, or an .npz archive's ``x`` (or its only array)."""
    if not path.is_file():
        raise InferenceError(f"input not found: {path}")
    suffix = path.suffix.lower()
    if suffix not in (".npy", ".npz"):
        raise InferenceError(f"{path}: not an input edgert predict reads (an .npy or .npz array, or image files "
                             f"{', '.join(IMAGE_SUFFIXES)})")
    try:
        if suffix == ".npy":
            return np.load(path, mmap_mode="r", allow_pickle=False)
        with np.load(path, allow_pickle=False) as archive:
            names = archive.files
            if "x" not in names and len(names) != 1:
                raise InferenceError(f"{path}: no array x, and {len(names)} arrays ({', '.join(names[:5])}): "
                                     "name the samples x")
            return archive["x" if "x" in names else names[0]]
    except (OSError, ValueError, EOFError) as error:
        raise InferenceError(f"{path}: not a readable numpy file ({error})") from None
