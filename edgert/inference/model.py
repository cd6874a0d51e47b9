"""A trained model (``edgert merge``'s output, or any one-input ONNX model) on stock onnxruntime.

:class:`TrainedModel` knows the model's input (name, shape, element type), reads what the
merge recorded in its metadata (the loss, the run's data settings, the class names) and runs
batches of samples, each checked and converted to the input's type first. A model exported
with a fixed batch size gets batches of exactly that size (the last one padded, the padding's
outputs dropped).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgert.inference.errors import InferenceError
from edgert.models.data_settings import DataSettings
from edgert.models.errors import DatasetError
from edgert.ort_import import onnxruntime
from edgert.providers import CPU

# the merged model's metadata keys edgert reads (exporter/merge.py writes them; docs/EXPORTER.md)
LOSS_KEY, DATA_KEY, CLASSES_KEY, MODEL_KEY = "edgert.loss", "edgert.data", "edgert.classes", "edgert.model"
ELEMENT_TYPES = {
    "tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int16)": np.int16, "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_,
}


@dataclass(frozen=True)
class ModelInput:
    """The model's one input: its name, shape (``None`` for a dimension named rather than fixed) and type."""

    name: str
    shape: tuple[int | None, ...]
    dtype: np.dtype

    @property
    def sample_shape(self) -> tuple[int | None, ...]:
        return self.shape[1:]

    def shown(self) -> str:
        return "[" + ", ".join("N" if d is None else str(d) for d in self.shape) + "]"


class TrainedModel:
    """An ONNX model in an onnxruntime session, with its input described and its edgert metadata read."""

    def __init__(self, path: str | Path, threads: int = 0):
        self.path = Path(path)
        if not self.path.is_file():
            raise InferenceError(f"model not found: {self.path}")
        ort = onnxruntime()
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.log_severity_level = 3
        try:
            self._session = ort.InferenceSession(str(self.path), options, providers=[CPU])
        except Exception as error:  # onnxruntime raises its own classes for a file it cannot load
            raise InferenceError(f"{self.path}: not a model onnxruntime can load ({_first_line(error)})") from None
        inputs = self._session.get_inputs()
        if len(inputs) != 1:
            raise InferenceError(f"{self.path} takes {len(inputs)} inputs ({', '.join(i.name for i in inputs)}); "
                                 "edgert evaluate and predict feed one")
        if inputs[0].type not in ELEMENT_TYPES:
            raise InferenceError(f"{self.path}: input {inputs[0].name!r} is a {inputs[0].type}, not a tensor of "
                                 "numbers")
        shape = tuple(d if isinstance(d, int) and d > 0 else None for d in (inputs[0].shape or ()))
        if not shape:
            raise InferenceError(f"{self.path}: input {inputs[0].name!r} has no batch dimension")
        self.input = ModelInput(inputs[0].name, shape, np.dtype(ELEMENT_TYPES[inputs[0].type]))
        self.output = self._session.get_outputs()[0]
        self.metadata = dict(self._session.get_modelmeta().custom_metadata_map)

    @property
    def loss(self) -> str:
        """The loss the model was trained with (its ``edgert.loss``; cross-entropy when it does not say)."""
        return self.metadata.get(LOSS_KEY, "cross_entropy")

    @property
    def classes(self) -> tuple[str, ...] | None:
        """The class names the run's data gave, if the merge recorded them."""
        names = self._json(CLASSES_KEY)
        return tuple(str(n) for n in names) if isinstance(names, list) else None

    @property
    def data_settings(self) -> DataSettings | None:
        """The run's data settings, if the merge recorded them."""
        data = self._json(DATA_KEY)
        if data is None:
            return None
        try:
            return DataSettings.from_json(data, f"{self.path}: metadata {DATA_KEY}")
        except DatasetError as error:
            raise InferenceError(str(error)) from None

    @property
    def zoo_model(self) -> str | None:
        """The zoo model it was built from (``edgert.model``), which picks the layout of the zoo's data sets."""
        return self.metadata.get(MODEL_KEY)

    @property
    def fixed_batch(self) -> int | None:
        """The batch size the model was exported with, if fixed."""
        return self.input.shape[0]

    def check_samples(self, shape: tuple[int, ...], what: str) -> None:
        """Refuse samples of ``shape`` (no batch dimension) the input cannot take, naming ``what`` they came from."""
        wanted = self.input.sample_shape
        if len(shape) != len(wanted) or any(w is not None and w != d for w, d in zip(wanted, shape)):
            raise InferenceError(f"{what}: samples of shape {list(shape)}, but the model's input "
                                 f"{self.input.name!r} takes {self.input.shown()}")

    def run(self, samples: np.ndarray, what: str) -> np.ndarray:
        """The model's output for a batch of samples (any number: a fixed batch size is padded to)."""
        samples = self._converted(samples, what)
        size = self.fixed_batch
        if size is None or len(samples) == size:
            return self._run(samples, what)
        outputs = []
        for start in range(0, len(samples), size):
            part = samples[start:start + size]
            padded = np.concatenate([part, np.zeros((size - len(part), *part.shape[1:]), part.dtype)])
            outputs.append(self._run(padded, what)[:len(part)])
        return np.concatenate(outputs)

    def _run(self, samples: np.ndarray, what: str) -> np.ndarray:
        try:
            return self._session.run([self.output.name], {self.input.name: samples})[0]
        except Exception as error:  # onnxruntime's own classes: a shape the graph refuses inside
            raise InferenceError(f"{what}: the model refused these samples ({_first_line(error)})") from None

    def _converted(self, samples: np.ndarray, what: str) -> np.ndarray:
        wanted = self.input.dtype
        if samples.dtype == wanted:
            return np.ascontiguousarray(samples)
        if samples.dtype.kind not in "biuf":
            raise InferenceError(f"{what}: {samples.dtype} samples, but the model's input takes {wanted}")
        if wanted.kind in "iu" and samples.dtype.kind == "f" and not np.all(np.mod(samples, 1) == 0):
            raise InferenceError(f"{what}: fractional values, but the model's input takes {wanted} (token ids)")
        return np.ascontiguousarray(samples, dtype=wanted)

    def _json(self, key: str):
        if key not in self.metadata:
            return None
        try:
            return json.loads(self.metadata[key])
        except json.JSONDecodeError:
            raise InferenceError(f"{self.path}: metadata {key} is not JSON") from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
